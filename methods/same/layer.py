"""SAME's routed LoRA mixture around one frozen nn.Linear, and the expert scores of
adaptive activation:

    y = W0 x + s * sum_i w_i B_i A_i dropout(x),   s = alpha / r,
    w_b = mean_{t in prompt(b)} softmax(W_G x_{b,t})   (per sequence b; masked and
          renormalised in training, optionally top-k at inference)
    Score = minmax(U) - minmax(F_ref)   (experts with Score < tau_score freeze)

Source: SAME, ICML 2026, arXiv 2602.01990; code LAMDA-CL/Prism.

Differs from the paper/code (why: docs/methods/same.md, "Routing", "3. Adaptive expert activation"):
- routing per sequence over the prompt, in training and inference (the code: one
  vector per batch in training, per sample top-2 at inference); decoding steps
  reuse the prefill's weights;
- a wrapper of nn.Linear, not peft (docs/methods/same.md, "Implementation and cost").
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .subspace import InputCovariance

# Letters: B batch, T sequence, E experts, r r_e, d_in / d_out a linear's widths.

A_STD = 0.01  # the code's A init, N(0, 0.01^2)


class Routing:
    """What the routed linears of one model share during one forward (set by the
    model's forward pre-hook)."""

    def __init__(self):
        self.train = False  # a training forward (SAME.loss): masks apply, statistics collect
        self.reuse = False  # a cached decoding step: each linear reuses its last weights
        self.pool: torch.Tensor | None = None  # (B, T) bool: tokens whose probabilities are averaged
        self.stat: torch.Tensor | None = None  # (B, T) bool: tokens in the statistics
        self.collect = True  # a training forward adds to the statistics (not a rank's padding copy)
        self.shared = False  # each rank sees its share of the step: covariances merge later


class SAMELinear(nn.Module):
    """y = base(x) + s * sum_i w_i B_i A_i dropout(x), w per sequence from this
    linear's router (module docstring). x: (B, T, d_in) -> (B, T, d_out)."""

    def __init__(self, base: nn.Linear, n_experts: int, rank: int, scale: float, dropout: float,
                 infer_top_k: int, routing: Routing):
        super().__init__()
        self.base = base
        self.n_experts, self.rank, self.scale, self.infer_top_k = n_experts, rank, scale, infer_top_k
        self.dropout = nn.Dropout(dropout)
        kw = dict(device=base.weight.device, dtype=base.weight.dtype)
        self.lora_A = nn.ParameterList(nn.Parameter(torch.randn(rank, base.in_features, **kw) * A_STD)
                                       for _ in range(n_experts))
        self.lora_B = nn.ParameterList(nn.Parameter(torch.zeros(base.out_features, rank, **kw))
                                       for _ in range(n_experts))
        router = torch.empty(n_experts, base.in_features, **kw)
        nn.init.kaiming_uniform_(router, a=math.sqrt(5))  # as a bias-free nn.Linear(d_in, E)
        self.router = nn.Parameter(router)
        self.routing = routing
        self.cov: InputCovariance | None = None  # the covariance of this linear's input
        self.collects = False  # this linear adds its input to cov (gate for x, down for h)
        self.weights: torch.Tensor | None = None  # (B, E): the last forward's w (decoding reuses it)
        self.rows: torch.Tensor | None = None  # (b,): the rows of `weights` still decoded (None: all)
        # adaptive activation (method state, saved by SAME.state_dict)
        state = dict(device=base.weight.device)
        self.register_buffer("frozen", torch.zeros(n_experts, dtype=torch.bool, **state), persistent=False)
        self.register_buffer("usage", torch.zeros(n_experts, **state), persistent=False)  # U
        self.register_buffer("importance", torch.zeros(n_experts, **state), persistent=False)  # F
        self.register_buffer("importance_ref", torch.zeros(n_experts, **state), persistent=False)
        self.register_buffer("acc", torch.zeros(2, n_experts + 1, **state), persistent=False)
        # acc[0] = (sum_b p_b, n_seq), acc[1] = (sum_b w_b e_b, n_tok): this step's micro-batches

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        r = self.routing
        if r.reuse:
            w = self.weights
            if w is None or (w.shape[0] if self.rows is None else len(self.rows)) != x.shape[0]:
                raise RuntimeError("SAME: a cached decoding step without the prefill forward of the same "
                                   "batch; run the whole prompt through the model first")
        else:
            w = self._route(x)  # (B, E)
        if r.train:  # frozen experts: no compute, no gradient
            experts = (~self.frozen).nonzero().flatten().tolist()
        elif self.infer_top_k:  # the experts some row of the prefilled batch picked
            experts = (w > 0).any(0).nonzero().flatten().tolist()
        else:
            experts = list(range(self.n_experts))
        if r.reuse and self.rows is not None:
            w = w[self.rows]  # (b, E): the rows still decoded; the experts stay the batch's
        a = torch.cat([self.lora_A[i] for i in experts])  # (n r, d_in)
        b = torch.cat([self.lora_B[i] for i in experts], dim=1)  # (d_out, n r)
        z = self.dropout(x) @ a.T  # (B, T, n r)
        z = z * w[:, experts].repeat_interleave(self.rank, dim=1).unsqueeze(1).to(z.dtype)
        return out + self.scale * (z @ b.T)

    def keep_rows(self, index: torch.Tensor) -> None:
        """Decoding goes on with rows `index` (b,) of the current ones (cl_bench/eval/generation.py)."""
        self.rows = index if self.rows is None else self.rows[index]

    @property
    def routing_weights(self) -> torch.Tensor | None:
        """w (B, E) of the last routed forward (read by the routing-drift probe,
        cl_bench/eval/probes/routing.py)."""
        return self.weights

    def _route(self, x: torch.Tensor) -> torch.Tensor:
        """w (B, E) from the prompt mean of this linear's routing probabilities."""
        r = self.routing
        if r.pool is None:
            raise RuntimeError("SAME: the routed linears need the model's forward pre-hook (call the "
                               "model, not its inner modules)")
        top_k = 0 if r.train else self.infer_top_k
        logits = F.linear(x.float(), self.router.float())  # (B, T, E)
        if top_k:
            logits = logits / self.n_experts  # the code's inference temperature
        pool = r.pool.unsqueeze(-1).float()  # (B, T, 1)
        probs = (logits.softmax(-1) * pool).sum(1) / pool.sum(1)  # (B, E)
        if r.train:
            w = self._train_weights(x, probs)
        elif top_k:
            top, index = probs.topk(top_k, dim=-1)
            w = torch.zeros_like(probs).scatter(-1, index, top / top.sum(-1, keepdim=True))
        else:
            w = probs
        self.weights, self.rows = w.detach(), None
        return w

    def _train_weights(self, x: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        """Masked, renormalised weights; records usage, importance and statistics."""
        keep = (~self.frozen).to(probs.dtype)  # (E,)
        if int(keep.sum()) == 1:
            w = keep.expand_as(probs)  # one survivor: weight 1, no router gradient
        else:
            w = probs * keep
            w = w / w.sum(-1, keepdim=True)
        if not self.routing.collect:
            return w
        with torch.no_grad():
            stat = self.routing.stat
            energy = (x.float().pow(2).sum(-1) * stat).sum(1)  # (B,) sum of ||x||^2
            self.acc[0, :-1] += probs.sum(0)
            self.acc[0, -1] += probs.shape[0]
            self.acc[1, :-1] += (w * energy.unsqueeze(1)).sum(0)
            self.acc[1, -1] += stat.sum()
            if self.collects:
                self.cov.add(x.detach()[stat], self.routing.shared)
        return w

    def end_step(self, ema: float, live: bool) -> None:
        """Fold this step's usage and importance into the EMAs."""
        usage, n_seq = self.acc[0, :-1], self.acc[0, -1]
        energy, n_tok = self.acc[1, :-1], self.acc[1, -1]
        if n_seq > 0:
            self.usage.mul_(ema).add_((1 - ema) * usage / n_seq)
        if n_tok > 0:
            self.importance.mul_(ema).add_((1 - ema) * energy / n_tok)
        if live:
            self.importance_ref.copy_(self.importance)
        self.acc.zero_()


def minmax(v: torch.Tensor) -> torch.Tensor:
    """(v - min) / (max - min); a constant vector maps to 0."""
    span = v.max() - v.min()
    return torch.zeros_like(v) if span <= 0 else (v - v.min()) / span


def activation_scores(usage: torch.Tensor, importance: torch.Tensor) -> torch.Tensor:
    """Score = minmax(U) - minmax(F): low for experts little used now but important before."""
    return minmax(usage) - minmax(importance)
