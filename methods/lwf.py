"""LwF: learning without forgetting, distilling the previous model on new data.

Loss while training task t ≥ 1 (Li & Hoiem, 2017; the LLM form of TRACE's
baseline, done as reference/baselines.md "LwF" recommends):
    L = CE + λ · T² · KL(p_old^T ‖ p_new^T)
p^T = softmax(logits / T) over the vocabulary; "old" is a frozen copy of the
model at the end of task t−1, run online on the same batch (no grad, eval
mode). The KL is summed over the vocabulary and averaged over the answer
positions only: logits at position i predict token i+1, so position i counts
when label i+1 is not -100 (the tokens CE covers). T² keeps the gradient's
scale independent of T (Hinton et al., 2015). Task 0 has no KL. Parts: "lm"
(CE) and "kl" (T²·KL, before λ).

The teacher is not saved: it is built in `before_task` from the model's
current weights, which on resume are the restored weights of the end of the
previous stage.

Differences from TRACE's LwF.py, on purpose:
- TRACE computes kl_div(log_softmax(old/T), softmax(new/T)), i.e. KL(new‖old)
  with the gradient flowing through the target; here KL(old‖new), gradient
  through the student only.
- TRACE has no T² factor, sums over all positions (prompt and padding included)
  and divides by the batch size; here answer positions, token mean.
- TRACE precomputes the teacher's logits for the whole next task (terabytes at
  full scale) and matches them to batches by step index while the sampler
  reshuffles, so teacher and student see different examples; here the teacher
  runs on the same batch.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from cl_bench.losses import answer_forward, answer_logits, distillation_kl
from cl_bench.errors import UserError
from cl_bench.method import Method, MethodArgs, Stage
from cl_bench.registry import register_method


@dataclass
class LwFArgs(MethodArgs):
    lambda_kl: float = 1.0  # weight of the T²·KL term (TRACE: 1)
    temperature: float = 2.0  # T (TRACE: 2)

    def __post_init__(self) -> None:
        if self.lambda_kl < 0:
            raise UserError(f"method_args.lambda_kl={self.lambda_kl} must be >= 0")
        if self.temperature <= 0:
            raise UserError(f"method_args.temperature={self.temperature} must be > 0")


@register_method("lwf")
class LwF(Method):
    description = "LwF: CE + λT²·KL(previous model ‖ model) on answer tokens, online frozen teacher"
    lr_family = "full"
    Args = LwFArgs

    def __init__(self, args: LwFArgs, context):
        super().__init__(args, context)
        self.teacher: torch.nn.Module | None = None

    def before_task(self, stage: Stage) -> None:
        if stage.index == 0:
            return
        self.teacher = None  # free the old copy before making the new one
        self.teacher = copy.deepcopy(self.model).eval().requires_grad_(False)

    def loss(self, batch, step):
        out = answer_forward(self.model, batch)  # logits at the answer positions only
        if self.teacher is None:
            return out.loss, {"lm": out.loss.item(), "kl": 0.0}
        with torch.no_grad():
            old = answer_logits(self.teacher, batch)  # (N, V) at the same positions
        kl = distillation_kl(out.logits, old, None, self.args.temperature)
        return out.loss + self.args.lambda_kl * kl, {"lm": out.loss.item(), "kl": kl.item()}

    def param_report(self) -> dict:
        report = super().param_report()
        if self.teacher is not None:  # the frozen teacher is held beside the model
            report["total"] += sum(p.numel() for p in self.teacher.parameters())
        return report
