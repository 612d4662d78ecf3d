"""Drop-Upcycling, continual form (Nakamura et al., ICLR 2025; METHODS.md).

    expert_i = slice_i with floor(r h) of its h neurons (gate rows, up rows, down
               columns) re-drawn from N(mu, sigma) of the entries replaced, r = 0.5

Standard upcycling (the same core pieces as methods/upcycle.py: layer, groups,
freezing, loss and resume, cl_bench/models/upcycling.py) except how each new
expert is made, at task 0 and for every later group (cl_bench/models/expert_init.py).

Source: Drop-Upcycling (Nakamura et al., ICLR 2025) and its code.

Differs from the paper/code:
- one random neuron set per expert, shared by its gate rows, up rows and down
  columns (the paper; the code draws a set per matrix); mu, sigma per matrix (the code);
- balancing coefficient 0.01 and router rows N(0, 0.02) (the paper: 0.02 and a
  uniform init of std 0.02), so the two methods differ only in the experts' init.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from cl_bench.errors import UserError
from cl_bench.method import Method, Stage
from cl_bench.models.expert_init import ExpertInit, drop_upcycle_init
from cl_bench.models.moe import group_sizes, rebuild, upcycle_model
from cl_bench.models.reach import ExpertReach
from cl_bench.models.upcycling import (MoEArgs, grow_groups, grown_param_report, lm_and_balancing, moe_settings,
                                       train_newest_group)
from cl_bench.registry import register_method


@dataclass
class DropUpcycleArgs(MoEArgs):
    drop_ratio: float = 0.5  # r: share of each new expert's neurons re-initialised

    def __post_init__(self):
        super().__post_init__()
        if not 0.0 <= self.drop_ratio <= 1.0:
            raise UserError(f"method_args.drop_ratio={self.drop_ratio} must be in [0, 1]")


@register_method("drop-upcycle")
class DropUpcycle(Method):
    description = "Drop-Upcycling: as upcycle, half of each new expert's neurons re-initialised"
    lr_family = "expert"
    Args = DropUpcycleArgs

    def expert_init(self) -> ExpertInit:
        return drop_upcycle_init(self.args.drop_ratio)

    def setup(self, model: nn.Module) -> None:
        self.model = model
        # an expert group no token of a step reached takes no optimiser step, on either backend
        self._reach = ExpertReach(model, self.ctx)
        self.idle_units, self.idle_parameters = self._reach.units, self._reach.idle
        upcycle_model(model, init=self.expert_init(), router_std=self.args.router_std, **moe_settings(self.args))
        train_newest_group(model, self.args.train_shared)

    def before_task(self, stage: Stage) -> None:
        grow_groups(self.model, stage.index + 1, self.expert_init(), self.args.router_std)
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
