"""Two small model helpers that methods and analyses share: run a block with the
model in eval mode (its train/eval flag restored afterwards, also on error), and
the device its parameters live on."""
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
