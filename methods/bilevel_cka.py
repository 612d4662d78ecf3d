"""bilevel-cka: CKA-guided bilevel MoE upcycling (ICML 2026), the paper's algorithm
done as METHODS.md ("bilevel-cka") fixes it.

Base: Standard upcycling (methods/upcycle.py): same MoE layer, K = 8 slice experts,
top-2, Switch balancing, frozen dense MLP as the shared path ("swap" by default).
Task 0 is plain upcycling: no mask, no CKA.

Task t >= 1, in each candidate layer l (`candidate_layers`, default every MoE
layer), with A_l = (a_1 .. a_K) the layer's active experts (a_c: the newest
expert standing in for dense slice c; task 0's group at first):

1. Supernet: the layer Expand would deploy, with a switch per clone. a_c and its
   router row r_c stay, frozen (e_old). A trainable clone e_new,c of a_c joins
   the router as one more expert standing in for slot c, with a row of its own,
   r'_c ~ N(0, router_std^2) and bias 0 (as Standard upcycling's new experts;
   drawn from a seeded generator per task). pi_{l,c} in {0, 1} says whether
   clone c is there: the softmax runs over the E experts of the layer and the K
   clones, clone c's numerator multiplied by pi_c,
       p_e(x) = pi_e exp(z_e(x)) / sum_j pi_j exp(z_j(x)),   pi_e = 1 for the E experts,
   then top-k, renormalised, and the balancing loss on the chosen indices (E +
   sum pi live experts), as UpcycledMoE. A clone at pi = 0 has probability 0 and
   is never chosen; at pi = 1 it is routed as the expert Expand makes of it. So
   with every pi = 0 the supernet is the model before the task, and at pi = the
   decisions it is the finalised model, operation for operation (both tested;
   each stage records the loss gap, float rounding).
   Routing choice (issue #9). The clone's row is not a copy of r_c: a copy (the
   earlier design: the clone took over r_c inside the supernet, and r_c and the
   trained copy r'_c both stayed after Expand) scores the clone as a_c, so top-2
   picks the old and the new copy of one slot on every token a_c wins (measured
   on the tiny model, lr 1e-5, 8 steps: 100% of the tokens, rows within 7e-5,
   logits 0.44 from the supernet's), and the deployed model is not the searched
   one. With a row of its own a pair of copies comes at chance rate (recorded:
   pair_share), and the row learns from the task and replay losses which tokens
   to take. Not chosen: the published code's mean(old rows) + N(0, 0.01^2)
   (routers then frozen), which scores every token near the layer's mean logit,
   mostly below the top-2, so the clone gets little traffic or gradient (tiny
   model after task 0, every clone present: 0-2% of the top-2 assignments go to
   clones with such rows, 15-17% with rows of their own); a trained row with an
   lr of its own, which adds an argument and still starts from one of these
   rows; a per-pair old/new choice, which needs a routing rule the deployed
   UpcycledMoE does not have. An Expand adds an expert beside a_c; it no longer
   replaces a_c inside the supernet (METHODS.md's pi * e_new + (1 - pi) * e_old),
   because the deployed model keeps a_c routable.
   Mask logits alpha: [L_cand, K, 2] (recycle, expand); pi = the expand side of a
   hard straight-through Gumbel-Softmax sample,
       y = softmax((alpha + g) / tau),  g ~ Gumbel(0, 1),  pi = onehot(argmax y) + y - sg(y)
   (one-hot forward, soft gradient). d/dpi_c flows through clone c's probability
   (its renormalised top-k weight and the balancing term): a sample with pi_c = 1
   says whether the clone's weight should rise; one with pi_c = 0 says almost
   nothing (the clone is not chosen). Init: p_expand = sigmoid(alpha_e -
   alpha_r) = `init_expand_prob` (0.6), or `mask_init=random`: alpha ~ N(0, 0.1^2).
   Temperature: the hard sample does not depend on tau, and Adam divides each
   update by the running RMS of its gradient, so tau changes neither the forward
   pass nor the step size (about mask_lr per update): it only reweights the
   samples' soft gradients (y_e y_r / tau) against each other inside Adam's moments.
2. Inner step (every optimiser step; masks sampled once per step from alpha,
   alpha itself not trained here):
       L_in = L_task + lambda_CKA * L_CKA + lambda_replay * L_replay
   L_task: answer-token CE + balancing on the task batch; L_replay: CE on the
   step's replay micro-batch (the harness's shared buffer, interleave policy);
       L_CKA = mean_{l in deep} 1 - CKA(Phi_l, Phi_l^old)
   linear CKA (cl_bench/cka.py) over the non-pad tokens of the replay batch (at
   most `cka_max_tokens`, evenly spaced), Phi_l the *output* of decoder layer l
   of the masked forward, with its gradient; Phi_l^old the same layer of the
   model as it was before this task, on the same batch (no gradient). deep:
   `cka_layers`, default the last third of the decoder layers (ceil(L/3)).
3. Outer step every N steps (after the step's task micro-batches, on its replay
   batch), Adam on alpha (lr mask_lr_eff, below; rebuilt each task):
       L_out = L_replay(pi) - gamma * G + beta * B(r),   r = mean(pi)
       G = sg(L_recycle - L_expand) * r
   L_recycle / L_expand: CE of the step's last task micro-batch with every mask
   forced to 0 / 1 (no gradient);
       B(r) = 2 (r_target - r)        if r < r_target
            = sigmoid(r - r_target)    otherwise
   (METHODS.md writes "beta * L_balance, L_balance = 2 beta (r_target - r) below
   target": read here as one beta, so the term below target is 2 beta (r_target - r),
   the paper code's value.) Then tau_k = max(tau_final, tau0 * rho^k) after update k.
4. Finalise: sigmoid(alpha_e - alpha_r) > 0.5 -> Expand: the trained clone joins
   the layer as a new expert with its trained row r'_c (one new group per layer
   and task holding its expanded clones, slot c each, added with the layer's
   add_group, so rows stay aligned), and becomes the active expert of slot c;
   the old one stays, frozen and routable, for old tasks. Otherwise Recycle: the
   clone is dropped; the old expert stays active and is cloned again next task.
   Parameters grow by one expert (3 h d) and one router row (d + 1) per Expand.
5. The harness stores the task's replay examples (shared budget).

Trainable in task t >= 1: the clones and their router rows (plus attention,
embeddings, norms with train_shared=true, and the scale s in shared=add mode);
non-candidate layers and every old expert and row are frozen. lr: MethodArgs'
1e-5 (the paper code: 1.5e-5, bilevel-reference.md §6).

Defaults (METHODS.md; the paper script's values, bilevel-reference.md §2, §8):
lambda_cka 0.15, lambda_replay 1.0, gamma 0.35, beta 0.4, r_target 0.5, N 10,
tau0 5.0, rho 0.995, tau_final 0.1, init_expand_prob 0.6, mask_lr 0.01.
cl-bench's own (no value in METHODS.md): cka_max_tokens 1024,
min_mask_updates 4. The schedule is fitted to the task's step count, computed
in before_task from the stage's data:
- N_eff = min(N, max(1, steps // min_mask_updates)) so a short task still gets
  outer updates (min_mask_updates=0 keeps N; a task left with no update at all
  is refused before training, with the arguments to change);
- rho_eff = min(rho, (tau_final / tau0)^(1 / U)) with U = steps // N_eff the
  task's updates, so tau reaches tau_final at the last one (with rho = 0.995 it
  would need 781 updates);
- mask_lr_eff = max(mask_lr, g0 / U), g0 = max over slots of |alpha_e - alpha_r|
  at the start (log(0.6/0.4) = 0.405 at the prior). Adam moves a logit by at
  most about its lr per update, so the gap moves at most 2 U lr in a task; with
  U = 4 and mask_lr 0.01 that is 0.08, and Recycle (gap < 0) is out of reach.
  mask_lr_eff makes the reach 2 U mask_lr_eff >= 2 g0: any slot can travel from
  its start to the mirror of it (p_expand 0.6 -> 0.4). The paper's step counts
  (~78 updates) keep mask_lr; the cpu profile's 4 updates a task give ~0.10.
All of it is recorded per task.
Ablations: mask=off (every pi = 1, no outer step: always Expand, CKA only),
lambda_cka=0 (masks only; CKA still measured and recorded), mask_init=random.

Records. Per step (metrics.jsonl): lm, lb, expand (share of pi = 1 this step);
from the replay micro-batch, prefixed replay_ by the harness: lm, cka (mean),
cka_<layer>, cka_loss, and on outer steps mask_loss, mask_replay, mask_gain,
mask_balance, mask_rate, tau. Per stage (run.json "params"): the decision map
[candidate layer x slot], expand probabilities, expansion rate, experts added,
CKA per deep layer (cka_before: mean over the task's first N_eff steps;
cka_after: over its last N_eff; cka_final: the finalised model against the
pre-task model on the last replay batch), the mask schedule (steps, N_eff, U,
rho_eff, tau_end, mask_lr, mask_lr_eff, init_gap g0, reach 2 U mask_lr_eff),
`deploy_check` on the task's last `CHECK_BATCHES` micro-batches: the supernet's
loss at pi = the decisions, the finalised model's, their gap, and per candidate
layer the share of (non-pad) tokens whose top-k in the finalised model holds
two copies of one slot (pair_share), and the parameter counts ("trainable":
what trained in the task, the clones included).

Where this differs from the published code (bilevel-reference.md §8), on purpose:
- The clones really train: they are parameters of the model, in the optimiser
  (§6: the code's experts are never stepped, so clone = old and G = 0).
- L_CKA carries gradient through Phi_l (§8.2: a float under no_grad, every 20 steps).
- CKA on each deep layer's output (the code's hidden_states[l] is layer l's
  input, §8.9), on every step's replay batch, i.e. on data of every earlier task
  (the code's reference batches are always task 0's, §3); the reference is the
  model before this task, recomputed exactly per batch (masks 0 plus the
  pre-task values of anything else that trains) rather than cached activations,
  because the replay batch changes every step: one extra no-grad forward a step.
- Router rows stay aligned with experts (§8.7: appended at the end while experts
  are inserted in the middle); each clone has its own row from the start, trained
  with it inside the supernet, and that row is the new expert's row (the code:
  old and new share the old row during the search, then the new one gets mean
  of old rows + noise and routers are frozen), so what is deployed was searched.
- Masks cover every candidate layer (default all; the code: 6 hard-coded of 16),
  no sensitivity probe, no deep-layer bias, no adaptive gamma / beta / r_target, no
  CKA warm-up or layer weights (none is in METHODS.md); the balance above target
  is sigmoid(r - r_target), not sparsity_weight * (r - r_target) (§8.4).
- tau reaches tau_final within each task (§8.5: it ends near 3.4), and mask_lr
  is raised where a task has too few outer updates to reach Recycle.
- The shared weights are frozen by default (§8.8; train_shared=true trains them).
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import random
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from cl_bench.cka import linear_cka
from cl_bench.data import IGNORE
from cl_bench.errors import UserError
from cl_bench.method import Stage, lm_loss
from cl_bench.methods.upcycle import Upcycle, UpcycleArgs
from cl_bench.models.moe import ExpertGroup, UpcycledMoE, decoder_layers, load_balancing_loss, moe_layers
from cl_bench.models.params import count
from cl_bench.registry import register_method

MASK_MODES = ("on", "off")
MASK_INITS = ("prior", "random")
RANDOM_INIT_STD = 0.1  # mask_init=random: the paper code's MASK_OVERRIDE=random, N(0, 0.1)
CHECK_BATCHES = 4  # task micro-batches (the last ones) the deploy check at finalisation runs on

# Letters: L_c candidate layers, K slots (experts per task), B, T, N, d, E as in moe.py.


@dataclass
class BilevelCKAArgs(UpcycleArgs):
    # supernet and masks
    candidate_layers: list[int] | None = None  # decoder layers with a supernet; None: every MoE layer
    mask: str = "on"  # on: learned masks; off: every slot expands (ablation "CKA only")
    mask_init: str = "prior"  # prior: p_expand = init_expand_prob; random: logits ~ N(0, 0.1^2)
    init_expand_prob: float = 0.6
    mask_lr: float = 0.01  # Adam on the mask logits; raised per task where Recycle is out of reach
    mask_every: int = 10  # N: an outer step every N optimiser steps
    min_mask_updates: int = 4  # N shrinks so a task has at least this many outer steps; 0: keep N
    tau0: float = 5.0
    tau_decay: float = 0.995  # rho; lowered per task when tau would not reach tau_final
    tau_final: float = 0.1
    # inner loss
    lambda_cka: float = 0.15
    lambda_replay: float = 1.0
    cka_layers: list[int] | None = None  # decoder layers whose outputs CKA compares; None: last third
    cka_max_tokens: int = 1024  # replay tokens per CKA (evenly spaced when more)
    # outer loss
    gamma: float = 0.35  # knowledge-gain weight
    beta: float = 0.4  # balance weight
    r_target: float = 0.5  # target expansion rate

    def __post_init__(self):
        super().__post_init__()
        if self.mask not in MASK_MODES:
            raise UserError(f"method_args.mask={self.mask!r}: choose one of {', '.join(MASK_MODES)}")
        if self.mask_init not in MASK_INITS:
            raise UserError(f"method_args.mask_init={self.mask_init!r}: choose one of {', '.join(MASK_INITS)}")
        if not 0 < self.init_expand_prob < 1:
            raise UserError(f"method_args.init_expand_prob={self.init_expand_prob} must be in (0, 1)")
        if self.mask_every < 1 or self.min_mask_updates < 0 or self.cka_max_tokens < 2:
            raise UserError("method_args: mask_every must be >= 1, min_mask_updates >= 0 and "
                            "cka_max_tokens >= 2")
        if not (0 < self.tau_final <= self.tau0 and 0 < self.tau_decay <= 1):
            raise UserError(f"method_args: need 0 < tau_final ({self.tau_final}) <= tau0 ({self.tau0}) "
                            f"and 0 < tau_decay ({self.tau_decay}) <= 1")
        for name in ("lambda_cka", "lambda_replay", "gamma", "beta", "mask_lr"):
            if getattr(self, name) < 0:
                raise UserError(f"method_args.{name}={getattr(self, name)} must be >= 0")
        if not 0 <= self.r_target <= 1:
            raise UserError(f"method_args.r_target={self.r_target} must be in [0, 1]")


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



def mask_schedule(n_steps: int | None, args: BilevelCKAArgs) -> tuple[int, int | None, float]:
    """(N_eff, outer updates U, rho_eff) for a task of `n_steps` optimiser steps
    (None: unknown, the arguments as given); see the module docstring."""
    every, decay = args.mask_every, args.tau_decay
    if n_steps is None:
        return every, None, decay
    if args.min_mask_updates:
        every = max(1, min(every, n_steps // args.min_mask_updates))
    updates = n_steps // every
    if updates and args.tau0 * decay ** updates > args.tau_final:
        decay = (args.tau_final / args.tau0) ** (1 / updates)
    return every, updates, decay


def reachable_mask_lr(updates: int | None, init_gap: float, mask_lr: float) -> float:
    """mask_lr_eff = max(mask_lr, g0 / U): Adam moves each logit by at most ~lr per
    update, so the expand - recycle gap moves at most 2 U lr in U updates; this lr
    lets a gap g0 reach -g0 (module docstring). U None (unknown): mask_lr."""
    if not updates:
        return mask_lr
    return max(mask_lr, init_gap / updates)


def no_update_error(stage: Stage, n_steps: int, args: BilevelCKAArgs) -> UserError:
    return UserError(
        f"bilevel-cka: stage {stage.index} ({stage.label}) takes {n_steps} optimiser steps, fewer than "
        f"method_args.mask_every={args.mask_every} with method_args.min_mask_updates=0, so its masks "
        f"would get no outer update and every decision would be the initialisation; set "
        f"min_mask_updates >= 1 (the default 4 fits N to the task) or mask_every <= {max(n_steps, 1)}")


def balance(rate: torch.Tensor, r_target: float) -> torch.Tensor:
    """B(r): 2 (r_target - r) below the target, sigmoid(r - r_target) at or above it."""
    return 2 * (r_target - rate) if rate.item() < r_target else torch.sigmoid(rate - r_target)


class _Supernet(nn.Module):
    """A candidate layer's MLP during a task t >= 1: the MoE layer `moe` (its experts
    and rows unchanged and frozen) and `clones`, trainable copies of its active
    experts (clone c of expert active[c], slot c), each with a router row of its
    own drawn N(0, router_std^2) from `generator` and bias 0. `pi` [K], set before
    each forward, says which clones are routable (module docstring, 1.): at
    pi = 1 a clone is routed exactly as the expert Expand makes of it."""

    def __init__(self, moe: UpcycledMoE, active: list[int], router_std: float, generator: torch.Generator):
        super().__init__()
        self.moe = moe
        like = moe.router_weight()  # (E, d)
        index = torch.tensor(active, device=like.device)
        experts = moe.experts()
        stacked = [torch.stack([experts[e][i] for e in active]).detach().clone() for i in range(3)]
        rows = torch.randn(len(active), moe.d, generator=generator) * router_std  # (K, d), drawn on CPU
        self.clones = ExpertGroup(*stacked, rows.to(like), like.new_zeros(len(active)))  # slots 0..K-1
        self.register_buffer("active", index, persistent=False)  # (K,)
        self.pi = like.new_ones(len(active))  # (K,)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """As UpcycledMoE.route over the E experts and the K clones, clone c's
        softmax numerator times pi_c. x: (N, d) -> probs (N, E+K) fp32, weights
        (N, k) fp32 summing to 1, indices (N, k) into [experts..., clones...]."""
        moe, clones = self.moe, self.clones
        weight = torch.cat([moe.router_weight(), clones.router_weight])  # (E+K, d)
        bias = torch.cat([moe.router_bias(), clones.router_bias])  # (E+K,)
        logits = F.linear(x.float(), weight.float(), bias.float())  # (N, E+K)
        present = torch.cat([logits.new_ones(moe.n_experts), self.pi.float()])  # (E+K,)
        # the max over every entry keeps exp <= 1 (no inf * 0 at pi = 0); the ratio is the softmax's
        num = (logits - logits.detach().amax(dim=-1, keepdim=True)).exp() * present  # (N, E+K)
        probs = num / num.sum(dim=-1, keepdim=True)
        top, indices = probs.topk(moe.k, dim=-1)  # a clone at pi = 0 has probability 0: never chosen
        return probs, top / top.sum(dim=-1, keepdim=True), indices

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        moe, clones = self.moe, self.clones
        shape = x.shape  # (B, T, d)
        flat = x.reshape(-1, shape[-1])  # (N, d)
        probs, weights, indices = self.route(flat)
        if moe.training and moe.lb_coef > 0:
            # Switch balancing over the live experts (E + sum pi), as the deployed layer's balance_loss
            live = moe.n_experts + float(self.pi.detach().sum())
            f = torch.bincount(indices.reshape(-1), minlength=probs.shape[-1]).to(probs.dtype) / indices.numel()
            moe.aux_loss = moe.lb_coef * live * torch.dot(f, probs.mean(dim=0))
        else:
            moe.aux_loss = None
        experts = moe.experts() + list(zip(clones.gate.unbind(0), clones.up.unbind(0), clones.down.unbind(0)))
        routed = _dispatch(flat, weights, indices, experts, moe.dense.act_fn)
        if moe.shared == "add":
            return moe.dense(x) + moe.routed_scale * routed.reshape(shape)
        # clone c stands in for slot c, as active[c] does: swap it out of the dense path alike
        as_experts = torch.where(indices < moe.n_experts, indices,
                                 self.active[(indices - moe.n_experts).clamp(min=0)])  # (N, k)
        return (moe.swapped_dense(flat, weights, as_experts) + routed).reshape(shape)


def _dispatch(x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, experts: list,
              act) -> torch.Tensor:
    """UpcycledMoE.experts_forward over an explicit list of (gate, up, down): the
    N*k assignments sorted by expert, each expert run once on its own tokens.
    x: (N, d); weights, indices: (N, k) -> (N, d)."""
    N, k = indices.shape
    flat = indices.reshape(-1)  # (N*k,)
    order = torch.argsort(flat, stable=True)
    token = order // k
    counts = torch.bincount(flat, minlength=len(experts)).tolist()
    xs = x.index_select(0, token)  # (N*k, d), grouped by expert
    outs, start = [], 0
    for (gate, up, down), n in zip(experts, counts):
        if n:
            xe = xs[start:start + n]
            outs.append((act(xe @ gate.T) * (xe @ up.T)) @ down.T)  # (n, d)
            start += n
    if not outs:
        return torch.zeros_like(x)
    ys = torch.cat(outs) * weights.reshape(-1)[order].unsqueeze(1).to(x.dtype)  # (N*k, d)
    return torch.zeros_like(x).index_add(0, token, ys)


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
                model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], use_cache=False)
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
        load_balancing_loss(model)
    return [p / max(tokens, 1) for p in pairs]


@dataclass
class _Task:
    """What one task t >= 1 holds while it trains."""

    nets: dict[int, _Supernet]  # candidate decoder layer -> its supernet
    snapshot: dict[str, torch.Tensor]  # pre-task values of what trains besides the clones
    generator: torch.Generator  # Gumbel noise (and a random init), seeded per task
    n_steps: int | None
    every: int  # N_eff
    decay: float  # rho_eff
    logits: nn.Parameter | None  # alpha (L_c, K, 2); None with mask=off
    optimizer: torch.optim.Optimizer | None
    tau: float
    mask_lr: float | None = None  # mask_lr_eff
    init_gap: float | None = None  # g0: max |alpha_e - alpha_r| at the start
    updates: int = 0
    pi: torch.Tensor | None = None  # (L_c, K): this step's sample
    pi_step: int = -1
    task_batch: dict | None = None  # the last task micro-batch (outer step)
    task_batches: deque = field(default_factory=lambda: deque(maxlen=CHECK_BATCHES))  # deploy check
    replay_batch: dict | None = None  # the last replay micro-batch (final CKA)
    cka: list[list[float]] = field(default_factory=list)  # per replay step, per deep layer


@register_method("bilevel-cka")
class BilevelCKA(Upcycle):
    description = "CKA-guided bilevel upcycling: clones of the active experts, learned masks pick Expand/Recycle"
    Args = BilevelCKAArgs
    zero_unsupported = dict.fromkeys((2, 3), (
        "its outer step trains the mask logits with their own optimiser inside replay_loss "
        "(torch.autograd.grad through the model): only the rank holding a step's replay micro-batch would "
        "take it, and ZeRO-3 cannot differentiate partitioned weights outside the engine's backward"))
    uses_replay = True

    def __init__(self, args: BilevelCKAArgs, context):
        super().__init__(args, context)
        if context is not None and context.config.replay.policy != "interleave":
            raise UserError(f"bilevel-cka needs replay.policy=interleave (its CKA term and outer step use "
                            f"the replay micro-batch of each step), not {context.config.replay.policy!r}; "
                            f"set --set replay.policy=interleave")
        self._active: dict[int, list[int]] = {}  # candidate layer -> expert index per slot
        self._task: _Task | None = None
        self._record: dict[str, Any] | None = None  # this stage's per-task record
        self._optimizer: torch.optim.Optimizer | None = None

    def setup(self, model: nn.Module) -> None:
        super().setup(model)
        n = len(decoder_layers(model))
        a = self.args
        self._candidates = _layers(a.candidate_layers, list(range(n)), n, "candidate_layers")
        self._cka_layers = _layers(a.cka_layers, list(range(n - math.ceil(n / 3), n)), n, "cka_layers")
        self._active = {i: list(range(a.experts_per_task)) for i in self._candidates}

    # ---- task start ------------------------------------------------------------
    def plan(self, tasks: list) -> list[Stage]:
        """Standard stages; refuses, before anything trains, a task whose masks would
        get no outer update (module docstring: the schedule)."""
        stages = super().plan(tasks)
        if self.args.mask == "on":
            for stage in stages[1:]:
                n_steps = self.stage_steps(stage)
                if n_steps is not None and not mask_schedule(n_steps, self.args)[1]:
                    raise no_update_error(stage, n_steps, self.args)
        return stages

    def before_task(self, stage: Stage) -> None:
        self._record = None
        if stage.index == 0:
            super().before_task(stage)  # task 0: plain upcycling
            return
        a = self.args
        n_steps = self.stage_steps(stage)
        every, updates, decay = mask_schedule(n_steps, a)
        if a.mask == "on" and updates == 0:
            raise no_update_error(stage, n_steps, a)
        blocks = decoder_layers(self.model)
        self.model.requires_grad_(a.train_shared)
        for layer in moe_layers(self.model):
            layer.requires_grad_(False)
            if layer.routed_scale is not None:
                layer.routed_scale.requires_grad_(True)
        seed = self.ctx.config.seed if self.ctx is not None else 0
        generator = torch.Generator().manual_seed(
            random.Random(f"{seed}/bilevel-cka/{stage.index}").getrandbits(63))
        rows = torch.Generator().manual_seed(  # the clones' router rows: their own stream
            random.Random(f"{seed}/bilevel-cka/{stage.index}/rows").getrandbits(63))
        nets = {}
        for i in self._candidates:
            nets[i] = blocks[i].mlp = _Supernet(blocks[i].mlp, self._active[i], a.router_std, rows)
        clones = {id(p) for net in nets.values() for p in net.clones.parameters()}
        snapshot = {n: p.detach().clone() for n, p in self.model.named_parameters()
                    if p.requires_grad and id(p) not in clones}
        logits = optimizer = mask_lr = init_gap = None
        if a.mask == "on":
            shape = (len(self._candidates), a.experts_per_task, 2)
            if a.mask_init == "random":
                init = torch.randn(shape, generator=generator) * RANDOM_INIT_STD
            else:
                init = torch.zeros(shape)
                init[..., 1] = math.log(a.init_expand_prob / (1 - a.init_expand_prob))
            init_gap = float((init[..., 1] - init[..., 0]).abs().max())
            mask_lr = reachable_mask_lr(updates, init_gap, a.mask_lr)
            logits = nn.Parameter(init.to(self._device()))
            optimizer = torch.optim.Adam([logits], lr=mask_lr)
        self._task = _Task(nets, snapshot, generator, n_steps, every, decay, logits, optimizer, a.tau0,
                           mask_lr, init_gap)

    def optimizer_for_stage(self, stage, previous):
        self._optimizer = super().optimizer_for_stage(stage, previous)
        return self._optimizer

    # ---- losses ----------------------------------------------------------------------
    def loss(self, batch, step):
        task = self._task
        if task is None:
            return super().loss(batch, step)  # task 0: Standard upcycling's CE + balancing
        pi = self._step_masks(step)
        self._set_masks(pi)
        lm = lm_loss(self.model, batch)
        lb = load_balancing_loss(self.model)
        task.task_batch = batch
        task.task_batches.append(batch)
        return lm + lb, {"lm": lm.item(), "lb": lb.item(), "expand": float(pi.mean())}

    def replay_loss(self, batch, step):
        a, task = self.args, self._task
        if task is None:  # task 0 replays only with replay.lima > 0
            lm = lm_loss(self.model, batch)
            load_balancing_loss(self.model)  # clear: balancing belongs to the task loss
            return a.lambda_replay * lm, {"lm": lm.item()}
        parts: dict[str, float] = {}
        if a.mask == "on" and (step + 1) % task.every == 0 and task.task_batch is not None:
            parts.update(self._outer_step(batch))
        reference = self._reference_features(batch)
        self._set_masks(self._step_masks(step))
        with self._capture() as feats:
            lm = lm_loss(self.model, batch)
        load_balancing_loss(self.model)
        current = {l: self._tokens(feats[l], batch) for l in self._cka_layers}
        if a.lambda_cka == 0:  # measured for the record only
            current = {l: f.detach() for l, f in current.items()}
        ckas = torch.stack([linear_cka(current[l], reference[l]) for l in self._cka_layers])  # (n_deep,)
        cka_loss = (1 - ckas).mean()
        values = ckas.detach().tolist()
        task.cka.append(values)
        task.replay_batch = batch
        parts.update({"lm": lm.item(), "cka": sum(values) / len(values), "cka_loss": cka_loss.item(),
                      **{f"cka_{l}": c for l, c in zip(self._cka_layers, values)}})
        return a.lambda_replay * lm + a.lambda_cka * cka_loss, parts

    def _outer_step(self, replay: dict) -> dict[str, float]:
        """One Adam step on the mask logits (module docstring, 3.)."""
        a, task = self.args, self._task
        pi = straight_through_gumbel(task.logits, task.tau, task.generator)[..., 1]  # (L_c, K)
        self._set_masks(pi)
        l_replay = lm_loss(self.model, replay)
        with torch.no_grad():
            self._set_masks(torch.ones_like(pi))
            l_expand = lm_loss(self.model, task.task_batch)
            self._set_masks(torch.zeros_like(pi))
            l_recycle = lm_loss(self.model, task.task_batch)
        load_balancing_loss(self.model)
        rate = pi.mean()
        gain = (l_recycle - l_expand).detach() * rate
        bal = balance(rate, a.r_target)
        total = l_replay - a.gamma * gain + a.beta * bal
        (grad,) = torch.autograd.grad(total, [task.logits])  # the model's gradients stay untouched
        task.logits.grad = grad
        task.optimizer.step()
        task.logits.grad = None
        task.updates += 1
        task.tau = max(a.tau_final, a.tau0 * task.decay ** task.updates)
        return {"mask_loss": total.item(), "mask_replay": l_replay.item(), "mask_gain": gain.item(),
                "mask_balance": bal.item(), "mask_rate": rate.item(), "tau": task.tau}

    # ---- masks and features -------------------------------------------------------
    def _step_masks(self, step: int) -> torch.Tensor:
        """This step's pi (L_c, K): one sample per optimiser step, from alpha without
        its gradient (the inner step trains the model, not alpha)."""
        task = self._task
        if task.pi_step != step:
            task.pi_step = step
            if task.logits is None:
                task.pi = torch.ones(len(self._candidates), self.args.experts_per_task, device=self._device())
            else:
                task.pi = straight_through_gumbel(task.logits.detach(), task.tau, task.generator)[..., 1]
        return task.pi

    def _set_masks(self, pi: torch.Tensor) -> None:
        for c, i in enumerate(self._candidates):
            self._task.nets[i].pi = pi[c]

    @contextlib.contextmanager
    def _capture(self):
        """Collects the output of each CKA layer during the forwards inside."""
        blocks = decoder_layers(self.model)
        feats: dict[int, torch.Tensor] = {}

        def hook(i):
            def store(module, inputs, output):
                feats[i] = output[0] if isinstance(output, tuple) else output  # (B, T, d)
            return store

        handles = [blocks[i].register_forward_hook(hook(i)) for i in self._cka_layers]
        try:
            yield feats
        finally:
            for handle in handles:
                handle.remove()

    def _tokens(self, h: torch.Tensor, batch: dict) -> torch.Tensor:
        """(B, T, d) -> (n, d): the non-pad tokens, at most cka_max_tokens evenly spaced."""
        flat = h[batch["attention_mask"].bool()]
        n, m = flat.shape[0], self.args.cka_max_tokens
        if n > m:
            flat = flat[torch.linspace(0, n - 1, m, device=flat.device).round().long()]
        return flat

    def _reference_features(self, batch: dict) -> dict[int, torch.Tensor]:
        """CKA-layer outputs of the model as it was before this task: every mask at 0
        (old experts, old rows) and the snapshot of whatever else trains."""
        task = self._task
        self._set_masks(torch.zeros(len(self._candidates), self.args.experts_per_task, device=self._device()))
        kwargs = dict(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False)
        with torch.no_grad(), self._capture() as feats:
            if task.snapshot:
                torch.func.functional_call(self.model, task.snapshot, (), kwargs)
            else:
                self.model(**kwargs)
        load_balancing_loss(self.model)
        return {l: self._tokens(feats[l], batch) for l in self._cka_layers}

    def _mean_loss(self, batches: list[dict]) -> float:
        """Answer-token CE over `batches` (token-weighted), in eval mode, no gradient."""
        was = self.model.training
        self.model.eval()
        total = tokens = 0.0
        with torch.no_grad():
            for b in batches:
                n = int((b["labels"] != IGNORE).sum())
                total += float(lm_loss(self.model, b)) * n
                tokens += n
        self.model.train(was)
        return total / max(tokens, 1)

    def _device(self) -> torch.device:
        return next(self.model.parameters()).device

    # ---- task end --------------------------------------------------------------------
    def after_task(self, stage: Stage) -> None:
        task = self._task
        if task is None:
            return
        if task.logits is None:
            expand = torch.ones(len(self._candidates), self.args.experts_per_task, dtype=torch.bool)
        else:
            expand = (task.logits[..., 1] - task.logits[..., 0]).detach().cpu().sigmoid() > 0.5
        self._finalise(expand)

    def _finalise(self, expand: torch.Tensor) -> None:
        """Expand the clones where `expand` (L_c, K) is true, drop the others, and
        write this stage's record."""
        task, a = self._task, self.args
        reference = self._reference_features(task.replay_batch) if task.replay_batch is not None else None
        trained = sum(p.numel() for p in self.model.parameters() if p.requires_grad)
        check = list(task.task_batches)  # the deploy check: supernet at pi = decisions vs finalised
        if check:
            self._set_masks(expand.to(self._device(), torch.float32))
            supernet_loss = self._mean_loss(check)
        blocks = decoder_layers(self.model)
        added = 0
        for c, i in enumerate(self._candidates):
            net = task.nets[i]
            layer, clones = net.moe, net.clones
            chosen = expand[c].nonzero().flatten().tolist()  # slots that expand
            if chosen:
                first = layer.n_experts
                index = torch.tensor(chosen, device=clones.gate.device)
                taken = tuple(w[index].detach().clone() for w in (clones.gate, clones.up, clones.down))
                layer.add_group(lambda dense, k, taken=taken: taken, router_std=0.0, slots=chosen)
                with torch.no_grad():
                    layer.groups[-1].router_weight.copy_(clones.router_weight[index])
                    layer.groups[-1].router_bias.copy_(clones.router_bias[index])
                for j, slot in enumerate(chosen):
                    self._active[i][slot] = first + j
                added += len(chosen)
            blocks[i].mlp = layer
        if self._optimizer is not None:
            _drop_removed(self._optimizer, self.model)  # its checkpoint names every parameter it holds
        deploy = None
        if check:
            deployed_loss = self._mean_loss(check)
            deploy = {"batches": len(check), "supernet_loss": _round(supernet_loss),
                      "deployed_loss": _round(deployed_loss),
                      "loss_gap": round(abs(deployed_loss - supernet_loss), 9),
                      "pair_share": [_round(x) for x in pair_shares(self.model, self._candidates, check)]}
        cka_final = None
        if reference is not None:
            with torch.no_grad(), self._capture() as feats:
                self.model(input_ids=task.replay_batch["input_ids"],
                           attention_mask=task.replay_batch["attention_mask"], use_cache=False)
            load_balancing_loss(self.model)
            cka_final = [_round(linear_cka(self._tokens(feats[l], task.replay_batch), reference[l]))
                         for l in self._cka_layers]
        window = task.every
        probs = None
        if task.logits is not None:
            probs = (task.logits[..., 1] - task.logits[..., 0]).detach().cpu().sigmoid()
            probs = [[_round(p) for p in row] for row in probs.tolist()]
        self._record = {
            "trainable": trained,
            "expansion_rate": float(expand.float().mean()),
            "experts_added": added,
            "decision_layers": list(self._candidates),
            "decisions": expand.int().tolist(),
            "expand_prob": probs,
            "cka_layers": list(self._cka_layers),
            "cka_before": _mean_rows(task.cka[:window]),
            "cka_after": _mean_rows(task.cka[-window:]),
            "cka_final": cka_final,
            "mask_schedule": {"steps": task.n_steps, "mask_every": task.every, "updates": task.updates,
                              "tau0": a.tau0, "tau_decay": task.decay, "tau_end": task.tau,
                              "mask_lr": a.mask_lr, "mask_lr_eff": task.mask_lr,
                              "init_gap": None if task.init_gap is None else _round(task.init_gap),
                              "reach": None if task.mask_lr is None else _round(2 * task.updates * task.mask_lr)},
            "deploy_check": deploy,
        }
        self._task = None

    # ---- records and resume ------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "active": {i: list(v) for i, v in self._active.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self._active = {int(i): list(v) for i, v in state["active"].items()}

    def param_report(self) -> dict[str, Any]:
        report = count(self.model)
        report["expansion_rate"] = None  # task 0: nothing offered
        report.update(self._record or {})
        return report

    @classmethod
    def param_schedule(cls, model: nn.Module, n_tasks: int, args: BilevelCKAArgs, *,
                       decisions: list | None = None,
                       experts_per_layer: float | None = None) -> list[dict[str, Any]]:
        """Without training the decisions are unknown: by default every stage t >= 1 is
        reported as if every decision were Expand, the upper bound (as many experts
        as Standard upcycling; exact with mask=off). `decisions`: a map
        [task][candidate layer][slot] of 0/1 for tasks 1..T-1 (a run record's, or a
        paper's), counted as given; `experts_per_layer`: the mean experts per MoE
        layer after the last task, made into such a map by `spread_decisions`.
        "trainable" is the supernet's: the clones of the active experts and their
        router rows."""
        if decisions is not None and experts_per_layer is not None:
            raise UserError("give a decision map or an expert count per layer, not both")
        # mask=off: no mask logits (on the meta device they hold no values); every slot
        # expands unless `decisions` say otherwise
        method = cls(dataclasses.replace(args, mask="off"), context=None)
        bound = "upper: every decision Expand"
        method.setup(model)
        n_cand, K = len(method._candidates), args.experts_per_task
        if experts_per_layer is not None:
            decisions = spread_decisions(experts_per_layer, n_tasks, len(moe_layers(model)), n_cand, K)
            bound = (f"{experts_per_layer:g} experts per MoE layer after the last task "
                     f"(expansions spread evenly over tasks and layers)")
        elif decisions is not None:
            decisions = _check_decisions(decisions, n_tasks, n_cand, K)
            bound = "the given decisions"
        rows = []
        for t in range(n_tasks):
            stage = Stage(t, [], f"task {t}")
            method.before_task(stage)
            if t and decisions is not None:
                method._finalise(torch.tensor(decisions[t - 1], dtype=torch.bool))
            else:
                method.after_task(stage)
            rows.append({"stage": t, **method.param_report(), "bound": bound})
        return rows


