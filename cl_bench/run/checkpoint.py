"""What of a run is saved and restored: after every stage the record and the
predictions (write_files), then a checkpoint of weights, method state, optimiser
state, generator states, the replay buffer and the probe's references (save);
on --resume the checkpoint comes back and the record drops what the interrupted
stage wrote after it (restore). Rank 0 writes; every rank restores.

Inside a stage (train.checkpoint_every_s), at a step boundary: the weights, the
method's and the optimiser's state, the generator states and the stage's step log
so far, with where it stands (phase, next step), in checkpoint-step/ (save_in_stage).
Resuming there (InStage) replays the stage's hooks from its start, which are
deterministic given the stage checkpoint's generator states, so that whatever
before_task and before_phase built (a teacher, a new expert group, an anchor)
exists again; at the saved phase it loads the saved state over them and the backend
skips the steps already taken. The result is the uninterrupted run's, byte for byte
(tests/test_resume_in_stage.py).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from cl_bench.record import io as results
from cl_bench.run.checkpoint_shape import Loaded

if TYPE_CHECKING:
    from cl_bench.run.prepare import Run
    from cl_bench.record.schema import RunRecord

log = logging.getLogger(__name__)


def write_files(run: Run) -> None:
    """The record and the predictions, on rank 0 (results.write_run)."""
    if run.backend.is_main:
        results.write_run(run.run_dir, run.record, run.predictions)


def _name_of(model: torch.nn.Module) -> dict[int, str]:
    return {id(p): n for n, p in model.named_parameters()}


def _training_state(run: Run) -> dict[str, Any]:
    """Weights, method state, optimiser state (by parameter name) and generator states."""
    state = {"model": run.method.model.state_dict(), "method": run.method.state_dict(), "optimizer": None,
             "rng": results.rng_state()}
    if run.optimizer is not None:
        names = _name_of(run.method.model)
        state["optimizer"] = {
            "groups": [[names[id(p)] for p in g["params"]] for g in run.optimizer.param_groups],
            "state": run.optimizer.state_dict(),
        }
    return state


def _loaded(run: Run, name: str) -> Loaded:
    """The checkpoint `name` of the run, to be applied field by field (checkpoint_shape)."""
    state = results.load_checkpoint(run.run_dir, name)
    return Loaded(results.checkpoint_file(run.run_dir, name), state)


def _load_training_state(run: Run, saved: Loaded) -> None:
    """Weights, method and optimiser state and generator states, each checked against
    the run's (one line naming the field otherwise)."""
    with saved.applying("method"):
        run.method.load_state_dict(saved.get("method", dict))  # may rebuild architecture first
    run.method.model.load_state_dict(saved.check_weights(run.method.model))
    groups = saved.optimizer_groups(run.method.model)
    if groups is not None:
        params = dict(run.method.model.named_parameters())
        with saved.applying("optimizer.groups"):
            run.optimizer = run.method.make_optimizer([{"params": [params[n] for n in names]} for names in groups])
        fresh = [dict(g) for g in run.optimizer.param_groups]
        with saved.applying("optimizer.state"):
            run.optimizer.load_state_dict(saved.state["optimizer"]["state"])
        saved.check_optimizer(run.optimizer, fresh)
    rng = saved.get("rng", dict)
    with saved.applying("rng"):
        results.set_rng_state(rng)


def save(run: Run, stage_index: int) -> None:
    """Full weights, method state and optimiser state (gathered by the backend after
    training: the model is an ordinary module on every rank here); rank 0 writes.
    The stage's in-stage checkpoint, if any, goes once this one is written."""
    if not run.backend.is_main:
        return
    state = {
        "stage": stage_index,
        **_training_state(run),
        "replay": run.replay.state_dict(),
        "probe": run.probe.state_dict() if run.probe is not None else None,
        "routing": run.routing.state_dict() if run.routing is not None else None,
    }
    results.save_checkpoint(run.run_dir, state)
    results.remove_checkpoint(run.run_dir, results.STEP_CHECKPOINT_DIR)


@dataclass
class InStage:
    """Where an in-stage checkpoint stands: training resumes in `stage` at phase
    `phase`, step `step` (the steps before it are taken), with `state` loaded once
    that phase's hooks have run; `log_rows`, `global_step` and `train_s`: the
    stage's step log, the run's step count and the training seconds up to there."""

    stage: int
    phase: int
    step: int
    log_rows: list[dict]
    global_step: int
    train_s: float
    state: Loaded | None = None  # as loaded (save_in_stage takes the run's own)


def save_in_stage(run: Run, at: InStage) -> None:
    """The in-stage checkpoint `at` (its state taken now, at a step boundary); rank 0."""
    if run.backend.is_main:
        results.save_checkpoint(run.run_dir, {
            "stage": at.stage, "phase": at.phase, "step": at.step, "log_rows": at.log_rows,
            "global_step": at.global_step, "train_s": at.train_s, **_training_state(run)},
            results.STEP_CHECKPOINT_DIR)


