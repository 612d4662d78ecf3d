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

Under DeepSpeed ZeRO-2/3 the optimiser steps flat fp32 partitions, each this
rank's slice of many parameters end to end, so it is handed their layout
(`bind_zero_layout`, cl_bench/step_gradients.py's ZeroLayout): m and v are
updated on the partition as above; a ≥2-D parameter held whole by one rank is
filtered there; for one cut over ranks (ZeRO-2: one at each partition boundary;
ZeRO-3: all) the full |m| is assembled on each rank holding part of it (each
rank's slice, zeros elsewhere, one all-reduce per batch of whole matrices), S
taken from it exactly as on whole parameters, and this rank's slice of S
applied; < 2-D parameters move fully. The numbers are the torch backend's up to
the order of the gradient sums. The authors' code under accelerate + ZeRO-2
gives every parameter its own param group, so each group's flat partition is a
rank's slice of one parameter and the top-k is taken per slice (ties as above):
S depends on the number of ranks there, not here.

Cost: AdamW's memory plus one top-k over |m| per tensor per step (on 2 CPU
cores about 0.6 s for a 28M-entry embedding). Under ZeRO, per step, an
all-reduce of the cut matrices' |m| (ZeRO-3: every matrix, about the traffic of
ZeRO's own step), a buffer of up to BATCH_NUMEL fp32 values at a time, and the
top-k of each cut matrix on every rank holding part of it: the top-k work
shrinks with more ranks under ZeRO-2 only.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from cl_bench.errors import UserError
from cl_bench.method import Method, MethodArgs
from cl_bench.registry import register_method
from cl_bench.step_gradients import Segment, ZeroLayout

# Under ZeRO, the values (fp32) of the matrices assembled per all-reduce: whole
# matrices, so a larger one goes alone.
BATCH_NUMEL = 1 << 24


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
        self.zero_layout: ZeroLayout | None = None

    def bind_zero_layout(self, layout: ZeroLayout | None) -> None:
        """Under ZeRO (backends/zero_engine.py) the tensors stepped are flat partitions:
        `layout` says which slice of which parameter each holds; None: parameters again."""
        self.zero_layout = layout

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
                # a float, as Adam takes it: ZeRO's carried state holds a float32 tensor, whose powers round otherwise
                m, v, t = state["exp_avg"], state["exp_avg_sq"], float(state["step"])
                # The arithmetic follows torch.optim.Adam's single-tensor path, so α = 1
                # reproduces it bit for bit.
                m.lerp_(grad, 1 - beta1)
                v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                if group["weight_decay"]:
                    p.mul_(1 - lr * group["weight_decay"])
                step_size = lr / (1 - beta1 ** t)
                denom = (v.sqrt() / (1 - beta2 ** t) ** 0.5).add_(eps)
                if self.zero_layout is not None:
                    numerator = self._filtered_flat(m, self.zero_layout.segments[p], group["alpha"])
                elif p.dim() >= 2:
                    # Unchosen entries get a zero numerator: P + (−lr·0)/d = P exactly.
                    keep = top_k(m.abs().flatten(), group["alpha"])
                    numerator = torch.where(keep.view_as(p), m, torch.zeros_like(m))
                else:
                    numerator = m
                p.addcdiv_(numerator, denom, value=-step_size)
        return loss

    def _filtered_flat(self, m: torch.Tensor, segments: list[Segment], alpha: float) -> torch.Tensor:
        """m of a flat partition with 0 outside the top-k of each matrix it holds part of:
        a matrix held whole by one rank is filtered there; the |m| of one cut over ranks
        is assembled whole on each of them (each rank's slice, zeros elsewhere, summed
        over the ranks: exact), a batch of such matrices per all-reduce, which every
        rank makes alike, in the same order, whatever it holds."""
        numerator = m.clone()
        matrices = [s for s in segments if len(s.shape) >= 2]
        for s in matrices:
            if s.ranks == 1 and s.numel:
                keep = top_k(m[s.offset:s.offset + s.numel].abs(), alpha)
                numerator[s.offset:s.offset + s.numel].masked_fill_(~keep, 0)
        for batch in _batches([s for s in matrices if s.ranks > 1]):
            sizes = [s.shape.numel() for s in batch]
            starts = [sum(sizes[:i]) for i in range(len(batch))]
            full = m.new_zeros(sum(sizes))
            for s, at in zip(batch, starts):
                full[at + s.start:at + s.start + s.numel] = m[s.offset:s.offset + s.numel].abs()
            self.zero_layout.all_reduce(full)
            for s, at, size in zip(batch, starts, sizes):
                if s.numel:
                    keep = top_k(full[at:at + size], alpha)[s.start:s.start + s.numel]
                    numerator[s.offset:s.offset + s.numel].masked_fill_(~keep, 0)
        return numerator


def top_k(magnitudes: torch.Tensor, alpha: float) -> torch.Tensor:
    """The mask of the ⌊α·numel⌋ largest of flat `magnitudes` (|m| of one tensor)."""
    keep = torch.zeros(magnitudes.numel(), dtype=torch.bool, device=magnitudes.device)
    keep[magnitudes.topk(math.floor(alpha * magnitudes.numel()), sorted=False).indices] = True
    return keep


def _batches(segments: list[Segment]):
    """The segments in order, in runs of whole matrices of at most BATCH_NUMEL values
    (a larger matrix alone)."""
    batch, size = [], 0
    for s in segments:
        if batch and size + s.shape.numel() > BATCH_NUMEL:
            yield batch
            batch, size = [], 0
        batch.append(s)
        size += s.shape.numel()
    if batch:
        yield batch


@register_method("mofo")
class MoFO(Method):
    description = "MoFO: Adam moving only the top-α fraction of each weight matrix by |momentum| per step"
    lr_family = "full"
    Args = MoFOArgs

    def make_optimizer(self, groups: list[dict]) -> torch.optim.Optimizer:
        a = self.args
        return MomentumFilteredAdam(groups, lr=a.lr, betas=(a.beta1, a.beta2), eps=a.eps,
                                    weight_decay=a.weight_decay, alpha=a.alpha)
