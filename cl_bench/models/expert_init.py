"""How the experts of a new MoE group are made from a dense Llama-style SwiGLU MLP
(W_gate, W_up: [H, d], W_down: [d, H]), K experts of width h = H / K at a time:

- `slice_experts`: expert i = rows [i*h, (i+1)*h) of W_gate and W_up and the same
  columns of W_down, copied (the K slices summed with weight 1 are the dense MLP);
- `drop_upcycle_experts`: the slices with floor(r*h) neurons of each expert
  re-drawn from N(mu, sigma) of the entries they replace (Drop-Upcycling,
  Nakamura et al., ICLR 2025; differs from its code: one index set per expert,
  shared by gate rows, up rows and down columns, as the paper, where the code
  draws one per matrix).

An `ExpertInit` maps (dense MLP, K) to gate [n, h, d], up [n, h, d], down [n, d, h]
(cl_bench/models/moe.py, `UpcycledMoE.add_group`).
"""
from __future__ import annotations

import functools
from typing import Callable

import torch
from torch import nn

# (dense MLP, K) -> gate [n, h, d], up [n, h, d], down [n, d, h]
ExpertInit = Callable[[nn.Module, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def slice_experts(dense: nn.Module, n_per_group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The K SwiGLU slices of `dense`, copied: expert i = rows [i*h, (i+1)*h) of
    gate/up, the same columns of down."""
    gate_w = dense.gate_proj.weight.detach()  # (H, d)
    H, d = gate_w.shape
    h = H // n_per_group
    gate = gate_w.reshape(n_per_group, h, d).clone()  # (K, h, d)
    up = dense.up_proj.weight.detach().reshape(n_per_group, h, d).clone()
    down = dense.down_proj.weight.detach().reshape(d, n_per_group, h).permute(1, 0, 2).contiguous()  # (K, d, h)
    return gate, up, down


def drop_upcycle_experts(dense: nn.Module, n_per_group: int, ratio: float = 0.5):
    """Drop-Upcycling (Nakamura et al., 2025) on the slices: in each expert, one
    random set of floor(ratio*h) neurons is re-initialised, shared by the gate
    rows, up rows and down columns (the paper; its code draws a set per matrix).
    Each replaced block is drawn from N(mu, sigma) with mu, sigma the mean and std
    of the entries it replaces, per matrix and expert (as the code's
    `shuffle_and_partially_initialize`)."""
    gate, up, down = slice_experts(dense, n_per_group)
    n, h = gate.shape[0], gate.shape[1]
    n_drop = int(ratio * h)
    for i in range(n):
        idx = torch.randperm(h)[:n_drop].to(gate.device)
        gate[i, idx] = _redraw(gate[i, idx])  # (n_drop, d)
        up[i, idx] = _redraw(up[i, idx])
        down[i][:, idx] = _redraw(down[i][:, idx])  # (d, n_drop)
    return gate, up, down


def drop_upcycle_init(ratio: float) -> ExpertInit:
    return functools.partial(drop_upcycle_experts, ratio=ratio)


def _redraw(w: torch.Tensor) -> torch.Tensor:
    return torch.randn_like(w) * w.std() + w.mean()  # tensors, not .item(): works on meta


def zero_experts(dense: nn.Module, n_per_group: int, n: int):
    """Placeholders of the right shape for `rebuild` (weights are loaded after)."""
    H, d = dense.gate_proj.weight.shape
    h = H // n_per_group
    like = dense.gate_proj.weight
    return (like.new_zeros(n, h, d), like.new_zeros(n, h, d), like.new_zeros(n, d, h))
