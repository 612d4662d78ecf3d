"""The one training loop (cl_bench/backends/loop.py): hook order, token weights,
steps passed over on resume, interleaved replay; and the torch backend through it.
A phase of 5 + 3 rows (two epochs) at batch 2, micro-batch 1: steps 0-2 hold 2, 2
and 1 rows, steps 3-4 hold 2 and 1."""
from __future__ import annotations

import torch

from cl_bench.backends.loop import Job, run_phase, step_key
from cl_bench.config import RunConfig, TrainConfig
from cl_bench.data.encode import Encoder, collate
from cl_bench.data.replay import sample_rows
from cl_bench.method import Stage
from cl_bench.models.loading import byte_tokenizer

TOK = byte_tokenizer()
ENC = Encoder(TOK, 16, 6, "head_tail", 4)
CONFIG = RunConfig(seed=7, train=TrainConfig(batch_size=2, micro_batch_size=1, grad_clip=0.0))
STAGE = Stage(0, [], "t")
EPOCHS = [[ENC.train_example(f"p{i}", "a" * (i + 1)) for i in range(5)],
          [ENC.train_example(f"q{i}", "b") for i in range(3)]]
REPLAY = [ENC.train_example(f"r{i}", "c" * (i + 1)) for i in range(4)]


class Recorder:
    """A method's hooks, each call written to `calls`."""

    def __init__(self, model=None):
        self.model, self.calls = model, []
        self.idle: dict[int, list] = {}  # step -> the parameters idle_parameters names

    def loss(self, micro, step):
        self.calls.append(("loss", step))
        if self.model is None:
            return torch.tensor(1.0), {"nll": float(micro["input_ids"].shape[0])}
        out = self.model(**micro)
        return out.loss, {"nll": float(out.loss.detach())}

    def replay_loss(self, micro, step):
        self.calls.append(("replay_loss", step))
        return self.loss(micro, step)[0], {"nll": 5.0}

    def step_batches(self, step, micro_batches, replay):
        self.calls.append(("step_batches", step, len(micro_batches), replay is not None))

    def before_step(self, step):
        self.calls.append(("before_step", step))

    def after_step(self, step):
        self.calls.append(("after_step", step))

    def idle_parameters(self, step):
        return self.idle.get(step, [])


def test_job_log_sums_weighted_parts_prefixes_replay_and_skips_padding():
    parts: dict[str, float] = {}
    Job({}, 0.25, None, "").log(parts, {"nll": 2.0})
    Job({}, 0.75, None, "").log(parts, {"nll": 4.0})
    Job({}, 1.0, None, "replay_").log(parts, {"nll": 9.0})
    Job({}, 0.0, None, None).log(parts, {"nll": 100.0})
    assert parts == {"nll": 0.25 * 2 + 0.75 * 4, "replay_nll": 9.0}


def test_run_phase_calls_hooks_in_order_and_passes_over_taken_steps():
    """From step 2 on: step_batches with all the step's micro-batches and its replay one,
    each step's micro-batch losses (token-weighted to 1), then its replay micro-batch
    (the draw of its step key), then before_step, the optimiser update, after_step and
    on_step with the step's parts; steps 0-1 compute nothing but their replay draws count."""
    method, seen = Recorder(), []

    def backward(jobs, step, key):
        seen.append((step, key, [(j.prefix, j.weight) for j in jobs], jobs[-1].micro))
        parts: dict[str, float] = {}
        for job in jobs:
            loss, named = job.hook(job.micro, step)
            job.log(parts, named)
        return parts

    def update(parts, idle):
        method.calls.append(("update", dict(parts)))
        parts["grad_norm"] = 1.0

    logged = []
    used = run_phase(method, STAGE, EPOCHS, 0, CONFIG, backward, update, lambda s, p: logged.append((s, p)),
                     REPLAY, start_step=2)
    assert used == 5  # one replay row per step, the 2 passed over included
    assert [s for s, *_ in seen] == [2, 3, 4] and [s for s, _ in logged] == [2, 3, 4]
    expected = []
    for step, n in ((2, 1), (3, 2), (4, 1)):
        expected += [("step_batches", step, n, True)] + [("loss", step)] * n + [
            ("replay_loss", step), ("loss", step), ("before_step", step),
                                            ("update", {"nll": 1.0, "replay_nll": 5.0}), ("after_step", step)]
    assert method.calls == expected
    for step, key, jobs, replay_micro in seen:
        epoch = 0 if step < 3 else 1
        assert key == step_key(7, STAGE, epoch, step) == f"7/t/{epoch}/{step}"
        assert jobs[-1] == ("replay_", 1.0) and abs(sum(w for _, w in jobs[:-1]) - 1) < 1e-9
        drawn = collate(sample_rows(REPLAY, 1, key), 0)
        assert all(torch.equal(drawn[k], replay_micro[k]) for k in drawn)
    assert logged[0][1] == {"nll": 1.0, "replay_nll": 5.0, "grad_norm": 1.0}


