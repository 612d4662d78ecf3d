"""A step's gradients and weights as a method may change them in `before_step`, the
same way on every backend: each rank sees its own part of each parameter.

Between the last backward of a step and the optimiser step, `method.ctx.grads`
(a StepGradients: one process's, or the backend's for the phase) gives

    fragments(params)  this rank's Fragment of each parameter: flat indices
                       [start, start + numel) of the parameter's values, the step's
                       gradient over them (reduced over ranks, summed over the step's
                       micro-batches: what the optimiser will use, clipping included)
                       and the fp32 weights over them; with grad=False the weights
                       only, which a loss may read too (no gradient exists yet then);
    write(fragments)   the fragments' gradients, changed in place, put back;
    set_weights(params, fragments)
                       after the optimiser step (after_step): the fragments' fp32
                       `weight`, changed in place, become the weights the next
                       forward uses on every rank (ZeRO: the masters are written
                       in place; the working copies follow);
    assemble(params, fragments, values)
                       per parameter, a whole flat tensor from each rank's slice of
                       it (`values`: id(param) -> this rank's fragment-sized tensor):
                       what the ranks computed on their fragments, whole on every rank;
    world_size, rank   how many ranks, and this one's (rank 0 writes checkpoints);
    all_reduce(t)      t summed over ranks, in place (one rank: t itself);
    all_gather(values) a list of this rank's values -> every rank's, concatenated
                       in rank order (statistics a loss kept of its micro-batches);
    apart()            a context: the forwards and torch.autograd.grad calls inside
                       take gradients of a method's own tensors, outside the
                       optimiser's step (the flagship's mask logits), and no hook of
                       the backend's gradient reduction runs in them (ZeRO-3 reduces
                       a leaf module's gradients in its backward hook, which any
                       backward through the module would run).

A per-coordinate change (a penalty's gradient) needs no communication; a linear
one (a projection) needs its coefficients summed over ranks: every rank calls
`all_reduce` the same number of times, in the same order (before_step runs on
every rank). On the torch backend a fragment is the whole parameter and its
`.grad` (created as zeros where it is None); on the deepspeed backend it is the
slice that ZeRO's partition puts on this rank (backends/deepspeed_backend.py,
ZeroGradients): a rank may hold no part of a small parameter.

An optimiser that needs each parameter whole (a per-matrix rule) steps, under ZeRO,
flat fp32 partitions that span many parameters; a ZeroLayout says which part of
which parameter each holds. The engine's phase (backends/zero_engine.py) gives it to
an optimiser that has `bind_zero_layout(layout)`, and None when the phase ends.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn


@dataclass
class Fragment:
    """This rank's part of one parameter during a step (module docstring). `grad` and
    `weight` are flat tensors of `numel` values; write into `grad` only (None where
    asked for the weights only)."""

    param: nn.Parameter
    start: int
    numel: int
    grad: torch.Tensor | None
    weight: torch.Tensor
    shape: torch.Size | None = None  # the whole parameter's (ZeRO-3 leaves `param` empty); None: param.shape

    def __post_init__(self):
        if self.shape is None:
            self.shape = self.param.shape

    @property
    def stop(self) -> int:
        return self.start + self.numel

    def of(self, full: torch.Tensor) -> torch.Tensor:
        """The same slice of a tensor shaped like the parameter (F, θ*, a basis row)."""
        return full.reshape(-1)[self.start:self.stop]


class StepGradients:
    """One process (the torch backend): every parameter whole, its `.grad` in place."""

    world_size = 1
    rank = 0  # this process's rank (rank 0 writes records and checkpoints)

    def fragments(self, params: list[nn.Parameter], grad: bool = True) -> list[Fragment]:
        out = []
        for p in params:
            if grad and p.grad is None:
                p.grad = torch.zeros_like(p)
            out.append(Fragment(p, 0, p.numel(), p.grad.view(-1) if grad else None, p.detach().view(-1)))
        return out

    def write(self, fragments: list[Fragment]) -> None:
        """The fragments' `grad` are views of `.grad`: nothing to put back."""

    def set_weights(self, params: list[nn.Parameter], fragments: list[Fragment]) -> None:
        """The fragments' `weight` are the parameters themselves: nothing to copy. On N
        ranks every rank calls it with the same `params`, in the same order."""

    def assemble(self, params: list[nn.Parameter], fragments: list[Fragment],
                 values: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """One process: each fragment is its whole parameter, so `values` already are."""
        return dict(values)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def all_gather(self, values: list) -> list:
        return list(values)

    def apart(self) -> contextlib.AbstractContextManager:
        """One process: torch.autograd.grad runs no hook of the optimiser's parameters."""
        return contextlib.nullcontext()


@dataclass
class Segment:
    """One parameter's part of a flat partition: values [start, start + numel) of the
    flattened parameter sit at [offset, offset + numel) of the flat tensor (numel 0:
    this rank holds none of it). `shape`: the whole parameter's; `ranks`: how many
    ranks hold a part of it (1: one rank holds it whole, this one or another)."""

    param: nn.Parameter
    shape: torch.Size
    offset: int
    start: int
    numel: int
    ranks: int = 1


@dataclass
class ZeroLayout:
    """What the flat partitions an optimiser steps under ZeRO hold. `segments[flat]`:
    every parameter of that partition, in the same order on every rank (so collectives
    over them match), with this rank's offsets; `all_reduce(t)` sums t over the ranks
    in place."""

    segments: dict[torch.Tensor, list[Segment]]
    all_reduce: Callable[[torch.Tensor], Any]
