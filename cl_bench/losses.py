"""Knowledge distillation on answer tokens, shared by the methods that distil a
teacher into the model being trained (LwF: the previous model; cluster-upcycle:
an EMA of the MoE under dense routing)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from cl_bench.data.encode import IGNORE


def distillation_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor,
                    labels: torch.Tensor, temperature: float) -> torch.Tensor:
    """T² · KL(softmax(teacher/T) ‖ softmax(student/T)), summed over the vocabulary
    and averaged over answer positions, in fp32.

    student_logits, teacher_logits: (B, L, V); labels: (B, L), IGNORE off the answer.
    """
    answer = labels[:, 1:] != IGNORE  # (B, L-1): position i predicts token i+1
    new = student_logits[:, :-1][answer].float() / temperature  # (N, V)
    old = teacher_logits[:, :-1][answer].float() / temperature  # (N, V)
    # kl_div(input, target) = Σ target·(log target − input) = KL(target ‖ input)
    kl = F.kl_div(F.log_softmax(new, dim=-1), F.log_softmax(old, dim=-1), log_target=True,
                  reduction="sum")
    return temperature ** 2 * kl / max(int(answer.sum()), 1)
