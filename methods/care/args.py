"""CaRE's arguments (`method_args`). Its per-task learning-rate schedule, linear
warm-up over 3% of a task's steps then cosine to 0, is the harness's "cosine"
schedule (cl_bench/run/schedule.py), declared as `CaRE.lr_schedule`; the config's
train.lr_schedule / train.warmup_ratio override it.

Source of the defaults: CaRE, ICML 2026, arXiv 2602.03473, code LMMMEng/CaRE, and
the adaptation of reference/seed-methods.md, section (c). Differs from the
paper/code: G = 8 pseudo-classes, AdamW 5e-4, 3% warm-up and cosine come from the
adaptation; the Linear init, the k-means details and the diagnostics are chosen.
Which default comes from where: docs/methods/care.md, Defaults and sources.
"""
from __future__ import annotations

from dataclasses import dataclass

from cl_bench.errors import UserError
from cl_bench.method import MethodArgs

ROUTER_INPUTS = ("expert", "residual")
UNIFORM_CE_TOL = 0.05  # perceiver_uniform: |CE - ln G| <= this share of ln G (docs/methods/care.md, Records)


@dataclass
class CareArgs(MethodArgs):
    lr: float = 5e-4  # AdamW (reference notes, adaptation)
    expert_dim: int = 16  # bottleneck of each task's expert
    shared_dim: int = 64  # bottleneck of the shared adapter Ebar
    dropout: float = 0.1  # inside the adapters
    routers: int = 2  # M: routers summed per sequence
    top_k: int = 3  # K: experts kept per router
    pseudo_classes: int = 8  # G: k-means groups per task, the perceivers' outputs
    logit_scale: float = 20.0  # s: the perceiver CE reads s * logits
    perceiver_weight: float = 1.0  # lambda
    kl_temp_low: float = 1.0  # T_l in the lower half of the layers
    kl_temp_high: float = 2.0  # T_l in the upper half
    anchor: float = 0.999  # mu: Ebar's pull back to its task-start value, tasks >= 1
    router_input: str = "expert"  # expert: pool E_i(z_a) (code); residual: pool z_a (paper note)
    init_std: float = 0.02  # trunc-normal std of the new Linear weights and the perceiver gain
    kmeans_iters: int = 50  # Lloyd iterations at most (chosen)
    diag_examples: int = 16  # test examples per seen task for the stage record; 0: none (chosen)

    def __post_init__(self):
        for name in ("expert_dim", "shared_dim", "routers", "top_k", "pseudo_classes", "kmeans_iters"):
            if getattr(self, name) < 1:
                raise UserError(f"method_args.{name}={getattr(self, name)} must be >= 1")
        if not 0 <= self.dropout < 1 or not 0 <= self.anchor <= 1:
            raise UserError(f"method_args: dropout ({self.dropout}) must be in [0, 1), anchor "
                            f"({self.anchor}) in [0, 1]")
        for name in ("logit_scale", "kl_temp_low", "kl_temp_high", "lr"):
            if getattr(self, name) <= 0:
                raise UserError(f"method_args.{name}={getattr(self, name)} must be > 0")
        for name in ("perceiver_weight", "init_std", "diag_examples"):
            if getattr(self, name) < 0:
                raise UserError(f"method_args.{name}={getattr(self, name)} must be >= 0")
        if self.router_input not in ROUTER_INPUTS:
            raise UserError(f"method_args.router_input={self.router_input!r}: choose one of "
                            f"{', '.join(ROUTER_INPUTS)}")

