"""The single-process PyTorch backend: the optimisation loop of one stage."""
from __future__ import annotations

import torch

from cl_bench.backends.base import Backend
from cl_bench.backends.loop import Job, StepCallback, run_phase, seeded
from cl_bench.method import Method, Stage
from cl_bench.run import precision


class TorchBackend(Backend):
    name = "torch"

    def train_stage(self, method: Method, optimizer: torch.optim.Optimizer, stage: Stage,
                    epochs: list[list[dict]], pad_id: int,
                    on_step: StepCallback | None = None,
                    replay_rows: list[dict] | None = None, start_step: int = 0) -> int:
        """Run every optimiser step of `stage` (cl_bench/backends/loop.py); `epochs[e]`
        holds the tokenised rows of epoch e. Micro-batch losses are weighted by their
        share of the step's answer tokens, so a step's gradient does not depend on how
        it is split. Each micro-batch's forward draws from its own seeded generator
        (loop.seeded), as on the deepspeed backend. With `replay_rows`, each step adds
        one replay micro-batch through `method.replay_loss` (the interleave policy).
        Forward passes run under the training precision's autocast (bf16: fp32 weights,
        gradients and optimiser state). Steps before `start_step` were taken before an
        in-stage checkpoint: they are passed over (their replay draws counted, nothing
        computed). Returns the number of replay examples used."""
        clip = self.config.train.grad_clip
        method.model.train()
        params = [p for g in optimizer.param_groups for p in g["params"]]

        def backward(jobs: list[Job], step: int, key: str) -> dict[str, float]:
            optimizer.zero_grad(set_to_none=True)
            parts: dict[str, float] = {}
            for j, job in enumerate(jobs):
                micro = {k: v.to(self.device) for k, v in job.micro.items()}
                with seeded(f"{key}/{j}", self.device), precision.autocast(self.train_precision, self.device):
                    loss, named = job.hook(micro, step)
                (loss * job.weight).backward()
                job.log(parts, named)
            return parts

        def update(parts: dict[str, float], idle: list[torch.nn.Parameter]) -> None:
            for p in idle:  # AdamW skips a parameter without a gradient (before_step may have made one)
                if p.grad is not None and bool(p.grad.any()):
                    raise RuntimeError(f"{type(method).__name__}.idle_parameters named a parameter with a nonzero "
                                       f"gradient: idle means no micro-batch of the step reached it")
                p.grad = None
            if clip > 0:
                parts["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(params, clip))
            optimizer.step()

        return run_phase(method, stage, epochs, pad_id, self.config, backward, update, on_step, replay_rows,
                         start_step)