def load_in_stage(run: Run) -> InStage | None:
    """The in-stage checkpoint of the stage the run continues with, if there is one
    (one of an earlier stage, left by a stop between the stage checkpoint and its
    removal, is removed)."""
    if not results.has_checkpoint(run.run_dir, results.STEP_CHECKPOINT_DIR):
        return None
    saved = _loaded(run, results.STEP_CHECKPOINT_DIR)
    if saved.index("stage", 0, len(run.stages) - 1) != run.record.stages_done:
        run.backend.barrier()
        run.backend.on_main(lambda: results.remove_checkpoint(run.run_dir, results.STEP_CHECKPOINT_DIR))
        return None
    log_rows = saved.get("log_rows", list)
    if not all(isinstance(r, dict) and isinstance(r.get("step"), int) for r in log_rows):
        raise saved.fail("log_rows", "must be the stage's step log rows (objects with an integer step)")
    train_s = saved.get("train_s", (int, float))
    return InStage(saved.index("stage", 0, len(run.stages) - 1), saved.index("phase", 0, 1 << 30),
                   saved.index("step", 0, 1 << 30), log_rows, saved.index("global_step", 0, 1 << 62),
                   float(train_s), saved)


def enter_in_stage(run: Run, at: InStage) -> None:
    """Load the in-stage checkpoint's state (its phase's hooks have run) and note the
    resume in the record."""
    _load_training_state(run, at.state)
    run.global_step = at.global_step
    last = (run.record.resumes or [None])[-1]
    if last is not None and last.get("at_stage") == at.stage:
        last["at_step"] = {"phase": at.phase, "step": at.step}
    if run.backend.is_main:
        log.info("%s: continuing stage %d at step %d of its phase %d (in-stage checkpoint)", run.run_dir,
                 at.stage + 1, at.step, at.phase + 1)


def keep_zero_shot(old: RunRecord, new: RunRecord, run_dir: Path) -> list[dict]:
    """A restart (no stage checkpoint yet): the zero-shot scores of `old`, the record
    read, go into `new`, the fresh one, if the model is the same (its sha256 among
    the info compared); returns their predictions. A task whose predictions are not
    all in predictions.jsonl (a stop between the record's write and theirs) is
    scored again."""
    if old.zero_shot is None or old.model != new.model or len(old.zero_shot) != len(new.tasks):
        return []
    rows: dict[str, list[dict]] = {}
    for row in results.read_jsonl(run_dir / results.PREDICTIONS_FILE, staged=True):
        if row["stage"] == results.ZERO_SHOT_STAGE:
            rows.setdefault(row.get("task"), []).append(row)
    n = {m["task"]: m["n"] for m in old.task_metrics if m["stage"] == results.ZERO_SHOT_STAGE}
    kept = [name for name, score in zip(new.tasks, old.zero_shot)
            if score is not None and name in n and len(rows.get(name, [])) == n[name]]
    if not kept:
        return []
    new.zero_shot = [score if name in kept else None for name, score in zip(new.tasks, old.zero_shot)]
    new.task_metrics = [m for m in old.task_metrics if m["stage"] == results.ZERO_SHOT_STAGE and m["task"] in kept]
    new.timing.zero_shot_s = old.timing.zero_shot_s
    return [row for name in kept for row in rows[name]]


def restore(run: Run, command: str) -> None:
    """The last checkpoint into the run; the record and the step log keep the stages
    it holds, and note the resume (`command`)."""
    saved = _loaded(run, results.CHECKPOINT_DIR)
    rec = run.record
    hi = min(len(run.stages), rec.stages_done) - 1  # the record is written before the checkpoint
    done = saved.index("stage", 0, hi) + 1
    _load_training_state(run, saved)
    with saved.applying("replay"):
        run.replay.load_state_dict(saved.get("replay", dict), run.replay_sources)
    for name, probe in (("probe", run.probe), ("routing", run.routing)):
        if probe is not None and saved.state.get(name) is not None:
            with saved.applying(name):
                probe.load_state_dict(saved.state[name])
    for kind in (rec.probes or {}).values():  # what the interrupted stage recorded
        for key in [k for k in kind if int(k) >= done]:
            del kind[key]
    # Drop whatever the interrupted stage wrote after its checkpoint.
    rec.stages_done = done
    rec.params = rec.params[:done]
    rec.timing.stages = rec.timing.stages[:done]
    rec.task_metrics = [m for m in rec.task_metrics if m["stage"] < done]
    for b in range(done, len(rec.matrix)):
        rec.matrix[b] = [None] * len(rec.tasks)
    run.predictions = [r for r in results.read_jsonl(run.run_dir / results.PREDICTIONS_FILE, staged=True)
                       if r["stage"] < done]
    metrics = run.run_dir / results.METRICS_FILE
    kept = [r for r in results.read_jsonl(metrics, staged=True) if r["stage"] < done]
    run.backend.barrier()  # every rank has read the files before rank 0 rewrites one
    run.backend.on_main(lambda: results.write_jsonl(metrics, kept))
    rec.status = "running"
    rec.error = None  # of the interrupted attempt
    rec.failed_at = None
    rec.resumes = [*(rec.resumes or []), {"at_stage": done, "command": command,
                                          "backend": run.backend.describe()}]
    if run.backend.is_main:
        log.info("resuming %s at stage %d/%d", run.run_dir, done + 1, len(run.stages))
