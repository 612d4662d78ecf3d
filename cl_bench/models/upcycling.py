"""The pieces the upcycling methods compose (upcycle, drop-upcycle, btx,
cluster-upcycle, bilevel-cka): their shared arguments, growing one expert group
per task from the dense MLPs, what trains, the task loss with load balancing,
and the parameter report.

    L = CE(answer tokens) + sum over MoE layers of coef * E * sum_i f_i P_i

The layer is cl_bench/models/moe.py's UpcycledMoE; the balancing terms are
collected by cl_bench/models/balancing.py. Source: sparse upcycling
(Komatsuzaki et al., 2023) in the continual form of METHODS.md ("Upcycling
family"); Switch balancing (Fedus et al., 2021).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from cl_bench.errors import UserError
from cl_bench.method import MethodArgs, lm_loss
from cl_bench.models.balancing import balancing_losses
from cl_bench.models.expert_init import ExpertInit
from cl_bench.models.modes import device_of
from cl_bench.models.moe import SHARED_MODES, UpcycledMoE, decoder_layers, moe_layers
from cl_bench.models.params import count


@dataclass
class MoEArgs(MethodArgs):
    """The arguments every upcycling method has; a method's Args adds its own."""

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


def moe_settings(args: MoEArgs) -> dict[str, Any]:
    """The UpcycledMoE keyword arguments (`upcycle_model`, `rebuild`) of `args`."""
    return dict(k=args.top_k, n_per_group=args.experts_per_task, lb_coef=args.lb_coef,
                shared=args.shared, routed_scale_init=args.routed_scale_init)


def as_moe(mlp: nn.Module, args: MoEArgs) -> UpcycledMoE:
    """`mlp` itself if it is an MoE layer, else an UpcycledMoE around it with no group yet."""
    return mlp if isinstance(mlp, UpcycledMoE) else UpcycledMoE(mlp, **moe_settings(args))


def moe_everywhere(model: nn.Module, args: MoEArgs) -> list[UpcycledMoE]:
    """Every decoder layer's MLP as an MoE layer (those still dense wrapped, no group yet)."""
    out = []
    for block in decoder_layers(model):
        block.mlp = as_moe(block.mlp, args)
        out.append(block.mlp)
    return out


def grow_groups(model: nn.Module, n_groups: int, init: ExpertInit, router_std: float) -> None:
    """Add groups made by `init` until every MoE layer holds `n_groups` (idempotent:
    a resumed run, whose layers already hold them, adds nothing)."""
    for layer in moe_layers(model):
        while len(layer.groups) < n_groups:
            layer.add_group(init, router_std)


def train_newest_group(model: nn.Module, train_shared: bool, newest: bool = True) -> None:
    """What trains in an upcycling task: the newest group's experts and router rows
    (none with newest=False), the routed scale ("add"), and attention, embeddings,
    norms and head only with train_shared. The dense MLPs and older groups are frozen
    as whole parameters, so AdamW's carried moments cannot move them."""
    model.requires_grad_(train_shared)
    for layer in moe_layers(model):
        layer.requires_grad_(False)  # dense path and old groups
        if newest:
            layer.groups[-1].requires_grad_(True)  # the newest experts and their router rows
        if layer.routed_scale is not None:
            layer.routed_scale.requires_grad_(True)


def train_routers(model: nn.Module) -> None:
    """Freeze every expert and the dense MLP; train the router rows and biases of every
    group (old ones included) and the routed scale ("add")."""
    for layer in moe_layers(model):
        layer.requires_grad_(False)
        for group in layer.groups:
            group.router_weight.requires_grad_(True)
            group.router_bias.requires_grad_(True)
        if layer.routed_scale is not None:
            layer.routed_scale.requires_grad_(True)


def lm_and_balancing(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
    """Answer-token CE + the balancing terms of this forward: (loss, {"lm", "lb"})."""
    with balancing_losses() as balance:
        lm = lm_loss(model, batch)
    lb = balance.total(device_of(model))
    return lm + lb, {"lm": lm.item(), "lb": lb.item()}


def grown_param_report(model: nn.Module) -> dict[str, Any]:
    """params.count, and expansion_rate for methods that add a whole group per task:
    every slot offered to a task t >= 1 expands (K of K), rate 1; None at task 0."""
    report = count(model)
    report["expansion_rate"] = 1.0 if any(len(layer.groups) > 1 for layer in moe_layers(model)) else None
    return report
