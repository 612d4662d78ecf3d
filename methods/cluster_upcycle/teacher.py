"""The distillation teacher of cluster-upcycle, expert-ensemble self-distillation
(EESD; docs/methods/cluster-upcycle.md, step 5): the model with an EMA of what
trains substituted, run with every MoE layer dense (top-k = E).

Formulas (L_EESD is cl_bench.losses.distillation_kl):
    L_EESD = T^2 * mean over answer tokens of KL(p_teacher || p_student), p = softmax(logits / T)
    y_ens = sum_i g_i^ema E_i^ema(x);  theta_ema <- d theta_ema + (1 - d) theta after every step
Source: cluster-aware upcycling (CAU, CVPR 2026, arXiv 2604.13508; no code).

Differs from the paper (not public; chosen): KL(teacher || student) on answer
tokens, T = 1, weight 1, decay 0.999 per step (from the fp32 weights the optimiser
steps, on any backend); the EMA covers only what trains in
the task (frozen groups enter at their fixed values) and, by default, carries over
from task to task (ema_reset=true restarts it); the seed's layer-local MSE variant
is not implemented.
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn

from cl_bench.losses import answer_logits
from cl_bench.models.modes import substituted
from cl_bench.models.moe import moe_layers
from cl_bench.step_gradients import StepGradients


@contextlib.contextmanager
def dense_routing(model: nn.Module):
    """Every MoE layer routes each token to all of its E experts (top-k = E: the full
    softmax, which already sums to 1) while inside."""
    layers = moe_layers(model)
    saved = [layer.k for layer in layers]
    try:
        for layer in layers:
            layer.k = layer.n_experts
        yield
    finally:
        for layer, k in zip(layers, saved):
            layer.k = k


def sync_ema(model: nn.Module, ema: dict[str, torch.Tensor]
             ) -> tuple[dict[str, torch.Tensor], list[tuple[torch.Tensor, nn.Parameter]]]:
    """The EMA holds exactly the parameters trainable now: those already in `ema`
    keep their average, new ones join at their current value, frozen ones leave
    (the teacher then uses their fixed value, where their EMA would converge).
    Returns the new EMA and its (value, parameter) pairs."""
    params = dict(model.named_parameters())
    ema = {name: ema[name] if name in ema else p.detach().clone()
           for name, p in params.items() if p.requires_grad}
    return ema, [(value, params[name]) for name, value in ema.items()]


def ema_step(pairs: list[tuple[torch.Tensor, nn.Parameter]], decay: float, grads: StepGradients) -> None:
    """value <- d value + (1 - d) p, p the weights the optimiser steps (ZeRO: the fp32
    masters, each rank its fragment, the averages then assembled whole on every rank:
    the teacher runs on whole weights; `grads`: the phase's, cl_bench/step_gradients.py)."""
    with torch.no_grad():
        params = [p for _, p in pairs]
        fragments = grads.fragments(params, grad=False)
        value_of = {id(p): v for v, p in pairs}
        new = {id(f.param): f.of(value_of[id(f.param)]).lerp(f.weight.to(value_of[id(f.param)].dtype), 1 - decay)
               for f in fragments}
        whole = grads.assemble(params, fragments, new)
        for value, p in pairs:
            value.copy_(whole[id(p)].view_as(value))


def teacher_logits(model: nn.Module, ema: dict[str, torch.Tensor],
                   batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """(N, V) logits of the EMA model at the answer positions of `batch` (those the
    student's loss reads: cl_bench/losses.py), every MoE layer dense (no gradient), the
    EMA values swapped in (`substituted`). Run outside the student's
    `balancing_losses()` block: it adds no balancing term."""
    with torch.no_grad(), dense_routing(model), substituted(model, ema):
        return answer_logits(model, batch)
