"""One behaviour test per forgetting-reduction family, on the tiny random Llama:
a few steps on task A, then on task B, and task A's loss after B is lower than
under the family's plain sequential fine-tuning (SeqFT for the full-weight
methods, LoRA-SeqFT, `lora`, for the adapter methods, which train the same
adapter at the same lr). Each stage runs through the real backend loop
(TorchBackend.train_stage: micro-batches, clipping, the hooks in the harness's
order) and, for a replaying method, the harness's own ReplayBuffer.

Each test names the mutation that makes it fail: the mechanism removed (then the
method is its baseline, or close to it, and the margin is not met). The margins
hold over seeds 0-4 (the tests run seed 0); the losses per seed are in each
test's docstring. OGD has no such test: with its AdamW (as TRACE's) the applied
update is not orthogonal to the stored gradients, and on this model OGD's loss
on A after B is within 0.05 of LoRA-SeqFT's on every seed (issue 27's report)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from cl_bench.backends.torch_backend import TorchBackend
from cl_bench.benchmarks.trace.loader import Example
from cl_bench.config import ReplayConfig
from cl_bench.method import Stage
from cl_bench.data.replay import ReplayBuffer
from helpers import answer_ce, encode, make_method

STEPS_A, STEPS_B = 20, 30  # optimiser steps on each task: one batch of all 8 examples per step
FULL_LR, ADAPTER_LR = 3e-3, 5e-2  # the tiny model learns A (CE 10.8 -> ~1.1, LoRA ~5.0) and SeqFT forgets it

TASK_A = SimpleNamespace(name="A", train=[Example(f"Question: {i} plus {i + 1}? Answer:", f"{2 * i + 1} apples", i)
                                          for i in range(8)])
TASK_B = SimpleNamespace(name="B", train=[Example(f"<s> def f{i}(x):<EOL> y = x * {i}<EOL>", f"return y - {i}", i)
                                          for i in range(8)])


def loss_on_a_after_b(name: str, seed: int = 0, **args) -> float:
    """Train `name` STEPS_A steps on TASK_A, then STEPS_B on TASK_B, through the
    backend (a replaying method with the harness's buffer, 4 examples of A);
    return the answer cross-entropy on TASK_A's examples afterwards (eval mode)."""
    method = make_method(name, seed=seed, **args)
    method.ctx.all_tasks = [TASK_A, TASK_B]
    method.ctx.n_stages = 2
    backend = TorchBackend(method.ctx.config, torch.device("cpu"))
    buffer = ReplayBuffer(ReplayConfig(per_task=4), seed=seed)
    encoder, pad = method.ctx.encoder, method.ctx.pad_id
    optimizer = None
    for index, (task, n_steps) in enumerate(((TASK_A, STEPS_A), (TASK_B, STEPS_B))):
        stage = Stage(index, [task], task.name)
        method.before_task(stage)
        rows = [encoder.train_example(e.prompt, e.answer) for e in task.train]
        replay_rows = None
        if method.uses_replay and len(buffer):  # as the sequencer's interleave policy
            replay_rows = [encoder.train_example(e.prompt, e.answer) for e in buffer.examples()]
        for phase in method.phases(stage):
            method.before_phase(stage, phase)
            optimizer = method.optimizer_for_stage(stage, optimizer)
            backend.train_stage(method, optimizer, stage, [rows] * n_steps, pad,
                                replay_rows=replay_rows if phase.replay else None)
        method.after_task(stage)
        buffer.add_task(task)
    method.model.eval()
    with torch.no_grad():
        return answer_ce(method.model, encode(method, TASK_A.train)).item()


@pytest.fixture(scope="module")
def seqft() -> float:
    """Task A's loss after B under SeqFT (seeds 0-4: 2.97, 2.25, 2.48, 2.31, 2.21;
    after A alone: 1.13, 1.06, 1.03, 1.12, 1.07)."""
    return loss_on_a_after_b("seqft", lr=FULL_LR)


@pytest.fixture(scope="module")
def lora() -> float:
    """Task A's loss after B under LoRA-SeqFT (seeds 0-4: 5.38, 5.28, 5.33, 5.37, 5.25;
    after A alone: 5.10, 4.86, 4.97, 5.15, 5.14)."""
    return loss_on_a_after_b("lora", lr=ADAPTER_LR)


@pytest.mark.slow
def test_ewc_forgets_less_than_seqft(seqft):
    """Catches: EWC's penalty gradient not applied (before_step adding nothing, or
    λ = 0): EWC is then SeqFT exactly. Seeds 0-4, default λ = 1e4: 1.10, 1.42,
    0.99, 1.53, 1.10 against SeqFT's 2.97, 2.25, 2.48, 2.31, 2.21 (least gap 0.78)."""
    assert loss_on_a_after_b("ewc", lr=FULL_LR) < seqft - 0.5


@pytest.mark.slow
def test_lwf_forgets_less_than_seqft(seqft):
    """Catches: LwF's distillation term detached or dropped (LwF is then SeqFT).
    Seeds 0-4, λ = 10: 1.42, 1.22, 1.00, 1.15, 0.96 (least gap to SeqFT 1.03; at
    the default λ = 1 the gap is smaller, 0.3-1.6)."""
    assert loss_on_a_after_b("lwf", lr=FULL_LR, lambda_kl=10.0) < seqft - 0.5


@pytest.mark.slow
def test_replay_forgets_less_than_seqft(seqft):
    """Catches: no replay micro-batches (uses_replay off, or an empty buffer):
    Replay is then SeqFT. Seeds 0-4: 0.40, 0.40, 0.60, 0.30, 0.33 (least gap 1.6)."""
    assert loss_on_a_after_b("replay", lr=FULL_LR) < seqft - 0.5


@pytest.mark.slow
def test_olora_forgets_less_than_lora_seqft(lora):
    """Catches: the orthogonality term removed from O-LoRA's loss (λ1 = 0: a new
    pair per task, old pairs frozen, and no better than LoRA-SeqFT: 5.39, 5.43,
    5.30, 5.36, 5.42). Seeds 0-4, λ1 = 0.5: 5.15, 5.14, 5.03, 4.93, 5.05 against
    LoRA-SeqFT's 5.38, 5.28, 5.33, 5.37, 5.25 (least gap 0.14)."""
    assert loss_on_a_after_b("olora", lr=ADAPTER_LR) < lora - 0.1
