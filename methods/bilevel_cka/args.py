"""bilevel-cka's arguments (`method_args`): the family's (cl_bench/models/upcycling.py,
MoEArgs: K = 8 slice experts, top-2, balancing, shared path) and the search's:

    pi ~ ST-Gumbel(alpha, tau),  p_expand = sigmoid(alpha_e - alpha_r) = init_expand_prob at the start
    L_in = L_task + lambda_cka L_CKA + lambda_replay L_replay,   L_out = L_replay(pi) - gamma G + beta B(r)

Source: CKA-guided bilevel MoE upcycling (ICML 2026), as METHODS.md ("bilevel-cka"):
the paper script's lambda_cka, lambda_replay, gamma, beta, r_target, N, tau0, rho,
tau_final, init_expand_prob, mask_lr (docs/methods/bilevel-cka.md, "Defaults").

Differs from the paper/code:
- cka_max_tokens and min_mask_updates are cl-bench's own (no value in METHODS.md);
- candidate_layers defaults to every MoE layer (the code: 6 hard-coded layers of 16).
"""
from __future__ import annotations

from dataclasses import dataclass

from cl_bench.errors import UserError
from cl_bench.models.upcycling import MoEArgs

MASK_MODES = ("on", "off")
MASK_INITS = ("prior", "random")
OUTER_SAMPLES = ("own", "shared")
RANDOM_INIT_STD = 0.1  # mask_init=random: the paper code's MASK_OVERRIDE=random, N(0, 0.1)


@dataclass
class BilevelCKAArgs(MoEArgs):
    # supernet and masks
    candidate_layers: list[int] | None = None  # decoder layers with a supernet; None: every MoE layer
    mask: str = "on"  # on: learned masks; off: every slot expands (ablation "CKA only")
    mask_init: str = "prior"  # prior: p_expand = init_expand_prob; random: logits ~ N(0, 0.1^2)
    init_expand_prob: float = 0.6
    mask_lr: float = 0.01  # Adam on the mask logits; raised per task where Recycle is out of reach
    mask_every: int = 10  # N: an outer step every N optimiser steps
    # own: the outer step draws its own pi and runs its own replay forward (the paper's);
    # shared: on an outer step its pi also serves the inner replay loss (one forward fewer)
    outer_sample: str = "own"
    min_mask_updates: int = 4  # N shrinks so a task has at least this many outer steps; 0: keep N
    tau0: float = 5.0
    tau_decay: float = 0.995  # rho; lowered per task when tau would not reach tau_final
    tau_final: float = 0.1
    # inner loss
    lambda_cka: float = 0.15
    lambda_replay: float = 1.0
    cka_layers: list[int] | None = None  # decoder layers whose outputs CKA compares; None: last third
    cka_max_tokens: int = 1024  # replay tokens per CKA (evenly spaced when more)
    # outer loss
    gamma: float = 0.35  # knowledge-gain weight
    beta: float = 0.4  # balance weight
    r_target: float = 0.5  # target expansion rate

    def __post_init__(self):
        super().__post_init__()
        if self.mask not in MASK_MODES:
            raise UserError(f"method_args.mask={self.mask!r}: choose one of {', '.join(MASK_MODES)}")
        if self.mask_init not in MASK_INITS:
            raise UserError(f"method_args.mask_init={self.mask_init!r}: choose one of {', '.join(MASK_INITS)}")
        if self.outer_sample not in OUTER_SAMPLES:
            raise UserError(f"method_args.outer_sample={self.outer_sample!r}: choose one of {', '.join(OUTER_SAMPLES)}")
        if not 0 < self.init_expand_prob < 1:
            raise UserError(f"method_args.init_expand_prob={self.init_expand_prob} must be in (0, 1)")
        if self.mask_every < 1 or self.min_mask_updates < 0 or self.cka_max_tokens < 2:
            raise UserError("method_args: mask_every must be >= 1, min_mask_updates >= 0 and "
                            "cka_max_tokens >= 2")
        if not (0 < self.tau_final <= self.tau0 and 0 < self.tau_decay <= 1):
            raise UserError(f"method_args: need 0 < tau_final ({self.tau_final}) <= tau0 ({self.tau0}) "
                            f"and 0 < tau_decay ({self.tau_decay}) <= 1")
        for name in ("lambda_cka", "lambda_replay", "gamma", "beta", "mask_lr"):
            if getattr(self, name) < 0:
                raise UserError(f"method_args.{name}={getattr(self, name)} must be >= 0")
        if not 0 <= self.r_target <= 1:
            raise UserError(f"method_args.r_target={self.r_target} must be in [0, 1]")
