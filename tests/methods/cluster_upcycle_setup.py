"""The cluster-upcycle tests' shared setup: tasks (and one that must not be read), the method
on the tiny Llama with the smoke config, batches."""
from __future__ import annotations

import random
from types import SimpleNamespace

import torch

from cl_bench.losses import answer_logits
from cl_bench.method import Stage
from helpers import SMOKE_TASKS, batch_of, make_method, trace_example

D, K, h = 64, 8, 16
GROUP = K * 3 * h * D + K * (D + 1)  # one group of one layer: experts + router rows and biases


# ---- helpers ------------------------------------------------------------------------

def make_task(name: str, n: int = 8, seed: int = 0):
    rng = random.Random(seed)
    return SimpleNamespace(name=name, train=[SimpleNamespace(prompt=e["prompt"], answer=e["answer"])
                                             for e in (trace_example(name, rng) for _ in range(n))])


class FutureTask:
    """A task whose data must not be read: any access to its examples fails the test."""

    def __init__(self, name: str):
        self.name = name

    @property
    def train(self):
        raise AssertionError(f"read the data of a later task ({self.name})")

    test = train


def make(tasks=None, **args):
    """The method on the tiny model with the smoke config, set up (dense)."""
    tasks = tasks if tasks is not None else [make_task(n) for n in SMOKE_TASKS]
    return make_method("cluster-upcycle", profile="smoke", tasks=tasks, **args)


def start(method, t: int):
    stage = Stage(t, [method.ctx.all_tasks[t]], method.ctx.all_tasks[t].name)
    method.before_task(stage)
    return stage


def task_batch(method, t: int = 0, n: int = 4) -> dict[str, torch.Tensor]:
    """The first `n` examples of the method's task t."""
    return batch_of(method, method.ctx.all_tasks[t], n)


def logits(model, b):
    """(N, V): the logits at the answer positions of `b` (those the losses read)."""
    with torch.no_grad():
        return answer_logits(model, b)
