"""Fault cases of a run folder: each asserts the exit code, one line on stderr
with no traceback, and that nothing already written was damaged."""
from __future__ import annotations

import errno
import hashlib
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from cl_bench.record import io as results
from cl_bench.run import checkpoint
from helpers import interrupted_run, run_cli, smoke_args


class _Exploit:
    """What a crafted checkpoint carries: unpickling it would call os.system."""

    def __reduce__(self):
        return (os.system, ("touch PWNED",))


def _digest(folder):  # run.lock aside: it holds the PID of whoever last took the lock
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.glob("*"))
            if p.is_file() and p.name != "run.lock"}


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
@pytest.mark.slow
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


# ---- the fault matrix: refused before anything runs ----------------------------
#
# Each setup(ctx) prepares the case and returns (argv, the folder that must stay as
# it was, extra text the message must hold or None); the run is refused with exit
# 2 and one line, and that folder is byte for byte (and name for name) unchanged.

def _tree(folder):
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()} if folder.exists() else None


def _one_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err and "\n" not in err and "Traceback" not in err, err
    return err


def _hold_lock(ctx, run_dir):
    """Another process holding run_dir's lock, as a running cl-bench would; returns its PID."""
    run_dir.mkdir(parents=True, exist_ok=True)
    code = ("import fcntl, os, sys, time; f = open(sys.argv[1], 'a+'); fcntl.flock(f, fcntl.LOCK_EX); "
            "f.truncate(0); f.write(str(os.getpid())); f.flush(); print('held', flush=True); time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", code, str(run_dir / results.LOCK_FILE)],
                            stdout=subprocess.PIPE, text=True)
    ctx.finalizer(lambda: (proc.kill(), proc.wait()))
    assert proc.stdout.readline().strip() == "held"
    return proc.pid


def _read_only(ctx, folder):
    """chmod a-w; as root (whom permissions do not stop) os.open is also refused
    there, as the kernel would refuse anyone else."""
    folder.chmod(0o555)
    ctx.finalizer(lambda: folder.chmod(0o755))
    if os.geteuid() == 0:
        real = os.open

        def refuse(path, flags, *args, **kwargs):
            writes = flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT)
            if writes and os.path.abspath(os.fspath(path)).startswith(str(folder)):
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), os.fspath(path))
            return real(path, flags, *args, **kwargs)

        ctx.monkeypatch.setattr(os, "open", refuse)


def _interrupted(ctx, at_stage=1):
    return interrupted_run(ctx.monkeypatch, *smoke_args(ctx.trace, ctx.tmp / "runs"), at_stage=at_stage)


def _folder_with(ctx, name):
    out = ctx.tmp / "runs"
    (out / "r1").mkdir(parents=True)
    (out / "r1" / name).write_text('{"stage": 0, "step": 0, "lm": 1.0}\n')
    return smoke_args(ctx.trace, out, "--run-id", "r1"), out, None


def _fresh(*extra):
    return lambda ctx: (smoke_args(ctx.trace, ctx.tmp / "runs", *extra), ctx.tmp, None)


def _locked_fresh(ctx):
    pid = _hold_lock(ctx, ctx.tmp / "runs" / "r1")
    return smoke_args(ctx.trace, ctx.tmp / "runs", "--run-id", "r1"), ctx.tmp / "runs", f"PID {pid}"


def _locked_resume(ctx):
    run_dir = _interrupted(ctx)
    pid = _hold_lock(ctx, run_dir)
    return ["run", "--resume", run_dir, "--no-progress"], run_dir, f"PID {pid}"


def _locked_starting(ctx):  # a run that has its lock but has not written a record yet
    pid = _hold_lock(ctx, ctx.tmp / "runs" / "r1")
    return ["run", "--resume", ctx.tmp / "runs" / "r1"], ctx.tmp / "runs", f"PID {pid}"


def _read_only_fresh(ctx):
    (ctx.tmp / "runs" / "r1").mkdir(parents=True)
    _read_only(ctx, ctx.tmp / "runs" / "r1")
    return smoke_args(ctx.trace, ctx.tmp / "runs", "--run-id", "r1"), ctx.tmp / "runs", None


def _read_only_resume(ctx):
    run_dir = _interrupted(ctx)
    _read_only(ctx, run_dir)
    return ["run", "--resume", run_dir, "--no-progress"], run_dir, None


def _resume_a_file(ctx):
    (ctx.tmp / "run.json").write_text("{}")
    return ["run", "--resume", ctx.tmp / "run.json"], ctx.tmp, None


def _resume_without_config(ctx):
    run_dir = _interrupted(ctx)
    record = json.loads((run_dir / "run.json").read_text())
    del record["config"]
    (run_dir / "run.json").write_text(json.dumps(record))
    return ["run", "--resume", run_dir, "--no-progress"], run_dir, None


def _resume_with(*flags):
    return lambda ctx: (["run", "--resume", _interrupted(ctx), "--no-progress", *flags], ctx.tmp / "runs", None)


