"""The flags of `cl-bench run` that say how a run runs, not what it computes
(cli_parser.RUN_LAUNCH_FLAGS: --nproc, --keep-checkpoint), which the record's config
does not hold: every line that says how to continue a run gives them again, so a run
launched on N ranks goes on on N ranks and keeps its checkpoint (the interrupt's line,
tests/run/test_faults_during_run.py; `cl-bench show`'s and a campaign's resume, here)."""
from __future__ import annotations

import pytest

from cl_bench.cli_parser import RUN_CONFIG_FLAGS, RUN_LAUNCH_FLAGS, build_parser, launch_flags


@pytest.mark.parametrize("argv, flags", [
    (["run", "--method", "ewc", "--backend", "deepspeed", "--nproc", "4", "--keep-checkpoint"],
     ["--nproc", "4", "--keep-checkpoint"]),
    (["--debug", "run", "--resume", "runs/r", "--nproc=2", "--no-progress"], ["--nproc", "2"]),
    (["run", "--keep-check", "--method", "seqft"], ["--keep-checkpoint"]),  # as argparse reads an abbreviation
    (["run", "--method", "seqft"], []),
    (["run", "--no-such-flag"], []),  # an older version's record: nothing this one cannot read
    (["show", "runs/r"], []),
])
def test_launch_flags_are_read_as_the_parser_reads_them(argv, flags, capsys):
    """Mutation caught: "nproc" left out of RUN_LAUNCH_FLAGS (the first two cases)."""
    assert launch_flags(argv) == flags
    assert capsys.readouterr() == ("", "")  # an unreadable command prints no usage


def test_every_run_flag_is_config_launch_or_neither_by_name():
    """A new flag of `run` is placed here on purpose: set by the config (refused with
    --resume), a launch flag (carried on --resume), or one that neither records nor
    carries. Mutation caught: a flag added to `run` and to neither list."""
    dests = set(vars(build_parser().parse_args(["run"]))) - {"command", "debug", "local_rank"}  # the program's own
    neither = {"resume", "no_progress"}
    assert dests == set(RUN_CONFIG_FLAGS) | set(RUN_LAUNCH_FLAGS) | neither
    assert not set(RUN_CONFIG_FLAGS) & set(RUN_LAUNCH_FLAGS)
