"""Gradients of a loss over a task's examples, batch by batch, outside training:
what methods that store something of a finished task compute (EWC's Fisher,
OGD's gradient basis).

    for grads in batch_gradients(model, encoder, examples, params, loss_fn, batch_size):
        ...  # grads[i]: ∂ loss_fn(model, batch) / ∂ params[i], or None if unused

Each batch is `batch_size` consecutive examples, encoded as training rows (the
answer + EOS labelled, as the harness trains), padded with the encoder's pad id
and moved to the model's device. The model's train/eval flag is the caller's:
wrap the loop in `cl_bench.models.modes.eval_mode(model)` for dropout off. One
batch's gradients are computed at a time, so a caller that reduces them (a sum
of squares) holds one model-sized set, not one per example.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import torch
from torch import nn

from cl_bench.data.encode import Encoder, collate
from cl_bench.models.modes import device_of


def batch_gradients(model: nn.Module, encoder: Encoder, examples: Sequence, params: Sequence[torch.Tensor],
                    loss_fn: Callable[[nn.Module, dict[str, torch.Tensor]], torch.Tensor],
                    batch_size: int = 1) -> Iterator[tuple[torch.Tensor | None, ...]]:
    """For each batch of `examples` (objects with .prompt and .answer) in order: the
    gradients of loss_fn(model, batch) w.r.t. `params` (None for one it does not reach)."""
    rows = [encoder.train_example(e.prompt, e.answer) for e in examples]
    device = device_of(model)
    for start in range(0, len(rows), batch_size):
        batch = collate(rows[start:start + batch_size], encoder.tokenizer.pad_token_id)
        batch = {k: v.to(device) for k, v in batch.items()}
        yield torch.autograd.grad(loss_fn(model, batch), list(params), allow_unused=True)
