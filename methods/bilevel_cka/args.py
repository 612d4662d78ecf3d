"""bilevel-cka's arguments (`method_args`): the family's (cl_bench/models/upcycling.py,
MoEArgs: K = 8 slice experts, top-2, balancing, shared path) and the search's:

    pi ~ ST-Gumbel(alpha, tau),  p_expand = sigmoid(alpha_e - alpha_r) = init_expand_prob at the start
    L_in = L_task + lambda_cka L_CKA + lambda_replay L_replay,   L_out = L_replay(pi) - gamma G + beta B(r)

Source: CKA-guided bilevel MoE upcycling (ICML 2026), as METHODS.md ("bilevel-cka"):
the paper script's lambda_cka, lambda_replay, gamma, beta, r_target, N, tau0, rho,
tau_final, init_expand_prob, mask_lr (docs/methods/bilevel-cka.md, "Defaults").

Differs from the paper/code:
- cka_max_tokens and min_mask_updates are cl-bench's own (no value in METHODS.md);
- candidate_layers defaults to every MoE layer (the code: 6 hard-coded layers of 16);
- depth_prior=cka measures the depth term (the code's fixed +1.0 on the last layers is
  depth_prior=fixed); mask_reach raises mask_lr where a task has fewer updates than the
  paper's ~78 (docs/methods/bilevel-cka.md, "Guided initialisation").
"""
from __future__ import annotations

from dataclasses import dataclass

from cl_bench.errors import UserError
from cl_bench.models.upcycling import MoEArgs

MASK_MODES = ("on", "off")
MASK_INITS = ("guided", "prior", "random")
DEPTH_PRIORS = ("cka", "fixed")
SUPERNETS = ("route", "mix")
OUTER_SAMPLES = ("own", "shared")
RANDOM_INIT_STD = 0.1  # mask_init=random: the paper code's MASK_OVERRIDE=random, N(0, 0.1)
# The reach the paper's search has in a task: ~78 outer updates at mask_lr 0.01 move an
# expand - recycle gap by at most 2 * 78 * 0.01 (bilevel-reference.md §2).
PAPER_REACH = 2 * 78 * 0.01


@dataclass
class BilevelCKAArgs(MoEArgs):
    # supernet and masks
    candidate_layers: list[int] | None = None  # decoder layers with a supernet; None: every MoE layer
    mask: str = "on"  # on: learned masks; off: every slot expands (ablation "CKA only")
    # guided: the prior plus the flatness and depth terms (guidance.py); prior: every slot
    # p_expand = init_expand_prob (the "uniform init" ablation); random: logits ~ N(0, 0.1^2)
    mask_init: str = "guided"
    init_expand_prob: float = 0.6
    kappa_flat: float = 4.0  # guided: + (s - 0.5) kappa_flat on each slot's Expand logit (the code's 4)
    kappa_depth: float = 1.0  # guided: + kappa_depth * depth_l on every slot of layer l (the code's 1.0)
    # cka: depth_l = the previous task's 1 - CKA drift of layer l on old-task replay data,
    # min-max scaled over layers; fixed: depth_l = 1 on the last 3/16 of the layers (the code's
    # layers 13-15 of 16)
    depth_prior: str = "cka"
    probe_batches: int = 20  # guided: replay micro-batches of the flatness probe (the code's 20)
    mask_lr: float = 0.01  # Adam on the mask logits; raised per task where its reach is short
    mask_reach: float = PAPER_REACH  # the gap a task's updates can move at most, at least (search.py)
    # route: each clone a routable expert of its own, gated by pi; mix: the paper's pair,
    # pi * new + (1 - pi) * old on the old expert's routing (supernet.py)
    supernet: str = "route"
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
        for name, choices in (("depth_prior", DEPTH_PRIORS), ("supernet", SUPERNETS)):
            if getattr(self, name) not in choices:
                raise UserError(f"method_args.{name}={getattr(self, name)!r}: choose one of {', '.join(choices)}")
        if self.probe_batches < 1:
            raise UserError(f"method_args.probe_batches={self.probe_batches} must be >= 1")
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
        for name in ("lambda_cka", "lambda_replay", "gamma", "beta", "mask_lr", "kappa_flat", "kappa_depth",
                     "mask_reach"):
            if getattr(self, name) < 0:
                raise UserError(f"method_args.{name}={getattr(self, name)} must be >= 0")
        if not 0 <= self.r_target <= 1:
            raise UserError(f"method_args.r_target={self.r_target} must be in [0, 1]")
