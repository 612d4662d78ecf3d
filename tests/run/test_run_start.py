"""The start of `cl-bench run`: the run folder and the estimated time come first, the
estimate from the committed records as `cl-bench campaign` makes it; a stop before the
run's record exists says how to start it again, and that command works."""
from __future__ import annotations

import shlex
from pathlib import Path

from cl_bench.tools.campaign import estimate
from helpers import interrupted_run, only_run, run_cli, smoke_args


def test_the_estimate_reads_the_checkouts_committed_records():
    """Mutation caught: RECORDS one folder short (cl_bench/results, after the move into tools/)."""
    root = Path(__file__).resolve().parents[2]
    assert estimate.RECORDS == root / "results" and estimate.RECORDS.is_dir()


def _first_lines(capsys) -> list[str]:
    return capsys.readouterr().out.splitlines()[:2]


def test_run_names_its_folder_and_estimate_first(trace_dir, tmp_path, monkeypatch, capsys):
    """Mutations caught: no announcement; an estimate not from the records (a record of
    the same method and step shape turns "no estimate" into minutes, naming it)."""
    monkeypatch.setattr(estimate, "RECORDS", tmp_path / "none")
    assert run_cli(*smoke_args(trace_dir, tmp_path / "a", "--run-id", "first")) == 0
    folder, left = _first_lines(capsys)
    assert folder == f"run folder: {tmp_path / 'a' / 'first'}"
    assert left.startswith("estimated time: no estimate (no complete record of this step shape, tiny-llama in fp32")

    monkeypatch.setattr(estimate, "RECORDS", tmp_path / "a")  # the first run is now a record to learn from
    assert run_cli(*smoke_args(trace_dir, tmp_path / "b", "--run-id", "second")) == 0
    folder, left = _first_lines(capsys)
    assert folder == f"run folder: {tmp_path / 'b' / 'second'}"
    assert left.startswith("estimated time: ") and left.endswith(" min at one thread (first)"), left


def test_a_run_a_campaign_launched_estimates_from_the_campaigns_records(trace_dir, tmp_path, monkeypatch,
                                                                       capsys):
    """A campaign's run has its commit's clone for code, whose records lack every run
    committed since: it reads the campaign's (launch.environment) instead. Mutation
    caught: the environment's records ignored (the run reads its code's checkout: here
    none, "no estimate"; in the tuning campaign, OGD's paper6 run of an unrecorded machine
    where three of its own tuning runs had been committed)."""
    assert run_cli(*smoke_args(trace_dir, tmp_path / "a", "--run-id", "first")) == 0
    monkeypatch.setattr(estimate, "RECORDS", tmp_path / "none")
    monkeypatch.setenv(estimate.RECORDS_ENV, str(tmp_path / "a"))
    capsys.readouterr()
    assert run_cli(*smoke_args(trace_dir, tmp_path / "b", "--run-id", "second")) == 0
    _, left = _first_lines(capsys)
    assert left.startswith("estimated time: ") and left.endswith(" min at one thread (first)"), left


def test_a_stop_before_the_record_says_how_to_start_again(trace_dir, tmp_path, monkeypatch, capsys):
    """A stop while the model loads leaves the folder with its lock only; the line names
    the same command with the folder's --run-id, and that command starts the run there
    (mutation caught: the bare "interrupted", which names neither)."""
    real = _stopped_in(monkeypatch, "load")
    out = tmp_path / "runs"
    assert run_cli(*smoke_args(trace_dir, out)) == 130
    line = capsys.readouterr().err.strip().splitlines()[-1]
    head, _, command = line.partition(" with: ")
    assert head == "interrupted before the run's record was written; nothing to keep; start it again (its folder " \
                   "counts as empty)", line
    (run_dir,) = [p for p in out.iterdir() if p.is_dir() and p.name != ".cache"]
    assert [p.name for p in run_dir.iterdir()] == ["run.lock"]
    argv = shlex.split(command)
    assert argv[:2] == ["cl-bench", "run"] and argv[-2:] == ["--run-id", run_dir.name]
    monkeypatch.setattr("cl_bench.run.prepare.load", real)
    assert run_cli(*argv[1:]) == 0
    assert only_run(out) == run_dir


def test_a_stop_before_the_run_folder_says_nothing_was_written(trace_dir, tmp_path, monkeypatch, capsys):
    """A stop before the folder is claimed (a DeepSpeed backend joining its ranks, say)
    names the command to start again and that nothing was written (mutation caught: the
    bare "interrupted" it printed)."""
    _stopped_in(monkeypatch, "create_backend")
    out = tmp_path / "runs"
    assert run_cli(*smoke_args(trace_dir, out)) == 130
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("interrupted before the run folder was made; nothing was written; start it again "
                           "with: cl-bench run --profile smoke"), line
    assert not out.exists() or [p.name for p in out.iterdir()] in ([], [".cache"])


def test_a_stop_while_a_resume_is_taken_up_leaves_the_record_and_says_continue(trace_dir, tmp_path, monkeypatch,
                                                                                 capsys):
    """`run --resume` stopped while the model loads: the record is left byte for byte
    and the line gives the same --resume command, which then finishes the run
    (mutation caught: the interrupt passed on to main's handler, whose line says
    "start it again" for a folder that holds a record)."""
    run_dir = interrupted_run(monkeypatch, *smoke_args(trace_dir, tmp_path / "runs"), at_stage=1)
    before = (run_dir / "run.json").read_bytes()
    real = _stopped_in(monkeypatch, "load")
    capsys.readouterr()
    assert run_cli("run", "--resume", run_dir, "--no-progress") == 130
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line == ("interrupted before the run was taken up; its record is as it was; continue with: "
                    f"cl-bench run --resume {run_dir} --no-progress"), line
    assert (run_dir / "run.json").read_bytes() == before
    monkeypatch.setattr("cl_bench.run.prepare.load", real)
    assert run_cli("run", "--resume", run_dir, "--no-progress") == 0


def _stopped_in(monkeypatch, name: str):
    """cl_bench.run.prepare's `name` raises KeyboardInterrupt (Ctrl-C there); returns the real one."""
    from cl_bench.run import prepare

    real = getattr(prepare, name)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(prepare, name, interrupted)
    return real
