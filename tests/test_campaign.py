"""scripts/campaign.py: a plan's runs skipped when complete, resumed when
interrupted, started otherwise; auto precision refused on a CPU without bf16."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from helpers import interrupted_run, run_cli, smoke_args

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import campaign  # noqa: E402


@pytest.fixture
def plan(trace_dir, tmp_path, monkeypatch):
    """A plan of three smoke runs: one complete, one interrupted in stage 1, one new."""
    out = tmp_path / "out"
    assert run_cli(*smoke_args(trace_dir, out / "a", "--method", "seqft", "--run-id", "done")) == 0
    interrupted_run(monkeypatch, *smoke_args(trace_dir, out / "b", "--method", "seqft", "--run-id", "cut"),
                    at_stage=1)
    flags = f"--profile smoke --data-dir {trace_dir} --method seqft --method-arg lr=1e-3"
    path = tmp_path / "plan.txt"
    path.write_text(f"# three runs\n{out}/a/done: {flags}\n{out}/b/cut: {flags}\n\n{out}/new: {flags}  # a comment\n")
    return path, out


def test_dry_run_says_skip_resume_start_and_refuses_auto_without_bf16(plan, monkeypatch, capsys):
    """Mutations caught: a complete run started again, an interrupted one started
    afresh, auto precision let through on a CPU without bf16."""
    path, out = plan
    here = ["--code", str(ROOT)]  # not a clone of HEAD: the tree under test may have changes
    assert campaign.main([str(path), "--dry-run", *here]) == 0
    said = capsys.readouterr().out.splitlines()
    assert [line.split()[:2] for line in said] == [["done", f"{out}/a/done"], ["resume", f"{out}/b/cut"],
                                                    ["start", f"{out}/new"]]

    path.write_text(path.read_text() + f"{out}/auto: --profile smoke --method seqft --set train.precision=auto\n")
    monkeypatch.setattr("cl_bench.precision.native_bf16", lambda device: False)
    assert campaign.main([str(path), "--dry-run", *here]) == 2
    assert f"{path}: lines 6 ask for precision auto or bf16" in capsys.readouterr().err
    assert campaign.main([str(path), "--dry-run", "--allow-fp32", *here]) == 0
    monkeypatch.setattr("cl_bench.precision.native_bf16", lambda device: True)
    assert campaign.main([str(path), "--dry-run", *here]) == 0


def test_a_resumed_run_takes_the_code_of_the_commit_it_started_from(plan):
    """Mutation caught: resuming with HEAD's code (two versions in one run)."""
    path, out = plan
    record = out / "b" / "cut" / "run.json"
    first = campaign._git("rev-list", "--max-parents=0", "HEAD").splitlines()[0]  # any commit of the repository
    record.write_text(json.dumps({**json.loads(record.read_text()), "git_commit": first}))
    entry = campaign.read_plan(path)[1]
    assert campaign.commit_of(entry, "resume") == first


@pytest.mark.parametrize("line, says", [
    ("results/x --profile smoke", "write '<output dir>/<run id>: <cl-bench run flags>'"),
    ("results/x: --profile smoke --run-id y", "drop --run-id"),
    ("results/x: --profile smoke --method nope", "unknown method 'nope'"),
])
def test_a_bad_plan_line_is_one_message_naming_the_line(tmp_path, capsys, line, says):
    path = tmp_path / "plan.txt"
    path.write_text(f"# header\n{line}\n")
    assert campaign.main([str(path), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"{path}:2: ") and says in err and "Traceback" not in err


@pytest.mark.slow
def test_a_campaign_finishes_every_run_and_leaves_the_complete_one_alone(plan):
    """Mutations caught: the complete run re-run (its record rewritten), the
    interrupted run started afresh (no resume in its record)."""
    path, out = plan
    before = (out / "a" / "done" / "run.json").read_bytes()
    assert campaign.main([str(path), "--slots", "2", "--code", str(ROOT)]) == 0
    assert (out / "a" / "done" / "run.json").read_bytes() == before
    records = {name: json.loads((out / name / "run.json").read_text()) for name in ("b/cut", "new")}
    assert all(r["status"] == "complete" for r in records.values())
    assert [r["at_stage"] for r in records["b/cut"]["resumes"]] == [1]
    assert "resumes" not in records["new"] or not records["new"]["resumes"]
