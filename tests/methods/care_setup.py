"""The CaRE tests' shared setup: three small tasks, the method on the tiny Llama, batches,
growing and training it as the backend does."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from cl_bench.method import Stage
from helpers import encode, make_method, run_steps

D, G = 64, 8


# ---- helpers ------------------------------------------------------------------------

def _task(name: str, make) -> SimpleNamespace:
    examples = [SimpleNamespace(prompt=p, answer=a, index=i) for i, (p, a) in enumerate(make(i) for i in range(12))]
    return SimpleNamespace(name=name, train=examples[:8], test=examples[8:])


TASKS = [
    _task("math", lambda i: (f"Solve.\nQuestion:\n{i} plus {i % 3}?\nAnswer:", str(i + i % 3))),
    _task("code", lambda i: (f"<s> def f{i}(x):<EOL> y = x * {i}<EOL>", f"return y + {i % 4}")),
    _task("german", lambda i: (f"Vereinfache:\nDer Hund {i} lief nach Hause {i % 5}.\nEinfach:", f"Hund {i}.")),
]


def make(n_tasks: int = 3, **args):
    """CaRE on the tiny Llama with the smoke profile's config and TASKS, set up."""
    method = make_method("care", profile="smoke", tasks=TASKS[:n_tasks], **args)
    return method, method.model


def stage(t: int) -> Stage:
    return Stage(t, [TASKS[t]], TASKS[t].name)


def batch_of(method, task, split="train") -> dict[str, torch.Tensor]:
    return encode(method, getattr(task, split))


def grow(method, n: int) -> None:
    """Begin tasks 0..n-1 without training, then give every adapter a live scale, so
    each expert and the shared adapter contribute (a trained look)."""
    for t in range(n):
        method.before_task(stage(t))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for layer in method.layers:
            for adapter in [layer.shared, *(t.expert for t in layer.triplets)]:
                adapter.scale.copy_(torch.randn(D, generator=g))
            for t in layer.triplets:  # perceivers that are not near-uniform
                t.perceiver_norm.weight.copy_(1 + 0.5 * torch.randn(D, generator=g))
                t.perceiver.weight.mul_(20)


def train(method, st: Stage, steps: int, optimizer=None):
    """`steps` optimiser steps as the backend takes them, on the stage's training batch;
    the optimiser and the last step's loss parts."""
    method.model.train()
    last: dict = {}
    optimizer = run_steps(method, st, batch_of(method, st.tasks[0]), steps, optimizer,
                          on_step=lambda step, loss, parts: last.update(parts))
    return optimizer, last


def snapshot(module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def left_pad(prompts: list[list[int]], pad: int):
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for r, p in enumerate(prompts):
        ids[r, width - len(p):] = torch.tensor(p)
        mask[r, width - len(p):] = 1
    return ids, mask