def _score_not_utf8(ctx):
    (ctx.tmp / "p.jsonl").write_bytes(b'{"prompt": "\xff", "prediction": "1", "answer": "1"}\n')
    return ["score", "--task", "NumGLUE-cm", "--predictions", ctx.tmp / "p.jsonl"], ctx.tmp, None


def _score_pooled(ctx):
    run_dir = _interrupted(ctx, at_stage=2)  # stages 1 and 2 saved: NumGLUE-cm scored at both
    return ["score", "--task", "NumGLUE-cm", "--predictions", run_dir / "predictions.jsonl"], run_dir, None


def _stopped_before_its_record(ctx):  # what a stop while the model loads leaves: the lock file alone
    (ctx.tmp / "runs" / "r1").mkdir(parents=True)
    (ctx.tmp / "runs" / "r1" / results.LOCK_FILE).write_text("12345\n")
    return ["run", "--resume", ctx.tmp / "runs" / "r1"], ctx.tmp / "runs", "--run-id r1 --output-dir"


def _split_is_a_folder(ctx):
    split = ctx.trace / "Py150" / "test.json"
    split.unlink()
    split.mkdir()
    return smoke_args(ctx.trace, ctx.tmp / "runs"), ctx.trace, "replace it with the test.json file of Py150"


def _duplicate_key(ctx):
    (ctx.tmp / "my.yaml").write_text("train:\n  epochs: 1\n  lr_schedule: constant\n  epochs: 2\n")
    return smoke_args(ctx.trace, ctx.tmp / "runs", "--config", ctx.tmp / "my.yaml"), ctx.tmp, None


def _empty_answers(with_prompts):
    """NumGLUE-cm's training answers all emptied (its prompts too, unless `with_prompts`)."""
    def setup(ctx):
        path = ctx.trace / "NumGLUE-cm" / "train.json"
        path.write_text(json.dumps([{"prompt": r["prompt"] if with_prompts else "", "answer": ""}
                                    for r in json.loads(path.read_text())]))
        return smoke_args(ctx.trace, ctx.tmp / "runs"), ctx.trace, f"{path}: field \"answer\" is empty"
    return setup


REFUSED = [  # (case, setup, message)
    ("non-empty folder", lambda ctx: _folder_with(ctx, "notes.txt"), "folder exists and is not empty (notes.txt)"),
    ("leftover metrics", lambda ctx: _folder_with(ctx, "metrics.jsonl"), "a run starts only in an absent or empty"),
    ("run-id ..", _fresh("--run-id", ".."), "run_id='..' must be one plain folder name"),
    ("run-id a/b", _fresh("--run-id", "a/b"), "run_id='a/b' must be one plain folder name"),
    ("run-id absolute", _fresh("--run-id", "/tmp/x"), "run_id='/tmp/x' must be one plain folder name"),
    ("run-id newline", _fresh("--run-id", "a\nb"), "run_id='a\\nb' must be one plain folder name (no '/', no newline"),
    ("split file is a folder", _split_is_a_folder, "Py150/test.json: is a folder, not a split file"),
    ("yaml duplicate key", _duplicate_key, "my.yaml: line 4: 'epochs' is given twice in 'train'; keep one"),
    ("locked, fresh start", _locked_fresh, "in use by another cl-bench process"),
    ("locked, resume", _locked_resume, "in use by another cl-bench process"),
    ("locked, resume before a record", _locked_starting, "in use by another cl-bench process"),
    ("resume, stopped before a record", _stopped_before_its_record, "stopped before its record was written"),
    ("replay buffer as a method argument", _fresh("--method", "replay", "--method-arg", "buffer=10"),
     "has no argument 'buffer'; its arguments: lr, weight_decay, beta1, beta2; the replay buffer is the harness's: "
     "--set replay.fraction|per_task|policy|lima=VALUE"),
    ("config field as a method argument", _fresh("--method-arg", "epochs=2"),
     "has no argument 'epochs'; 'epochs' is a config field: --set train.epochs=VALUE;"),
    ("lr nan", _fresh("--method-arg", "lr=nan"), "method_args.lr=nan must be a finite number > 0"),
    ("lr -1", _fresh("--method-arg", "lr=-1"), "method_args.lr=-1.0 must be a finite number > 0"),
    ("lr inf", _fresh("--method-arg", "lr=inf"), "method_args.lr=inf must be a finite number > 0"),
    ("router_lr 0", _fresh("--method", "btx", "--method-arg", "router_lr=0"), "method_args.router_lr=0.0 must be"),
    ("grad_clip nan", _fresh("--set", "train.grad_clip=nan"), "train.grad_clip=nan must be a finite number >= 0"),
    ("grad_clip -1", _fresh("--set", "train.grad_clip=-1"), "train.grad_clip=-1.0 must be a finite number >= 0"),
    ("max_new_tokens_cap 0", _fresh("--set", "eval.max_new_tokens_cap=0"), "eval.max_new_tokens_cap=0 must be at least 1"),
    ("--set yaml tag", _fresh("--set", "train.lr_by_family={full: !!python/name:os.system}"), "not a valid YAML value"),
    ("--set malformed", _fresh("--set", "eval.sharpness_layers=[1,"), "eval.sharpness_layers='[1,' is not a valid YAML"),
    ("read-only run folder", _read_only_fresh, "run folder is not writable"),
    ("read-only resume", _read_only_resume, "run folder is not writable"),
    ("resume a file", _resume_a_file, "is a file, not a run folder"),
    ("resume, no config", _resume_without_config, "the record has no 'config'"),
    ("resume --method --seed", _resume_with("--method", "lora", "--seed", "0"), "drop --method, --seed"),
    ("resume --method-arg --set", _resume_with("--method-arg", "lr=1", "--set", "train.epochs=2"),
     "drop --method-arg, --set"),
    ("empty answers", _empty_answers(True), "no answer tokens are left to train on; fill in the answers"),
    ("empty answers and prompts", _empty_answers(False), "no answer tokens are left to train on; fill in the"),
    ("score not UTF-8", _score_not_utf8, "p.jsonl: not UTF-8 text (byte 12)"),
    ("score pooled stages", _score_pooled, "has predictions of stages 0, 1; pass --stage"),
]


