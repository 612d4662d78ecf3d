"""A run's checkpoints: the folders, and what goes into them. After every stage,
weights, method state, optimiser state, generator states, the replay buffer and
the probes' references go into checkpoint/ (save); inside a stage
(train.checkpoint_every_s), at a step boundary, the weights, the method's and the
optimiser's state, the generator states and the stage's step log so far, with
where it stands (phase, next step), go into checkpoint-step/ (save_in_stage).
Rank 0 writes. Whether and where a run continues from them is
cl_bench/run/resume.py's; the layout of one loaded is checked field by field
(cl_bench/run/checkpoint_shape.py).

A checkpoint folder is written whole under `<name>.new`, then swapped in: the
previous one survives a crash (save_checkpoint). It is loaded with
weights_only=True: tensors and plain values only, so a checkpoint from someone
else cannot run code on --resume (load_checkpoint). A run resuming maps the file
instead of reading it (loaded): its pages are read as they are touched and shared
by every rank of a machine, and a rank copies out only what it keeps (the weights
into the model; at ZeRO-3 its piece of the optimiser state). Whatever it keeps is
its own copy, so nothing holds the mapping once the checkpoint is applied: the file
a later checkpoint replaces is freed, and never rewritten in place under a mapping.
"""
from __future__ import annotations

import pickle
import random
import re
import shutil
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from cl_bench.errors import UserError, resume_line
from cl_bench.run.checkpoint_shape import Loaded

if TYPE_CHECKING:
    from cl_bench.run.state import Run

CHECKPOINT_DIR = "checkpoint"  # after the last finished stage
STEP_CHECKPOINT_DIR = "checkpoint-step"  # inside the stage in progress (train.checkpoint_every_s)


# ---- the folders ------------------------------------------------------------------

def rng_state() -> dict[str, Any]:
    """Python's, numpy's and torch's generator states as tensors and plain values
    (numpy's key array as a tensor), so checkpoints load with weights_only=True."""
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    return {"python": random.getstate(),
            "numpy": [name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(gauss)],
            "torch": torch.get_rng_state()}


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    name, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.int64).astype(np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])


def save_checkpoint(run_dir: Path, state: dict[str, Any], name: str = CHECKPOINT_DIR) -> None:
    """Write the folder `name` (checkpoint/) whole, then swap it in: the previous one
    survives a crash."""
    final = run_dir / name
    staging = run_dir / f"{name}.new"
    old = run_dir / f"{name}.old"
    shutil.rmtree(staging, ignore_errors=True)
    try:
        staging.mkdir()
        torch.save(state, staging / "state.pt")
    except (OSError, RuntimeError) as exc:  # torch.save reports a full disk as RuntimeError
        shutil.rmtree(staging, ignore_errors=True)
        raise UserError(f"{staging}: cannot write the checkpoint ({_write_failure(exc, run_dir)}); the "
                        f"previous one is kept: free space, then {resume_line(run_dir)}") from None
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
    staging.rename(final)
    shutil.rmtree(old, ignore_errors=True)


def _write_failure(exc: Exception, folder: Path) -> str:
    """Why a write failed, in words: the OS's reason, or for torch.save's RuntimeError
    ("[enforce fail at inline_container.cc:N] . PytorchStreamWriter failed writing file
    data/3: file write failed") its last clause and the space left on that disk."""
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    last = str(exc).splitlines()[0].rsplit(": ", 1)[-1] if str(exc) else type(exc).__name__
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        return last
    return f"{last}; {free / 2**20:.0f} MiB free on its disk"


def has_checkpoint(run_dir: Path, name: str = CHECKPOINT_DIR) -> bool:
    return any((run_dir / folder / "state.pt").exists() for folder in (name, f"{name}.old"))


def remove_checkpoint(run_dir: Path, name: str) -> None:
    for folder in (name, f"{name}.old", f"{name}.new"):
        shutil.rmtree(run_dir / folder, ignore_errors=True)


def checkpoint_file(run_dir: Path, name: str = CHECKPOINT_DIR) -> Path | None:
    """The state.pt that load_checkpoint reads (None: there is none)."""
    for folder in (name, f"{name}.old"):
        if (run_dir / folder / "state.pt").exists():
            return run_dir / folder / "state.pt"
    return None


def load_checkpoint(run_dir: Path, name: str = CHECKPOINT_DIR, mmap: bool = False) -> dict[str, Any]:
    """The last checkpoint, loaded with `weights_only=True`: tensors and plain types
    only, so a checkpoint from someone else cannot run code on --resume. `mmap`: its
    tensors map the file (torch's private mapping: writes to them stay in the process)."""
    path = checkpoint_file(run_dir, name)
    if path is not None:
        try:
            # torch maps zip files only (the format torch.save writes): another is read, and refused below
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap and zipfile.is_zipfile(path))
        except pickle.UnpicklingError as exc:
            found = re.search(r"GLOBAL ([\w.]+)", str(exc))  # what the file asked to import
            first = f"it imports {found.group(1)}" if found else type(exc).__name__
            raise UserError(f"{path}: refused: it holds more than tensors and plain values ({first}); "
                            f"a cl-bench checkpoint never does, so it was not written by cl-bench") from None
        except (EOFError, RuntimeError, OSError) as exc:
            raise UserError(f"{path}: unreadable checkpoint ({type(exc).__name__}); the run cannot "
                            f"resume from it: start it again under a new --run-id") from None
    raise UserError(f"{run_dir}: no checkpoint to resume from (the run stopped before its "
                    f"first stage finished); start it again without --resume")


