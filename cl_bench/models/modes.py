"""Small model helpers that methods, analyses and backends share: run a block with
the model in eval mode (its train/eval flag restored afterwards, also on error), the
device its parameters live on, and which module's forward reads a parameter."""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn


@contextlib.contextmanager
def eval_mode(model: nn.Module) -> Iterator[nn.Module]:
    """`model.eval()` for the block; the previous train/eval flag comes back after it."""
    was_training = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(was_training)


def device_of(model: nn.Module) -> torch.device:
    """The device of the model's first parameter (a model lives on one device here)."""
    return next(model.parameters()).device


def forward_readers(model: nn.Module) -> dict[nn.Module, nn.Module]:
    """Each module that holds parameters itself -> the module whose forward reads them:
    itself if it has a forward, else its nearest ancestor that has one (an MoE layer
    reads its expert groups' weights, a ParameterList's owner its entries). Missing
    where no ancestor has a forward."""
    parent: dict[nn.Module, nn.Module] = {}
    for module in model.modules():
        for child in module.children():
            parent[child] = module
    no_forward = nn.Module.forward
    readers: dict[nn.Module, nn.Module] = {}
    for module in model.modules():
        if next(module.parameters(recurse=False), None) is None:
            continue
        owner = module
        while owner is not None and type(owner).forward is no_forward:
            owner = parent.get(owner)
        if owner is not None:
            readers[module] = owner
    return readers
