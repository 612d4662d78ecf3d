"""Small model helpers that methods, analyses and backends share: run a block with
the model in eval mode (its train/eval flag restored afterwards, also on error), the
device its parameters live on, which module's forward reads a parameter, and a
forward with other values in some parameters' place (`substituted`)."""
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


@contextlib.contextmanager
def substituted(model: nn.Module, values: dict[str, torch.Tensor]) -> Iterator[None]:
    """Inside: each parameter of `model` named in `values` (model.named_parameters()'s
    names) holds that value, in its own dtype, during the forward of every module that
    reads it (forward_readers: a tied weight has two, its embedding and its head), and
    its own value again after. The swap happens in forward hooks, inside the window
    where ZeRO-3 has the parameter gathered (its fetch hook runs before the appended
    pre-hook, its release hook after the prepended post-hook), so it is the same on
    every backend; torch.func.functional_call would put plain tensors in the
    parameters' place, which ZeRO-3's fetch hooks cannot gather. Readers nested in
    each other swap once (a count per parameter). For forwards without gradient."""
    params = dict(model.named_parameters())
    unknown = sorted(set(values) - set(params))
    if unknown:
        raise KeyError(f"substituted: no parameter named {unknown[0]!r} in the model")
    wanted = {params[name]: value for name, value in values.items()}
    by_reader: dict[nn.Module, list[tuple[nn.Parameter, torch.Tensor]]] = {}
    for module, reader in forward_readers(model).items():
        pairs = [(p, wanted[p]) for p in module.parameters(recurse=False) if p in wanted]
        by_reader.setdefault(reader, []).extend(pairs)
    held: dict[nn.Parameter, torch.Tensor] = {}  # a parameter's own tensor while swapped out
    depth: dict[nn.Parameter, int] = {}

    def swap_in(pairs):
        def hook(module, args):
            for p, value in pairs:
                depth[p] = depth.get(p, 0) + 1
                if depth[p] == 1:
                    held[p], p.data = p.data, value.to(p.dtype)
        return hook

    def swap_out(pairs):
        def hook(module, args, output):
            for p, _ in pairs:
                depth[p] -= 1
                if depth[p] == 0:
                    p.data = held.pop(p)
        return hook

    handles = []
    try:
        for reader, pairs in by_reader.items():
            if pairs:
                handles.append(reader.register_forward_pre_hook(swap_in(pairs)))
                handles.append(reader.register_forward_hook(swap_out(pairs), prepend=True))
        yield
    finally:
        for handle in handles:
            handle.remove()
        for p, value in held.items():  # a forward that raised between the two hooks
            p.data = value
