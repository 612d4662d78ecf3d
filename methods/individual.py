"""Individual FT: a reference row, not a continual method.

For each task a fresh copy of the pretrained model is fine-tuned with SeqFT's
settings (and a fresh optimiser) and evaluated on that task alone, giving the
single-task reference R*_j = R[j][j] (TRACE / LLMCL convention). It is reported
beside the ranked methods, never ranked; BWT is undefined for it.
"""
from __future__ import annotations

import torch

from cl_bench.method import Method, Stage, trainable_groups
from cl_bench.registry import register_method


@register_method("individual")
class Individual(Method):
    description = "Reference: a fresh pretrained model fine-tuned on each task alone (R[j][j] only)"
    lr_family = "full"
    reference = True
    eval_scope = "stage"  # each task's fresh model is scored on that task alone

    def setup(self, model: torch.nn.Module) -> None:
        super().setup(model)
        # The pretrained weights, restored before every task. Kept on the CPU
        # (shapes only on the meta device, for `cl-bench params`).
        self._pretrained = {k: v.detach().to("meta" if v.is_meta else "cpu", copy=True)
                            for k, v in model.state_dict().items()}
        self._tasks_done = 0

    def before_task(self, stage: Stage) -> None:
        self.model.load_state_dict(self._pretrained)
        self._tasks_done = stage.index + 1

    def optimizer_for_stage(self, stage: Stage, previous):
        return self.make_optimizer(trainable_groups(self.model))  # fresh moments for every task

    def param_report(self) -> dict:
        report = super().param_report()
        n = report["total"]
        report["total"] = 2 * n  # the model and the pretrained copy it restarts from
        report["deployed"] = n * self._tasks_done  # one model per task so far
        return report
