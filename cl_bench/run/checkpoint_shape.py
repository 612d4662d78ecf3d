"""The layout of a loaded checkpoint (checkpoint.load_checkpoint: tensors and plain
values only), checked while cl_bench/run/checkpoint.py applies it to a run: the fields
cl-bench writes, of their types and lengths, weights and optimiser moments of the
model's shapes. A file of plain values in another layout fails with one line
naming the file and the field, never a traceback. The method's own state is the
method's: what its load_state_dict raises on it is reported as field `method`.
"""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch

from cl_bench.errors import UserError

FIX = "put back the checkpoint cl-bench wrote, or start the run again under a new --run-id"
# what applying a part of another layout raises (torch, numpy, random, the method's own loader)
APPLY_ERRORS = (KeyError, TypeError, ValueError, IndexError, AttributeError, RuntimeError)


class LayoutError(UserError):
    """A checkpoint not in the layout cl-bench writes: the run stops before any of
    it is applied to what is on disk (sequencer.execute leaves the record as it was)."""


class Loaded:
    """A loaded checkpoint `state` from `path`, read field by field."""

    def __init__(self, path: Path, state: Any):
        self.path, self.state = path, state
        if not isinstance(state, dict):
            raise LayoutError(f"{path}: holds a {type(state).__name__}, not the fields cl-bench writes; {FIX}")

    def fail(self, field: str, why: str) -> LayoutError:
        return LayoutError(f"{self.path}: field {field} {why}; {FIX}")

    def get(self, key: str, types: type | tuple, none: bool = False) -> Any:
        value = self.state.get(key)
        if value is None and none and key in self.state:
            return None
        allowed = types if isinstance(types, tuple) else (types,)
        if key not in self.state:
            raise self.fail(key, "is missing")
        if not isinstance(value, allowed) or isinstance(value, bool) and bool not in allowed:
            raise self.fail(key, f"must be {' or '.join(t.__name__ for t in allowed)}, found {type(value).__name__}")
        return value

    def index(self, key: str, lo: int, hi: int) -> int:
        """An integer in [lo, hi]."""
        value = self.get(key, int)
        if not lo <= value <= hi:
            raise self.fail(f"{key}={value}", f"must be in [{lo}, {hi}]")
        return value

    @contextlib.contextmanager
    def applying(self, field: str):
        """What applying `field` raises, as one line naming it."""
        try:
            yield
        except APPLY_ERRORS as exc:
            first = (str(exc).strip().splitlines() or [""])[0][:160]
            raise self.fail(field, f"does not fit this run ({type(exc).__name__}: {first})") from None

    def check_weights(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """`model`: the weights match its parameters and buffers, key for key and shape for shape."""
        saved = self.get("model", dict)
        expected = model.state_dict()
        for key, value in saved.items():
            if key not in expected:
                raise self.fail(f"model.{key}", "is not a weight of this run's model")
            if not isinstance(value, torch.Tensor) or value.shape != expected[key].shape:
                raise self.fail(f"model.{key}", f"must be a tensor of shape {tuple(expected[key].shape)}")
        missing = [k for k in expected if k not in saved]
        if missing:
            raise self.fail(f"model.{missing[0]}", "is missing")
        return saved

    def optimizer_groups(self, model: torch.nn.Module) -> list[list[str]] | None:
        """The optimiser's parameter groups by name (None: no optimiser saved)."""
        saved = self.get("optimizer", dict, none=True)
        if saved is None:
            return None
        names = dict(model.named_parameters())
        groups = saved.get("groups")
        if not isinstance(groups, list) or not all(isinstance(g, list) for g in groups):
            raise self.fail("optimizer.groups", "must be a list of lists of parameter names")
        for i, group in enumerate(groups):
            unknown = [n for n in group if not isinstance(n, str) or n not in names]
            if unknown:
                raise self.fail(f"optimizer.groups[{i}]", f"names {unknown[0]!r}, not a parameter of the model")
        if not isinstance(saved.get("state"), dict):
            raise self.fail("optimizer.state", "must be the optimiser's state_dict")
        return groups

    def check_optimizer_state(self, optimizer: torch.optim.Optimizer) -> None:
        """Before it is loaded (the backend may hold it otherwise than torch does): each
        saved per-parameter entry a floating tensor (a scalar, or of its parameter's
        shape) or a number, of one kind for every parameter (AdamW's step: a tensor;
        MoFO's: an int), and none for anything else. Saved entries pair with
        `optimizer`'s parameters in order, as torch's load_state_dict pairs them; groups
        of other sizes are its to refuse."""
        saved = self.state["optimizer"]["state"]
        pairs, entries = saved_pairs(saved, optimizer), saved.get("state")
        if pairs is None or not isinstance(entries, dict):
            return
        known = {i for i, _ in pairs}
        stray = [k for k in entries if k not in known]  # torch would keep them as they are, unchecked
        if stray:
            raise self.fail(f"optimizer.state.state.{stray[0]}", "is not a parameter of the saved groups")
        kinds: dict[str, type] = {}
        for i, p in pairs:
            state = entries.get(i, {})
            if not isinstance(state, dict):
                raise self.fail(f"optimizer.state.state.{i}", "must be a dict of its parameter's state")
            for key, value in state.items():
                tensor = isinstance(value, torch.Tensor)
                ok = (tensor and value.is_floating_point() and (value.dim() == 0 or value.shape == p.shape)
                      or type(value) in (int, float)) and kinds.setdefault(key, type(value)) is type(value)
                if not ok:
                    raise self.fail(f"optimizer.state.state.{key}", f"must be a floating tensor of its "
                                    f"parameter's shape {tuple(p.shape)} (or a scalar), like the others")

    def check_hyperparameters(self, optimizer: torch.optim.Optimizer, fresh: list[dict]) -> None:
        """After load_state_dict: each hyperparameter of the type a new optimiser has
        (`fresh`: its param_groups before loading)."""
        for i, (group, new) in enumerate(zip(optimizer.param_groups, fresh)):
            for key, value in new.items():
                if key != "params" and type(group.get(key)) is not type(value):
                    raise self.fail(f"optimizer.state.param_groups[{i}].{key}",
                                    f"must be {type(value).__name__}, found {type(group.get(key)).__name__}")


def saved_pairs(saved: dict[str, Any],
                optimizer: torch.optim.Optimizer) -> list[tuple[Any, torch.nn.Parameter]] | None:
    """An optimiser state_dict's parameter ids paired with `optimizer`'s parameters in
    order, as torch's load_state_dict pairs them; None where its groups are unreadable or
    hold another number of parameters (load_state_dict's to refuse)."""
    groups = saved.get("param_groups")
    if not (isinstance(groups, list) and all(isinstance(g, dict) and isinstance(g.get("params"), list)
                                             for g in groups)):
        return None
    ids = [i for g in groups for i in g["params"]]
    params = [p for g in optimizer.param_groups for p in g["params"]]
    return list(zip(ids, params)) if len(ids) == len(params) else None
