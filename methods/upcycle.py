"""Standard (sparse) upcycling, continual form (METHODS.md, "Upcycling family").

Task 0: every MLP becomes an MoE layer of 8 routed SwiGLU slices of itself,
top-2, beside the frozen dense MLP as the shared path (cl_bench/models/moe.py).
Task t >= 1: 8 new slices copied from the pretrained dense MLP (frozen, so
always the pretrained weights) join every layer with their own router rows,
N(0, router_std); the layer grows 8 -> 8T.

Shared path (`shared`): "swap" by default: a token's two chosen experts stand
in for their own slices of the dense MLP, so the upcycled model starts as the
dense model and the experts train at full strength from the first step. The
paper code's layer ("add": dense + routed, unscaled) raises SmolLM2's loss on
held-out TRACE answers before any training (`cl-bench perf upcycle-gap`,
results/perf/upcycle-gap-smollm2.json), beyond METHODS.md's 2% bound.
`shared=add` gives it, with a learned per-layer scale s from routed_scale_init.

Trainable in task t: the newest group of experts and its router rows (and s in
"add" mode). Old experts and old router rows are frozen as whole parameters
(each group owns its rows), so AdamW's carried moments cannot move them.
Attention, embeddings and norms are frozen unless train_shared=true (the
paper's code in effect trains them, bilevel-reference.md §6). The dense MLP
always stays frozen.

Loss: answer-token cross-entropy + load balancing (Switch, coef 0.01, summed
over layers). lr: MethodArgs' 1e-5 (METHODS.md gives none for this family; the
paper's code uses 1.5e-5, bilevel-reference.md §6); AdamW (0.9, 0.95), wd 0.

Deviations from the paper's code (bilevel-reference.md §1-2, §8): a balancing
loss (it has none), router rows N(0, 0.02) (it uses PyTorch's default), the
"swap" shared path (it adds the routed sum: shared=add reproduces that),
experts that actually train, shared weights frozen by default.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from cl_bench.errors import UserError
from cl_bench.method import Method, MethodArgs, Stage, lm_loss
from cl_bench.models.moe import (SHARED_MODES, ExpertInit, group_sizes, load_balancing_loss, moe_layers, rebuild,
                                 slice_experts, upcycle_model)
from cl_bench.models.params import count
from cl_bench.registry import register_method


@dataclass
class UpcycleArgs(MethodArgs):
    experts_per_task: int = 8  # K: slices per group; one group joins every layer per task
    top_k: int = 2
    lb_coef: float = 0.01  # Switch load-balancing coefficient; 0 turns it off
    router_std: float = 0.02  # new router rows ~ N(0, router_std), biases 0
    shared: str = "swap"  # swap: routed experts stand in for their dense slices (starts as the dense
    #                       model); add: dense + s * routed, the paper code's layer with s = 1
    routed_scale_init: float = 1.0  # s at upcycling, "add" only (s is then learned)
    train_shared: bool = False  # also train attention, embeddings, norms, head

    def __post_init__(self):
        for name in ("experts_per_task", "top_k"):
            if getattr(self, name) < 1:
                raise UserError(f"method_args.{name}={getattr(self, name)} must be >= 1")
        if self.top_k > self.experts_per_task:
            raise UserError(f"method_args.top_k={self.top_k} exceeds experts_per_task="
                            f"{self.experts_per_task}; lower top_k")
        if self.shared not in SHARED_MODES:
            raise UserError(f"method_args.shared={self.shared!r}: choose one of {', '.join(SHARED_MODES)}")
        for name in ("lb_coef", "router_std"):
            if getattr(self, name) < 0:
                raise UserError(f"method_args.{name}={getattr(self, name)} must be >= 0")


@register_method("upcycle")
class Upcycle(Method):
    description = "Standard upcycling: 8 new slice experts per layer per task, old experts frozen"
    lr_family = "expert"
    Args = UpcycleArgs

    def expert_init(self) -> ExpertInit:
        """How a new group's experts are made from the dense MLP."""
        return slice_experts

    def _moe_settings(self) -> dict[str, Any]:
        a = self.args
        return dict(k=a.top_k, n_per_group=a.experts_per_task, lb_coef=a.lb_coef,
                    shared=a.shared, routed_scale_init=a.routed_scale_init)

    def setup(self, model: nn.Module) -> None:
        super().setup(model)
        upcycle_model(model, init=self.expert_init(), router_std=self.args.router_std,
                      **self._moe_settings())
        self._set_trainable()

    def before_task(self, stage: Stage) -> None:
        # Group g serves task g; idempotent, so a resumed run adds nothing twice.
        for layer in moe_layers(self.model):
            while len(layer.groups) < stage.index + 1:
                layer.add_group(self.expert_init(), self.args.router_std)
        self._set_trainable()

    def _set_trainable(self) -> None:
        self.model.requires_grad_(self.args.train_shared)
        for layer in moe_layers(self.model):
            layer.requires_grad_(False)  # dense path and old groups
            layer.groups[-1].requires_grad_(True)  # the newest experts and their router rows
            if layer.routed_scale is not None:
                layer.routed_scale.requires_grad_(True)

    def loss(self, batch, step):
        lm = lm_loss(self.model, batch)
        lb = load_balancing_loss(self.model)
        return lm + lb, {"lm": lm.item(), "lb": lb.item()}

    def state_dict(self) -> dict[str, Any]:
        return {"layout": group_sizes(self.model)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        rebuild(self.model, state["layout"], **self._moe_settings())
        self._set_trainable()

    def param_report(self) -> dict[str, Any]:
        report = count(self.model)
        # Every slot offered to a task t >= 1 expands (8 of 8): rate 1; none at task 0.
        grown = any(len(layer.groups) > 1 for layer in moe_layers(self.model))
        report["expansion_rate"] = 1.0 if grown else None
        return report
