"""Branch-Train-MiX, continual form (Sukhbaatar et al., 2024; METHODS.md,
"Upcycling family"; reference/baselines.md, "BTM / BTX").

    branch: L = CE(ffn_t)                      mix: L = CE + sum_layers lb_coef * E * sum_i f_i P_i

Each task trains in two phases (`phases`), each over the profile's epochs:

1. branch: in every decoder layer a fresh copy of the pretrained dense MLP
   (the seed's FFN) replaces the layer and is trained alone on the task: no
   routing, earlier experts unused.
2. mix: the branch's K = 8 SwiGLU slices join the layer's MoE as a new group
   (slice i stands in for dense slice i), with new router rows N(0, router_std);
   the branch itself is dropped. Then the router (the rows of every group, old
   ones included, and their biases) is fine-tuned on the task plus the shared
   replay buffer, all experts frozen. Replay matters here: without it the
   router collapses toward the newest expert (reference notes).

Task 0 is the same: the model is dense until the first mix. The MoE layer and
the family's arguments, loss and report are the core's (cl_bench/models/moe.py,
cl_bench/models/upcycling.py): top-2 of 8T experts beside the frozen dense MLP,
"swap" shared path by default. Router lr: `router_lr` (1e-4, cl-bench's choice:
the rows are new and tiny, N(0, 0.02); BTX publishes no value for this form).

Source: Branch-Train-MiX (Sukhbaatar et al., 2024).

Differs from BTX (stated, continual adaptation):
- experts are slices of each branch rather than whole branch FFNs (METHODS.md),
  so a token uses 2/8 of a branch;
- no seed expert (the frozen dense MLP is the shared path instead);
- with train_shared=true the branch phase also trains attention, embeddings and
  norms, carried from task to task, not averaged over branches.
"""
from __future__ import annotations

import copy
import functools
from dataclasses import dataclass
from typing import Any

from torch import nn

from cl_bench.errors import UserError
from cl_bench.method import Method, Phase, Stage, lm_loss
from cl_bench.models.expert_init import slice_experts
from cl_bench.models.moe import UpcycledMoE, decoder_layers, group_sizes, rebuild
from cl_bench.models.reach import ExpertReach
from cl_bench.models.upcycling import (MoEArgs, as_moe, grown_param_report, lm_and_balancing, moe_settings,
                                       train_routers)
from cl_bench.registry import register_method

BRANCH, MIX = Phase("branch", replay=False), Phase("mix", replay=True)


@dataclass
class BtxArgs(MoEArgs):
    router_lr: float = 1e-4  # lr of the router fine-tune (mix phase); the branch trains at lr

    def __post_init__(self):
        super().__post_init__()
        if self.router_lr <= 0:
            raise UserError(f"method_args.router_lr={self.router_lr} must be > 0")


@register_method("btx", aliases=("btm",))
class BranchTrainMix(Method):
    description = "Branch-Train-MiX: per task a dense-FFN branch trained alone, mixed in as 8 experts, router tuned with replay"
    lr_family = "expert"
    Args = BtxArgs
    uses_replay = True

    def setup(self, model: nn.Module) -> None:
        self.model = model  # dense until task 0's mix; experts join at the mix phase, from the branch
        # an expert group no token of a step reached takes no optimiser step, on either backend
        self._reach = ExpertReach(model, self.ctx)
        self.idle_units, self.idle_parameters = self._reach.units, self._reach.idle
        self._phase = MIX
        self._set_trainable()

    def phases(self, stage: Stage) -> list[Phase]:
        return [BRANCH, MIX]

    def before_phase(self, stage: Stage, phase: Phase) -> None:
        self._phase = phase
        blocks = decoder_layers(self.model)
        if phase == BRANCH:
            for block in blocks:
                dense = block.mlp.dense if isinstance(block.mlp, UpcycledMoE) else block.mlp
                block.mlp = _Branch(block.mlp, copy.deepcopy(dense))
        else:
            for block in blocks:
                if not isinstance(block.mlp, _Branch):
                    continue  # resumed after this task's mix: nothing to add
                branch = block.mlp
                moe = as_moe(branch.home, self.args)  # task 0: upcycle the dense MLP, no group yet
                moe.add_group(functools.partial(_slices_of, branch.ffn), self.args.router_std)
                block.mlp = moe
        self._set_trainable()

    def _set_trainable(self) -> None:
        branch = self._phase == BRANCH
        self.model.requires_grad_(branch and self.args.train_shared)
        if not branch:
            train_routers(self.model)
            return
        for block in decoder_layers(self.model):
            if isinstance(block.mlp, _Branch):
                block.mlp.requires_grad_(False)
                block.mlp.ffn.requires_grad_(True)

    def make_optimizer(self, groups):
        lr = self.args.lr if self._phase == BRANCH else self.args.router_lr
        return super().make_optimizer([{**g, "lr": lr} for g in groups])

    def loss(self, batch, step):
        if self._phase == BRANCH:
            lm = lm_loss(self.model, batch)
            return lm, {"lm": lm.item()}
        return lm_and_balancing(self.model, batch)

    def state_dict(self) -> dict[str, Any]:
        return {"layout": group_sizes(self.model)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        rebuild(self.model, state["layout"], **moe_settings(self.args))
        self._set_trainable()

    def param_report(self) -> dict[str, Any]:
        return grown_param_report(self.model)


class _Branch(nn.Module):
    """A decoder layer's MLP slot during the branch phase: `ffn` (a trainable copy
    of the pretrained dense MLP) computes the layer; `home` (the MoE layer, or the
    dense MLP before task 0's mix) waits, unused, to take the branch's slices."""

    def __init__(self, home: nn.Module, ffn: nn.Module):
        super().__init__()
        self.home = home
        self.ffn = ffn

    def forward(self, x):
        return self.ffn(x)


def _slices_of(branch_ffn: nn.Module, dense: nn.Module, n_per_group: int):
    """The expert init for a mix: slices of the trained branch, not of `dense`."""
    return slice_experts(branch_ffn, n_per_group)