def spread_decisions(experts_per_layer: float, n_tasks: int, n_moe: int, n_cand: int, K: int) -> list:
    """A decision map [task 1..T-1][candidate layer][slot] with round((X - K) * n_moe)
    Expands, X = `experts_per_layer` the mean over the n_moe MoE layers after the
    last task (K each at task 0): filled layer by layer, then task by task, then
    slot by slot, so layers differ by at most one expert and tasks by at most one
    per layer. Only the last stage's count is fixed by X; the spread over tasks is
    this choice."""
    n = round((experts_per_layer - K) * n_moe)
    cap = (n_tasks - 1) * n_cand * K
    if not 0 <= n <= cap:
        top = K + cap / n_moe
        raise UserError(f"--experts-per-layer {experts_per_layer:g}: over {n_tasks} tasks a layer holds "
                        f"{K} (task 0) to {top:g} experts on average (every decision Expand); give a "
                        f"value in that range")
    maps = [[[0] * K for _ in range(n_cand)] for _ in range(n_tasks - 1)]
    for p in range(n):
        rest = p // n_cand
        maps[rest % (n_tasks - 1)][p % n_cand][rest // (n_tasks - 1)] = 1
    return maps


def _check_decisions(decisions: list, n_tasks: int, n_cand: int, K: int) -> list:
    """The map for tasks 1..T-1 (a leading null or empty task 0 dropped), checked."""
    if len(decisions) == n_tasks and not decisions[0]:
        decisions = decisions[1:]
    if len(decisions) != n_tasks - 1:
        raise UserError(f"decision map: {len(decisions)} tasks of decisions for --tasks {n_tasks}; give one "
                        f"[layer][slot] map per task 1..{n_tasks - 1} (a leading null for task 0 may stand first)")
    for t, task in enumerate(decisions, start=1):
        ok = (isinstance(task, list) and len(task) == n_cand
              and all(isinstance(row, list) and len(row) == K and all(v in (0, 1) for v in row) for row in task))
        if not ok:
            raise UserError(f"decision map, task {t}: expected {n_cand} candidate layers x {K} slots of 0/1")
    return decisions


def _layers(chosen: list[int] | None, default: list[int], n: int, name: str) -> list[int]:
    layers = default if chosen is None else sorted(set(chosen))
    bad = [i for i in layers if not 0 <= i < n]
    if bad or not layers:
        raise UserError(f"method_args.{name}={chosen}: give decoder layers in 0..{n - 1} "
                        f"(the model has {n}), or null for the default")
    return layers


def _drop_removed(optimizer: torch.optim.Optimizer, model: nn.Module) -> None:
    """Remove from `optimizer` (and its state) the parameters no longer in `model`:
    the clones, dropped or copied into new expert groups at finalisation."""
    live = {id(p) for p in model.parameters()}
    for group in optimizer.param_groups:
        group["params"] = [p for p in group["params"] if id(p) in live]
    for p in [p for p in optimizer.state if id(p) not in live]:
        del optimizer.state[p]


def _mean_rows(rows: list[list[float]]) -> list[float] | None:
    return [_round(sum(col) / len(col)) for col in zip(*rows)] if rows else None


def _round(x) -> float:
    return round(float(x), 6)
