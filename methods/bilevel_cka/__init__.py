"""bilevel-cka: CKA-guided bilevel MoE upcycling, the paper's algorithm done as
METHODS.md ("bilevel-cka") fixes it.

Task 0 is Standard upcycling (methods/upcycle.py: K = 8 slice experts, top-2,
Switch balancing, the frozen dense MLP as the shared path). Task t >= 1, in each
candidate layer: a trainable clone of each active expert a_c, with a router row
of its own, routable beside a_c where its hard straight-through Gumbel mask
pi_c = 1 (supernet.py), and

    L_in  = L_task + lambda_CKA * L_CKA + lambda_replay * L_replay       every step
    L_CKA = mean_{l in deep} 1 - CKA(Phi_l, Phi_l^old)                  replay batch, layer outputs
    L_out = L_replay(pi) - gamma * G + beta * B(r),  G = sg(L_recycle - L_expand) * r,  r = mean(pi)

the outer loss trained on the mask logits alpha every N steps (search.py); at
the end, sigmoid(alpha_e - alpha_r) > 0.5 -> Expand (the clone joins as a new
expert), else Recycle (record.py).

Source: CKA-guided bilevel MoE upcycling (ICML 2026); its published code as
bilevel-reference.md describes it. Full account (routing choice, schedule,
defaults, records, provenance): docs/methods/bilevel-cka.md.

Differs from the paper/code (bilevel-reference.md §8), on purpose:
- the clones really train (the code never steps its experts: clone = old, G = 0);
- L_CKA carries gradient, on each deep layer's output, on every step's replay
  batch, against the model before this task (the code: a float every 20 steps,
  layer inputs, task 0's batches);
- router rows stay aligned with experts; each clone's own row is searched and deployed;
- masks on every candidate layer; no sensitivity probe, deep-layer bias, adaptive
  gamma / beta / r_target, CKA warm-up or layer weights; balance above target sigmoid;
- tau reaches tau_final within each task; mask_lr raised where Recycle is out of reach;
- shared weights frozen by default (train_shared=true trains them).
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from cl_bench.analysis.cka import linear_cka
from cl_bench.errors import UserError
from cl_bench.method import Stage, lm_loss
from cl_bench.methods.upcycle import Upcycle, UpcycleArgs
from cl_bench.models.moe import decoder_layers, load_balancing_loss, moe_layers
from cl_bench.registry import register_method

from .record import _Record, spread_decisions
from .search import CHECK_BATCHES, _Search, _Task, mask_schedule, no_update_error, reachable_mask_lr
from .supernet import _Supernet, balance, pair_shares, straight_through_gumbel

__all__ = ["BilevelCKA", "BilevelCKAArgs", "MASK_MODES", "MASK_INITS", "RANDOM_INIT_STD", "CHECK_BATCHES",
           "straight_through_gumbel", "balance", "mask_schedule", "reachable_mask_lr", "no_update_error",
           "pair_shares", "spread_decisions"]

MASK_MODES = ("on", "off")
MASK_INITS = ("prior", "random")
RANDOM_INIT_STD = 0.1  # mask_init=random: the paper code's MASK_OVERRIDE=random, N(0, 0.1)

# Letters: L_c candidate layers, K slots (experts per task), B, T, N, d, E as in moe.py.


@dataclass
class BilevelCKAArgs(UpcycleArgs):
    # supernet and masks
    candidate_layers: list[int] | None = None  # decoder layers with a supernet; None: every MoE layer
    mask: str = "on"  # on: learned masks; off: every slot expands (ablation "CKA only")
    mask_init: str = "prior"  # prior: p_expand = init_expand_prob; random: logits ~ N(0, 0.1^2)
    init_expand_prob: float = 0.6
    mask_lr: float = 0.01  # Adam on the mask logits; raised per task where Recycle is out of reach
    mask_every: int = 10  # N: an outer step every N optimiser steps
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


@register_method("bilevel-cka")
class BilevelCKA(_Record, _Search, Upcycle):
    description = "CKA-guided bilevel upcycling: clones of the active experts, learned masks pick Expand/Recycle"
    Args = BilevelCKAArgs
    zero_unsupported = dict.fromkeys((2, 3), (
        "its outer step trains the mask logits with their own optimiser inside replay_loss "
        "(torch.autograd.grad through the model): only the rank holding a step's replay micro-batch would "
        "take it, and ZeRO-3 cannot differentiate partitioned weights outside the engine's backward"))
    uses_replay = True

    def __init__(self, args: BilevelCKAArgs, context):
        super().__init__(args, context)
        if context is not None and context.config.replay.policy != "interleave":
            raise UserError(f"bilevel-cka needs replay.policy=interleave (its CKA term and outer step use "
                            f"the replay micro-batch of each step), not {context.config.replay.policy!r}; "
                            f"set --set replay.policy=interleave")
        self._active: dict[int, list[int]] = {}  # candidate layer -> expert index per slot
        self._task: _Task | None = None
        self._record: dict[str, Any] | None = None  # this stage's per-task record
        self._optimizer: torch.optim.Optimizer | None = None

    def setup(self, model: nn.Module) -> None:
        super().setup(model)
        n = len(decoder_layers(model))
        a = self.args
        self._candidates = _layers(a.candidate_layers, list(range(n)), n, "candidate_layers")
        self._cka_layers = _layers(a.cka_layers, list(range(n - math.ceil(n / 3), n)), n, "cka_layers")
        self._active = {i: list(range(a.experts_per_task)) for i in self._candidates}

    # ---- task start ------------------------------------------------------------
    def plan(self, tasks: list) -> list[Stage]:
        """Standard stages; refuses, before anything trains, a task whose masks would
        get no outer update (docs/methods/bilevel-cka.md, "Schedule")."""
        stages = super().plan(tasks)
        if self.args.mask == "on":
            for stage in stages[1:]:
                n_steps = self.stage_steps(stage)
                if n_steps is not None and not mask_schedule(n_steps, self.args)[1]:
                    raise no_update_error(stage, n_steps, self.args)
        return stages

    def before_task(self, stage: Stage) -> None:
        self._record = None
        if stage.index == 0:
            super().before_task(stage)  # task 0: plain upcycling
            return
        a = self.args
        n_steps = self.stage_steps(stage)
        every, updates, decay = mask_schedule(n_steps, a)
        if a.mask == "on" and updates == 0:
            raise no_update_error(stage, n_steps, a)
        blocks = decoder_layers(self.model)
        self.model.requires_grad_(a.train_shared)
        for layer in moe_layers(self.model):
            layer.requires_grad_(False)
            if layer.routed_scale is not None:
                layer.routed_scale.requires_grad_(True)
        seed = self.ctx.config.seed if self.ctx is not None else 0
        generator = torch.Generator().manual_seed(
            random.Random(f"{seed}/bilevel-cka/{stage.index}").getrandbits(63))
        rows = torch.Generator().manual_seed(  # the clones' router rows: their own stream
            random.Random(f"{seed}/bilevel-cka/{stage.index}/rows").getrandbits(63))
        nets = {}
        for i in self._candidates:
            nets[i] = blocks[i].mlp = _Supernet(blocks[i].mlp, self._active[i], a.router_std, rows)
        clones = {id(p) for net in nets.values() for p in net.clones.parameters()}
        snapshot = {n: p.detach().clone() for n, p in self.model.named_parameters()
                    if p.requires_grad and id(p) not in clones}
        logits = optimizer = mask_lr = init_gap = None
        if a.mask == "on":
            shape = (len(self._candidates), a.experts_per_task, 2)
            if a.mask_init == "random":
                init = torch.randn(shape, generator=generator) * RANDOM_INIT_STD
            else:
                init = torch.zeros(shape)
                init[..., 1] = math.log(a.init_expand_prob / (1 - a.init_expand_prob))
            init_gap = float((init[..., 1] - init[..., 0]).abs().max())
            mask_lr = reachable_mask_lr(updates, init_gap, a.mask_lr)
            logits = nn.Parameter(init.to(self._device()))
            optimizer = torch.optim.Adam([logits], lr=mask_lr)
        self._task = _Task(nets, snapshot, generator, n_steps, every, decay, logits, optimizer, a.tau0,
                           mask_lr, init_gap)

    def optimizer_for_stage(self, stage, previous):
        self._optimizer = super().optimizer_for_stage(stage, previous)
        return self._optimizer

    # ---- losses ----------------------------------------------------------------------
    def loss(self, batch, step):
        task = self._task
        if task is None:
            return super().loss(batch, step)  # task 0: Standard upcycling's CE + balancing
        pi = self._step_masks(step)
        self._set_masks(pi)
        lm = lm_loss(self.model, batch)
        lb = load_balancing_loss(self.model)
        task.task_batch = batch
        task.task_batches.append(batch)
        return lm + lb, {"lm": lm.item(), "lb": lb.item(), "expand": float(pi.mean())}

    def replay_loss(self, batch, step):
        a, task = self.args, self._task
        if task is None:  # task 0 replays only with replay.lima > 0
            lm = lm_loss(self.model, batch)
            load_balancing_loss(self.model)  # clear: balancing belongs to the task loss
            return a.lambda_replay * lm, {"lm": lm.item()}
        parts: dict[str, float] = {}
        if a.mask == "on" and (step + 1) % task.every == 0 and task.task_batch is not None:
            parts.update(self._outer_step(batch))
        reference = self._reference_features(batch)
        self._set_masks(self._step_masks(step))
        with self._capture() as feats:
            lm = lm_loss(self.model, batch)
        load_balancing_loss(self.model)
        current = {l: self._tokens(feats[l], batch) for l in self._cka_layers}
        if a.lambda_cka == 0:  # measured for the record only
            current = {l: f.detach() for l, f in current.items()}
        ckas = torch.stack([linear_cka(current[l], reference[l]) for l in self._cka_layers])  # (n_deep,)
        cka_loss = (1 - ckas).mean()
        values = ckas.detach().tolist()
        task.cka.append(values)
        task.replay_batch = batch
        parts.update({"lm": lm.item(), "cka": sum(values) / len(values), "cka_loss": cka_loss.item(),
                      **{f"cka_{l}": c for l, c in zip(self._cka_layers, values)}})
        return a.lambda_replay * lm + a.lambda_cka * cka_loss, parts

    # ---- records and resume ------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "active": {i: list(v) for i, v in self._active.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self._active = {int(i): list(v) for i, v in state["active"].items()}


def _layers(chosen: list[int] | None, default: list[int], n: int, name: str) -> list[int]:
    layers = default if chosen is None else sorted(set(chosen))
    bad = [i for i in layers if not 0 <= i < n]
    if bad or not layers:
        raise UserError(f"method_args.{name}={chosen}: give decoder layers in 0..{n - 1} "
                        f"(the model has {n}), or null for the default")
    return layers
