"""The bilevel-cka supernet: a candidate layer's MLP during a task t >= 1, the
MoE layer beside a trainable clone of each of its K active experts, each clone
behind a hard mask pi_c in {0, 1}:

    p_e(x) = pi_e exp(z_e(x)) / sum_j pi_j exp(z_j(x)),   pi_e = 1 for the E experts
    pi = onehot(argmax y) + y - sg(y),   y = softmax((alpha + g) / tau),  g ~ Gumbel(0, 1)
    B(r) = 2 (r_target - r) below r_target, sigmoid(r - r_target) at or above it

then top-k, renormalised, and Switch balancing over the E + sum pi live experts:
UpcycledMoE's own route and forward with the clones as its `extra` group and pi
as their gates (cl_bench/models/moe.py). At pi = 0 it is the layer before the
task; at pi = the decisions, the layer Expand deploys, operation for operation.

Source: CKA-guided bilevel MoE upcycling (ICML 2026); straight-through
Gumbel-Softmax: Jang et al., 2017.

supernet=mix (the paper's pair form, not the default): no clone is routable on
its own; the router of the layer chooses as before the task, and an assignment to
the active expert a_c computes pi_c clone_c(x) + (1 - pi_c) a_c(x), on a_c's row:

    y = shared(x) + sum_{e in top-k} w_e [pi_c(e) clone_c(e)(x) + (1 - pi_c(e)) expert_e(x)]

(pi_c(e) = 0 for an expert that is not active). Its Expand deploys that at pi = 1:
the clone's weights take a_c's place (record.py), so deployed = searched.

Differs from the paper/code (why: docs/methods/bilevel-cka.md, "Routing choice"):
- each clone has a router row of its own, N(0, router_std^2), not a copy of its
  expert's row (the code: shared during the search, then mean of rows + noise);
- a clone is added beside its expert, not pi e_new + (1 - pi) e_old (METHODS.md;
  that is supernet=mix, whose Expand then writes the clone over the old expert,
  the one deployment equal to what it searched, where the paper keeps both);
- the balance above target is sigmoid(r - r_target), not sparsity_weight * (r - r_target).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from cl_bench.models import balancing
from cl_bench.models.moe import ExpertGroup, UpcycledMoE, decoder_layers

# Letters: L_c candidate layers, K slots (experts per task), B, T, N, d, E as in moe.py.


def straight_through_gumbel(logits: torch.Tensor, tau: float,
                            generator: torch.Generator | None = None) -> torch.Tensor:
    """Hard straight-through Gumbel-Softmax over the last dim (Jang et al., 2017):
    the forward value is one-hot at argmax(logits + g), exactly; the gradient is
    that of y = softmax((logits + g) / tau). g ~ Gumbel(0, 1) from `generator` (CPU)."""
    u = torch.rand(logits.shape, generator=generator).to(logits.device, logits.dtype)
    g = -torch.log(-torch.log(u.clamp(1e-10, 1 - 1e-7)))
    y = ((logits + g) / tau).softmax(dim=-1)
    hard = F.one_hot(y.argmax(dim=-1), logits.shape[-1]).to(y.dtype)
    return hard + (y - y.detach())  # y - sg(y) is exactly 0 forward: the value stays one-hot


def balance(rate: torch.Tensor, r_target: float) -> torch.Tensor:
    """B(r): 2 (r_target - r) below the target, sigmoid(r - r_target) at or above it."""
    return 2 * (r_target - rate) if rate.item() < r_target else torch.sigmoid(rate - r_target)


class Supernet(nn.Module):
    """A candidate layer's MLP during a task t >= 1: the MoE layer `moe` (its experts
    and rows unchanged and frozen) and `clones`, trainable copies of its active
    experts (clone c of expert active[c], standing in for its slot c), each with a
    router row of its own drawn N(0, router_std^2) from `generator` and bias 0.
    `pi` [K], set before each forward, gates the clones (module docstring): at
    pi = 1 a clone is routed exactly as the expert Expand makes of it. pi None: the
    layer before the task, `moe` alone (the CKA reference: its rounding then does not
    depend on the clones' rows, which a gate 0 leaves out only mathematically).
    form "mix": the paper's pair form instead (module docstring); the clones' rows
    are then unused."""

    def __init__(self, moe: UpcycledMoE, active: list[int], router_std: float, generator: torch.Generator,
                 form: str = "route"):
        super().__init__()
        self.moe = moe
        like = moe.router_weight()  # (E, d)
        index = torch.tensor(active, device=like.device)
        experts = moe.experts()
        stacked = [torch.stack([experts[e][i] for e in active]).detach().clone() for i in range(3)]
        rows = torch.randn(len(active), moe.d, generator=generator) * router_std  # (K, d), drawn on CPU
        self.clones = ExpertGroup(*stacked, rows.to(like), like.new_zeros(len(active)),
                                  slots=moe.slots()[index])  # clone c swaps out what active[c] does
        self.register_buffer("active", index, persistent=False)  # (K,)
        self.form = form
        self.pi = like.new_ones(len(active))  # (K,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.pi is None:
            return self.moe(x)
        if self.form == "mix":
            return self.mixed(x)
        return self.moe(x, self.clones, self.pi)

    def mixed(self, x: torch.Tensor) -> torch.Tensor:
        """supernet=mix: x (B, T, d) -> (B, T, d). Each of the N*k assignments to an
        active expert a_c is split into one to a_c with weight w (1 - pi_c) and one to
        clone c with weight w pi_c; the others keep their expert (a second copy at
        weight 0). The layer's own dispatch and shared path then run on these 2k."""
        moe = self.moe
        shape = x.shape
        flat = x.reshape(-1, shape[-1])  # (N, d)
        probs, weights, indices = moe.route(flat)  # routing as before the task: (N, E), (N, k), (N, k)
        collector = balancing.active()
        if collector is not None and moe.training and moe.lb_coef > 0:
            collector.add(moe.balance_loss(probs, indices))
        lookup = torch.full((moe.n_experts,), -1, dtype=torch.long, device=indices.device)
        lookup[self.active] = torch.arange(len(self.active), device=indices.device)
        slot = lookup[indices]  # (N, k): the slot c an assignment's expert is active in, or -1
        is_active = slot >= 0
        share = torch.where(is_active, self.pi.float()[slot.clamp_min(0)], 0.0)  # (N, k)
        pairs = torch.cat([indices, torch.where(is_active, moe.n_experts + slot.clamp_min(0), indices)], 1)
        mixed = torch.cat([weights * (1 - share), weights * share], 1)  # (N, 2k), sums to 1 per token
        routed = moe.dispatch(flat, mixed, pairs, self.clones)
        if moe.shared == "add":
            return moe.dense(x) + moe.routed_scale * routed.reshape(shape)
        return (moe.swapped_dense(flat, mixed, pairs, self.clones) + routed).reshape(shape)


def pair_shares(model: nn.Module, layers: list[int], batches: list[dict]) -> list[float]:
    """Per decoder layer in `layers` (an UpcycledMoE each): the share of the non-pad
    tokens of `batches` whose top-k holds two experts of one slot (two copies of
    one dense slice). No gradient."""
    blocks = decoder_layers(model)
    inputs: dict[int, torch.Tensor] = {}

    def hook(i):
        def store(module, args):
            inputs[i] = args[0]  # (B, T, d)
        return store

    handles = [blocks[i].mlp.register_forward_pre_hook(hook(i)) for i in layers]
    pairs, tokens = [0] * len(layers), 0
    try:
        with torch.no_grad():
            for b in batches:
                model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], use_cache=False,
                      logits_to_keep=1)  # the FFN inputs are wanted, not the vocabulary logits
                keep = b["attention_mask"].bool()  # (B, T)
                tokens += int(keep.sum())
                for j, i in enumerate(layers):
                    layer = blocks[i].mlp
                    _, _, indices = layer.route(inputs[i][keep])  # (n, k)
                    slots = layer.slots()[indices].sort(dim=-1).values
                    pairs[j] += int((slots[:, 1:] == slots[:, :-1]).any(dim=-1).sum())
    finally:
        for handle in handles:
            handle.remove()
    return [p / max(tokens, 1) for p in pairs]