@pytest.mark.parametrize("setup, message", [c[1:] for c in REFUSED], ids=[c[0] for c in REFUSED])
def test_refused_in_one_line_and_nothing_written_changes(trace_dir, tmp_path, monkeypatch, capsys, request,
                                                         setup, message):
    ctx = SimpleNamespace(trace=trace_dir, tmp=tmp_path, monkeypatch=monkeypatch, finalizer=request.addfinalizer)
    argv, watched, extra = setup(ctx)
    before = _tree(watched)
    capsys.readouterr()
    assert run_cli(*argv) == 2
    err = _one_line(capsys)
    assert message in err and (extra is None or extra in err), err
    assert _tree(watched) == before


# ---- the fault matrix: failures while a run goes ---------------------------------
#
# Each patch(monkeypatch) makes stage `fails_at` (0-based) fail; the run exits 2 with
# one line, its record says so (when it can be written), the checkpoint of the last
# finished stage is kept, metrics.jsonl is strict JSON, and no leaderboard ranks it.

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
    err = _one_line(capsys)
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
    assert "no complete run" in _one_line(capsys)
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
    before = _tree(run_dir)
    capsys.readouterr()
    assert run_cli("run", "--resume", run_dir, "--no-progress") == 2
    err = _one_line(capsys)
    assert f"{run_dir}/run.json: stages_done is 2" in err and "put checkpoint/ back" in err, err
    assert _tree(run_dir) == before

    run_dir = interrupted_run(monkeypatch, *smoke_args(trace_dir, tmp_path / "one"), at_stage=1)
    checkpoint.remove_checkpoint(run_dir, checkpoint.CHECKPOINT_DIR)
    assert run_cli("run", "--resume", run_dir, "--no-progress") == 0
    record = json.loads((run_dir / "run.json").read_text())
    assert record["status"] == "complete" and record["resumes"][-1]["at_stage"] == 0


# ---- an interrupt says what it leaves, and --resume does what it said ----------

@pytest.mark.parametrize("at_stage, message, venv", [
    (0, "interrupted before the first stage was saved; nothing to keep; start it again with: cl-bench run --resume",
     False),
    (1, "interrupted; 1 of 3 stages are saved; continue with: cl-bench run --resume", False),
    # started as `make main` starts it, its venv not activated: the line names the program's path
    (1, "interrupted; 1 of 3 stages are saved; continue with: .venv/bin/cl-bench run --resume", True),
])
@pytest.mark.slow
def test_interrupt_message_is_true_and_resume_finishes(trace_dir, tmp_path, monkeypatch, capsys, at_stage, message,
                                                       venv):
    if venv:
        script = tmp_path / ".venv" / "bin" / "cl-bench"
        script.parent.mkdir(parents=True)
        script.write_text("#!/bin/sh\n")
        script.chmod(0o755)
        monkeypatch.chdir(tmp_path)
        monkeypatch.setattr(sys, "argv", [".venv/bin/cl-bench"])
        monkeypatch.setenv("PATH", "/usr/bin:/bin")
    capsys.readouterr()
    run_dir = interrupted_run(monkeypatch, *smoke_args(trace_dir, tmp_path / "runs"), at_stage=at_stage)
    err = _one_line(capsys)
    assert message in err and str(run_dir) in err
    assert json.loads((run_dir / "run.json").read_text())["error"].startswith("KeyboardInterrupt")
    assert run_cli("run", "--resume", run_dir, "--no-progress") == 0
    record = json.loads((run_dir / "run.json").read_text())
    assert record["status"] == "complete" and "error" not in record
    assert record["resumes"][-1]["at_stage"] == at_stage
    assert None not in record["matrix"][-1]
    steps = [(r["stage"], r["step"]) for r in _strict_jsonl(run_dir / "metrics.jsonl")]
    assert steps == [(b, s) for b in range(3) for s in range(2)]  # each step once: 8 examples / batch 4
