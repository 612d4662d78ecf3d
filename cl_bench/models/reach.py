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

import contextlib

import torch
from torch import nn

from cl_bench.models.moe import ExpertGroup, moe_layers


class ExpertReach:
    def __init__(self, model: nn.Module, ctx):
        self.model, self.ctx = model, ctx
        self._uncounted = False
        model.register_forward_pre_hook(self._before_forward)

    def _before_forward(self, module, args) -> None:
        """Each forward of the model: its MoE layers count the tokens they route (with
        gradients on: UpcycledMoE._note_reach) while the model trains, unless this is a
        padding copy or an uncounted forward."""
        on = module.training and not self.ctx.padding and not self._uncounted
        for layer in moe_layers(self.model):
            layer.count_reach = on

    @contextlib.contextmanager
    def uncounted(self):
        """Forwards inside reach nothing: those whose gradient goes elsewhere than the
        parameters' .grad (torch.autograd.grad to a method's own tensor, as bilevel-cka's
        outer step to its mask logits), so they leave the experts they route to without
        a gradient, as a step with no token for them does."""
        self._uncounted = True
        try:
            yield
        finally:
            self._uncounted = False

    def _groups(self) -> list[ExpertGroup]:
        """Every expert group of the model, in module order (the same on every rank): the
        MoE layers' own and those routed beside them, as bilevel-cka's supernet clones
        (its `extra` group), which a step whose masks close every clone of a layer leaves
        without a gradient."""
        return [m for m in self.model.modules() if isinstance(m, ExpertGroup)]

    def units(self) -> list[list[nn.Parameter]]:
        """Each expert group's stacked weights (its router rows always get a gradient)."""
        return [[g.gate, g.up, g.down] for g in self._groups()]

    def idle(self, step: int | None = None) -> list[nn.Parameter]:
        """The trained weights of the groups no token reached since the last call, summed
        over the ranks (every rank calls it once a step); the counts start again."""
        groups = self._groups()
        if not groups:  # still dense (btx's branches, cluster-upcycle before task 0)
            return []
        counts = torch.tensor([g.reach for g in groups], dtype=torch.float64, device=self._device())
        self.ctx.grads.all_reduce(counts)
        for g in groups:
            g.reach = 0
        return [p for g, n in zip(groups, counts.tolist()) if n == 0
                for p in (g.gate, g.up, g.down) if p.requires_grad]

    def _device(self):
        return next(iter(self.model.parameters())).device
