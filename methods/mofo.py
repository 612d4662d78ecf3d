"""MoFO: momentum-filtered Adam; each step moves only the entries with the largest momentum.

Per parameter tensor P at step t (Chen et al., 2024, "MoFO: Momentum-Filtered
Optimizer for Mitigating Forgetting in LLM Fine-Tuning"; YChen-zzz/MoFO):
    m ← β1 m + (1−β1) g,   v ← β2 v + (1−β2) g²          (all entries)
    P ← P · (1 − lr·wd)                                  (all entries)
    P_S ← P_S − lr · m̂_S / (√v̂_S + ε),  m̂ = m/(1−β1^t), v̂ = v/(1−β2^t)
with S the ⌊α·numel(P)⌋ entries of largest |m| in that tensor. Tensors of
fewer than 2 dims (biases, norm weights) always move fully. α = 1 is Adam
exactly (AdamW with wd > 0). Only the Adam moments carry across tasks; MoFO
needs no task boundary.

S comes from `topk` indices, so exactly ⌊α·numel⌋ entries move even when
|m| ties at the threshold. Differences from the official `AdamW_MoFO`
(open_instruct/algorithms_MoFO.py), on purpose or harmless:
- it moves every entry with |m| >= the k-th largest |m|, so ties at the
  threshold move more than the fraction;
- it picks the always-full tensors by name ("bias", "norm") and skips weight
  decay on norm weights; here by shape (< 2 dims: Llama's norm weights, any
  bias) and decay on all entries (moot at the default wd 0);
- it keeps m and v in fp32 whatever the parameter dtype; here they follow the
  parameter (fp32 as cl-bench loads models).

Defaults: α 0.15 (the README's example; its range 5-20%; `finetune.py`
defaults to 0.03), betas (0.9, 0.999), ε 1e-8, wd 0 (the official optimiser's
default 0.1 would shrink the unselected weights every step), lr 1e-5
(TRACE's SeqFT lr; the official runs use 1e-5 or 2e-5). There is no TRACE
implementation of MoFO to differ from.

Cost: AdamW's memory plus one top-k over |m| per tensor per step (on 2 CPU
cores about 0.6 s for a 28M-entry embedding).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from cl_bench.errors import UserError
from cl_bench.method import Method, MethodArgs
from cl_bench.registry import register_method


@dataclass
class MoFOArgs(MethodArgs):
    beta2: float = 0.999  # Adam's, as the official optimiser (SeqFT uses 0.95)
    eps: float = 1e-8
    alpha: float = 0.15  # fraction of each weight matrix updated per step

    def __post_init__(self) -> None:
        if not 0 < self.alpha <= 1:
            raise UserError(f"method_args.alpha={self.alpha} must be in (0, 1]")


class MomentumFilteredAdam(torch.optim.Optimizer):
    """Adam (decoupled weight decay) whose update reaches only the top-α fraction
    of each ≥2-D tensor by |first moment|; see the module docstring."""

    def __init__(self, params, lr: float = 1e-5, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, alpha: float = 0.15):
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha={alpha} must be in (0, 1]")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                      alpha=alpha))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, (beta1, beta2), eps = group["lr"], group["betas"], group["eps"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                m, v, t = state["exp_avg"], state["exp_avg_sq"], state["step"]
                # The arithmetic follows torch.optim.Adam's single-tensor path, so α = 1
                # reproduces it bit for bit.
                m.lerp_(grad, 1 - beta1)
                v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                if group["weight_decay"]:
                    p.mul_(1 - lr * group["weight_decay"])
                step_size = lr / (1 - beta1 ** t)
                denom = (v.sqrt() / (1 - beta2 ** t) ** 0.5).add_(eps)
                if p.dim() >= 2:
                    k = math.floor(group["alpha"] * p.numel())
                    chosen = m.abs().flatten().topk(k, sorted=False).indices
                    keep = torch.zeros(p.numel(), dtype=torch.bool, device=p.device)
                    keep[chosen] = True
                    # Unchosen entries get a zero numerator: P + (−lr·0)/d = P exactly.
                    numerator = torch.where(keep.view_as(p), m, torch.zeros_like(m))
                else:
                    numerator = m
                p.addcdiv_(numerator, denom, value=-step_size)
        return loss


@register_method("mofo")
class MoFO(Method):
    description = "MoFO: Adam moving only the top-α fraction of each weight matrix by |momentum| per step"
    lr_family = "full"
    Args = MoFOArgs
    zero_unsupported = dict.fromkeys((2, 3), (
        "its optimiser picks the top-alpha entries of each weight matrix, but ZeRO hands the optimiser flat "
        "partitions spanning many tensors, so there are no matrices to filter"))

    def make_optimizer(self, groups: list[dict]) -> torch.optim.Optimizer:
        a = self.args
        return MomentumFilteredAdam(groups, lr=a.lr, betas=(a.beta1, a.beta2), eps=a.eps,
                                    weight_decay=a.weight_decay, alpha=a.alpha)
