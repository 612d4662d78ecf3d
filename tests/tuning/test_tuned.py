"""The tuned file read back (cl_bench/tuning/tuned.py): `cl-bench run --tuned` takes the
method's arguments from it and records the file's commit; the tuned leaderboard holds
each method at its tuned arguments only, so that "≠ base" is against tuned SeqFT."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import yaml

from cl_bench import config as cfg
from cl_bench.errors import UserError
from cl_bench.leaderboard import build_table, load_runs
from cl_bench.tuning import tuned
from helpers import only_run, run_cli, smoke_args

TUNED = {"profile": "smoke", "methods": {"seqft": {"args": {"lr": 3.0e-5}}, "ewc": {"args": {"lr": 1.0e-5,
                                                                                             "lambda_ewc": 1.0e5}}}}


def git(root: Path, *argv: str) -> str:
    return subprocess.run(["git", "-C", str(root), *argv], check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture
def repo(tmp_path, monkeypatch) -> Path:
    """A checkout holding a committed configs/tuned/smoke.yaml, as tuned.ROOT."""
    root = tmp_path / "repo"
    (root / "configs" / "tuned").mkdir(parents=True)
    (root / "configs" / "tuned" / "smoke.yaml").write_text(yaml.safe_dump(TUNED))
    git(root.parent, "init", "-q", str(root))
    git(root, "-c", "user.name=t", "-c", "user.email=t@t", "add", ".")
    git(root, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "tuned")
    monkeypatch.setattr(tuned, "ROOT", root)
    return root


def test_tuned_takes_the_methods_arguments_from_the_file_and_names_its_commit(repo):
    """Mutation: config.resolve without the tuned hook leaves the default lr and no `tuned`."""
    config = cfg.resolve("cpu", None, {"profile": "smoke", "method": "ewc", "tuned": True})
    assert config.method_args == {"lr": 1e-5, "lambda_ewc": 1e5}
    assert config.tuned == f"configs/tuned/smoke.yaml@{git(repo, 'rev-parse', 'HEAD')}"
    assert cfg.resolve("cpu", None, {"profile": "smoke", "method": "ewc"}).tuned is None


@pytest.mark.parametrize("overrides, change, message", [
    ({"method_args": {"lr": "1e-3"}}, None, "--tuned sets lr of seqft from configs/tuned/smoke.yaml; drop "
                                            "--method-arg lr"),
    ({"method": "lwf"}, None, "no tuned arguments for lwf"),
    ({}, "edit", "has uncommitted changes; commit it"),
    ({"profile": "cpu"}, None, "cpu.yaml: no tuned file for this profile"),
    ({"tuned": "configs/tuned/smoke.yaml@abc"}, None, "give true (--tuned)"),
])
def test_tuned_refuses_what_the_record_could_not_name(repo, overrides, change, message):
    if change == "edit":
        (repo / "configs" / "tuned" / "smoke.yaml").write_text(yaml.safe_dump({**TUNED, "profile": "x"}))
    with pytest.raises(UserError) as e:
        cfg.resolve("cpu", None, {"profile": "smoke", "method": "seqft", "tuned": True, **overrides})
    assert message in str(e.value)


def test_a_tuned_smoke_run_records_the_file_and_its_commit(repo, trace_dir, tmp_path):
    argv = [a for a in smoke_args(trace_dir, tmp_path / "out", "--method", "seqft", "--tuned",
                                  "--order", "NumGLUE-cm") if a not in ("--method-arg", "lr=1e-3")]
    assert run_cli(*argv) == 0
    record = json.loads((only_run(tmp_path / "out") / "run.json").read_text())
    assert record["config"]["tuned"] == f"configs/tuned/smoke.yaml@{git(repo, 'rev-parse', 'HEAD')}"
    assert record["method_args"]["lr"] == 3e-5


def test_the_tuned_leaderboard_holds_each_method_at_its_tuned_arguments_and_judges_base_against_tuned_seqft(
        tmp_path, fake_run):
    """Mutation: select ignoring the arguments puts SeqFT at its shared rate beside the tuned one."""
    runs = tmp_path / "results"
    at_tuned = tuned.expected_args({m: e["args"] for m, e in TUNED["methods"].items()}, "smoke")
    shared = tuned.expected_args({"seqft": {}, "ewc": {}}, "smoke")
    fake_run(runs / "seqft-shared", "seqft", shared["seqft"], [10, 10, 10], split="test")
    fake_run(runs / "seqft-tuned", "seqft", at_tuned["seqft"], [30, 30, 30], split="test")
    fake_run(runs / "ewc-tuned", "ewc", at_tuned["ewc"], [20, 20, 20], split="test")
    fake_run(runs / "ewc-tuned-on-eval", "ewc", at_tuned["ewc"], [40, 40, 40], split="eval")
    fake_run(runs / "ewc-other-order", "ewc", at_tuned["ewc"], [40, 40], split="test", tasks=["NumGLUE-cm", "Py150"])
    chosen = tuned.select(load_runs(runs), at_tuned, "smoke")
    assert sorted(Path(r.source).parent.name for r in chosen) == ["ewc-tuned", "seqft-tuned"]
    table = build_table(chosen)
    (ewc,) = table.index[table["Method"] == "ewc"]
    assert list(table["Method"]) == ["seqft", "ewc"] and table.loc[ewc, "Last ≠ base"] == "yes"
    assert [Path(r.source).parent.name for r in tuned.select(load_runs(runs), shared, "smoke")] == ["seqft-shared"]


def test_the_finals_run_each_method_at_its_tuned_arguments_on_the_test_split_seeded_rows_at_every_seed(
        repo, tmp_path):
    """A committed row that is the finals run (same arguments, seed and budget) is named,
    not re-run. Mutation: finals_plan without the records lookup plans ewc again."""
    from cl_bench.campaign.plan import Entry, planned, read_plan
    from cl_bench.tuning import grid as grids
    from cl_bench.tuning import plan
    import dataclasses

    path = tmp_path / "grid.yaml"
    path.write_text(yaml.safe_dump({
        "profile": "smoke", "order": ["NumGLUE-cm", "Py150", "20Minuten"], "rule": "last-acc-keep-base",
        "output": "results/tuning", "methods": {"seqft": {"lr": [3.0e-6, 1.0e-5, 3.0e-5]},
                                                "ewc": {"lr": [3.0e-6, 1.0e-5, 3.0e-5]}},
        "finals": {"output": "results/tuned", "seeds": [1234, 2], "seeded": ["seqft", "ewc"]}}, sort_keys=False))
    g = grids.load(path)
    flags = ["--profile", "smoke", "--method", "ewc", "--tuned", "--seed", "2"]
    config, method_args = planned(Entry(Path("x/y"), flags, 0))
    committed = tmp_path / "results" / "ewc-smoke-seed2"
    committed.mkdir(parents=True)
    (committed / "run.json").write_text(json.dumps({
        "status": "complete", "method": "ewc", "seed": 2, "config": {**config.to_dict(), "tuned": None},
        "method_args": dataclasses.asdict(method_args), "git_commit": "abcdef123",
        "backend": {"precision": {"train": "fp32", "eval": "fp32"}}}))
    text = plan.finals_plan(g, Path("configs/tuned/smoke.yaml"), tuned.load(tuned.path_for("smoke")),
                            plan.Records(Path("results"), tmp_path), g.finals.output, g.finals.seeds,
                            g.finals.seeded)
    (tmp_path / "finals.txt").write_text(text)
    entries = read_plan(tmp_path / "finals.txt")
    assert [str(e.run_dir) for e in entries] == ["results/tuned/seqft", "results/tuned/seqft-seed2",
                                                 "results/tuned/ewc", "results/ewc-smoke-seed2"]
    assert "kept: code abcdef12" in text
    configs = [planned(e)[0] for e in entries]
    assert {c.data.test_split for c in configs} == {"test"} and [c.seed for c in configs] == [1234, 2, 1234, 2]
    assert [c.method_args.get("lr") for c in configs] == [3e-5, 3e-5, 1e-5, 1e-5]
    assert all(c.tuned.startswith("configs/tuned/smoke.yaml@") for c in configs)