def test_torch_backend_runs_the_loop_with_its_optimiser():
    """TorchBackend.train_stage: the loop's hook order, and every step moves the
    weights through the optimiser it was given (clipping logs grad_norm)."""
    from cl_bench.backends.torch_backend import TorchBackend
    from cl_bench.models.loading import tiny_llama

    model, tok, _ = tiny_llama(0)
    method = Recorder(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    config = RunConfig(seed=7, train=TrainConfig(batch_size=2, micro_batch_size=1, grad_clip=1.0))
    backend = TorchBackend(config, torch.device("cpu"))
    rows = [Encoder(tok, 16, 6, "head_tail", 4).train_example(f"p{i}", "answer") for i in range(3)]
    before = [p.detach().clone() for p in model.parameters()]
    logged = []
    assert backend.train_stage(method, optimizer, STAGE, [rows], tok.pad_token_id,
                               lambda s, p: logged.append((s, p))) == 0
    assert method.calls == [("step_batches", 0, 2, False), ("loss", 0), ("loss", 0), ("before_step", 0),
                            ("after_step", 0), ("step_batches", 1, 1, False), ("loss", 1), ("before_step", 1),
                            ("after_step", 1)]
    assert [s for s, _ in logged] == [0, 1] and all(set(p) == {"nll", "grad_norm"} for _, p in logged)
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_torch_backend_leaves_idle_parameters_alone():
    """A parameter the method names idle in a step (Method.idle_parameters: no
    micro-batch reached it) takes no AdamW step there, though before_step gave it a
    (zero) gradient as a method may through ctx.grads: its weight, moments and step
    count stay (the deepspeed backend's zero_engine does the same under ZeRO); and one
    named idle that has a gradient is refused. Mutation caught: the torch update not
    clearing the idle gradients (the parameter moves by its momentum at step 1 and
    counts 2 steps)."""
    import pytest

    from cl_bench.backends.torch_backend import TorchBackend
    from cl_bench.models.loading import tiny_llama
    from cl_bench.step_gradients import StepGradients

    model, tok, _ = tiny_llama(0)
    extra = torch.nn.Parameter(torch.ones(3))  # in the loss at step 0 only
    method = Recorder(model)
    loss = method.loss
    method.loss = lambda micro, step: (lambda lo, parts: (lo + (extra.sum() if step == 0 else 0), parts))(
        *loss(micro, step))
    method.idle = {1: [extra]}
    moved = []
    method.before_step = lambda step: StepGradients().fragments([*model.parameters(), extra])  # zero where None
    method.after_step = lambda step: moved.append(extra.detach().clone())
    optimizer = torch.optim.AdamW([*model.parameters(), extra], lr=0.1)
    config = RunConfig(seed=7, train=TrainConfig(batch_size=2, micro_batch_size=1, grad_clip=1.0))
    rows = [Encoder(tok, 16, 6, "head_tail", 4).train_example(f"p{i}", "answer") for i in range(3)]
    backend = TorchBackend(config, torch.device("cpu"))
    backend.train_stage(method, optimizer, STAGE, [rows], tok.pad_token_id)
    assert not torch.equal(moved[0], torch.ones(3))  # step 0 trained it
    assert torch.equal(moved[1], moved[0]) and float(optimizer.state[extra]["step"]) == 1

    method.idle = {0: [extra]}  # reached at step 0: not idle
    with pytest.raises(RuntimeError, match="idle_parameters named a parameter with a nonzero gradient"):
        backend.train_stage(method, optimizer, STAGE, [rows], tok.pad_token_id)
