"""SAME (ICML 2026, arXiv 2602.01990; code LAMDA-CL/Prism) on decoder LLMs: a LoRA
mixture of per-task experts on the FFN linears with spectral-aware routing,
curvature-aware scaling and adaptive expert activation
(reference/seed-methods.md, section (b): "SAME-LoRA", the faithful variant).

Architecture. Every FFN linear (gate_proj, up_proj, down_proj of every decoder
layer) of the frozen model becomes
    y = W0 x + s * sum_i w_i B_i A_i dropout(x),   s = alpha / r,
    A_i in R^{r_e x d_in},  B_i in R^{d_out x r_e},  i = 0 .. E-1,
with E = T experts from the start (expert t belongs to task t), r_e = 8 (the
code's r = 8 E, alpha = 2 r, so s = 2), A ~ N(0, 0.01^2), B = 0 (the model
starts as the dense one), dropout 0.05 on the experts' input. Each linear has
its own bias-free router W_G in R^{E x d_in} on its own input (gate and up see
the post-attention-norm x, down sees h = silu(W_g x) * (W_u x)). As in the
code, every expert trains in every task unless adaptive activation freezes it;
expert t is the one task t never freezes. W0 and everything outside the
experts and routers stay frozen.

Routing (adaptation: per sequence over the prompt). For sequence b,
    p_b = mean_{t in prompt(b)} softmax(W_G x_{b,t})           (fp32)
and every token of b (prompt and answer) uses w_b. prompt(b) = the tokens with
attention_mask 1 and, in a training forward (labels given), label -100 (the
collator's prompt tokens; answer tokens and EOS never enter the pool). At
generation the prefill forward holds only the prompt (left padded; padding is
out of the pool), and every later one-token forward with a non-empty KV cache
reuses the weights the prefill computed, per row: the same logits as a full
forward over prompt + generated tokens with labels -100 on the prompt (tested).
The pool is non-causal within the prompt, which is exact for whole-prompt
prefill but would not be for chunked prefill.
- Training: w_b = p_b restricted to the experts not frozen by adaptive
  activation and renormalised (soft mixture; frozen experts are not computed
  and get no gradient). A single survivor gets the constant weight 1, so the
  router has no gradient.
- Inference: w_b = p_b (infer_top_k = 0, the default: as in training), or with
  infer_top_k = k the code's rule: p_b from softmax(W_G x / E), top-k,
  renormalised (the code: k = 2).
The code routes differently: in training one soft vector per *batch*, the mean
of softmax(W_G x) over all tokens of the batch, padding included; at inference
per sample over its tokens, top-2. Neither survives KV-cache decoding (the mean
moves with every generated token), so cl-bench routes per sequence over the
prompt in both, as seed-methods.md §3 asks.

1. Spectral-aware routing. Per decoder layer, two uncentred input covariances
(x for gate/up, h for down) accumulate over every task,
    C^t = (a_{t-1} C^{t-1} + n_t Chat^t) / a_t,   a_t = a_{t-1} + n_t
(i.e. the sum of x x^T over all tokens seen so far over their count), from the
training forwards' tokens with attention_mask 1 except each sequence's first
(position 0, the attention sink: seed-methods.md §3). Every R optimiser steps
of a task (from step 0; R from the task's length, "Schedule" below) the top
eigenpairs (lambda_i, v_i) of the running C are recomputed (torch.linalg.eigh;
for inputs wider than 4096, a randomized top-(max_rank + 16) decomposition,
torch.svd_lowrank); k = the
smallest count whose eigenvalues hold >= delta of tr C, capped at max_rank;
V_par = v_1..v_k. Each router gradient G (E x d_in) becomes
    G <- G V_par diag(g) V_par^T + G V_perp V_perp^T = G - (G V_par) diag(1 - g) V_par^T,
    g_i = max(1 - rho, sqrt(lambda_k / lambda_i)),
so high-energy directions shrink by at most rho and V_perp passes unchanged
(the code: g = clamp(sigma_min / sigma, 0.8, 1.2) with sigma a standard
deviation, rho = 0.2; with sigma_min the smallest kept, g <= 1). An update in
V_perp leaves the logits of old inputs about fixed, since V_perp^T x_old ~ 0
(tested). With k = 0 it is the identity.

2. Curvature-aware scaling (from task 1 on). The forgetting proxy
tr(dW C^{t-1} dW^T) gives dW = -eta grad (C^{t-1})^{-1}, approximated by the
damped low-rank inverse
    P = V_k (Lambda_k + mu I)^{-1} V_k^T + mu^{-1} (I - V_k V_k^T),
    G P = G / mu + (G V_k)(diag(1 / (lambda + mu)) - 1 / mu) V_k^T,
with (V_k, Lambda_k) the delta-energy eigenpairs (cap max_rank) of C^{t-1}, the
covariance accumulated over every earlier task, frozen at the end of task t-1.
It multiplies the gradient of every expert's A (the code: A only; not B, not
the router), with the layer's x- or h-covariance. P = I when k = 0, mu = 1
(tested); P = (C + mu I)^{-1} exactly when C has rank k (tested).

`precondition`: "grad" (default, the code) applies both maps to the gradients
before clipping and the AdamW step, which partly undoes them (Adam divides by
the running RMS); "update" applies them to the parameter change of the AdamW
step instead (seed-methods.md §4: the variant to test).

3. Adaptive expert activation, per linear. U_i: EMA(0.95) over optimiser steps
of the batch-mean routing probability p_i (before masking), reset each task.
F_i: EMA(0.95) of w_i ||x||^2 (the weight the expert actually had, times the
input energy, mean over the statistics tokens), carried across tasks. Score =
minmax(U) - minmax(F_ref) (minmax over the E experts; a constant vector maps to
0). From step W of a task on (the warm-up, "Schedule" below), after every
step, experts with Score < tau_score are frozen for the next step (weight 0,
renormalised, no compute, no gradient; AdamW skips them, since their gradient is None), except the task's
own expert t, never frozen. Once every other expert of a linear is frozen, that
linear's masks stay fixed for the rest of the task ("locked"). Masks apply to
training forwards only; inference uses every expert.
`importance`: "previous" (default, the paper's semantics as seed-methods.md §4
recommends: F of earlier tasks, fixed during the task) takes F_ref as the
element-wise running max of F over the ends of all earlier tasks,
    F_ref^0 = 0,   F_ref^{t+1} = max(F_ref^t, F at the end of task t)
(0 at task 0, where the score reduces to minmax(U)). The max, not F at the end
of task t alone: a frozen expert has w_i = 0, so its F decays by 0.95 a step
during the task it is protected in (to 0.95^n), and with F_ref = F_end(t) an
expert important in task t-1 would be unprotected in task t (tested). Nor a
sum or mean over tasks: minmax is scale-free, so a sum is a mean, which dilutes
an expert important to one early task by 1/t; the max keeps the paper's
criterion, "important to some earlier task" (chosen: seed-methods.md gives no
rule across tasks beyond "F frozen from previous tasks"). "live" is the code's:
F also moves with the current task's data and is used as it moves (and decays
for frozen experts, as in the code). With live F,
||x||^2 uncorrelated with routing makes F ~ U, Score ~ 0 and every other
expert frozen at the first mask update: a single survivor, constant weight 1,
and no router gradient for the rest of the task. This is detected and
recorded (below), never silent. Note that minmax over few experts is coarse:
the non-current expert with the lowest U, and the one with the highest F_ref,
always score <= 0, so with E = 3 (the smoke profile) a linear often locks at
its first update whatever the semantics.

Schedule (fitted to the task's length, as bilevel-cka fits its temperature).
The paper's values, warm-up 50 and a refresh every 20 steps, exceed the 8-32
optimiser steps of a cpu-profile task (the committed run never froze an expert).
From the task's step count n (Method.stage_steps, computed in before_task),
    W = min(freeze_warmup, floor(warmup_share * n)),
    R = max(1, min(refresh_every, n // min_refreshes))   (R = refresh_every if min_refreshes = 0),
so the paper's values stay the upper bounds and hold as given once a task is
long enough (n >= 200 and n >= 80 with the defaults; the paper profile on
TRACE's 5000-row release runs >= 785 steps a task), while a short task masks
for its last 75% of steps and gets at least 4 refreshes (n = 8: W = 2, R = 2;
n = 32: W = 8, R = 8). Without a run (n unknown) the arguments are used as given. Both are recorded per task.
warmup_share 0.25 and min_refreshes 4 are chosen (the code's 50 / 20 fit a task
of one epoch over TRACE's 5000 examples: 50 is 16-32% of it at batch 16-32;
4 as bilevel-cka's min_mask_updates).

Records. Per step (metrics.jsonl): lm, frozen (the share of the non-current
experts frozen in this step, over all linears). Per stage (run.json "params"):
n_experts; activation_schedule {steps: n, freeze_warmup: W, refresh_every: R,
refreshes: how many ran}; router_rank {x, h: k per layer at the task's last
refresh}, router_rank_min (the smallest k over the task's refreshes), curvature_rank
(k of C^{t-1} per layer, None at task 0), spectrum {x, h: [lambda_1, lambda_k,
tr C] per layer of C^t at the task's end: mu is the crossover of P, so compare
it with these}; freeze_masks {gate, up, down: per layer, 1 = frozen at the
task's end}, freeze_share (per layer and expert, the share of the task's steps
it was frozen), locked_at (per layer, the step its masks locked, or None),
all_frozen (every linear locked: no router learns) and all_frozen_step;
router_grad_norm {per_step (the norm over every router, before the projection),
mean, max, zero_steps: task 0's first step is one, as every B is still 0 and
routing cannot matter yet}, router_grad_norm_by_layer {gate, up, down: mean per
layer}. A warning is logged when every linear locks.

Defaults and sources. The code (config/methods/same.py): r_e 8, alpha / r 2,
dropout 0.05, gate/up/down, AdamW 2e-4, delta 0.9, mu 0.9, rho 0.2, tau_score
0.1, EMA 0.95, refresh every 20 steps (an upper bound here: "Schedule"), top-2
at inference (infer_top_k=2 gives it). seed-methods.md §3: max_rank 64 (d = 576;
128 for d = 2048), freeze_warmup 50 (an upper bound), statistics without padding
and position 0. Chosen here (no
published value): router init nn.Linear's default (Kaiming-uniform, a = sqrt 5;
the code's router is a bias-free nn.Linear); the constant lr, AdamW betas
(0.9, 0.95) and weight decay 0 of the harness (the code: cosine schedule with
warm-up 0.03, which the harness does not run); the per-step EMA clock (updates
once per optimiser step, not per micro-batch); g as above; the fallback to
every non-pad token when a row has no prompt token. `n_experts` defaults to the
run's task count (E = T, the code's rule); a run with more tasks than experts
is refused.

Where cl-bench differs from the code, and why (seed-methods.md §1, §4):
- per-sequence prompt routing in training and inference (above);
- the covariance is uncentred, accumulated over every task seen, and
  eigendecomposed exactly with sorted eigenpairs (the code: the current batch,
  centred, one randomized range-finder pass, 64 unsorted components, every 20
  steps; the curvature map uses the last such snapshot of the previous task,
  here the accumulated C^{t-1});
- the router projection runs from step 0 (the code: from step 10) and uses
  the running covariance, this task's tokens so far included (the paper's C^t;
  the curvature map uses C^{t-1});
- F is frozen from the previous tasks by default (importance=previous), as
  their running max; masking waits W steps (the code: none);
- the warm-up and the refresh interval shrink with a short task ("Schedule");
- no iter_pred (the paper's short-sequence evaluation trick).

Implementation: `SAMELinear`, a wrapper around each nn.Linear, not peft. peft
holds one adapter per name and mixes active adapters with fixed weights; it has
no router per linear whose output weights the adapters per sequence, and
expert freezing, gradient maps and the routing cache would all reach into its
internals. The wrapper writes the formula above directly (expert i =
`lora_A.i`, `lora_B.i`, router `router`). The covariances and both gradient
maps are cl_bench/subspace.py. The covariances are fp32 d x d per layer and
input (SmolLM2-135M: about 0.3 GB in all; Llama-3.2-1B: 4.6 GB, on the GPU),
kept in the method's checkpoint state. Cost: one x x^T product per linear input
and micro-batch, and one eigendecomposition per covariance at every refresh and
task end (SmolLM2's 1536-wide h: about 0.7 s on one CPU thread, so ~25 s per
refresh over its 30 layers; a cpu-profile task refreshes min_refreshes = 4
times, about 100 s).

Ablations: spectral_routing, curvature_scaling, adaptive_activation = false
turn a mechanism off; with all three off the method is a plain per-sequence
routed LoRA mixture (tested).
"""
from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from cl_bench.data import IGNORE
from cl_bench.errors import UserError
from cl_bench.method import Method, MethodArgs, Stage, lm_loss
from cl_bench.models.moe import decoder_layers
from cl_bench.registry import register_method
from cl_bench.subspace import InputCovariance, Subspace, damped_inverse, spectral_projection

