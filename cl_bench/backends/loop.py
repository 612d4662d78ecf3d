"""The loop of one training phase, the same on every backend. For each epoch e (rows
in epoch_order(seed, stage, e)), each optimiser step s of `steps` (train.batch_size
rows in micro-batches of train.micro_batch_size):

    jobs:  one per micro-batch, weight = its share of the step's answer tokens,
           hook = method.loss; with interleaved replay, one more micro-batch of
           sample_rows(replay_rows, micro_batch_size, step_key) at weight 1 through
           method.replay_loss
    method.step_batches(s, micro-batches, replay micro-batch)   (every rank, all of them)
    backward(jobs, s, step_key)  -> the step's logged parts     (the backend's)
    method.before_step(s) -> update(parts, method.idle_parameters(s)) -> method.after_step(s)
    -> on_step(s, parts)

Steps before `start_step` were taken before an in-stage checkpoint: they are passed
over, their replay draws counted, nothing computed. The backend gives the two
functions that differ: how a step's jobs become gradients (torch: autocast and
backward on this process; deepspeed: a share of the jobs per rank through the
engine) and how the optimiser steps (clipping included; it logs "grad_norm").
"""
from __future__ import annotations

import random
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable

import torch

from cl_bench.config import RunConfig
from cl_bench.data.encode import IGNORE, collate, epoch_order, steps
from cl_bench.data.replay import sample_rows
from cl_bench.method import Method, Stage

StepCallback = Callable[[int, dict[str, float]], None]


@dataclass
class Job:
    """One micro-batch of an optimiser step: its loss hook and weight; parts it logs
    go under `prefix` (None: a padding copy that logs nothing)."""

    micro: dict[str, torch.Tensor]  # input_ids, labels, attention_mask: (B, T), on the CPU
    weight: float  # share of the step's answer tokens (1 for the replay micro-batch)
    hook: Callable  # method.loss or method.replay_loss: (micro, step) -> (loss, parts)
    prefix: str | None  # "": the step's loss parts, token-weighted sums; "replay_": the replay's

    def log(self, parts: dict[str, float], named: dict[str, float]) -> None:
        """Add the parts its hook returned to the step's `parts`."""
        if self.prefix == "":
            for key, value in named.items():
                parts[key] = parts.get(key, 0.0) + value * self.weight
        elif self.prefix:
            parts.update({self.prefix + k: v for k, v in named.items()})


Backward = Callable[[list[Job], int, str], dict[str, float]]  # (jobs, step, step_key) -> parts
# the optimiser step, leaving the idle parameters (Method.idle_parameters) alone; may add "grad_norm" to parts
Update = Callable[[dict[str, float], list[torch.nn.Parameter]], None]


def step_key(seed: int, stage: Stage, epoch: int, step: int) -> str:
    """The key of a step's draws: its replay micro-batch (sample_rows) and each
    micro-batch's forward (`seeded`)."""
    return f"{seed}/{stage.label}/{epoch}/{step}"


@contextmanager
def seeded(key: str, device: torch.device):
    """The draws of one micro-batch's forward (dropout, a method's noise) from a generator
    seeded by its key, `step_key(...)/j` for the step's j-th job: the same on either
    backend and on any number of ranks, whichever rank runs job j. The running stream is
    put back afterwards."""
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices, device_type=device.type):
        torch.manual_seed(random.Random(key).getrandbits(63))
        yield


def run_phase(method: Method, stage: Stage, epochs: list[list[dict]], pad_id: int, config: RunConfig,
              backward: Backward, update: Update, on_step: StepCallback | None = None,
              replay_rows: list[dict] | None = None, start_step: int = 0) -> int:
    """Every optimiser step of one phase (module docstring); `epochs[e]` holds the
    tokenised rows of epoch e. Returns the number of replay examples used, those of
    the steps passed over included."""
    t, seed = config.train, config.seed
    step = replayed = 0
    for epoch, rows in enumerate(epochs):
        order = epoch_order(len(rows), seed, stage.label, epoch)
        for batch in steps(rows, order, t.batch_size, t.micro_batch_size, pad_id):
            key = step_key(seed, stage, epoch, step)
            if step < start_step:
                replayed += len(sample_rows(replay_rows, t.micro_batch_size, key)) if replay_rows else 0
                step += 1
                continue
            jobs = [Job(m, int((m["labels"] != IGNORE).sum()) / max(batch.n_tokens, 1), method.loss, "")
                    for m in batch.micro_batches]
            if replay_rows:
                rows_r = sample_rows(replay_rows, t.micro_batch_size, key)
                jobs.append(Job(collate(rows_r, pad_id), 1.0, method.replay_loss, "replay_"))
                replayed += len(rows_r)
            method.step_batches(step, batch.micro_batches, jobs[-1].micro if replay_rows else None)
            parts = backward(jobs, step, key)
            method.before_step(step)
            update(parts, method.idle_parameters(step))
            method.after_step(step)
            if on_step is not None:
                on_step(step, parts)
            step += 1
    return replayed
