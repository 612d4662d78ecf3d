"""In-stage checkpoints (train.checkpoint_every_s, cl_bench/run/checkpoint.py): a run
killed with SIGKILL inside a stage, after an in-stage checkpoint, resumes at the
step after that checkpoint and ends with the uninterrupted run's predictions,
metrics and matrix, byte for byte.

The run goes in a subprocess that patches the backends so that the process
kills itself (SIGKILL: nothing is caught, nothing is flushed) right after the
optimiser step `step` of phase `phase` of stage `stage`, before that step is
logged or checkpointed: the step is lost and must be taken again. Both processes
log every step they compute, so the test also sees that the resumed process took
only the steps after the checkpoint (mutation caught: "resume restarts the stage",
e.g. load_in_stage returning None; checked: the predictions and metrics are still
equal there, the steps taken are not).
"""
from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from cl_bench.record import io as results
from cl_bench.run import checkpoint
from helpers import deepspeed_args, make_trace, run_cli, smoke_args

ROOT = Path(__file__).resolve().parents[2]
# 4 steps a stage (8 items, 2 a step), an in-stage checkpoint after every step
SHAPE = ["--set", "train.batch_size=2", "--set", "train.micro_batch_size=1"]
EVERY_STEP = ["--set", "train.checkpoint_every_s=0"]

_PATCHED_RUN = textwrap.dedent("""
    import json, os, signal, sys
    from cl_bench.backends.torch_backend import TorchBackend
    from cl_bench.backends.deepspeed_backend import DeepSpeedBackend
    from cl_bench.cli import main

    kill = json.loads(os.environ["KILL_AT"]) if os.environ.get("KILL_AT") else None
    taken = open(os.environ["STEPS_LOG"], "a")
    calls = {}

    def patched(real):
        def train_stage(self, method, optimizer, stage, epochs, pad_id, on_step=None, *args, **kwargs):
            phase = calls[stage.index] = calls.get(stage.index, -1) + 1
            def report(step, parts):
                taken.write(json.dumps([stage.index, phase, step]) + "\\n"); taken.flush()
                if kill == [stage.index, phase, step]:
                    os.kill(os.getpid(), signal.SIGKILL)
                on_step(step, parts)
            return real(self, method, optimizer, stage, epochs, pad_id, report, *args, **kwargs)
        return train_stage

    for backend in (TorchBackend, DeepSpeedBackend):
        backend.train_stage = patched(backend.train_stage)
    sys.exit(main(sys.argv[1:]))
""")


def _run(argv: list, steps_log: Path, kill_at: list[int] | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "STEPS_LOG": str(steps_log),
           "KILL_AT": json.dumps(kill_at) if kill_at else "",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-c", _PATCHED_RUN, *map(str, argv)], env=env, capture_output=True,
                          text=True, timeout=600)


