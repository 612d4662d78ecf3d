"""bilevel-cka: CKA-guided bilevel MoE upcycling (ICML 2026), the paper's algorithm
done as METHODS.md ("bilevel-cka") fixes it.

Base: Standard upcycling (methods/upcycle.py): same MoE layer, K = 8 slice experts,
top-2, Switch balancing, frozen dense MLP as the shared path ("swap" by default).
Task 0 is plain upcycling: no mask, no CKA.

Task t >= 1, in each candidate layer l (`candidate_layers`, default every MoE
layer), with A_l = (a_1 .. a_K) the layer's active experts (a_c: the newest
expert standing in for dense slice c; task 0's group at first):

1. Supernet. a_c and its router row r_c stay, frozen (e_old); a trainable clone
   e_new,c with a copy r'_c of the row joins beside it. Per slot c, with
   pi_{l,c} in {0, 1},
       expert output  pi * e_new,c(x) + (1 - pi) * e_old,c(x)
       router row     pi * r'_c + (1 - pi) * r_c            (bias likewise)
   The router still scores the E experts of the layer and picks indices; the
   balancing loss stays on those indices. With every pi = 0 the supernet is the
   model as it was before the task, exactly (tested).
   Mask logits alpha: [L_cand, K, 2] (recycle, expand); pi = the expand side of a
   hard straight-through Gumbel-Softmax sample,
       y = softmax((alpha + g) / tau),  g ~ Gumbel(0, 1),  pi = onehot(argmax y) + y - sg(y)
   (one-hot forward, soft gradient; the hard sample does not depend on tau, so
   tau shapes only the gradient). Init: p_expand = sigmoid(alpha_e - alpha_r) =
   `init_expand_prob` (0.6), or `mask_init=random`: alpha ~ N(0, 0.1^2).
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
   batch), Adam on alpha (lr 0.01, rebuilt each task):
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
   the old one stays, frozen, for old tasks. Otherwise Recycle: the clone is
   dropped; the old expert stays active and is cloned again next task.
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
in before_task from the stage's data: N_eff = min(N, max(1, steps //
min_mask_updates)) so a short task still gets outer updates (min_mask_updates=0
keeps N), and rho_eff = min(rho, (tau_final / tau0)^(1 / U)) with U = steps //
N_eff the task's updates, so tau reaches tau_final at the last one (with rho =
0.995 it would need 781 updates). Both are recorded per task.
Ablations: mask=off (every pi = 1, no outer step: always Expand, CKA only),
lambda_cka=0 (masks only; CKA still measured and recorded), mask_init=random.

Records. Per step (metrics.jsonl): lm, lb, expand (share of pi = 1 this step);
from the replay micro-batch, prefixed replay_ by the harness: lm, cka (mean),
cka_<layer>, cka_loss, and on outer steps mask_loss, mask_replay, mask_gain,
mask_balance, mask_rate, tau. Per stage (run.json "params"): the decision map
[candidate layer x slot], expand probabilities, expansion rate, experts added,
CKA per deep layer (cka_before: mean over the task's first N_eff steps;
cka_after: over its last N_eff; cka_final: the finalised model against the
pre-task model on the last replay batch), the mask schedule, and the parameter
counts ("trainable": what trained in the task, the clones included).

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
  are inserted in the middle); the clone's row trains with it and is the new
  expert's row (the code: mean of old rows + noise, then routers frozen).
- Masks cover every candidate layer (default all; the code: 6 hard-coded of 16),
  no sensitivity probe, no deep-layer bias, no adaptive gamma / beta / r_target, no
  CKA warm-up or layer weights (none is in METHODS.md); the balance above target
  is sigmoid(r - r_target), not sparsity_weight * (r - r_target) (§8.4).
- tau reaches tau_final within each task (§8.5: it ends near 3.4).
- The shared weights are frozen by default (§8.8; train_shared=true trains them).
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import random
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from cl_bench.cka import linear_cka
from cl_bench.errors import UserError
from cl_bench.method import Stage, lm_loss
from cl_bench.methods.upcycle import Upcycle, UpcycleArgs
from cl_bench.models.moe import ExpertGroup, UpcycledMoE, decoder_layers, load_balancing_loss, moe_layers
from cl_bench.models.params import count
from cl_bench.registry import register_method

MASK_MODES = ("on", "off")
MASK_INITS = ("prior", "random")
RANDOM_INIT_STD = 0.1  # mask_init=random: the paper code's MASK_OVERRIDE=random, N(0, 0.1)

# Letters: L_c candidate layers, K slots (experts per task), B, T, N, d, E as in moe.py.


@dataclass
class BilevelCKAArgs(UpcycleArgs):
    # supernet and masks
    candidate_layers: list[int] | None = None  # decoder layers with a supernet; None: every MoE layer
    mask: str = "on"  # on: learned masks; off: every slot expands (ablation "CKA only")
    mask_init: str = "prior"  # prior: p_expand = init_expand_prob; random: logits ~ N(0, 0.1^2)
    init_expand_prob: float = 0.6
    mask_lr: float = 0.01  # Adam on the mask logits
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


def balance(rate: torch.Tensor, r_target: float) -> torch.Tensor:
    """B(r): 2 (r_target - r) below the target, sigmoid(r - r_target) at or above it."""
    return 2 * (r_target - rate) if rate.item() < r_target else torch.sigmoid(rate - r_target)


class _Supernet(nn.Module):
    """A candidate layer's MLP during a task t >= 1: the MoE layer `moe` (its experts
    and rows unchanged, the old ones frozen) and `clones`, trainable copies of its
    active experts with copies of their router rows (clone c of expert active[c],
    slot c). `pi` [K], set before each forward, picks per slot (module docstring)."""

    def __init__(self, moe: UpcycledMoE, active: list[int]):
        super().__init__()
        self.moe = moe
        weight, bias = moe.router_weight(), moe.router_bias()  # (E, d), (E,)
        index = torch.tensor(active, device=weight.device)
        experts = moe.experts()
        stacked = [torch.stack([experts[e][i] for e in active]).detach().clone() for i in range(3)]
        self.clones = ExpertGroup(*stacked, weight[index].detach().clone(), bias[index].detach().clone())
        self.register_buffer("active", index, persistent=False)  # (K,)
        self.pi = weight.new_ones(len(active))  # (K,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        moe, clones, active, pi = self.moe, self.clones, self.active, self.pi
        shape = x.shape  # (B, T, d)
        flat = x.reshape(-1, shape[-1])  # (N, d)
        weight, bias = moe.router_weight(), moe.router_bias()  # (E, d), (E,)
        delta = clones.router_weight - weight[active]  # (K, d)
        weight = weight.index_add(0, active, pi.unsqueeze(1).to(weight.dtype) * delta)
        bias = bias.index_add(0, active, pi.to(bias.dtype) * (clones.router_bias - bias[active]))
        # as UpcycledMoE.route: softmax over all E in fp32, top-k renormalised
        probs = F.linear(flat.float(), weight.float(), bias.float()).softmax(dim=-1)  # (N, E)
        top, indices = probs.topk(moe.k, dim=-1)
        weights = top / top.sum(dim=-1, keepdim=True)  # (N, k)
        moe.aux_loss = moe.balance_loss(probs, indices) if moe.training and moe.lb_coef > 0 else None
        keep = 1 - torch.zeros(moe.n_experts, device=x.device).index_add(0, active, pi.float())  # (E,)
        routed = moe.experts_forward(flat, weights * keep[indices], indices) + \
            self._clones_forward(flat, weights, indices)
        if moe.shared == "add":
            return moe.dense(x) + moe.routed_scale * routed.reshape(shape)
        return (moe.swapped_dense(flat, weights, indices) + routed).reshape(shape)

    def _clones_forward(self, x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """sum over the assignments to active expert c of pi_c * weight * clone_c(x).
        x: (N, d); weights, indices: (N, k) -> (N, d)."""
        clones = self.clones
        out = torch.zeros_like(x)
        # a clone at pi = 0 adds nothing; with pi differentiable it is still needed for d/dpi
        on = [True] * len(self.active) if self.pi.requires_grad else (self.pi != 0).tolist()
        for c, e in enumerate(self.active.tolist()):
            if not on[c]:
                continue
            token, j = (indices == e).nonzero(as_tuple=True)
            if not len(token):
                continue
            xe = x.index_select(0, token)  # (n, d)
            y = (self.moe.dense.act_fn(xe @ clones.gate[c].T) * (xe @ clones.up[c].T)) @ clones.down[c].T  # (n, d)
            w = (weights[token, j] * self.pi[c]).to(x.dtype)  # (n,)
            out = out.index_add(0, token, y * w.unsqueeze(1))
        return out


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
    updates: int = 0
    pi: torch.Tensor | None = None  # (L_c, K): this step's sample
    pi_step: int = -1
    task_batch: dict | None = None  # the last task micro-batch (outer step)
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
    def before_task(self, stage: Stage) -> None:
        self._record = None
        if stage.index == 0:
            super().before_task(stage)  # task 0: plain upcycling
            return
        a = self.args
        blocks = decoder_layers(self.model)
        self.model.requires_grad_(a.train_shared)
        for layer in moe_layers(self.model):
            layer.requires_grad_(False)
            if layer.routed_scale is not None:
                layer.routed_scale.requires_grad_(True)
        nets = {}
        for i in self._candidates:
            nets[i] = blocks[i].mlp = _Supernet(blocks[i].mlp, self._active[i])
        clones = {id(p) for net in nets.values() for p in net.clones.parameters()}
        snapshot = {n: p.detach().clone() for n, p in self.model.named_parameters()
                    if p.requires_grad and id(p) not in clones}
        n_steps = self.stage_steps(stage)
        every, _, decay = mask_schedule(n_steps, a)
        seed = self.ctx.config.seed if self.ctx is not None else 0
        generator = torch.Generator().manual_seed(
            random.Random(f"{seed}/bilevel-cka/{stage.index}").getrandbits(63))
        logits = optimizer = None
        if a.mask == "on":
            shape = (len(self._candidates), a.experts_per_task, 2)
            if a.mask_init == "random":
                init = torch.randn(shape, generator=generator) * RANDOM_INIT_STD
            else:
                init = torch.zeros(shape)
                init[..., 1] = math.log(a.init_expand_prob / (1 - a.init_expand_prob))
            logits = nn.Parameter(init.to(self._device()))
            optimizer = torch.optim.Adam([logits], lr=a.mask_lr)
        self._task = _Task(nets, snapshot, generator, n_steps, every, decay, logits, optimizer, a.tau0)

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
                              "tau0": a.tau0, "tau_decay": task.decay, "tau_end": task.tau},
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
    def param_schedule(cls, model: nn.Module, n_tasks: int, args: BilevelCKAArgs) -> list[dict[str, Any]]:
        """Without training the decisions are unknown: every stage t >= 1 is reported
        as if every decision were Expand, the upper bound (as many experts as
        Standard upcycling; exact with mask=off). "trainable" is the supernet's:
        the clones of the active experts and their router rows."""
        method = cls(dataclasses.replace(args, mask="off"), context=None)  # off: every slot expands
        method.setup(model)
        rows = []
        for t in range(n_tasks):
            stage = Stage(t, [], f"task {t}")
            method.before_task(stage)
            method.after_task(stage)
            rows.append({"stage": t, **method.param_report(), "bound": "upper: every decision Expand"})
        return rows


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
