"""The flags of `cl-bench run` that say how a run runs, not what it computes
(errors.LAUNCH_FLAGS: --nproc, --keep-checkpoint), which the record's config
does not hold: every line that says how to continue a run gives them again, so a run
launched on N ranks goes on on N ranks and keeps its checkpoint (the interrupt's line,
tests/run/test_faults_during_run.py; `cl-bench show`'s and a campaign's resume, here)."""
from __future__ import annotations

import pytest

from cl_bench.cli_parser import RUN_CONFIG_FLAGS, build_parser
from cl_bench.errors import LAUNCH_FLAGS, launch_flags

RUN_LAUNCH_FLAGS = {flag[2:].replace("-", "_") for flag in LAUNCH_FLAGS}


@pytest.mark.parametrize("argv, flags", [
    (["run", "--method", "ewc", "--backend", "deepspeed", "--nproc", "4", "--keep-checkpoint"],
     ["--nproc", "4", "--keep-checkpoint"]),
    (["--debug", "run", "--resume", "runs/r", "--nproc=2", "--no-progress"], ["--nproc", "2"]),
    (["run", "--keep-check", "--npr", "3"], ["--nproc", "3", "--keep-checkpoint"]),  # abbreviated, as run reads them
    (["run", "--nproc", "x"], []),
    (["run", "--method", "seqft"], []),
    (["run", "--no-such-flag"], []),  # an older version's record: nothing this one cannot read
    (["run", "--nproc", "2", "--zero", "1", "--no-such-flag"], ["--nproc", "2"]),  # nor does it hide the rest
    (["show", "runs/r"], []),
])
def test_launch_flags_are_read_as_the_parser_reads_them(argv, flags, capsys):
    """Mutation caught: --nproc left out of LAUNCH_FLAGS (the first two cases)."""
    assert launch_flags(argv) == flags
    assert capsys.readouterr() == ("", "")  # an unreadable command prints no usage


def test_every_run_flag_is_config_launch_or_neither_by_name():
    """A new flag of `run` is placed here on purpose: set by the config (refused with
    --resume), a launch flag (carried on --resume), or one that neither records nor
    carries. Mutation caught: a flag added to `run` and to neither list."""
    dests = set(vars(build_parser().parse_args(["run"]))) - {"command", "debug", "local_rank"}  # the program's own
    neither = {"resume", "no_progress"}
    assert dests == set(RUN_CONFIG_FLAGS) | RUN_LAUNCH_FLAGS | neither
    assert not set(RUN_CONFIG_FLAGS) & RUN_LAUNCH_FLAGS


def test_a_message_inside_a_run_continues_it_as_its_launch_did(monkeypatch):
    """errors.resume_line without a command (a full disk's message, record/io.py and
    run/checkpoint.py): this process's own, in a rank its launcher's (CL_BENCH_COMMAND),
    and the program its launcher was called by (CL_BENCH_PROGRAM, set by
    backends/launch.py). Mutations caught: the launcher's command not read (no flags);
    the program not passed to the ranks (`cl-bench` for `.venv/bin/cl-bench`)."""
    from cl_bench.backends import launch
    from cl_bench.errors import PROGRAM_ENV, program, resume_line
    from cl_bench.run import signals

    monkeypatch.setattr("sys.argv", [".venv/bin/cl-bench", "run", "--nproc", "2", "--keep-checkpoint"])
    monkeypatch.setattr(launch, "program", lambda: ".venv/bin/cl-bench")  # as `make main` leaves it
    started = []
    monkeypatch.setattr(signals, "start_group", lambda argv, env: started.append(env))
    monkeypatch.setattr(signals, "wait_forwarding", lambda proc: (0, signals.Stop()))
    argv = ["run", "--nproc", "2", "--keep-checkpoint"]
    assert launch.launch(2, argv, "cl-bench run --nproc 2 --keep-checkpoint") == (0, False)
    env = started[0]
    for key in ("CL_BENCH_COMMAND", PROGRAM_ENV):  # now as a rank of that launch
        monkeypatch.setenv(key, env[key])
    monkeypatch.setattr("sys.argv", ["/x/cl_bench/cli.py", "run"])  # a rank: python -m cl_bench.cli
    assert program() == ".venv/bin/cl-bench"
    assert resume_line("runs/r") == ".venv/bin/cl-bench run --resume runs/r --nproc 2 --keep-checkpoint"