def _taken(path: Path) -> list[list[int]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _same_bytes(a: Path, b: Path) -> None:
    for name in (results.PREDICTIONS_FILE, results.METRICS_FILE):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    rec_a, rec_b = (json.loads((d / results.RUN_FILE).read_text()) for d in (a, b))
    for key in ("matrix", "zero_shot", "summary", "intervals", "params", "replay"):
        assert rec_a[key] == rec_b[key], key


# (method, kill at [stage, phase, step]): dense, replay interleaved with training,
# a teacher built in before_task, a new expert group per task, the flagship (Gumbel
# noise, mask logits and their optimiser: failed before their in-task state was
# saved), SAME (router bases and masks: likewise), two phases a stage (the kill in the
# second), and stage 0 (no stage checkpoint yet: the run restarts, then continues
# in-stage). The other methods pass the same test (checked once, all 17).
CASES = [("seqft", [1, 0, 2]), ("replay", [1, 0, 2]), ("lwf", [1, 0, 2]), ("upcycle", [1, 0, 2]),
         ("bilevel-cka", [1, 0, 2]), ("same", [1, 0, 2]), ("btx", [1, 1, 2]), ("seqft", [0, 0, 2])]


@pytest.fixture(scope="module")
def twin(tmp_path_factory):
    """The synthetic tree of this module's runs, and the uninterrupted run of a method on it
    (no in-stage checkpoints), made once: the two seqft cases share theirs."""
    root = tmp_path_factory.mktemp("twins")
    trace, done = make_trace(root / "trace"), {}

    def run(method: str) -> Path:
        if method not in done:
            assert run_cli(*smoke_args(trace, root / "runs"), "--method", method, *SHAPE, "--run-id", method) == 0
            done[method] = root / "runs" / method
        return done[method]
    run.trace = trace
    return run


@pytest.mark.slow
@pytest.mark.parametrize("method, kill_at", CASES, ids=[f"{m}-{'-'.join(map(str, k))}" for m, k in CASES])
def test_sigkill_inside_a_stage_resumes_at_the_checkpoint_byte_for_byte(twin, tmp_path, method, kill_at):
    _killed_and_resumed([*smoke_args(twin.trace, tmp_path / "runs"), "--method", method, *SHAPE], twin(method),
                        tmp_path, kill_at)


# On the deepspeed backend (one rank): the checkpoint's weights and optimiser state are
# gathered from the engine between two steps (DeepSpeedBackend.whole, ZeroPhase.whole)
# and the resumed phase's engine starts from them. The flagship at ZeRO-2, upcycle at
# ZeRO-3 (every weight partitioned; its added experts trained). Mutations caught: the
# whole() context a no-op at ZeRO-3 (the checkpoint holds ZeRO-3's empty placeholders:
# refused at resume), the optimiser state left out of it (the resumed Adam starts
# again: the run differs after the kill).
DS_CASES = [("bilevel-cka", 2), ("upcycle", 3)]


@pytest.mark.slow
@pytest.mark.parametrize("method, zero", DS_CASES, ids=[f"{m}-zero{z}" for m, z in DS_CASES])
def test_sigkill_inside_a_deepspeed_stage_resumes_at_the_checkpoint_byte_for_byte(trace_dir, tmp_path, method,
                                                                                   zero):
    args = [*smoke_args(trace_dir, tmp_path / "runs"), "--method", method, *SHAPE,
            *deepspeed_args(tmp_path, zero)]
    assert run_cli(*args, "--run-id", "twin") == 0
    _killed_and_resumed(args, tmp_path / "runs" / "twin", tmp_path, [1, 0, 2])


def _killed_and_resumed(args: list, twin_dir: Path, tmp_path: Path, kill_at: list[int]) -> None:
    """The run of `args` killed at `kill_at` after an in-stage checkpoint at every step,
    then resumed: twin_dir's run (the same, uninterrupted), byte for byte."""
    run_dir = tmp_path / "runs" / "killed"
    first, second = tmp_path / "first.log", tmp_path / "second.log"
    killed = _run([*args, *EVERY_STEP, "--run-id", "killed"], first, kill_at)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    stage, phase, step = kill_at
    assert checkpoint.has_checkpoint(run_dir, checkpoint.STEP_CHECKPOINT_DIR)
    assert json.loads((run_dir / results.RUN_FILE).read_text())["stages_done"] == stage

    resumed = _run(["run", "--resume", run_dir, "--no-progress"], second)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    _same_bytes(twin_dir, run_dir)
    # the resumed process took the lost step again and nothing before it
    again = _taken(second)
    assert again[0] == kill_at, again[:3]
    assert all(s > stage or (s == stage and (p > phase or (p == phase and k >= step))) for s, p, k in again)
    assert len(_taken(first)) + len(again) - 1 == sum(1 for _ in results.read_jsonl(twin_dir / "metrics.jsonl"))
    record = json.loads((run_dir / results.RUN_FILE).read_text())
    assert record["status"] == "complete" and record["resumes"][-1]["at_step"] == {"phase": phase, "step": step}
    assert not any(run_dir.glob("checkpoint*"))


def test_checkpoint_every_s_is_checked_before_anything_loads(trace_dir, tmp_path, capsys):
    assert run_cli(*smoke_args(trace_dir, tmp_path / "runs"), "--set", "train.checkpoint_every_s=-1") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "train.checkpoint_every_s=-1.0 must be a number of seconds >= 0" in err[0]
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").glob("*/run.json"))


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads the process's mappings (Linux)")
def test_a_resumed_run_trains_on_with_no_checkpoint_file_mapped(trace_dir, tmp_path, monkeypatch):
    """--resume maps the checkpoint file (checkpoint.loaded); once it is applied nothing
    of the run holds the mapping, neither the stage checkpoint's nor the in-stage one's:
    the file a later checkpoint replaces is freed, and the loaded weights are not a
    second copy of the model for the rest of the stage. ewc, which keeps the Fisher and
    anchor tensors it is given, stopped after step 1 of stage 2 with an in-stage
    checkpoint at every step; the process's mappings read as each stage's training
    starts. Mutations caught: the method's field not copied (ewc's tensors hold the
    in-stage checkpoint's mapping), the optimiser's state not copied (AdamW's step and
    moments, on the CPU, stay the file's), the InStage keeping the loaded file."""
    from cl_bench.backends.torch_backend import TorchBackend
    from helpers import interrupted_run

    run_dir = interrupted_run(monkeypatch, *smoke_args(trace_dir, tmp_path / "runs", "--method", "ewc", *SHAPE,
                                                       *EVERY_STEP), at_stage=1, after_step=1)
    real = TorchBackend.train_stage
    mapped: list[list[str]] = []

    def train_stage(self, *args, **kwargs):
        gc.collect()
        lines = Path("/proc/self/maps").read_text().splitlines()
        mapped.append(sorted({line.split(str(run_dir))[1] for line in lines if str(run_dir) in line}))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(TorchBackend, "train_stage", train_stage)
    assert run_cli("run", "--resume", run_dir, "--no-progress") == 0
    assert mapped == [[], []], mapped


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads the process's mappings (Linux)")
def test_a_kept_copy_of_a_loaded_tensor_that_requires_grad_holds_no_mapping(tmp_path):
    """checkpoint.loaded's copies are detached: a copy made by clone() alone keeps the
    mapped tensor in its graph (and so the file). Mutation caught: clone() alone (the
    copy's grad_fn, CloneBackward0, leads back to the mapped tensor)."""
    from types import SimpleNamespace

    folder = tmp_path / checkpoint.CHECKPOINT_DIR
    folder.mkdir()
    torch.save({"method": {"w": torch.ones(3, requires_grad=True)}}, folder / "state.pt")
    kept = checkpoint.loaded(SimpleNamespace(run_dir=tmp_path), checkpoint.CHECKPOINT_DIR).state["method"]["w"]
    gc.collect()
    assert kept.requires_grad and kept.grad_fn is None
    assert str(folder) not in Path("/proc/self/maps").read_text()
