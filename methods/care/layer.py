"""CaRE's per-layer module: the BR-MoE beside a frozen decoder layer's MLP.

    z' = z_a + MLP(N2 z_a) + sum_{r in S} sum_{e <= r} a^r_e E_e(z_a) + Ebar(z_a)
    a^i = softmax(R_i(c_i) with logits outside the top K set to -100)
    S   = the M routers of lowest H_i = entropy(softmax(C_i(c_i)))
          (training on task t, or its oracle: t plus the M-1 routers i < t of lowest H_i)

z_a is the residual after attention, N2 the layer's own post-attention norm
(moved inside `CareMLP`), c_i the prompt-token mean of E_i(z_a) (or of z_a,
`router_input=residual`). Source: CaRE, ICML 2026, arXiv 2602.03473, code
LMMMEng/CaRE (the paper's ViT block). Differs from the paper/code: sequence-level
routing on prompt tokens replaces the CLS token; one pass at inference (no
`iter_pred`). Details: docs/methods/care.md.

Letters: B batch, T tokens, d width, n triplets in a layer (tasks so far), G
pseudo-classes.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from cl_bench.models.prompt_pool import DECODE, PromptPool, masked_mean

from .args import CareArgs


# ---- pieces ------------------------------------------------------------------------

class RMSNorm(nn.Module):
    """x / rms(x) * weight, normalised in fp32 (as Llama's): (..., d) -> (..., d)."""

    def __init__(self, d: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def _linear(d_in: int, d_out: int, std: float) -> nn.Linear:
    layer = nn.Linear(d_in, d_out)
    nn.init.trunc_normal_(layer.weight, std=std)
    nn.init.zeros_(layer.bias)
    return layer


class Adapter(nn.Module):
    """scale * up(dropout(relu(down(norm(x))))), scale per channel from 0: (..., d) -> (..., d)."""

    def __init__(self, d: int, width: int, dropout: float, eps: float, std: float):
        super().__init__()
        self.norm = RMSNorm(d, eps)
        self.down = _linear(d, width, std)
        self.up = _linear(width, d, std)
        self.drop = nn.Dropout(dropout)
        self.scale = nn.Parameter(torch.zeros(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.up(self.drop(F.relu(self.down(self.norm(x))))) * self.scale


class Triplet(nn.Module):
    """Task i's expert E_i, router R_i (over experts 0..i) and perceiver C_i in one layer."""

    def __init__(self, d: int, n_experts: int, args: CareArgs, eps: float):
        super().__init__()
        self.expert = Adapter(d, args.expert_dim, args.dropout, eps, args.init_std)
        self.router = _linear(d, n_experts, args.init_std)
        self.perceiver_norm = RMSNorm(d, eps)
        nn.init.trunc_normal_(self.perceiver_norm.weight, std=args.init_std)  # the code's init
        self.perceiver = _linear(d, args.pseudo_classes, args.init_std)

    def perceive(self, c: torch.Tensor) -> torch.Tensor:
        """C_i(c): c (B, d) -> logits (B, G), fp32."""
        h = self.perceiver_norm(c.float()).float()
        return F.linear(h, self.perceiver.weight.float(), self.perceiver.bias.float())

    def route(self, c: torch.Tensor, k: int) -> torch.Tensor:
        """R_i(c) with logits outside the top k at -100, softmaxed: (B, d) -> (B, i+1), fp32."""
        logits = F.linear(c.float(), self.router.weight.float(), self.router.bias.float())
        return top_k_softmax(logits, k)


def top_k_softmax(logits: torch.Tensor, k: int) -> torch.Tensor:
    """softmax over the last dim after setting the logits outside the top k to -100 (the code)."""
    if k >= logits.shape[-1]:
        return logits.softmax(dim=-1)
    keep = torch.zeros_like(logits, dtype=torch.bool).scatter(-1, logits.topk(k, dim=-1).indices, True)
    return logits.masked_fill(~keep, -100.0).softmax(dim=-1)


def entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) over the last dim, computed in fp32."""
    logits = logits.float()
    return -(logits.softmax(dim=-1) * logits.log_softmax(dim=-1)).sum(dim=-1)


def select_routers(entropies: torch.Tensor, forced: torch.Tensor | None, m: int) -> torch.Tensor:
    """Which routers each row sums: entropies (B, n) fp32 -> (B, n) of 0/1.
    forced None (inference): the m of lowest entropy. forced (B,) (training on
    task forced[b], or its oracle): forced[b] plus the m-1 routers i < forced[b]
    of lowest entropy."""
    B, n = entropies.shape
    zeros = torch.zeros_like(entropies)
    if forced is None:
        return zeros.scatter(1, entropies.topk(min(m, n), dim=1, largest=False).indices, 1.0)
    sel = F.one_hot(forced, n).to(entropies.dtype)
    past = torch.arange(n, device=entropies.device) < forced.unsqueeze(1)  # (B, n)
    k = min(m - 1, n - 1)
    if k > 0:
        picks = entropies.masked_fill(~past, math.inf).topk(k, dim=1, largest=False).indices
        sel = sel + zeros.scatter(1, picks, 1.0) * past  # a pick outside the past (inf) is dropped
    return sel


# ---- the layer -----------------------------------------------------------------------

@dataclass
class Control:
    """Shared by the method and its layers: how the running forward routes."""

    pool: PromptPool
    forced: torch.Tensor | None = None  # (B,): the router each row must use (training, oracle)
    bypass: bool = False  # the frozen base model alone (pseudo-label features)
    records: list | None = None  # a list: each layer appends its routing record (depth order)


class CareMLP(nn.Module):
    """A decoder layer's MLP slot: MLP(N2 z_a) + routed experts + Ebar; input z_a (B, T, d),
    the layer's post-attention norm N2 moved in here."""

    def __init__(self, norm: nn.Module, mlp: nn.Module, d: int, eps: float, args: CareArgs,
                 control: Control):
        super().__init__()
        self.norm = norm
        self.mlp = mlp
        self.shared = Adapter(d, args.shared_dim, args.dropout, eps, args.init_std)
        self.triplets = nn.ModuleList()
        self.d, self.eps, self.args = d, eps, args
        self.control = control
        self.routing: torch.Tensor | None = None  # (B, n): the last pooled forward's weights

    def keep_rows(self, index: torch.Tensor) -> None:
        """Decoding goes on with rows `index` (b,) of the current ones (cl_bench/eval/generation.py)."""
        if self.routing is not None:
            self.routing = self.routing[index]

    @property
    def routing_weights(self) -> torch.Tensor | None:
        """(B, n) expert weights of the last pooled forward (read by the routing-drift
        probe, cl_bench/eval/probes/routing.py)."""
        return self.routing

    def add_triplet(self) -> None:
        """Task n's triplet; its expert is the mean of experts 0..n-2 when n >= 2 (the code)."""
        n = len(self.triplets)
        like = next(self.shared.parameters())
        triplet = Triplet(self.d, n + 1, self.args, self.eps).to(device=like.device, dtype=like.dtype)
        if n >= 2:
            with torch.no_grad():
                for name, p in triplet.expert.named_parameters():
                    p.copy_(torch.stack([t.expert.get_parameter(name) for t in self.triplets[:n - 1]]).mean(0))
        self.triplets.append(triplet)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        out = self.mlp(self.norm(z))
        control = self.control
        if control.bypass:
            return out
        out = out + self.shared(z)
        n = len(self.triplets)
        if n == 0:
            return out
        experts = torch.stack([t.expert(z) for t in self.triplets])  # (n, B, T, d)
        if control.pool.kind == DECODE:
            weights = self.routing
            if weights is None or weights.shape != (z.shape[0], n):
                raise RuntimeError("CaRE: a decode step without a prefill of this batch before it")
        else:
            mask = control.pool.mask
            if mask is None or mask.shape != z.shape[:2]:
                raise RuntimeError("CaRE: no prompt mask for this forward; call the whole model "
                                   "(its pre-hook sets the mask), not a submodule")
            weights, record = self.route(z, experts, mask, control.forced)
            self.routing = weights.detach()
            if control.records is not None:
                control.records.append(record)
        return out + torch.einsum("nbtd,bn->btd", experts, weights.to(z.dtype))

    def route(self, z: torch.Tensor, experts: torch.Tensor, mask: torch.Tensor,
              forced: torch.Tensor | None) -> tuple[torch.Tensor, dict]:
        """Weights (B, n) of the experts for each row, and the record of the routing."""
        n = len(self.triplets)
        if self.args.router_input == "residual":
            c = masked_mean(z, mask).expand(n, -1, -1)  # (n, B, d)
        else:
            c = torch.stack([masked_mean(e, mask) for e in experts])  # (n, B, d) fp32
        logits = torch.stack([t.perceive(c[i]) for i, t in enumerate(self.triplets)])  # (n, B, G)
        h = entropy(logits).T  # (B, n)
        probs = torch.stack([F.pad(t.route(c[i], self.args.top_k), (0, n - 1 - i))
                             for i, t in enumerate(self.triplets)], dim=1)  # (B, router n, expert n)
        selected = select_routers(h.detach(), forced, self.args.routers)  # (B, n)
        weights = torch.einsum("br,bre->be", selected, probs)  # (B, n)
        return weights, {"perceiver": logits, "entropy": h.detach(), "selected": selected}
