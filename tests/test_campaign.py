"""scripts/campaign.py: a plan's runs skipped when complete, resumed when
interrupted, started otherwise, each from a clone of its commit; auto precision
refused on a CPU without bf16; a bad plan is one line."""
from __future__ import annotations

import json
import subprocess
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


def here(*argv):
    """A dry run on the tree as it is (the tree under test may have changes, which
    a new run's clone of HEAD refuses)."""
    return [*argv, "--dry-run", "--code", str(ROOT)]


def test_dry_run_says_skip_resume_start_and_refuses_auto_without_bf16(plan, monkeypatch, capsys):
    """Mutations caught: a complete run started again, an interrupted one started
    afresh, auto precision let through on a CPU without bf16."""
    path, out = plan
    assert campaign.main(here(str(path))) == 0
    said = capsys.readouterr().out.splitlines()
    assert [line.split()[:2] for line in said] == [["done", f"{out}/a/done"], ["resume", f"{out}/b/cut"],
                                                    ["start", f"{out}/new"]]

    (out / "locked").mkdir()  # a start that died before its record: only a lock file
    (out / "locked" / ".lock").write_text("")
    path.write_text(path.read_text() + f"{out}/locked: --profile smoke --method seqft\n"
                    f"{out}/auto: --profile smoke --method seqft --set train.precision=auto\n")
    monkeypatch.setattr("cl_bench.precision.native_bf16", lambda device: True)
    assert campaign.main(here(str(path))) == 0
    assert capsys.readouterr().out.splitlines()[3].split()[:2] == ["start", f"{out}/locked"]
    monkeypatch.setattr("cl_bench.precision.native_bf16", lambda device: False)
    assert campaign.main(here(str(path))) == 2
    assert f"{path}: lines 7 ask for precision auto or bf16" in capsys.readouterr().err
    assert campaign.main(here(str(path), "--allow-fp32")) == 0
    path.write_text(path.read_text() + f"{out}/bf16: --profile smoke --method seqft --set eval.precision=bf16\n")
    assert campaign.main(here(str(path), "--allow-fp32")) == 2  # emulated bf16: never


def test_a_resumed_run_takes_the_commit_it_started_from_and_says_what_the_line_changed(plan, capsys):
    """Mutations caught: resuming with HEAD's code (two versions in one run), a run
    from an unknown commit resumed anyway, a changed line passed over in silence."""
    path, out = plan
    record = out / "b" / "cut" / "run.json"
    data = json.loads(record.read_text())
    first = campaign._git("rev-list", "--max-parents=0", "HEAD").splitlines()[0]  # any commit of the repository
    record.write_text(json.dumps({**data, "git_commit": first}))
    entries = campaign.read_plan(path)
    assert campaign.commit_of(entries[1], campaign.recorded(entries[1])) == first
    record.write_text(json.dumps({**data, "git_commit": "0" * 40}))
    with pytest.raises(campaign.CampaignError, match="not a commit of this repository; resume it by hand"):
        campaign.commit_of(entries[1], campaign.recorded(entries[1]))

    path.write_text(path.read_text().replace("lr=1e-3\n", "lr=1e-2\n", 2))
    assert campaign.main([str(path), "--dry-run", "--code", str(ROOT)]) == 0
    said = capsys.readouterr().err
    assert "is resumed as recorded, though the line now asks for method_args.lr 0.001 -> 0.01" in said


@pytest.mark.parametrize("line, says", [
    ("results/x --profile smoke", "write '<output dir>/<run id>: <cl-bench run flags>'"),
    ("results/x: --profile smoke --run-id=y", "drop --run-id"),
    ("results/x: --profile smoke --set 'a=b", "cannot split the flags (No closing quotation)"),
    ("results/x: --profile smoke --method nope", "unknown method 'nope'"),
    ("results/x: --profile smoke --no-such-flag", "these are not `cl-bench run` flags"),
])
def test_a_bad_plan_line_is_one_message_naming_the_line(tmp_path, capsys, line, says):
    path = tmp_path / "plan.txt"
    path.write_text(f"# header\n{line}\n")
    assert campaign.main(here(str(path))) == 2
    err = capsys.readouterr().err.splitlines()[-1]
    assert err.startswith(f"{path}:2: ") and says in err and "Traceback" not in err


def test_an_unreadable_record_is_one_message(plan, capsys):
    path, out = plan
    (out / "b" / "cut" / "run.json").write_text("{")
    assert campaign.main(here(str(path))) == 2
    assert f"{out}/b/cut/run.json: not a readable run record" in capsys.readouterr().err


@pytest.mark.slow
def test_a_campaign_runs_a_clones_code_finishes_every_run_and_leaves_the_complete_one_alone(
        plan, tmp_path, monkeypatch):
    """The runs import every package from the clone, methods included, and record
    its commit. Mutations caught: the live tree imported (no -P, or methods/ not
    linked), the complete run re-run, the interrupted run started afresh."""
    path, out = plan
    code = tmp_path / "code"
    subprocess.run(["git", "clone", "--quiet", str(ROOT), str(code)], check=True)
    marker = tmp_path / "imported"
    with open(code / "methods" / "__init__.py", "a") as f:  # each run notes where its methods came from
        f.write("import os\nif os.environ.get('CAMPAIGN_MARKER'):\n"
                "    open(os.environ['CAMPAIGN_MARKER'], 'a').write(__file__ + '\\n')\n")
    subprocess.run(["git", "-C", str(code), "-c", "user.name=t", "-c", "user.email=t@t", "commit", "--quiet", "-am",
                    "marker"], check=True)  # a clean clone: its runs record its commit
    monkeypatch.setenv("CAMPAIGN_MARKER", str(marker))
    before = (out / "a" / "done" / "run.json").read_bytes()
    assert campaign.main([str(path), "--slots", "2", "--code", str(code)]) == 0
    assert (out / "a" / "done" / "run.json").read_bytes() == before
    records = {name: json.loads((out / name / "run.json").read_text()) for name in ("b/cut", "new")}
    assert all(r["status"] == "complete" for r in records.values())
    assert [r["at_stage"] for r in records["b/cut"]["resumes"]] == [1]
    assert not records["new"].get("resumes")
    assert records["new"]["git_commit"] == campaign._git("rev-parse", "HEAD", cwd=code)
    imported = marker.read_text().splitlines()
    assert len(imported) == 2 and all(Path(p).resolve().is_relative_to(code.resolve()) for p in imported)
