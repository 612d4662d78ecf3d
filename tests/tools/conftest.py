"""Fixtures of the tools tests."""
from __future__ import annotations

import pytest

from helpers import interrupted_run, run_cli, smoke_args


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
