"""The bilevel-cka tests' shared setup: the method after task 0 on the tiny Llama, batches,
and the pieces several tests measure (losses, pair shares)."""
from __future__ import annotations

import torch

from cl_bench.method import MethodContext, Stage
from cl_bench.models import moe
from helpers import make_method, random_batch

D, K, h = 64, 8, 16
PER_EXPERT = 3 * h * D + D + 1  # gate, up, down + router row and bias


def make(**args):
    """The method after task 0 on the tiny Llama, its experts and rows moved off
    their slices (a trained look), and the stage of task 1 begun. Seeded: the router
    rows of task 0's group come from the global generator."""
    method = make_method("bilevel-cka", context=MethodContext.for_shapes(3), **{"lr": 1e-2, **args})
    model = method.model
    method.before_task(Stage(0, [], "task 0"))
    with torch.no_grad():
        g = torch.Generator().manual_seed(1)
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn(p.shape, generator=g))
    method.after_task(Stage(0, [], "task 0"))
    return method, model


batch = random_batch  # two rows of 12 random ids, the second right-padded


def task_loss(method, b, step):
    """A step's task micro-batch `b` as the harness gives it: step_batches first (the
    outer step's task micro-batch), then the loss."""
    method.step_batches(step, [b], None)
    return method.loss(b, step)


def logits(model, b, method=None, pi=None):
    if pi is not None:
        method._task.set_masks(pi)
    with torch.no_grad():
        return model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits


def train(method, steps, stage, previous=None, log=None):
    """`steps` optimiser steps as the backend takes them: task loss, replay loss, step;
    the optimiser from optimizer_for_stage(stage, previous), as the sequencer asks
    for it. `log`: a list that gets each step's replay parts."""
    optimizer = method.optimizer_for_stage(stage, previous)
    for step in range(steps):
        optimizer.zero_grad()
        loss, _ = task_loss(method, batch(step), step)
        loss.backward()
        loss, parts = method.replay_loss(batch(100 + step), step)
        loss.backward()
        optimizer.step()
        if log is not None:
            log.append(parts)
    return optimizer, parts


def clone_params(method):
    return {f"{i}.{n}": p for i, net in method._task.nets.items() for n, p in net.clones.named_parameters()}


def mean_loss(model, batches):
    """Answer-token CE over `batches`, token-weighted, no gradient."""
    total = tokens = 0
    with torch.no_grad():
        for b in batches:
            n = int((b["labels"] != -100).sum())
            total += float(model(**b).loss) * n
            tokens += n
    return total / tokens


def pair_share(model, batches):
    """Per MoE layer of the (finalised) model: the share of the non-pad tokens of
    `batches` whose top-k holds two experts of one slot, from the layer's own router."""
    shares = []
    for layer in moe.moe_layers(model):
        pairs = tokens = 0
        for b in batches:
            seen = []
            handle = layer.register_forward_pre_hook(lambda module, args: seen.append(args[0]))
            with torch.no_grad():
                model(input_ids=b["input_ids"], attention_mask=b["attention_mask"])
            handle.remove()
            _, _, indices = layer.route(seen[0][b["attention_mask"].bool()])  # (n, k)
            slots = layer.slots()[indices].sort(dim=-1).values
            pairs += int((slots[:, 1:] == slots[:, :-1]).any(dim=-1).sum())
            tokens += indices.shape[0]
        shares.append(pairs / tokens)
    return shares
