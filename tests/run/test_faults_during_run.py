"""Fault cases during a run: a stage that fails (NaN loss, a full disk), a stop while
a complete run removes its checkpoints, a folder without its stage checkpoint, and
the interrupt message; each asserts the exit code, one line on stderr with no
traceback, what was recorded and that the last checkpoint is kept."""
from __future__ import annotations

import errno
import json
import os
import shlex
import sys

import pytest
import torch

from cl_bench.record import io as results
from cl_bench.run import checkpoint
from helpers import file_digests, interrupted_run, one_line_error, run_cli, smoke_args


def _nan_loss_in_stage_2(monkeypatch):
    from cl_bench.backends.torch_backend import TorchBackend

    real = TorchBackend.train_stage

    def train_stage(self, method, optimizer, stage, epochs, pad_id, on_step=None, *args, **kwargs):
        def report(step, parts):
            on_step(step, {**parts, "lm": float("nan")} if stage.index == 1 and step == 1 else parts)
        return real(self, method, optimizer, stage, epochs, pad_id, report, *args, **kwargs)

    monkeypatch.setattr(TorchBackend, "train_stage", train_stage)


def _disk_full(monkeypatch, failing):
    """ENOSPC on the run.json writes numbered in `failing` (1: the first)."""
    real, calls = results.atomic_write_text, []

    def write(path, text):
        if path.name == results.RUN_FILE:
            calls.append(path)
            if len(calls) in failing:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(path, text)

    monkeypatch.setattr(results, "atomic_write_text", write)


def _checkpoint_disk_full(monkeypatch):
    real, calls = torch.save, []

    def save(obj, path, *args, **kwargs):
        calls.append(path)
        if len(calls) == 2:
            raise RuntimeError("[enforce fail at inline_container.cc:626] . PytorchStreamWriter failed writing "
                               "file data/3: file write failed")
        return real(obj, path, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)


FAILED = [  # (case, patch, extra flags, stages checkpointed, stages_done recorded, message, record status)
    ("lr 1e10 diverges", lambda mp: None, ("--method-arg", "lr=1e10"), 0, 0, "the run diverged", "failed"),
    ("nan loss in stage 2", _nan_loss_in_stage_2, (), 1, 1, "lm is nan at step 1; the run diverged", "failed"),
    # the record is written before the checkpoint, so a failure between the two records
    # the stage as done; --resume goes by the checkpoint and redoes it (run.json writes:
    # 1 when the run starts, 2 after stage 1, 3 after stage 2)
    ("disk full once", lambda mp: _disk_full(mp, {3}), (), 1, 2, "(No space left on device)", "failed"),
    ("disk stays full", lambda mp: _disk_full(mp, {3, 4}), (), 1, 1, "(No space left on device)", "running"),
    ("checkpoint disk full", _checkpoint_disk_full, (), 1, 2, "cannot write the checkpoint (file write failed; ",
     "failed"),
]


