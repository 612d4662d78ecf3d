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
from helpers import file_digests, interrupted_run, one_line_error, run_cli, smoke_args


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


def _tamper_code_legacy(state_pt):
    """The same in torch's legacy (not zip) format, which torch.load cannot memory-map."""
    state = torch.load(state_pt, weights_only=True)
    state["method"] = {"payload": _Exploit()}
    torch.save(state, state_pt, _use_new_zipfile_serialization=False)


def _tamper_truncate(state_pt):
    data = state_pt.read_bytes()
    state_pt.write_bytes(data[: len(data) // 3])


def _tamper_empty(state_pt):
    state_pt.write_bytes(b"")


@pytest.mark.parametrize("tamper, message", [
    (_tamper_code, "refused: it holds more than tensors and plain values (it imports posix.system)"),
    (_tamper_code_legacy, "refused: it holds more than tensors and plain values (it imports posix.system)"),
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
    ("score pooled stages", _score_pooled, "has predictions of stages 1, 2; pass --stage"),
]


@pytest.mark.parametrize("setup, message", [c[1:] for c in REFUSED], ids=[c[0] for c in REFUSED])
def test_refused_in_one_line_and_nothing_written_changes(trace_dir, tmp_path, monkeypatch, capsys, request,
                                                         setup, message):
    ctx = SimpleNamespace(trace=trace_dir, tmp=tmp_path, monkeypatch=monkeypatch, finalizer=request.addfinalizer)
    argv, watched, extra = setup(ctx)
    before = file_digests(watched)
    capsys.readouterr()
    assert run_cli(*argv) == 2
    err = one_line_error(capsys)
    assert message in err and (extra is None or extra in err), err
    assert file_digests(watched) == before


# ---- the fault matrix: failures while a run goes ---------------------------------
#
# Each patch(monkeypatch) makes stage `fails_at` (0-based) fail; the run exits 2 with
# one line, its record says so (when it can be written), the checkpoint of the last
# finished stage is kept, metrics.jsonl is strict JSON, and no leaderboard ranks it.
