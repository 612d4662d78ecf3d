"""What of a run is saved and restored: after every stage the record and the
predictions (write_files), then a checkpoint of weights, method state, optimiser
state, generator states, the replay buffer and the probe's references (save);
on --resume the checkpoint comes back and the record drops what the interrupted
stage wrote after it (restore). Rank 0 writes; every rank restores.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from cl_bench import results

if TYPE_CHECKING:
    from cl_bench.prepare import Run

log = logging.getLogger(__name__)


def write_files(run: Run) -> None:
    """The record and the predictions, on rank 0 (results.write_run)."""
    if run.backend.is_main:
        results.write_run(run.run_dir, run.record, run.predictions)


def _name_of(model: torch.nn.Module) -> dict[int, str]:
    return {id(p): n for n, p in model.named_parameters()}


def save(run: Run, stage_index: int) -> None:
    """Full weights, method state and optimiser state (gathered by the backend after
    training: the model is an ordinary module on every rank here); rank 0 writes."""
    if not run.backend.is_main:
        return
    names = _name_of(run.method.model)
    state = {
        "stage": stage_index,
        "model": run.method.model.state_dict(),
        "method": run.method.state_dict(),
        "optimizer": None,
        "rng": results.rng_state(),
        "replay": run.replay.state_dict(),
        "probe": run.probe.state_dict() if run.probe is not None else None,
        "routing": run.routing.state_dict() if run.routing is not None else None,
    }
    if run.optimizer is not None:
        state["optimizer"] = {
            "groups": [[names[id(p)] for p in g["params"]] for g in run.optimizer.param_groups],
            "state": run.optimizer.state_dict(),
        }
    results.save_checkpoint(run.run_dir, state)


def restore(run: Run, command: str) -> None:
    """The last checkpoint into the run; the record and the step log keep the stages
    it holds, and note the resume (`command`)."""
    state = results.load_checkpoint(run.run_dir)
    run.method.load_state_dict(state["method"])  # may rebuild architecture first
    run.method.model.load_state_dict(state["model"])
    if state["optimizer"] is not None:
        params = dict(run.method.model.named_parameters())
        groups = [{"params": [params[n] for n in names]} for names in state["optimizer"]["groups"]]
        run.optimizer = run.method.make_optimizer(groups)
        run.optimizer.load_state_dict(state["optimizer"]["state"])
    results.set_rng_state(state["rng"])
    run.replay.load_state_dict(state["replay"], run.replay_sources)
    if run.probe is not None and state.get("probe") is not None:
        run.probe.load_state_dict(state["probe"])
    if run.routing is not None and state.get("routing") is not None:
        run.routing.load_state_dict(state["routing"])
    done = state["stage"] + 1
    rec = run.record
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
    run.predictions = [r for r in results.read_jsonl(run.run_dir / results.PREDICTIONS_FILE)
                       if r["stage"] < done]
    metrics = run.run_dir / results.METRICS_FILE
    kept = [r for r in results.read_jsonl(metrics) if r["stage"] < done]
    run.backend.barrier()  # every rank has read the files before rank 0 rewrites one
    run.backend.on_main(lambda: results.write_jsonl(metrics, kept))
    rec.status = "running"
    rec.error = None  # of the interrupted attempt
    rec.failed_at = None
    rec.resumes = [*(rec.resumes or []), {"at_stage": done, "command": command,
                                          "backend": run.backend.describe()}]
    if run.backend.is_main:
        log.info("resuming %s at stage %d/%d", run.run_dir, done + 1, len(run.stages))
