"""Fault cases of a run folder: each asserts the exit code, one line on stderr
with no traceback, and that nothing already written was damaged."""
from __future__ import annotations

import hashlib
import os

import pytest
import torch

from conftest import interrupted_run, run_cli, smoke_args


class _Exploit:
    """What a crafted checkpoint carries: unpickling it would call os.system."""

    def __reduce__(self):
        return (os.system, ("touch PWNED",))


def _digest(folder):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.glob("*")) if p.is_file()}


def _tamper_code(state_pt):
    state = torch.load(state_pt, weights_only=True)
    state["method"] = {"payload": _Exploit()}
    torch.save(state, state_pt)


def _tamper_truncate(state_pt):
    data = state_pt.read_bytes()
    state_pt.write_bytes(data[: len(data) // 3])


def _tamper_empty(state_pt):
    state_pt.write_bytes(b"")


@pytest.mark.parametrize("tamper, message", [
    (_tamper_code, "refused: it holds more than tensors and plain values (it imports posix.system)"),
    (_tamper_truncate, "unreadable checkpoint"),
    (_tamper_empty, "unreadable checkpoint"),
])
def test_resume_from_a_bad_checkpoint_fails_in_one_line_and_runs_nothing(trace_dir, tmp_path, monkeypatch,
                                                                          capsys, tamper, message):
    run_dir = interrupted_run(monkeypatch, *smoke_args(trace_dir, tmp_path / "runs"), at_stage=1)
    tamper(run_dir / "checkpoint" / "state.pt")
    before = _digest(run_dir)
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    assert run_cli("run", "--resume", run_dir, "--no-progress") == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err and "Traceback" not in err
    assert not (tmp_path / "PWNED").exists()  # the payload never ran
    assert _digest(run_dir) == before  # nothing written was damaged
