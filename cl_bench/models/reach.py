"""Which expert groups a step's training forwards reached, for the MoE methods'
Method.idle_units / idle_parameters (cl_bench/method.py).

A group of stacked experts (cl_bench/models/moe.py) that no token of a step is routed to
gets no gradient on one process, so torch's AdamW leaves it alone, while ZeRO would give
it zeros and move it by its momentum. `ExpertReach` counts, per group, the tokens the
step's training forwards route to it (not a rank's weight-0 padding copy: ctx.padding),
sums the counts over the ranks when the step asks, and names the trained groups that got
none; the backends then leave them alone alike. A method composes one:

    setup:  self._reach = ExpertReach(model, self.ctx)
            self.idle_units, self.idle_parameters = self._reach.units, self._reach.idle
"""
from __future__ import annotations

import torch
from torch import nn

from cl_bench.models.moe import moe_layers


class ExpertReach:
    def __init__(self, model: nn.Module, ctx):
        self.model, self.ctx = model, ctx
        model.register_forward_pre_hook(self._before_forward)

    def _before_forward(self, module, args) -> None:
        """Each forward of the model: its MoE layers count the tokens they route (with
        gradients on: UpcycledMoE._note_reach) while the model trains, unless this is a
        padding copy."""
        on = module.training and not self.ctx.padding
        for layer in moe_layers(self.model):
            layer.count_reach = on

    def _groups(self):
        return [g for layer in moe_layers(self.model) for g in layer.groups]

    def units(self) -> list[list[nn.Parameter]]:
        """Each expert group's stacked weights (its router rows always get a gradient)."""
        return [[g.gate, g.up, g.down] for g in self._groups()]

    def idle(self, step: int | None = None) -> list[nn.Parameter]:
        """The trained weights of the groups no token reached since the last call, summed
        over the ranks (every rank calls it once a step); the counts start again."""
        layers = moe_layers(self.model)
        if not layers:  # still dense (btx's branches, cluster-upcycle before task 0)
            return []
        counts = torch.tensor([layer.reached(i) for layer in layers for i in range(len(layer.groups))],
                              dtype=torch.float64, device=self._device())
        self.ctx.grads.all_reduce(counts)
        for layer in layers:
            layer.reach = []
        return [p for g, n in zip(self._groups(), counts.tolist()) if n == 0
                for p in (g.gate, g.up, g.down) if p.requires_grad]

    def _device(self):
        return next(iter(self.model.parameters())).device
