"""Tuned files per benchmark (cl_bench/config_tuned.py): a tuned value is chosen on one
benchmark's eval split and belongs to it. TRACE's stay at configs/tuned/<profile>.yaml;
another benchmark's are configs/tuned/<benchmark>/<profile>.yaml, and a benchmark without
its file is refused, never given TRACE's. The tuning protocol keys its grid's benchmark
the same way (`tune choose` writes there, `tune finals` plans `--benchmark`). Each test's
docstring names the mutation it catches."""
from __future__ import annotations

import dataclasses

import pytest
import yaml

from cl_bench import config as cfg
from cl_bench import config_tuned, registry
from cl_bench.errors import UserError
from cl_bench.tools.campaign.plan import planned, read_plan
from cl_bench.tools.tuning import grid as grids
from cl_bench.tools.tuning import tuned
from helpers import one_line_error, run_cli
from test_tuned import git, repo  # noqa: F401  (repo: a checkout with TRACE's configs/tuned/smoke.yaml, as ROOT)

LS_ORDER = ["CB", "COPA", "RTE"]


def commit(root, files: dict[str, dict]) -> str:
    """Write and commit `files` (path -> YAML content) in the checkout; the commit."""
    for rel, content in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(yaml.safe_dump(content))
    git(root, "-c", "user.name=t", "-c", "user.email=t@t", "add", ".")
    git(root, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "files")
    return git(root, "rev-parse", "HEAD")


def test_a_long_sequence_tuned_run_without_its_own_file_is_refused_in_one_line(repo, tmp_path, monkeypatch, capsys):
    """Mutations caught: apply reading configs/tuned/<profile>.yaml whatever the run's benchmark
    (config.resolve not passing it, or path_for ignoring it), and `read` falling back to TRACE's
    file where the benchmark has none: TRACE's smoke.yaml is committed here, so either would
    load it and go on."""
    loaded = []
    monkeypatch.setattr(config_tuned, "load", lambda path: loaded.append(path) or {"seqft": {"lr": 3e-5}})
    code = run_cli("run", "--benchmark", "long-sequence", "--profile", "smoke", "--method", "seqft", "--tuned",
                   "--data-dir", tmp_path / "none", "--output-dir", tmp_path / "out")
    line = one_line_error(capsys)
    assert code == 2 and loaded == [] and not (tmp_path / "out").exists()
    assert line.startswith("error: configs/tuned/long-sequence/smoke.yaml: no tuned file of benchmark "
                           "long-sequence for profile smoke"), line
    assert "tune it on long-sequence's eval split" in line and "`cl-bench tune choose`" in line


def test_a_long_sequence_tuned_run_applies_its_own_file_and_records_its_path(repo):
    """Mutation caught: the tuned file keyed by the profile alone (path_for without the benchmark,
    or config.resolve not passing it): the long-sequence run would take TRACE's lr 1e-3 and name
    configs/tuned/cpu.yaml."""
    head = commit(repo, {"configs/tuned/cpu.yaml": {"methods": {"lora": {"args": {"lr": 1e-3}}}},
                         "configs/tuned/long-sequence/cpu.yaml": {"methods": {"lora": {"args": {"lr": 1e-2}}}}})
    run = cfg.resolve("cpu", None, {"method": "lora", "tuned": True, "data": {"benchmark": "long-sequence"}})
    assert run.method_args == {"lr": 1e-2} and run.tuned == f"configs/tuned/long-sequence/cpu.yaml@{head}"
    trace = cfg.resolve("cpu", None, {"method": "lora", "tuned": True})
    assert trace.method_args == {"lr": 1e-3} and trace.tuned == f"configs/tuned/cpu.yaml@{head}"