log = logging.getLogger(__name__)

# Letters: B batch, T sequence, E experts, r r_e, d_in / d_out a linear's widths,
# k kept eigen-directions, L decoder layers.

TARGETS = ("gate_proj", "up_proj", "down_proj")
INPUT_OF = {"gate_proj": "x", "up_proj": "x", "down_proj": "h"}  # which covariance each linear reads
PRECONDITION = ("grad", "update")
IMPORTANCE = ("previous", "live")
A_STD = 0.01  # the code's A init, N(0, 0.01^2)


@dataclass
class SAMEArgs(MethodArgs):
    lr: float = 2e-4  # the code's AdamW lr (constant here)
    n_experts: int | None = None  # E; None: the run's number of tasks (the code: E = T)
    expert_rank: int = 8  # r_e (the code: r 64 over 8 tasks, 48/6, 80/10)
    lora_scale: float = 2.0  # alpha / r (the code: 128 / 64)
    dropout: float = 0.05  # on the experts' input
    infer_top_k: int = 0  # 0: infer as trained (soft); k: the code's top-k of softmax(W_G x / E) (k = 2)
    # 1. spectral-aware routing
    spectral_routing: bool = True
    delta: float = 0.9  # energy of C kept in V_par (also for the curvature map)
    max_rank: int = 64  # cap on k (seed-methods.md: 64 at d = 576, 128 at d = 2048)
    rho: float = 0.2  # largest shrink of a router update in V_par
    refresh_every: int = 20  # steps between eigendecompositions (an upper bound: min_refreshes)
    min_refreshes: int = 4  # refreshes a task gets at least (lowers refresh_every); 0: as given
    # 2. curvature-aware scaling
    curvature_scaling: bool = True
    mu: float = 0.9  # damping of P
    precondition: str = "grad"  # grad: on gradients (the code); update: on the AdamW update
    # 3. adaptive expert activation
    adaptive_activation: bool = True
    ema: float = 0.95  # decay of U and F
    tau_score: float = 0.1  # freeze experts with Score below this
    freeze_warmup: int = 50  # steps of a task before any freezing (the code: 0; an upper bound)
    warmup_share: float = 0.25  # warm-up = min(freeze_warmup, floor(warmup_share * the task's steps))
    importance: str = "previous"  # previous: F of earlier tasks (paper); live: F moves now (code)

    def __post_init__(self):
        if self.n_experts is not None and self.n_experts < 1:
            raise UserError(f"method_args.n_experts={self.n_experts} must be >= 1 (or null: one per task)")
        for name in ("expert_rank", "max_rank", "refresh_every"):
            if getattr(self, name) < 1:
                raise UserError(f"method_args.{name}={getattr(self, name)} must be >= 1")
        if self.infer_top_k < 0 or (self.n_experts is not None and self.infer_top_k > self.n_experts):
            raise UserError(f"method_args.infer_top_k={self.infer_top_k} must be in 0..n_experts")
        if not 0 <= self.delta <= 1:
            raise UserError(f"method_args.delta={self.delta} must be in [0, 1]")
        if not 0 <= self.rho <= 1:
            raise UserError(f"method_args.rho={self.rho} must be in [0, 1]")
        if self.mu <= 0:
            raise UserError(f"method_args.mu={self.mu} must be > 0 (P divides by it)")
        if not 0 <= self.ema < 1:
            raise UserError(f"method_args.ema={self.ema} must be in [0, 1)")
        if self.freeze_warmup < 0 or self.min_refreshes < 0 or not 0 <= self.dropout < 1:
            raise UserError("method_args: freeze_warmup and min_refreshes must be >= 0 and dropout in [0, 1)")
        if not 0 <= self.warmup_share <= 1:
            raise UserError(f"method_args.warmup_share={self.warmup_share} must be in [0, 1]")
        if self.precondition not in PRECONDITION:
            raise UserError(f"method_args.precondition={self.precondition!r}: choose one of "
                            f"{', '.join(PRECONDITION)}")
        if self.importance not in IMPORTANCE:
            raise UserError(f"method_args.importance={self.importance!r}: choose one of "
                            f"{', '.join(IMPORTANCE)}")


