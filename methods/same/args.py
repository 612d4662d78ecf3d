"""SAME's arguments (SAMEArgs: every default and its source) and the schedule that
fits the freeze warm-up W and the refresh interval R to a task of n optimiser steps:

    W = min(freeze_warmup, floor(warmup_share * n))
    R = max(1, min(refresh_every, n // min_refreshes))   (R = refresh_every if min_refreshes = 0)

Source: SAME, ICML 2026, arXiv 2602.01990; code LAMDA-CL/Prism (config/methods/same.py).

Differs from the paper/code (why: docs/methods/same.md, "Schedule", "Defaults and sources"):
- warm-up 50 and refresh every 20 steps are upper bounds, shrunk for a short task;
- importance="previous" (F of the earlier tasks, their running max) by default; "live" is the code's;
- infer_top_k=0 (soft, as trained) by default; infer_top_k=2 gives the code's top-2.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from cl_bench.errors import UserError
from cl_bench.method import MethodArgs

# Letters: B batch, T sequence, E experts, r r_e, d_in / d_out a linear's widths,
# k kept eigen-directions, L decoder layers.

TARGETS = ("gate_proj", "up_proj", "down_proj")
INPUT_OF = {"gate_proj": "x", "up_proj": "x", "down_proj": "h"}  # which covariance each linear reads
PRECONDITION = ("grad", "update")
IMPORTANCE = ("previous", "live")


@dataclass
class SAMEArgs(MethodArgs):
    lr: float = 2e-4  # the code's AdamW lr (constant here)
    n_experts: int | None = None  # E; None: the run's number of tasks (the code: E = T)
    expert_rank: int = 8  # r_e (the code: r 64 over 8 tasks, 48/6, 80/10)
    lora_scale: float = 2.0  # alpha / r (the code: 128 / 64)
    dropout: float = 0.05  # on the experts' input
    infer_top_k: int = 0  # 0: infer as trained (soft); k: the code's top-k of softmax(W_G x / E) (k = 2)
    # 1. spectral-aware routing
    spectral_routing: bool = True
    delta: float = 0.9  # energy of C kept in V_par (also for the curvature map)
    max_rank: int = 64  # cap on k (seed-methods.md: 64 at d = 576, 128 at d = 2048)
    rho: float = 0.2  # largest shrink of a router update in V_par
    refresh_every: int = 20  # steps between eigendecompositions (an upper bound: min_refreshes)
    min_refreshes: int = 4  # refreshes a task gets at least (lowers refresh_every); 0: as given
    # 2. curvature-aware scaling
    curvature_scaling: bool = True
    mu: float = 0.9  # damping of P
    precondition: str = "grad"  # grad: on gradients (the code); update: on the AdamW update
    # 3. adaptive expert activation
    adaptive_activation: bool = True
    ema: float = 0.95  # decay of U and F
    tau_score: float = 0.1  # freeze experts with Score below this
    freeze_warmup: int = 50  # steps of a task before any freezing (the code: 0; an upper bound)
    warmup_share: float = 0.25  # warm-up = min(freeze_warmup, floor(warmup_share * the task's steps))
    importance: str = "previous"  # previous: F of earlier tasks (paper); live: F moves now (code)

    def __post_init__(self):
        if self.n_experts is not None and self.n_experts < 1:
            raise UserError(f"method_args.n_experts={self.n_experts} must be >= 1 (or null: one per task)")
        for name in ("expert_rank", "max_rank", "refresh_every"):
            if getattr(self, name) < 1:
                raise UserError(f"method_args.{name}={getattr(self, name)} must be >= 1")
        if self.infer_top_k < 0 or (self.n_experts is not None and self.infer_top_k > self.n_experts):
            raise UserError(f"method_args.infer_top_k={self.infer_top_k} must be in 0..n_experts")
        if not 0 <= self.delta <= 1:
            raise UserError(f"method_args.delta={self.delta} must be in [0, 1]")
        if not 0 <= self.rho <= 1:
            raise UserError(f"method_args.rho={self.rho} must be in [0, 1]")
        if self.mu <= 0:
            raise UserError(f"method_args.mu={self.mu} must be > 0 (P divides by it)")
        if not 0 <= self.ema < 1:
            raise UserError(f"method_args.ema={self.ema} must be in [0, 1)")
        if self.freeze_warmup < 0 or self.min_refreshes < 0 or not 0 <= self.dropout < 1:
            raise UserError("method_args: freeze_warmup and min_refreshes must be >= 0 and dropout in [0, 1)")
        if not 0 <= self.warmup_share <= 1:
            raise UserError(f"method_args.warmup_share={self.warmup_share} must be in [0, 1]")
        if self.precondition not in PRECONDITION:
            raise UserError(f"method_args.precondition={self.precondition!r}: choose one of "
                            f"{', '.join(PRECONDITION)}")
        if self.importance not in IMPORTANCE:
            raise UserError(f"method_args.importance={self.importance!r}: choose one of "
                            f"{', '.join(IMPORTANCE)}")


def activation_schedule(n_steps: int | None, args: SAMEArgs) -> tuple[int, int]:
    """(freeze warm-up, refresh interval) for a task of `n_steps` optimiser steps
    (None: unknown, the arguments as given); see docs/methods/same.md, "Schedule"."""
    if n_steps is None:
        return args.freeze_warmup, args.refresh_every
    warmup = min(args.freeze_warmup, math.floor(args.warmup_share * n_steps))
    every = args.refresh_every
    if args.min_refreshes:
        every = max(1, min(every, n_steps // args.min_refreshes))
    return warmup, every