# ---- what a run puts in them ------------------------------------------------------

def _name_of(model: torch.nn.Module) -> dict[int, str]:
    return {id(p): n for n, p in model.named_parameters()}


def _training_state(run: Run) -> dict[str, Any]:
    """Weights, method state, optimiser state (by parameter name) and generator states."""
    state = {"model": run.method.model.state_dict(), "method": run.method.state_dict(), "optimizer": None,
             "rng": rng_state()}
    if run.optimizer is not None:
        names = _name_of(run.method.model)
        state["optimizer"] = {
            "groups": [[names[id(p)] for p in g["params"]] for g in run.optimizer.param_groups],
            "state": run.optimizer.state_dict(),
        }
    return state


def loaded(run: Run, name: str) -> Loaded:
    """The checkpoint `name` of the run, to be applied field by field (checkpoint_shape),
    mapped (module docstring). Every field but the weights and the optimiser state,
    which load_training_state copies out, is copied now: a method, the replay buffer
    or a probe may keep what it is given."""
    state = load_checkpoint(run.run_dir, name, mmap=True)
    if isinstance(state, dict):
        state = {k: v if k in ("model", "optimizer") else _copied(v) for k, v in state.items()}
    return Loaded(checkpoint_file(run.run_dir, name), state)


def _tensors(value) -> list[torch.Tensor]:
    """Every tensor in a loaded value (dicts, lists and tuples walked)."""
    if torch.is_tensor(value):
        return [value]
    items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else ()
    return [t for item in items for t in _tensors(item)]


def _copy(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor of its own (detached: a copy's graph would hold the mapped one)."""
    return tensor.detach().clone().requires_grad_(tensor.requires_grad)


def _copied(value):
    """`value` with every tensor in it copied (dicts, lists and tuples walked)."""
    if torch.is_tensor(value):
        return _copy(value)
    if isinstance(value, dict):
        return type(value)({k: _copied(v) for k, v in value.items()})
    if isinstance(value, (list, tuple)):
        return type(value)(_copied(v) for v in value)
    return value


def _own(optimizer: torch.optim.Optimizer, saved: list[torch.Tensor]) -> None:
    """Each of `saved` (the loaded file's tensors) that `optimizer` kept as it was, in its
    state or its groups' hyperparameters, replaced by a copy (loaded)."""
    mapped = {id(t) for t in saved}
    for entries in [*optimizer.state.values(), *optimizer.param_groups]:
        for key, value in entries.items():
            if id(value) in mapped:
                entries[key] = _copy(value)


def load_training_state(run: Run, saved: Loaded) -> None:
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
            saved.check_optimizer_state(run.optimizer)
            run.backend.load_optimizer(run.optimizer, saved.state["optimizer"]["state"])
        _own(run.optimizer, _tensors(saved.state["optimizer"]))
        saved.check_hyperparameters(run.optimizer, fresh)
    rng = saved.get("rng", dict)
    with saved.applying("rng"):
        set_rng_state(rng)


def save(run: Run, stage_index: int) -> None:
    """Full weights, method state and optimiser state; rank 0 writes. Called inside
    backend.whole(run.optimizer): the model is an ordinary module on every rank here,
    but the deepspeed backend at ZeRO-3 keeps the optimiser state cut over the ranks
    between phases. The stage's in-stage checkpoint, if any, goes once this one is
    written."""
    if not run.backend.is_main:
        return
    state = {
        "stage": stage_index,
        **_training_state(run),
        "replay": run.replay.state_dict(),
        "probe": run.probe.state_dict() if run.probe is not None else None,
        "routing": run.routing.state_dict() if run.routing is not None else None,
    }
    save_checkpoint(run.run_dir, state)
    remove_checkpoint(run.run_dir, STEP_CHECKPOINT_DIR)


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
    state: Loaded | None = None  # as loaded, until applied (enter_in_stage); save_in_stage takes the run's own


def save_in_stage(run: Run, at: InStage) -> None:
    """The in-stage checkpoint `at` (its state taken now, at a step boundary); rank 0."""
    if run.backend.is_main:
        save_checkpoint(run.run_dir, {
            "stage": at.stage, "phase": at.phase, "step": at.step, "log_rows": at.log_rows,
            "global_step": at.global_step, "train_s": at.train_s, **_training_state(run)},
            STEP_CHECKPOINT_DIR)

