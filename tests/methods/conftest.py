"""Fixtures of the method tests."""
from __future__ import annotations

from pathlib import Path

import pytest

from helpers import TWO_TASKS, make_trace, only_run, run_cli, smoke_args


@pytest.fixture(scope="session")
def seqft_two_tasks(tmp_path_factory) -> Path:
    """One SeqFT run over two smoke tasks, kept checkpoint: the λ = 0 reference
    (of EWC and LwF, test_ewc.py and test_lwf.py: one run for both)."""
    root = tmp_path_factory.mktemp("seqft")
    trace = make_trace(root / "trace")
    assert run_cli(*smoke_args(trace, root / "out", *TWO_TASKS, "--keep-checkpoint")) == 0
    return only_run(root / "out")
