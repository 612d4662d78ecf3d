"""The learning-rate schedule, owned by the harness: within each training phase the
lr of every optimiser group is its base lr times

    warm-up:   (step + 1) / w                             step < w = ceil(warmup_ratio * n)
    then       constant: 1                                        (TRACE: no warm-up, no decay)
               cosine:   1/2 (1 + cos(pi (step - w) / max(1, n - w)))   down to 0 at step n

where n is the phase's optimiser steps. The config fields `train.lr_schedule` and
`train.warmup_ratio` choose it; left unset, they take the method's declaration
(`Method.lr_schedule`: constant for every method but CaRE, whose adaptation trains
each task with 3% warm-up and cosine). `prepare` writes the resolved pair into the
run's config, so the record says which schedule ran.

A group's base lr is the lr it had when the schedule first saw it, kept in the group
as "initial_lr" (as torch's lr schedulers do), so an optimiser the method keeps
across stages restarts from its base lr each phase rather than from the decayed one.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

SCHEDULES = ("constant", "cosine")


def lr_factor(kind: str, step: int, n_steps: int, warmup_ratio: float) -> float:
    """The multiplier of the base lr at optimiser step `step` of an `n_steps` phase."""
    if kind not in SCHEDULES:
        raise ValueError(f"unknown lr schedule {kind!r}; one of {', '.join(SCHEDULES)}")
    w = math.ceil(warmup_ratio * n_steps)
    if step < w:
        return (step + 1) / w
    if kind == "constant":
        return 1.0
    return 0.5 * (1 + math.cos(math.pi * (step - w) / max(1, n_steps - w)))


class LrSchedule:
    """Sets the lr of `optimizer`'s groups for each step of one phase: `at(0)` before
    the first step, `at(s + 1)` after step s (the backends' on_step). A constant
    schedule without warm-up leaves the optimiser untouched."""

    def __init__(self, optimizer: torch.optim.Optimizer | None, kind: str, warmup_ratio: float,
                 n_steps: int):
        self.optimizer, self.kind, self.warmup_ratio, self.n_steps = optimizer, kind, warmup_ratio, n_steps
        self.active = optimizer is not None and (kind != "constant" or warmup_ratio > 0)
        if self.active:
            for group in optimizer.param_groups:
                group.setdefault("initial_lr", group["lr"])

    def at(self, step: int) -> None:
        if not self.active:
            return
        factor = lr_factor(self.kind, step, self.n_steps, self.warmup_ratio)
        for group in self.optimizer.param_groups:
            group["lr"] = group["initial_lr"] * factor
