"""Standard (sparse) upcycling, continual form (METHODS.md, "Upcycling family").

    y = shared(x) + sum_{e in top-2(x)} w_e(x) expert_e(x),   L = CE + sum_layers lb_coef * E * sum_i f_i P_i

Task 0: every MLP becomes an MoE layer of K = 8 routed SwiGLU slices of itself,
top-2, beside the frozen dense MLP as the shared path (cl_bench/models/moe.py).
Task t >= 1: 8 new slices copied from the pretrained dense MLP (frozen, so
always the pretrained weights) join every layer with their own router rows,
N(0, router_std); the layer grows 8 -> 8T. Trainable in task t: the newest
group and its router rows (and s in "add" mode); old groups are frozen as whole
parameters (each group owns its rows), so AdamW's carried moments cannot move
them. Attention, embeddings and norms train only with train_shared=true. lr:
MethodArgs' 1e-5 (METHODS.md gives none for this family; the paper's code uses
1.5e-5, bilevel-reference.md §6); AdamW (0.9, 0.95), wd 0. The pieces are the
core's (cl_bench/models/upcycling.py), shared with the other upcycling methods.

Shared path (`shared`): "swap" by default: a token's two chosen experts stand
in for their own slices of the dense MLP, so the upcycled model starts as the
dense model and the experts train at full strength from the first step. The
paper code's layer ("add": dense + routed, unscaled) raises SmolLM2's loss on
held-out TRACE answers before any training (`cl-bench perf upcycle-gap`,
results/perf/upcycle-gap-smollm2.json), beyond METHODS.md's 2% bound.

Source: sparse upcycling (Komatsuzaki et al., ICLR 2023) and the CKA-guided
bilevel paper's code, as bilevel-reference.md describes it.

Differs from the paper's code (bilevel-reference.md §1-2, §8):
- a balancing loss (it has none); router rows N(0, 0.02) (it: PyTorch's default);
- the "swap" shared path (it adds the routed sum: shared=add reproduces that);
- experts that actually train; shared weights frozen by default.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from cl_bench.method import Method, Stage
from cl_bench.models.expert_init import slice_experts
from cl_bench.models.moe import group_sizes, rebuild, upcycle_model
from cl_bench.models.reach import ExpertReach
from cl_bench.models.upcycling import (MoEArgs, grow_groups, grown_param_report, lm_and_balancing, moe_settings,
                                       train_newest_group)
from cl_bench.registry import register_method


@dataclass
class UpcycleArgs(MoEArgs):
    """Standard upcycling has the family's arguments only (cl_bench/models/upcycling.py)."""


@register_method("upcycle")
class Upcycle(Method):
    description = "Standard upcycling: 8 new slice experts per layer per task, old experts frozen"
    lr_family = "expert"
    Args = UpcycleArgs

    def setup(self, model: nn.Module) -> None:
        self.model = model
        # an expert group no token of a step reached takes no optimiser step, on either backend
        self._reach = ExpertReach(model, self.ctx)
        self.idle_units, self.idle_parameters = self._reach.units, self._reach.idle
        upcycle_model(model, init=slice_experts, router_std=self.args.router_std, **moe_settings(self.args))
        train_newest_group(model, self.args.train_shared)

    def before_task(self, stage: Stage) -> None:
        grow_groups(self.model, stage.index + 1, slice_experts, self.args.router_std)  # group g serves task g
        train_newest_group(self.model, self.args.train_shared)

    def loss(self, batch, step):
        return lm_and_balancing(self.model, batch)

    def state_dict(self) -> dict[str, Any]:
        return {"layout": group_sizes(self.model)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        rebuild(self.model, state["layout"], **moe_settings(self.args))
        train_newest_group(self.model, self.args.train_shared)

    def param_report(self) -> dict[str, Any]:
        return grown_param_report(self.model)
