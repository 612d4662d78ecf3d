"""The headline leaderboard, written down once (results/headline.yaml; issue 51): a bare
`cl-bench leaderboard` reads the folder and exclusions the file names, --runs reads
any folder without it, and a bad file is one line naming the file, the field and the
fix, exit 2. Fake run records in tmp_path, the working directory moved there.

Mutations caught: cmd_leaderboard reading --runs' old default (results/, whole) instead
of the file; the file's exclusions dropped; a field left unchecked (a string for
`exclude`, which would exclude by each of its characters)."""
from __future__ import annotations

from pathlib import Path

import pytest

from cl_bench.report.leaderboard.headline import FALLBACK, leaderboard_runs, load_headline
from helpers import run_cli
from test_leaderboard import make_run, write


@pytest.fixture
def repo(tmp_path, monkeypatch):
    """results/ with a run at the top (seqft), one under long/ (ewc) and one under sweeps/ (lwf)."""
    results = tmp_path / "results"
    write(results, make_run("seqft-a"))
    write(results / "long", make_run("ewc-a", method="ewc"))
    write(results / "sweeps", make_run("lwf-a", method="lwf"))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def methods(out: str) -> set[str]:
    return {line.split(",")[0] for line in out.strip().splitlines()[1:]}


def test_bare_leaderboard_reads_the_headline_file(repo, capsys):
    (repo / "results" / "headline.yaml").write_text("runs: .\nexclude:\n  - long/*\n  - sweeps/*\n")
    assert run_cli("leaderboard", "--format", "csv") == 0
    assert methods(capsys.readouterr().out) == {"seqft"}
    assert run_cli("leaderboard", "--format", "csv", "--runs", "results") == 0  # any folder, without the file
    assert methods(capsys.readouterr().out) == {"seqft", "ewc", "lwf"}
    assert run_cli("leaderboard", "--format", "csv", "--runs", "results/long") == 0
    assert methods(capsys.readouterr().out) == {"ewc"}


def test_flags_narrow_the_headline_and_no_file_reads_results_whole(repo, capsys):
    (repo / "results" / "headline.yaml").write_text("runs: .\nexclude: [long/*]\n")
    assert run_cli("leaderboard", "--format", "csv", "--exclude", "sweeps/*") == 0
    assert methods(capsys.readouterr().out) == {"seqft"}
    (repo / "results" / "headline.yaml").unlink()
    assert load_headline() is None and leaderboard_runs(None, [], [])[0] == FALLBACK
    assert run_cli("leaderboard", "--format", "csv") == 0
    assert methods(capsys.readouterr().out) == {"seqft", "ewc", "lwf"}


def test_runs_is_relative_to_the_file(repo):
    (repo / "results" / "headline.yaml").write_text("runs: long\n")
    head = load_headline()
    assert head.runs == Path("results/long") and head.exclude == ()


@pytest.mark.parametrize("text, says", [
    ("runs: .\nexlude: [long/*]\n", ["unknown field 'exlude'", "did you mean 'exclude'"]),
    ("exclude: [long/*]\n", ["missing field 'runs'", "runs: ."]),
    ("runs: [a, b]\n", ["field 'runs' must be a folder", "runs: ."]),
    ("runs: nowhere\n", ["field 'runs'", "results/nowhere is not a folder"]),
    ("runs: .\nexclude: long/*\n", ["field 'exclude' must be a list of globs", "exclude: [long/*]"]),
    ("runs: .\nexclude: [long/*, 3]\n", ["field 'exclude' must be a list of globs"]),
    ("- runs\n", ["must be a mapping with the fields runs and exclude"]),
    ("runs: .\n  bad: : [\n", ["not valid YAML", "fix the file"]),
])
def test_a_bad_headline_file_is_one_line_naming_file_field_and_fix(repo, capsys, text, says):
    (repo / "results" / "headline.yaml").write_text(text)
    assert run_cli("leaderboard") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0]
    assert "results/headline.yaml" in err[0] and all(s in err[0] for s in says), err[0]


def test_the_committed_headline_file_loads(monkeypatch):
    """The repository's own file: its folder is results/, and it leaves out the runs that have
    tables of their own (long/) and those that are not the calibrated profile's rows."""
    root = Path(__file__).resolve().parents[2]
    monkeypatch.chdir(root)
    head = load_headline()
    assert head is not None and head.runs == Path("results")
    assert {"long/*", "cpu-v1/*", "calibration/*", "sweeps/*"} <= set(head.exclude)
