"""The SAME tests' shared setup: the method on the tiny Llama with a trained look, batches,
and the backend's step by hand."""
from __future__ import annotations

import torch

from cl_bench.method import MethodContext, Stage
from helpers import make_method, random_batch

E = 3
SIZE = 2 * (3 * E * 8 * (64 + 128) + E * (64 + 64 + 128))  # 29184


def make(context=None, **args):
    """SAME set up on the tiny Llama, with its experts and routers moved off their
    init (a trained look: B != 0, so experts and routing matter)."""
    method = make_method("same", context=context or MethodContext.for_shapes(E), **{"n_experts": E, **args})
    model = method.model
    with torch.no_grad():
        g = torch.Generator().manual_seed(1)
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.add_(0.1 * torch.randn(p.shape, generator=g))
            elif "router" in name:
                p.mul_(4)  # sharper routing
    return method, model


def batch(seed=0, prompt=6, length=12):
    """Two rows: prompt tokens labelled -100, the second row right-padded."""
    return random_batch(seed, length, prompt)


def step(method, optimizer, b, i):
    """One optimiser step in the backend's hook order."""
    optimizer.zero_grad(set_to_none=True)
    loss, parts = method.loss(b, i)
    loss.backward()
    method.before_step(i)
    optimizer.step()
    method.after_step(i)
    return parts


def train_task(method, t, n_steps, seed=0, optimizer=None):
    stage = Stage(t, [], f"task {t}")
    method.before_task(stage)
    optimizer = method.optimizer_for_stage(stage, optimizer)
    for i in range(n_steps):
        step(method, optimizer, batch(seed + i), i)
    method.after_task(stage)
    return optimizer


def weights(method):
    """(layer, proj) -> the last forward's routing weights (B, E)."""
    return {(l, p): lin.weights.clone() for l, p, lin in method._wrappers()}