def activation_schedule(n_steps: int | None, args: SAMEArgs) -> tuple[int, int]:
    """(freeze warm-up, refresh interval) for a task of `n_steps` optimiser steps
    (None: unknown, the arguments as given); see the module docstring, "Schedule"."""
    if n_steps is None:
        return args.freeze_warmup, args.refresh_every
    warmup = min(args.freeze_warmup, math.floor(args.warmup_share * n_steps))
    every = args.refresh_every
    if args.min_refreshes:
        every = max(1, min(every, n_steps // args.min_refreshes))
    return warmup, every


# ---- the routed LoRA mixture ----------------------------------------------------------

class _Routing:
    """What the routed linears of one model share during one forward (set by the
    model's forward pre-hook)."""

    def __init__(self):
        self.train = False  # a training forward (SAME.loss): masks apply, statistics collect
        self.reuse = False  # a cached decoding step: each linear reuses its last weights
        self.pool: torch.Tensor | None = None  # (B, T) bool: tokens whose probabilities are averaged
        self.stat: torch.Tensor | None = None  # (B, T) bool: tokens in the statistics


class SAMELinear(nn.Module):
    """y = base(x) + s * sum_i w_i B_i A_i dropout(x), w per sequence from this
    linear's router (module docstring). x: (B, T, d_in) -> (B, T, d_out)."""

    def __init__(self, base: nn.Linear, n_experts: int, rank: int, scale: float, dropout: float,
                 infer_top_k: int, routing: _Routing):
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
            if w is None or w.shape[0] != x.shape[0]:
                raise RuntimeError("SAME: a cached decoding step without the prefill forward of the same "
                                   "batch; run the whole prompt through the model first")
        else:
            w = self._route(x)  # (B, E)
        if r.train:  # frozen experts: no compute, no gradient
            experts = (~self.frozen).nonzero().flatten().tolist()
        elif self.infer_top_k:  # the experts some row picked
            experts = (w > 0).any(0).nonzero().flatten().tolist()
        else:
            experts = list(range(self.n_experts))
        a = torch.cat([self.lora_A[i] for i in experts])  # (n r, d_in)
        b = torch.cat([self.lora_B[i] for i in experts], dim=1)  # (d_out, n r)
        z = self.dropout(x) @ a.T  # (B, T, n r)
        z = z * w[:, experts].repeat_interleave(self.rank, dim=1).unsqueeze(1).to(z.dtype)
        return out + self.scale * (z @ b.T)

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
        self.weights = w.detach()
        return w

    def _train_weights(self, x: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        """Masked, renormalised weights; records usage, importance and statistics."""
        keep = (~self.frozen).to(probs.dtype)  # (E,)
        if int(keep.sum()) == 1:
            w = keep.expand_as(probs)  # one survivor: weight 1, no router gradient
        else:
            w = probs * keep
            w = w / w.sum(-1, keepdim=True)
        with torch.no_grad():
            stat = self.routing.stat
            energy = (x.float().pow(2).sum(-1) * stat).sum(1)  # (B,) sum of ||x||^2
            self.acc[0, :-1] += probs.sum(0)
            self.acc[0, -1] += probs.shape[0]
            self.acc[1, :-1] += (w * energy.unsqueeze(1)).sum(0)
            self.acc[1, -1] += stat.sum()
            if self.collects:
                self.cov.add(x.detach()[stat])
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


# ---- the method -----------------------------------------------------------------------

@dataclass
class _Task:
    """What one task holds while it trains."""

    index: int
    curvature: list[dict[str, Subspace | None]]  # per layer, C^{t-1}'s subspaces (x, h); [] at task 0
    bases: list[dict[str, Subspace | None]]  # per layer, the router subspaces of the last refresh
    ranks: list[dict[str, list[int]]]  # per layer, k at each refresh
    n_steps: int | None = None  # the task's optimiser steps (Method.stage_steps; None: unknown)
    warmup: int = 0  # freeze warm-up used (activation_schedule)
    refresh_every: int = 1  # refresh interval used (activation_schedule)
    steps: int = 0
    grad_norms: list[float] = dataclasses.field(default_factory=list)  # per step, all routers
    layer_norms: dict[str, torch.Tensor] | None = None  # proj -> (L,) sum over steps
    frozen_steps: dict[str, torch.Tensor] | None = None  # proj -> (L, E) steps frozen
    locked_at: dict[str, list[int | None]] | None = None  # proj -> per layer
    before: dict[int, torch.Tensor] | None = None  # precondition=update: values before the step


@register_method("same")
class SAME(Method):
    description = ("SAME: a LoRA mixture (one expert per task) on gate/up/down with spectral routing, "
                   "curvature scaling and adaptive expert activation")
    Args = SAMEArgs
    zero_unsupported = dict.fromkeys((2, 3), (
        "before_step rewrites router and adapter gradients in .grad (spectral projection, curvature scaling), "
        "which ZeRO partitions, and its input covariances come from each rank's own micro-batches"))

    def __init__(self, args: SAMEArgs, context):
        super().__init__(args, context)
        self._task: _Task | None = None
        self._record: dict[str, Any] | None = None
        self._previous: list[dict[str, Subspace | None]] = []  # per layer: C^{t}'s subspaces at task end

    # ---- setup ---------------------------------------------------------------------------
    def setup(self, model: nn.Module) -> None:
        a = self.args
        n_tasks = len(self.ctx.all_tasks) if self.ctx is not None else None
        self.n_experts = a.n_experts or n_tasks
        if self.n_experts is None:
            raise UserError("same: the number of experts is unknown without a run; set method_args.n_experts")
        if n_tasks is not None and n_tasks > self.n_experts:
            raise UserError(f"same: the run has {n_tasks} tasks but method_args.n_experts={self.n_experts}; "
                            f"SAME needs one expert per task (leave n_experts null)")
        if a.infer_top_k > self.n_experts:
            raise UserError(f"method_args.infer_top_k={a.infer_top_k} exceeds the {self.n_experts} experts")
        model.requires_grad_(False)
        self._routing = _Routing()
        self.linears: list[dict[str, SAMELinear]] = []  # per layer: proj -> wrapper
        self.covs: list[dict[str, InputCovariance]] = []  # per layer: "x", "h"
        for i, block in enumerate(decoder_layers(model)):
            mlp = getattr(block, "mlp", None)
            bases = {name: getattr(mlp, name, None) for name in TARGETS}
            missing = [n for n, m in bases.items() if not isinstance(m, nn.Linear)]
            if missing:
                raise UserError(f"same: layer {i}'s mlp has no nn.Linear {', '.join(missing)}; SAME wraps "
                                f"the SwiGLU FFN of Llama-style models")
            wrapped = {name: SAMELinear(base, self.n_experts, a.expert_rank, a.lora_scale, a.dropout,
                                        a.infer_top_k, self._routing) for name, base in bases.items()}
            covs = {"x": InputCovariance(bases["gate_proj"].in_features),
                    "h": InputCovariance(bases["down_proj"].in_features)}
            for name, layer in wrapped.items():
                layer.cov = covs[INPUT_OF[name]]
                layer.collects = name != "up_proj"  # up reads the same x as gate
                setattr(mlp, name, layer)
            self.linears.append(wrapped)
            self.covs.append(covs)
        model.register_forward_pre_hook(self._before_forward, with_kwargs=True)
        self.model = model

    def _before_forward(self, module, args, kwargs):
        """Set the routing of this forward: reuse at a cached decoding step, else pool
        over the prompt (label -100 within the attention mask)."""
        r = self._routing
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        r.reuse = cache is not None and cache.get_seq_length() > 0
        if r.reuse:
            return None
        ids = kwargs.get("input_ids", args[0] if args else None)
        shape = ids.shape if ids is not None else kwargs["inputs_embeds"].shape[:2]
        device = ids.device if ids is not None else kwargs["inputs_embeds"].device
        mask = kwargs.get("attention_mask")
        mask = torch.ones(shape, dtype=torch.bool, device=device) if mask is None else mask.bool()
        labels = kwargs.get("labels")
        pool = mask if labels is None else mask & (labels == IGNORE)
        r.pool = torch.where(pool.any(1, keepdim=True), pool, mask)  # no prompt token: every token
        r.stat = mask & (mask.cumsum(1) > 1)  # not padding, not a row's first token
        return None

    def _wrappers(self):
        """(layer, proj, wrapper) over every routed linear."""
        return [(l, name, lin) for l, layer in enumerate(self.linears) for name, lin in layer.items()]

    # ---- task start ------------------------------------------------------------------------
    def before_task(self, stage: Stage) -> None:
        t = stage.index
        if t >= self.n_experts:
            raise UserError(f"same: stage {t} has no expert of its own (n_experts={self.n_experts})")
        for _, _, lin in self._wrappers():
            lin.requires_grad_(True)
            lin.base.requires_grad_(False)
            lin.frozen.zero_()
            lin.usage.zero_()
            lin.acc.zero_()
            if self.args.importance == "live":
                lin.importance_ref.copy_(lin.importance)
            # previous: importance_ref holds max over the earlier tasks' F (after_task)
        n_layers, device = len(self.linears), self._device()
        n_steps = self.stage_steps(stage)
        warmup, every = activation_schedule(n_steps, self.args)
        curvature = self._previous if (t > 0 and self.args.curvature_scaling) else []
        self._task = _Task(
            t, [{k: (s.to(device) if s is not None else None) for k, s in c.items()} for c in curvature],
            bases=[{"x": None, "h": None} for _ in range(n_layers)],
            ranks=[{"x": [], "h": []} for _ in range(n_layers)],
            layer_norms={p: torch.zeros(n_layers) for p in TARGETS},
            frozen_steps={p: torch.zeros(n_layers, self.n_experts) for p in TARGETS},
            locked_at={p: [None] * n_layers for p in TARGETS},
            n_steps=n_steps, warmup=warmup, refresh_every=every)
        self._record = None

    # ---- training ------------------------------------------------------------------------
    def loss(self, batch, step):
        self._routing.train = True
        try:
            lm = lm_loss(self.model, batch)
        finally:
            self._routing.train = False
        return lm, {"lm": lm.item(), "frozen": self._frozen_share()}

    def _frozen_share(self) -> float:
        t = self._task.index if self._task is not None else 0
        others = [lin.frozen[[i for i in range(self.n_experts) if i != t]] for _, _, lin in self._wrappers()]
        n = sum(len(o) for o in others)
        return sum(int(o.sum()) for o in others) / n if n else 0.0

    def before_step(self, step: int) -> None:
        task, a = self._task, self.args
        if a.spectral_routing and step % task.refresh_every == 0:
            for l, covs in enumerate(self.covs):
                for key, cov in covs.items():
                    sub = cov.subspace(a.delta, a.max_rank)
                    task.bases[l][key] = sub
                    task.ranks[l][key].append(sub.k if sub is not None else 0)
        total = 0.0
        for l, name, lin in self._wrappers():
            g = lin.router.grad
            norm = 0.0 if g is None else float(g.float().norm())
            task.layer_norms[name][l] += norm
            total += norm ** 2
            task.frozen_steps[name][l] += lin.frozen.float().cpu()
        task.grad_norms.append(math.sqrt(total))
        task.steps += 1
        if a.precondition == "grad":
            for p, transform in self._maps():
                if p.grad is not None:
                    p.grad.copy_(transform(p.grad))
        else:
            task.before = {id(p): p.detach().clone() for p, _ in self._maps() if p.grad is not None}

    def _maps(self):
        """(parameter, map on its gradient or update) for what SAME preconditions:
        every router (spectral projection) and every expert's A (curvature, t >= 1)."""
        task, a = self._task, self.args
        out = []
        for l, name, lin in self._wrappers():
            key = INPUT_OF[name]
            if a.spectral_routing and task.bases[l][key] is not None:
                sub = task.bases[l][key]
                out.append((lin.router, lambda g, sub=sub: spectral_projection(g, sub, a.rho)))
            if task.curvature and task.curvature[l][key] is not None:
                sub = task.curvature[l][key]
                out.extend((A, lambda g, sub=sub: damped_inverse(g, sub, a.mu)) for A in lin.lora_A)
        return out

    def after_step(self, step: int) -> None:
        task, a = self._task, self.args
        if task.before is not None:
            with torch.no_grad():
                for p, transform in self._maps():
                    old = task.before.get(id(p))
                    if old is not None:
                        p.copy_(old + transform(p - old))
            task.before = None
        for l, name, lin in self._wrappers():
            lin.end_step(a.ema, a.importance == "live")
            if a.adaptive_activation and step + 1 >= task.warmup and task.locked_at[name][l] is None:
                self._update_masks(lin, task.index)
                others = [i for i in range(self.n_experts) if i != task.index]
                if others and bool(lin.frozen[others].all()):
                    task.locked_at[name][l] = step + 1  # the first step trained with the locked masks

    def _update_masks(self, lin: SAMELinear, t: int) -> None:
        frozen = activation_scores(lin.usage, lin.importance_ref) < self.args.tau_score
        frozen[t] = False  # the task's own expert always trains
        lin.frozen.copy_(frozen)

    # ---- task end ------------------------------------------------------------------------
    def after_task(self, stage: Stage) -> None:
        a, task = self.args, self._task
        self._previous = [{k: cov.subspace(a.delta, a.max_rank) for k, cov in covs.items()}
                          for covs in self.covs]
        self._record = self._stage_record(task)
        if self._record["all_frozen"]:
            log.warning("same: stage %d: every linear froze all experts but the task's own (from step %s): "
                        "the routers had no gradient from then on", stage.index, self._record["all_frozen_step"])
        for _, _, lin in self._wrappers():
            lin.frozen.zero_()  # inference and the next task start unmasked
            if a.importance == "previous":  # F_ref^{t+1} = max(F_ref^t, F at the end of task t)
                torch.maximum(lin.importance_ref, lin.importance, out=lin.importance_ref)
        self._task = None

    def _stage_record(self, task: _Task) -> dict[str, Any]:
        def per_layer(fn):
            return {key: [fn(prev[key], ranks[key]) for prev, ranks in zip(self._previous, task.ranks)]
                    for key in ("x", "h")}

        steps = max(task.steps, 1)
        locked = [s for p in TARGETS for s in task.locked_at[p]]
        all_frozen = self.n_experts > 1 and all(s is not None for s in locked)
        norms = task.grad_norms
        return {
            "n_experts": self.n_experts,
            "activation_schedule": {"steps": task.n_steps, "freeze_warmup": task.warmup,
                                    "refresh_every": task.refresh_every,
                                    "refreshes": len(task.ranks[0]["x"]) if task.ranks else 0},
            "router_rank": per_layer(lambda sub, ranks: ranks[-1] if ranks else None),
            "router_rank_min": per_layer(lambda sub, ranks: min(ranks) if ranks else None),
            "curvature_rank": ({key: [c[key].k if c[key] is not None else 0 for c in task.curvature]
                                for key in ("x", "h")} if task.curvature else None),
            "spectrum": per_layer(lambda sub, ranks: None if sub is None else
                                  [_round(sub.top), _round(sub.lam[-1]) if sub.k else None, _round(sub.trace)]),
            "freeze_masks": {p: [[int(f) for f in self.linears[l][p].frozen.tolist()]
                                 for l in range(len(self.linears))] for p in TARGETS},
            "freeze_share": {p: [[_round(x / steps) for x in row] for row in task.frozen_steps[p].tolist()]
                             for p in TARGETS},
            "locked_at": dict(task.locked_at),
            "all_frozen": all_frozen,
            "all_frozen_step": max(locked) if all_frozen else None,
            "router_grad_norm": {"per_step": [_round(x) for x in norms],
                                 "mean": _round(sum(norms) / len(norms)) if norms else None,
                                 "max": _round(max(norms)) if norms else None,
                                 "zero_steps": sum(1 for x in norms if x == 0.0)},
            "router_grad_norm_by_layer": {p: [_round(x / steps) for x in task.layer_norms[p].tolist()]
                                          for p in TARGETS},
        }

    # ---- records and resume -----------------------------------------------------------
    def _device(self) -> torch.device:
        return next(self.model.parameters()).device

    def state_dict(self) -> dict[str, Any]:
        return {
            "n_experts": self.n_experts,
            "covs": [{k: cov.state_dict() for k, cov in covs.items()} for covs in self.covs],
            "previous": [{k: None if s is None else dataclasses.asdict(s) for k, s in prev.items()}
                         for prev in self._previous],
            "importance": [{p: lin.importance.clone() for p, lin in layer.items()} for layer in self.linears],
            "importance_ref": [{p: lin.importance_ref.clone() for p, lin in layer.items()}
                               for layer in self.linears],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["n_experts"] != self.n_experts:
            raise UserError(f"same: the checkpoint has {state['n_experts']} experts, this run "
                            f"{self.n_experts}; resume with the original method_args")
        device = self._device()
        for covs, saved in zip(self.covs, state["covs"]):
            for key, cov in covs.items():
                cov.load_state_dict(saved[key])
                if cov.sum is not None:
                    cov.sum = cov.sum.to(device)
        self._previous = [{k: None if s is None else Subspace(**s).to(device) for k, s in prev.items()}
                          for prev in state["previous"]]
        refs = state.get("importance_ref", state["importance"])  # older checkpoints: F at the last task end
        for layer, saved, ref in zip(self.linears, state["importance"], refs):
            for p, lin in layer.items():
                lin.importance.copy_(saved[p])
                lin.importance_ref.copy_(ref[p])

    def param_report(self) -> dict[str, Any]:
        params = list(self.model.parameters())
        total = sum(p.numel() for p in params)
        idle = 0  # expert parameters a token does not touch (top-k inference)
        if self.args.infer_top_k:
            idle = sum((self.n_experts - self.args.infer_top_k) * self.args.expert_rank *
                       (lin.base.in_features + lin.base.out_features) for _, _, lin in self._wrappers())
        return {"total": total,
                "trainable": sum(p.numel() for p in params if p.requires_grad),
                "active_per_token": total - idle,
                # routing varies per sequence: the experts cannot fold into W0
                "deployed": total,
                "experts_per_layer": [self.n_experts] * len(self.linears),
                **(self._record or {})}

    @classmethod
    def param_schedule(cls, model: nn.Module, n_tasks: int, args: SAMEArgs) -> list[dict[str, Any]]:
        """E = n_tasks unless n_experts is set; nothing grows (E experts from the start)."""
        if args.n_experts is None:
            args = dataclasses.replace(args, n_experts=n_tasks)
        return super().param_schedule(model, n_tasks, args)


def _round(x) -> float:
    return float(f"{float(x):.6g}")  # 6 significant digits: router gradients can be tiny
