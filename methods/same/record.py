"""What one SAME task holds while it trains (Task), and the per-stage record built
from it at the task's end (stage_record, into run.json "params"): the activation
schedule, the router and curvature ranks k (the smallest k with
lambda_1 + .. + lambda_k >= delta * tr C, at most max_rank), the spectrum, the
freeze masks and shares, U and F, the lock steps and the router gradient norms.

Source: SAME, ICML 2026, arXiv 2602.01990; code LAMDA-CL/Prism.

Differs from the paper/code: the paper and code record none of this; every key
is described in docs/methods/same.md, "Records".
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from .args import TARGETS
from .subspace import Subspace


@dataclass
class Task:
    """What one task holds while it trains."""

    index: int
    curvature: list[dict[str, Subspace | None]]  # per layer, C^{t-1}'s subspaces (x, h); [] at task 0
    bases: list[dict[str, Subspace | None]]  # per layer, the router subspaces of the last refresh
    ranks: list[dict[str, list[int]]]  # per layer, k at each refresh
    n_steps: int | None = None  # the task's optimiser steps (MethodContext.stage_steps; None: unknown)
    warmup: int = 0  # freeze warm-up used (activation_schedule)
    refresh_every: int = 1  # refresh interval used (activation_schedule)
    steps: int = 0
    grad_norms: list[float] = dataclasses.field(default_factory=list)  # per step, all routers
    layer_norms: dict[str, torch.Tensor] | None = None  # proj -> (L,) sum over steps
    frozen_steps: dict[str, torch.Tensor] | None = None  # proj -> (L, E) steps frozen
    locked_at: dict[str, list[int | None]] | None = None  # proj -> per layer
    before: tuple | None = None  # precondition=update: (maps, this rank's fragments, fp32 values before)


def stage_record(task: Task, linears: list[dict[str, Any]], previous: list[dict[str, Subspace | None]],
                 n_experts: int) -> dict[str, Any]:
    """The stage record of `task`: `linears` per layer proj -> SAMELinear, `previous`
    per layer C^t's subspaces at the task's end (x, h), `n_experts` E."""

    def per_layer(fn):
        return {key: [fn(prev[key], ranks[key]) for prev, ranks in zip(previous, task.ranks)]
                for key in ("x", "h")}

    steps = max(task.steps, 1)
    locked = [s for p in TARGETS for s in task.locked_at[p]]
    all_frozen = n_experts > 1 and all(s is not None for s in locked)
    norms = task.grad_norms
    return {
        "n_experts": n_experts,
        "activation_schedule": {"steps": task.n_steps, "freeze_warmup": task.warmup,
                                "refresh_every": task.refresh_every,
                                "refreshes": len(task.ranks[0]["x"]) if task.ranks else 0},
        "router_rank": per_layer(lambda sub, ranks: ranks[-1] if ranks else None),
        "router_rank_min": per_layer(lambda sub, ranks: min(ranks) if ranks else None),
        "curvature_rank": ({key: [c[key].k if c[key] is not None else 0 for c in task.curvature]
                            for key in ("x", "h")} if task.curvature else None),
        "spectrum": per_layer(lambda sub, ranks: None if sub is None else
                              [_round(sub.top), _round(sub.lam[-1]) if sub.k else None, _round(sub.trace)]),
        "freeze_masks": {p: [[int(f) for f in linears[l][p].frozen.tolist()]
                             for l in range(len(linears))] for p in TARGETS},
        "freeze_share": {p: [[_round(x / steps) for x in row] for row in task.frozen_steps[p].tolist()]
                         for p in TARGETS},
        # what the masks were decided on, at the task's end: U (usage EMA) and F (importance EMA)
        "usage": {p: [[_round(x) for x in linears[l][p].usage.tolist()] for l in range(len(linears))]
                  for p in TARGETS},
        "importance": {p: [[_round(x) for x in linears[l][p].importance.tolist()] for l in range(len(linears))]
                       for p in TARGETS},
        "locked_at": dict(task.locked_at),
        "all_frozen": all_frozen,
        "all_frozen_step": max(locked) if all_frozen else None,
        "router_grad_norm": {"per_step": [_round(x) for x in norms],
                             "mean": _round(sum(norms) / len(norms)) if norms else None,
                             "max": _round(max(norms)) if norms else None,
                             "zero_steps": sum(1 for x in norms if x == 0.0)},
        "router_grad_norm_by_layer": {p: [_round(x / steps) for x in task.layer_norms[p].tolist()]
                                      for p in TARGETS},
    }


def _round(x) -> float:
    return float(f"{float(x):.6g}")  # 6 significant digits: router gradients can be tiny
