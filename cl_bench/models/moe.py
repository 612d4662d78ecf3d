"""The upcycled MoE layer shared by every MoE method (METHODS.md, "The upcycled MoE layer").

A Llama-style SwiGLU MLP  y = W_down(act(W_gate x) * (W_up x))  with W_gate, W_up: [H, d]
and W_down: [d, H] is replaced in place by

    y = shared(x) + sum_{e in top-k(x)} w_e(x) * expert_e(x)

- expert i of a group of K takes rows [i*h, (i+1)*h) of W_gate and W_up and the
  same columns of W_down, h = H / K (a "slice"); the K slices of a group summed
  with weight 1 are the dense MLP exactly. Each expert records the slice it
  came from (its slot, a buffer of its group). Other initialisers:
  cl_bench/models/expert_init.py.
- router: one row (and bias) per expert, softmax over all E experts in fp32,
  top-k, weights renormalised to sum to 1 (no noise, no capacity limit). With
  k = E (dense routing: top_k = experts_per_task over one group, cluster-upcycle's
  teacher) every expert sees every token, and each group runs as one SwiGLU of
  width n*h with its experts' neurons scaled by their weights: no dispatch.
- shared path, two modes (`shared`):
  "swap" (default): the frozen dense MLP with the routed experts' slots taken
  out in proportion to their weights,
      shared(x) = W_down[(act(W_gate x) * W_up x) * (1 - m(x))],
  m(x) in [0, 1]^H being, over the neurons of slot j, the summed weight of the
  chosen experts whose slot is j. A token's chosen experts stand in for their
  own slices of the dense MLP, so while experts equal their slices the layer
  *is* the dense MLP (function-preserving at upcycling, to float rounding), and
  experts get full gradient from the first step. Same cost as the dense MLP.
  "add": dense(x) + s * routed, s a learned per-layer scalar initialised to
  `routed_scale_init`; s = 1 is the paper code's layer, which is not
  function-preserving (dense + routed slices != dense: `cl-bench perf
  upcycle-gap` measures the loss it adds); s = 0 starts as the dense model but
  gives the experts no gradient until s has moved (with Adam, by ~lr a step).
- load balancing (Switch): coef * E * sum_i f_i * P_i, with f_i the share of the
  N*k token->expert assignments that go to expert i (sums to 1, as MegaBlocks;
  Mixtral's f sums to k) and P_i the mean router probability of expert i over
  the N tokens. Never stored on a layer: the training forwards run inside
  `with balancing_losses() as lb:` (cl_bench/models/balancing.py) add their
  term to `lb`; outside such a block none is computed.
- extra experts: `forward`/`route`/`experts_forward` take an optional `extra`
  group routed after the layer's own experts (row E + c scores extra expert c,
  which stands in for the slot `extra.slots[c]`), each behind a gate in [0, 1]
  multiplying its softmax numerator (0: not routable); balancing then counts
  E + sum(gates) live experts (bilevel-cka's supernet).

Experts live in groups (`ExpertGroup`): stacked tensors gate/up [n, h, d] and
down [n, d, h] plus the group's own router rows [n, d] and biases [n]. The
router of a layer is the concatenation of its groups' rows in group order, so
row e always scores expert e: adding a group appends its experts and its rows
together and cannot misalign them (the paper's code appends rows at the end
while inserting experts in the middle, bilevel-reference.md §2). A group is
one parameter set: freezing old experts *and* their router rows is
`group.requires_grad_(False)`, which stays exact under AdamW (masking the
gradient of rows of one shared router matrix would not: carried Adam moments
and weight decay still move masked rows).

Letters: B batch, T sequence, N = B*T tokens, d width, H FFN width, K experts
per group, h = H/K expert width, E experts in the layer, k experts per token.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from cl_bench.run import precision
from cl_bench.errors import UserError
from cl_bench.models import balancing
from cl_bench.models.balancing import BalancingLosses, balancing_losses  # noqa: F401 (re-exported)
from cl_bench.models.expert_init import (ExpertInit, drop_upcycle_experts, drop_upcycle_init,  # noqa: F401
                                         slice_experts, zero_experts)

SHARED_MODES = ("swap", "add")


# ---- the layer ------------------------------------------------------------------

class ExpertGroup(nn.Module):
    """n SwiGLU experts of width h, stacked, with their router rows."""

    def __init__(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
                 router_weight: torch.Tensor, router_bias: torch.Tensor, slots=None):
        super().__init__()
        n, h, d = gate.shape
        assert up.shape == (n, h, d) and down.shape == (n, d, h), (gate.shape, up.shape, down.shape)
        assert router_weight.shape == (n, d) and router_bias.shape == (n,)
        slots = torch.arange(n) if slots is None else torch.as_tensor(slots)
        assert slots.shape == (n,), slots.shape
        self.gate = nn.Parameter(gate)  # (n, h, d)
        self.up = nn.Parameter(up)  # (n, h, d)
        self.down = nn.Parameter(down)  # (n, d, h)
        self.router_weight = nn.Parameter(router_weight)  # (n, d): row i scores expert i
        self.router_bias = nn.Parameter(router_bias)  # (n,)
        # the dense slice each expert stands in for ("swap" shared path)
        self.register_buffer("slots", slots.to(device=gate.device, dtype=torch.long))  # (n,)
        # tokens routed to these experts while their layer's count_reach is set (the
        # training forwards of a step; cl_bench/models/reach.py reads and clears it)
        self.reach = 0

    def __len__(self) -> int:
        return self.gate.shape[0]


class UpcycledMoE(nn.Module):
    """shared(x) + sum over top-k experts; see the module docstring."""

    def __init__(self, dense: nn.Module, k: int = 2, n_per_group: int = 8, lb_coef: float = 0.01,
                 shared: str = "swap", routed_scale_init: float = 1.0):
        super().__init__()
        for name in ("gate_proj", "up_proj", "down_proj", "act_fn"):
            if not hasattr(dense, name):
                raise UserError(f"cannot upcycle {type(dense).__name__}: it has no '{name}'; "
                                f"only Llama-style SwiGLU MLPs (gate_proj/up_proj/down_proj) are supported")
        if any(getattr(dense, n).bias is not None for n in ("gate_proj", "up_proj", "down_proj")):
            raise UserError(f"cannot upcycle {type(dense).__name__} with biases (mlp_bias=True): "
                            f"the down bias does not split into slices")
        H, d = dense.gate_proj.weight.shape
        if H % n_per_group:
            raise UserError(f"FFN width {H} does not split into {n_per_group} experts; "
                            f"choose experts_per_task dividing {H}")
        if shared not in SHARED_MODES:
            raise UserError(f"shared path '{shared}' unknown; choose one of {', '.join(SHARED_MODES)}")
        self.dense = dense.requires_grad_(False)
        self.shared = shared
        self.k = k
        self.n_per_group = n_per_group
        self.lb_coef = lb_coef
        self.d, self.h = d, H // n_per_group
        self.groups = nn.ModuleList()
        self.routed_scale_init = routed_scale_init
        w = dense.gate_proj.weight
        # (1,), not 0-dim: DeepSpeed holds no 0-dim parameter (its engine broadcasts each as bytes)
        self.routed_scale = (nn.Parameter(torch.full((1,), float(routed_scale_init), dtype=w.dtype,
                                                     device=w.device)) if shared == "add" else None)
        # whether the forward counts the tokens it routes to each group (ExpertGroup.reach)
        self.count_reach = False

    def _note_reach(self, per_expert: list[int], groups: list[ExpertGroup]) -> None:
        """Add tokens per expert (router-row order over `groups`: the layer's, then an
        `extra` group's) to each group's count."""
        if not (self.count_reach and torch.is_grad_enabled()):
            return
        start = 0
        for g in groups:
            g.reach += sum(per_expert[start:start + len(g)])
            start += len(g)

    @property
    def n_experts(self) -> int:
        return sum(len(g) for g in self.groups)

    def group_sizes(self) -> list[int]:
        return [len(g) for g in self.groups]

    def add_group(self, init: ExpertInit = slice_experts, router_std: float = 0.02,
                  slots=None) -> list[nn.Parameter]:
        """Append the experts `init` makes (K slices by default) with new router rows
        ~ N(0, router_std) (zeros when 0) and zero biases, so row i of the layer's
        router keeps scoring expert i. `slots`: the dense slice each new expert
        stands in for (default: expert i of the group, slice i). Returns the new
        group's parameters."""
        gate, up, down = init(self.dense, self.n_per_group)
        n = gate.shape[0]
        if gate.shape[1:] != (self.h, self.d):
            raise ValueError(f"new experts have shape {tuple(gate.shape[1:])}, the layer's are "
                             f"{(self.h, self.d)}")
        like = self.dense.gate_proj.weight
        router_weight = like.new_zeros(n, self.d)
        if router_std > 0:
            router_weight.normal_(0.0, router_std)
        if slots is None:
            slots = torch.arange(n) % self.n_per_group
        group = ExpertGroup(gate, up, down, router_weight, like.new_zeros(n), slots)
        self.groups.append(group)
        return list(group.parameters())

    def router_weight(self) -> torch.Tensor:
        return torch.cat([g.router_weight for g in self.groups])  # (E, d)

    def router_bias(self) -> torch.Tensor:
        return torch.cat([g.router_bias for g in self.groups])  # (E,)

    def slots(self) -> torch.Tensor:
        return torch.cat([g.slots for g in self.groups])  # (E,)

    def with_extra(self, extra: ExpertGroup | None) -> list[ExpertGroup]:
        """The layer's groups, then `extra` (routed after them) where given."""
        return list(self.groups) if extra is None else [*self.groups, extra]

    def experts(self, extra: ExpertGroup | None = None) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """(gate [h, d], up [h, d], down [d, h]) of each expert, in router-row order
        (`extra`'s after the layer's). unbind views: their backward is one stack per group;
        in a bf16 evaluation, views of each group's one cached bf16 copy (precision.cast_once)."""
        groups = self.with_extra(extra)
        return [e for g in groups
                for e in zip(*(precision.cast_once(w).unbind(0) for w in (g.gate, g.up, g.down)))]

    def route(self, x: torch.Tensor, extra: ExpertGroup | None = None,
              gates: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: (N, d) -> probs (N, E') fp32, weights (N, k) fp32 summing to 1, indices (N, k);
        E' = E, or E + n with the n experts of `extra` after the layer's. `gates` (n,):
        extra expert c's softmax numerator times gates[c], the softmax taken as
        exp(z - max z) / sum (a gate 0 gives probability 0: never chosen)."""
        n_total = self.n_experts + (len(extra) if extra is not None else 0)
        if self.k > n_total:
            raise ValueError(f"top-{self.k} routing over {n_total} experts")
        weight, bias = self.router_weight(), self.router_bias()  # (E, d), (E,)
        if extra is not None:
            weight = torch.cat([weight, extra.router_weight])  # (E+n, d)
            bias = torch.cat([bias, extra.router_bias])
        logits = F.linear(x.float(), weight.float(), bias.float())
        if gates is None:
            probs = logits.softmax(dim=-1)
        else:
            present = torch.cat([logits.new_ones(self.n_experts), gates.float()])  # (E+n,)
            # the max over every entry keeps exp <= 1 (no inf * 0 at a gate 0); the ratio is the softmax's
            num = (logits - logits.detach().amax(dim=-1, keepdim=True)).exp() * present
            probs = num / num.sum(dim=-1, keepdim=True)
        top, indices = probs.topk(self.k, dim=-1)
        return probs, top / top.sum(dim=-1, keepdim=True), indices

    def balance_loss(self, probs: torch.Tensor, indices: torch.Tensor, n_live: float | None = None) -> torch.Tensor:
        """coef * E * sum_i f_i * P_i (Switch Transformer, Fedus et al. 2021, eq. 4);
        f_i: share of the N*k assignments routed to i; P_i: mean probability of i;
        E: `n_live` where given (experts behind gates count by their gate), else all."""
        E = probs.shape[-1]
        f = torch.bincount(indices.reshape(-1), minlength=E).to(probs.dtype) / indices.numel()
        return self.lb_coef * (E if n_live is None else n_live) * torch.dot(f, probs.mean(dim=0))

    def experts_forward(self, x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor,
                        extra: ExpertGroup | None = None) -> torch.Tensor:
        """sum_j weights[:, j] * expert_{indices[:, j]}(x): `every_expert` where k = E
        (every expert on every token: dense routing, nothing to dispatch), else `dispatch`.
        x: (N, d); weights, indices: (N, k) -> (N, d); indices count `extra` after the layer's."""
        groups = self.with_extra(extra)
        if indices.shape[1] == sum(len(g) for g in groups):
            return self.every_expert(x, torch.zeros_like(weights).scatter_(1, indices, weights), groups)
        return self.dispatch(x, weights, indices, extra)

    def dispatch(self, x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor,
                 extra: ExpertGroup | None = None) -> torch.Tensor:
        """`experts_forward` grouped by expert: the N*k assignments are sorted by expert,
        each expert runs once on its own tokens (experts without tokens are skipped),
        results are added back."""
        experts = self.experts(extra)
        N, k = indices.shape
        flat = indices.reshape(-1)  # (N*k,)
        order = torch.argsort(flat, stable=True)
        token = order // k  # token of each sorted assignment
        counts = torch.bincount(flat, minlength=len(experts)).tolist()
        self._note_reach(counts, self.with_extra(extra))
        xs = x.index_select(0, token)  # (N*k, d), grouped by expert
        outs, start = [], 0
        for (gate, up, down), n in zip(experts, counts):
            if n:
                xe = xs[start:start + n]
                outs.append((self.dense.act_fn(xe @ gate.T) * (xe @ up.T)) @ down.T)  # (n, d)
                start += n
        if not outs:  # no tokens at all
            return torch.zeros_like(x)
        ys = torch.cat(outs) * weights.reshape(-1)[order].unsqueeze(1).to(x.dtype)  # (N*k, d)
        return torch.zeros_like(x).index_add(0, token, ys)

    def every_expert(self, x: torch.Tensor, weights: torch.Tensor, groups: list[ExpertGroup]) -> torch.Tensor:
        """sum_e weights[:, e] * expert_e(x) over every expert of `groups` (in router-row
        order), one SwiGLU of width n*h a group: expert j's neurons [j*h, (j+1)*h) scaled by
        its weight before the down projection (linear, so the same sum), three products a
        group instead of three an expert and no sort, gather or scatter of N*E rows.
        x: (N, d); weights: (N, E) -> (N, d)."""
        self._note_reach([x.shape[0]] * sum(len(g) for g in groups), groups)  # every expert sees every token
        out, start = torch.zeros_like(x), 0
        for g in groups:
            n = len(g)
            gate, up, down = (precision.cast_once(w) for w in (g.gate, g.up, g.down))
            gate, up = gate.reshape(n * self.h, self.d), up.reshape(n * self.h, self.d)  # (n*h, d) views
            down = down.transpose(0, 1).reshape(self.d, n * self.h)  # (d, n*h): column j*h + i is down[j, :, i]
            inter = self.dense.act_fn(F.linear(x, gate)) * F.linear(x, up)  # (N, n*h)
            scale = weights[:, start:start + n].repeat_interleave(self.h, dim=1)  # (N, n*h)
            out = out + F.linear(inter * scale.to(inter.dtype), down)
            start += n
        return out

    def forward(self, x: torch.Tensor, extra: ExpertGroup | None = None,
                gates: torch.Tensor | None = None) -> torch.Tensor:
        """x: (B, T, d) -> (B, T, d); `extra`, `gates`: as `route`."""
        shape = x.shape  # (B, T, d)
        flat = x.reshape(-1, shape[-1])  # (N, d)
        probs, weights, indices = self.route(flat, extra, gates)
        collector = balancing.active()
        if collector is not None and self.training and self.lb_coef > 0:
            live = None if gates is None else self.n_experts + float(gates.detach().sum())
            collector.add(self.balance_loss(probs, indices, live))
        routed = self.experts_forward(flat, weights, indices, extra)
        if self.shared == "add":
            return self.dense(x) + self.routed_scale * routed.reshape(shape)
        return (self.swapped_dense(flat, weights, indices, extra) + routed).reshape(shape)

    def swapped_dense(self, x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor,
                      extra: ExpertGroup | None = None) -> torch.Tensor:
        """The dense MLP with each slot's neurons scaled by 1 - (weight routed to
        experts of that slot). x: (N, d); weights, indices: (N, k) -> (N, d)."""
        dense = self.dense
        slots = self.slots() if extra is None else torch.cat([self.slots(), extra.slots])  # (E',)
        inter = dense.act_fn(dense.gate_proj(x)) * dense.up_proj(x)  # (N, H)
        taken = x.new_zeros(x.shape[0], self.n_per_group)  # (N, K)
        taken.scatter_add_(1, slots[indices], weights.to(x.dtype))
        keep = (1 - taken).repeat_interleave(self.h, dim=1)  # (N, H)
        return dense.down_proj(inter * keep)


# ---- whole models -----------------------------------------------------------------

def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder blocks of a Llama-style model (`model.model.layers`)."""
    for owner in (getattr(model, "model", None), model):
        layers = getattr(owner, "layers", None)
        if isinstance(layers, nn.ModuleList):
            return layers
    raise UserError(f"{type(model).__name__}: no decoder layers found at model.model.layers; "
                    f"only Llama-style causal LMs can be upcycled")


def moe_layers(model: nn.Module) -> list[UpcycledMoE]:
    """The MoE layers of `model`, in depth order."""
    return [m for m in model.modules() if isinstance(m, UpcycledMoE)]


def group_sizes(model: nn.Module) -> list[list[int] | None]:
    """Per decoder layer: the sizes of its expert groups, or None for a dense MLP."""
    return [b.mlp.group_sizes() if isinstance(b.mlp, UpcycledMoE) else None
            for b in decoder_layers(model)]


def experts_per_layer(model: nn.Module) -> list[int] | None:
    """Experts in each decoder layer (0 for a dense MLP); None if no layer is MoE."""
    sizes = group_sizes(model)
    if all(s is None for s in sizes):
        return None
    return [sum(s) if s else 0 for s in sizes]


def _check_layers(n: int, layers) -> list[int]:
    chosen = list(range(n)) if layers is None else list(layers)
    bad = [i for i in chosen if not 0 <= i < n]
    if bad:
        raise UserError(f"MoE layers {bad} out of range: the model has {n} decoder layers (0..{n - 1})")
    return chosen


def upcycle_model(model: nn.Module, layers: list[int] | None = None, k: int = 2, n_per_group: int = 8,
                  lb_coef: float = 0.01, shared: str = "swap", routed_scale_init: float = 1.0,
                  init: ExpertInit = slice_experts, router_std: float = 0.02) -> list[UpcycledMoE]:
    """Replace the MLP of `layers` (default: all) by an UpcycledMoE with one group
    of `n_per_group` experts made by `init`, in place. Returns the new layers."""
    blocks = decoder_layers(model)
    out = []
    for i in _check_layers(len(blocks), layers):
        if isinstance(blocks[i].mlp, UpcycledMoE):
            raise ValueError(f"decoder layer {i} is already upcycled")
        moe = UpcycledMoE(blocks[i].mlp, k, n_per_group, lb_coef, shared, routed_scale_init)
        moe.add_group(init, router_std)
        blocks[i].mlp = moe
        out.append(moe)
    return out


def rebuild(model: nn.Module, layout: list, *, k: int = 2, n_per_group: int = 8, lb_coef: float = 0.01,
            shared: str = "swap", routed_scale_init: float = 1.0) -> list[UpcycledMoE]:
    """Give `model` the architecture `layout` so a saved state_dict loads into it.
    layout[i] per decoder layer: None or 0 (dense), an int (that many experts, in
    groups of n_per_group) or a list of group sizes. Layers already upcycled keep
    their groups and grow to the layout; weights are zero placeholders."""
    blocks = decoder_layers(model)
    if len(layout) != len(blocks):
        raise ValueError(f"layout has {len(layout)} entries, the model {len(blocks)} decoder layers")
    for i, (block, want) in enumerate(zip(blocks, layout)):
        if isinstance(want, int):
            if want % n_per_group:
                raise ValueError(f"layer {i}: {want} experts are not groups of {n_per_group}; "
                                 f"give the group sizes")
            want = [n_per_group] * (want // n_per_group)
        if not want:
            if isinstance(block.mlp, UpcycledMoE):
                raise ValueError(f"layer {i} is upcycled but the layout says dense")
            continue
        if not isinstance(block.mlp, UpcycledMoE):
            block.mlp = UpcycledMoE(block.mlp, k, n_per_group, lb_coef, shared, routed_scale_init)
        have = block.mlp.group_sizes()
        if have != list(want[:len(have)]):
            raise ValueError(f"layer {i} has groups {have}, which are not a prefix of {list(want)}")
        for n in want[len(have):]:
            block.mlp.add_group(functools.partial(zero_experts, n=n), router_std=0.0)
    return moe_layers(model)
