"""The MoE load-balancing loss, collected by a context rather than stored on modules.

    with balancing_losses() as lb:
        lm = lm_loss(model, batch)          # every training MoE forward adds its term
    loss = lm + lb.total(device)            # sum_layers coef * E * sum_i f_i P_i

A layer asks `active()` for the innermost open collector and appends its term
there (cl_bench/models/moe.py, `UpcycledMoE.forward`); with none open it computes
no term. So only the forwards a method runs inside the block count: a teacher's,
a reference's or a replay batch's forward outside it adds nothing, and no layer
holds a graph after its forward.
"""
from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import torch


class BalancingLosses:
    """The balancing terms of the training forwards run inside `balancing_losses()`,
    in the order the layers ran."""

    def __init__(self):
        self.terms: list[torch.Tensor] = []

    def add(self, term: torch.Tensor) -> None:
        self.terms.append(term)

    def total(self, device: torch.device | str | None = None) -> torch.Tensor:
        """Their sum (a 0-dim zero on `device` when there is none)."""
        if not self.terms:
            return torch.zeros((), device=device)
        total = self.terms[0]
        for term in self.terms[1:]:
            total = total + term
        return total


_ACTIVE: contextvars.ContextVar[BalancingLosses | None] = contextvars.ContextVar(
    "cl_bench_balancing_losses", default=None)


def active() -> BalancingLosses | None:
    """The innermost open collector, or None outside every `balancing_losses()` block."""
    return _ACTIVE.get()


@contextlib.contextmanager
def balancing_losses() -> Iterator[BalancingLosses]:
    """Collect the balancing term of every training MoE forward inside the block
    (the innermost block only, when nested)."""
    collector = BalancingLosses()
    token = _ACTIVE.set(collector)
    try:
        yield collector
    finally:
        _ACTIVE.reset(token)