def test_a_long_sequence_grid_plans_its_runs_on_it_and_chooses_into_its_own_file(repo, fake_run, monkeypatch):
    """Mutations caught: `tune choose` writing configs/tuned/<profile>.yaml whatever the grid's
    benchmark (over TRACE's file); the finals' lines without `--benchmark` (they would train
    TRACE, at TRACE's tuned file); Grid.flags without `--benchmark` (the tuning runs would)."""
    monkeypatch.chdir(repo)
    traces = (repo / "configs" / "tuned" / "smoke.yaml").read_bytes()
    (repo / "grid.yaml").write_text(yaml.safe_dump({
        "profile": "smoke", "benchmark": "long-sequence", "order": LS_ORDER, "rule": "last-acc-keep-base",
        "output": "results/tuning", "methods": {"seqft": {"lr": [3.0e-6, 1.0e-5, 3.0e-5]}},
        "finals": {"output": "results/tuned", "seeds": [1234]}}))
    assert run_cli("tune", "plan", "grid.yaml", "--out", "plan.txt") == 0
    lines = [e.flags for e in read_plan(repo / "plan.txt")]
    assert len(lines) == 3 and all(f[4:6] == ["--benchmark", "long-sequence"] for f in lines)
    for lr, final in zip((3e-6, 1e-5, 3e-5), ([20] * 3, [30] * 3, [38] * 3)):
        fake_run(repo / "results" / "tuning" / f"seqft-lr{lr:.0e}".replace("e-0", "e-"), "seqft", {"lr": lr}, final,
                 tasks=LS_ORDER)
    assert run_cli("tune", "choose", "grid.yaml") == 0
    chosen = yaml.safe_load((repo / "configs" / "tuned" / "long-sequence" / "smoke.yaml").read_text())
    assert chosen["methods"]["seqft"]["args"] == {"lr": 3e-5} and chosen["order"] == LS_ORDER
    assert (repo / "configs" / "tuned" / "smoke.yaml").read_bytes() == traces
    git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "add", ".")
    git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "chosen")
    assert run_cli("tune", "finals", "grid.yaml", "--out", "finals.txt") == 0
    (entry,) = read_plan(repo / "finals.txt")
    assert entry.flags == ["--profile", "smoke", "--method", "seqft", "--benchmark", "long-sequence", "--tuned",
                           "--seed", "1234"]
    final = planned(entry)[0]
    assert final.data.benchmark == "long-sequence" and final.method_args == {"lr": 3e-5}
    assert final.tuned.startswith("configs/tuned/long-sequence/smoke.yaml@")


def test_the_grids_base_rate_and_the_shared_rate_are_its_benchmarks(tmp_path, monkeypatch):
    """Mutation caught: tuned.expected_args resolving the profile without the benchmark (TRACE's
    fields): a benchmark whose profile sets its own family rate would have the grid's base rate,
    and the shared-rate leaderboard's, at TRACE's 1e-5 instead of its 3e-5."""
    from cl_bench.benchmarks.long_sequence import LONG_SEQUENCE

    own = dataclasses.replace(LONG_SEQUENCE, name="ls-fast", profiles={
        "smoke": {"data": {"order": LS_ORDER}, "train": {"lr_by_family": {"full": 3e-5}}}})
    monkeypatch.setitem(registry._BENCHMARKS, "ls-fast", own)
    assert tuned.default_args("seqft", "smoke")["lr"] == 1e-5
    assert tuned.default_args("seqft", "smoke", "ls-fast")["lr"] == 3e-5
    (tmp_path / "grid.yaml").write_text(yaml.safe_dump({
        "profile": "smoke", "benchmark": "ls-fast", "order": LS_ORDER, "rule": "last-acc-keep-base",
        "output": "results/tuning", "methods": {"seqft": {"lr": [1.0e-5, 3.0e-5, 1.0e-4]}},
        "finals": {"output": "results/tuned"}}))
    assert grids.load(tmp_path / "grid.yaml").methods["seqft"].base_lr == 3e-5


@pytest.mark.parametrize("declared, expect", [
    (None, "configs/tuned/mine/cpu.yaml"),  # the folder's name
    ("my-tasks", "configs/tuned/my-tasks/cpu.yaml"),  # the name benchmark.yaml declares
    ("trace", "declares the name 'trace' of a registered benchmark"),
    ("../up", "cannot name the folder of its tuned files"),
])
def test_a_folder_benchmarks_tuned_file_is_under_its_declared_name_never_a_registered_ones(
        tmp_path, declared, expect):
    """Mutation caught: benchmark_name without its checks: a folder declaring `name: trace` would
    be given TRACE's tuned file, and `name: ../up` a path outside configs/tuned/."""
    folder = tmp_path / "mine"
    folder.mkdir()
    spec = {"tasks": {"A": {"metric": "accuracy", "max_new_tokens": 4}}}
    (folder / "benchmark.yaml").write_text(yaml.safe_dump({**spec, **({"name": declared} if declared else {})}))
    if expect.startswith("configs/"):
        assert config_tuned.path_for("cpu", str(folder)) == config_tuned.ROOT / expect
        return
    with pytest.raises(UserError) as e:
        config_tuned.path_for("cpu", str(folder))
    assert expect in str(e.value) and "\n" not in str(e.value)
