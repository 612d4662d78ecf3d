"""The single-process PyTorch backend: the optimisation loop of one stage."""
from __future__ import annotations

from typing import Callable

import torch

from cl_bench.run import precision
from cl_bench.backends.base import Backend, replay_key, skipped_replay
from cl_bench.data.encode import IGNORE, collate, epoch_order, steps
from cl_bench.method import Method, Stage
from cl_bench.data.replay import sample_rows

StepCallback = Callable[[int, dict[str, float]], None]


class TorchBackend(Backend):
    name = "torch"

    def train_stage(self, method: Method, optimizer: torch.optim.Optimizer, stage: Stage,
                    epochs: list[list[dict]], pad_id: int,
                    on_step: StepCallback | None = None,
                    replay_rows: list[dict] | None = None, start_step: int = 0) -> int:
        """Run every optimiser step of `stage`; `epochs[e]` holds the tokenised rows of
        epoch e. Micro-batch losses are weighted by their share of the step's answer
        tokens, so a step's gradient does not depend on how it is split. With
        `replay_rows`, each step adds one replay micro-batch through
        `method.replay_loss` (the interleave policy). Forward passes run under the
        training precision's autocast (bf16: fp32 weights, gradients and optimiser
        state). Steps before `start_step` were taken before an in-stage checkpoint:
        they are passed over (their replay draws counted, nothing computed). Returns
        the number of replay examples used."""
        t = self.config.train
        model = method.model
        model.train()
        params = [p for g in optimizer.param_groups for p in g["params"]]
        autocast = lambda: precision.autocast(self.train_precision, self.device)  # noqa: E731
        step = replayed = 0
        for epoch, rows in enumerate(epochs):
            order = epoch_order(len(rows), self.config.seed, stage.label, epoch)
            for batch in steps(rows, order, t.batch_size, t.micro_batch_size, pad_id):
                if step < start_step:
                    replayed += skipped_replay(replay_rows, t.micro_batch_size, self.config.seed, stage, epoch, step)
                    step += 1
                    continue
                optimizer.zero_grad(set_to_none=True)
                parts_sum: dict[str, float] = {}
                for micro in batch.micro_batches:
                    micro = {k: v.to(self.device) for k, v in micro.items()}
                    weight = int((micro["labels"] != IGNORE).sum()) / max(batch.n_tokens, 1)
                    with autocast():
                        loss, parts = method.loss(micro, step)
                    (loss * weight).backward()
                    for key, value in parts.items():
                        parts_sum[key] = parts_sum.get(key, 0.0) + value * weight
                if replay_rows:
                    rows_r = sample_rows(replay_rows, t.micro_batch_size, replay_key(self.config.seed, stage, epoch, step))
                    micro = {k: v.to(self.device) for k, v in collate(rows_r, pad_id).items()}
                    with autocast():
                        loss, parts = method.replay_loss(micro, step)
                    loss.backward()
                    parts_sum.update({f"replay_{k}": v for k, v in parts.items()})
                    replayed += len(rows_r)
                method.before_step(step)
                if t.grad_clip > 0:
                    parts_sum["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(params, t.grad_clip))
                optimizer.step()
                method.after_step(step)
                if on_step is not None:
                    on_step(step, parts_sum)
                step += 1
        return replayed