def _strict_jsonl(path):
    def refuse(name):
        raise AssertionError(f"{path} holds {name}, which is not JSON")
    return [json.loads(line, parse_constant=refuse) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.parametrize("patch, extra, saved, done, message, status", [c[1:] for c in FAILED],
                         ids=[c[0] for c in FAILED])
@pytest.mark.slow
def test_a_failing_stage_is_recorded_and_keeps_the_last_checkpoint(trace_dir, tmp_path, monkeypatch, capsys,
                                                                    patch, extra, saved, done, message, status):
    out = tmp_path / "runs"
    patch(monkeypatch)
    capsys.readouterr()
    assert run_cli(*smoke_args(trace_dir, out, "--run-id", "r", *extra)) == 2
    err = one_line_error(capsys)
    assert message in err and "enforce fail" not in err and "PytorchStreamWriter" not in err, err
    run_dir = out / "r"
    record = json.loads((run_dir / "run.json").read_text())
    assert record["status"] == status and record["stages_done"] == done
    if status == "failed":
        assert message in record["error"]
    logged = {r["stage"] for r in _strict_jsonl(run_dir / "metrics.jsonl")}
    assert set(range(saved)) <= logged <= set(range(saved + 1))  # at most the failing stage's rows too
    if "diverged" in message:  # its rows are never written
        assert record["failed_at"]["stage"] == saved and "step" in record["failed_at"] and logged == set(range(saved))
    if saved:  # the last finished stage's checkpoint, whole
        assert torch.load(run_dir / "checkpoint" / "state.pt", weights_only=True)["stage"] == saved - 1
    else:
        assert not checkpoint.has_checkpoint(run_dir)
    monkeypatch.undo()
    assert run_cli("leaderboard", "--runs", out) == 2  # never ranked
    assert "no complete run" in one_line_error(capsys)
    if "diverged" not in message:  # nothing it kept was damaged: it resumes to the end
        assert run_cli("run", "--resume", run_dir, "--no-progress") == 0
        record = json.loads((run_dir / "run.json").read_text())
        assert record["status"] == "complete" and "error" not in record
        steps = [(r["stage"], r["step"]) for r in _strict_jsonl(run_dir / "metrics.jsonl")]
        assert steps == [(b, s) for b in range(3) for s in range(2)]


# ---- a stop while a complete run removes its checkpoints ----------------------

@pytest.mark.slow
def test_a_stop_while_a_complete_run_removes_its_checkpoints_leaves_it_complete(trace_dir, tmp_path, monkeypatch,
                                                                                caplog):
    """The record says complete before the checkpoints go; a Ctrl-C (or the machine's
    window ending) during their removal must not rewrite it as interrupted: with
    every stage done and the checkpoint half gone, it could then never be resumed
    nor ranked. Mutation caught: the guard in sequencer.execute dropped (exit 130,
    status interrupted)."""
    real = checkpoint.remove_checkpoint

    def cut(run_dir, name):
        if name == checkpoint.CHECKPOINT_DIR:  # only the complete run's removal (a stage's end removes checkpoint-step/)
            raise KeyboardInterrupt
        real(run_dir, name)

    monkeypatch.setattr(checkpoint, "remove_checkpoint", cut)
    assert run_cli(*smoke_args(trace_dir, tmp_path / "runs", "--run-id", "r")) == 0
    record = json.loads((tmp_path / "runs" / "r" / "run.json").read_text())
    assert record["status"] == "complete" and "error" not in record
    assert "stopped while removing the complete run's checkpoints" in caplog.text


# ---- a folder copied without its checkpoint ------------------------------------

@pytest.mark.slow
def test_resume_of_a_folder_without_its_stage_checkpoint_refuses_and_changes_nothing(trace_dir, tmp_path,
                                                                                     monkeypatch, capsys):
    """checkpoint*/ is git-ignored, so a run folder copied by git (a clone, the next
    machine) arrives without it. With 2 stages recorded, --resume refuses in one line
    and the folder stays as it was; it used to start again from stage 1 over the
    recorded stages (mutation caught: the check in resume.resumable dropped). With 1
    stage recorded (a stop between stage 1's record and its checkpoint looks the same)
    it still starts again and finishes (mutation caught: refusing from 1 stage)."""
    run_dir = interrupted_run(monkeypatch, *smoke_args(trace_dir, tmp_path / "runs"), at_stage=2)
    checkpoint.remove_checkpoint(run_dir, checkpoint.CHECKPOINT_DIR)
    before = file_digests(run_dir)
    capsys.readouterr()
    assert run_cli("run", "--resume", run_dir, "--no-progress") == 2
    err = one_line_error(capsys)
    assert f"{run_dir}/run.json: stages_done is 2" in err and "put checkpoint/ back" in err, err
    assert file_digests(run_dir) == before

    run_dir = interrupted_run(monkeypatch, *smoke_args(trace_dir, tmp_path / "one"), at_stage=1)
    checkpoint.remove_checkpoint(run_dir, checkpoint.CHECKPOINT_DIR)
    assert run_cli("run", "--resume", run_dir, "--no-progress") == 0
    record = json.loads((run_dir / "run.json").read_text())
    assert record["status"] == "complete" and record["resumes"][-1]["at_stage"] == 0


# ---- an interrupt says what it leaves, and --resume does what it said ----------

@pytest.mark.parametrize("at_stage, message, venv, launch", [
    (0, "interrupted before the first stage was saved; nothing to keep; start it again with: cl-bench run --resume",
     False, []),
    # a flag that says how the run runs, not what (errors.LAUNCH_FLAGS), is given again
    # (mutation caught: the line without it: the resumed run deletes the checkpoint it was to keep)
    (1, "interrupted; 1 of 3 stages are saved; continue with: cl-bench run --resume", False, ["--keep-checkpoint"]),
    # started as `make main` starts it, its venv not activated: the line names the program's path
    (1, "interrupted; 1 of 3 stages are saved; continue with: .venv/bin/cl-bench run --resume", True, []),
])
@pytest.mark.slow
def test_interrupt_message_is_true_and_resume_finishes(trace_dir, tmp_path, monkeypatch, capsys, at_stage, message,
                                                       venv, launch):
    if venv:
        script = tmp_path / ".venv" / "bin" / "cl-bench"
        script.parent.mkdir(parents=True)
        script.write_text("#!/bin/sh\n")
        script.chmod(0o755)
        monkeypatch.chdir(tmp_path)
        monkeypatch.setattr(sys, "argv", [".venv/bin/cl-bench"])
        monkeypatch.setenv("PATH", "/usr/bin:/bin")
    capsys.readouterr()
    run_dir = interrupted_run(monkeypatch, *smoke_args(trace_dir, tmp_path / "runs"), *launch, at_stage=at_stage)
    err = one_line_error(capsys)
    assert message in err and err.endswith(shlex.join([str(run_dir), *launch]))
    assert json.loads((run_dir / "run.json").read_text())["error"].startswith("KeyboardInterrupt")
    said = shlex.split(err.split(" with: ", 1)[1])
    assert run_cli(*said[1:], "--no-progress") == 0  # the command it gave, as the program runs it
    assert checkpoint.has_checkpoint(run_dir) == bool(launch)
    record = json.loads((run_dir / "run.json").read_text())
    assert record["status"] == "complete" and "error" not in record
    assert record["resumes"][-1]["at_stage"] == at_stage
    assert None not in record["matrix"][-1]
    steps = [(r["stage"], r["step"]) for r in _strict_jsonl(run_dir / "metrics.jsonl")]
    assert steps == [(b, s) for b in range(3) for s in range(2)]  # each step once: 8 examples / batch 4
