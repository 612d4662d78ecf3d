"""Cluster-aware upcycling (CAU, CVPR 2026, arXiv 2604.13508), continual form on
cl-bench's upcycled MoE layer (reference/seed-methods.md, section (a)).

The paper (abstract, project page and a third-party note; there is no code):
one-off initialisation of each upcycled FFN from calibration tokens, then
training with expert-ensemble self-distillation (EESD).

Per task t (t = 0 included), in every decoder layer, before the task trains:

1. Calibration. Up to `calib_examples` training examples of the *current* task
   (stage.tasks only: never a later task's data, and no earlier task's either),
   in a seeded order, are run through the model as it stands (dense at t = 0;
   the MoE with the groups of tasks < t afterwards), in eval mode without
   gradient. x = the FFN input (post-attention-norm hidden state) is kept at the
   prompt positions, padding, answer tokens and position 0 (the attention sink)
   dropped, until `calib_tokens` tokens. All layers come from this one forward
   (inputs of the model before the new group, not layer-sequential).
2. Spherical k-means with k = K (experts_per_task): x_hat = x / ||x||; assign to
   argmax_e mu_e^T x_hat; mu_e = normalised sum of its members; k-means++ seeds
   (distance 1 - cos), `kmeans_iters` iterations, `kmeans_restarts` restarts, the
   best mean cosine kept; seeded by (run seed, stage, layer).
3. Experts. Expert e of the new group stands in for dense slice e (its slot, as
   every group of cl-bench's layer) and is fitted on cluster e: for each matrix
   W of slice e with the cluster's inputs X_e to it,
       S_e = chol(X_e X_e^T + lambda I),  W S_e = U Sigma V^T,
       r = min(smallest r with sum_{j<=r} sigma_j^2 >= tau sum_j sigma_j^2, cap),
       W_e = U_r Sigma_r V_r^T S_e^-1,
   the rank-r minimiser of ||W X_e - W_e X_e||_F (SVD-LLM whitening;
   cl_bench/cluster_svd.py). gate and up use X_e (the cluster's x); down uses
   H_e = silu(G_slice x) * (U_slice x) over the cluster's tokens, computed with
   the dense slice's weights (the seed's reading for SwiGLU). lambda = ridge *
   mean diag(X_e X_e^T), float64. If the Cholesky fails (singular covariance:
   ridge=0 with fewer tokens than inputs), the eigen-decomposition square root
   with a pseudo-inverse is used instead (still the minimiser over X_e). A
   cluster with fewer than `min_cluster_tokens` tokens keeps the dense slice.
4. Router rows: row e = mu_e (unit norm) at t = 0; at t >= 1 the centroids are
   rescaled to the mean norm of the layer's existing rows and the new biases set
   to the mean existing bias (the seed's per-task expansion), so row e always
   scores the expert fitted on cluster e (add_group keeps rows and experts
   aligned; the rows are written after add_group returns).
4b. Drift guard (the seed, §4: "raise tau if it is more than about 3% worse"). With
   L_ref the answer-token LM loss on the calibration examples of the model with
   the new group as the dense slices themselves (the same centroid rows; at
   t = 0 with shared=swap this is the dense model, to float rounding) and L_init
   the loss with the fitted experts,
       drift = (L_init - L_ref) / L_ref,
   if |drift| > max_drift the experts are refitted (same clusters, same rows)
   down a ladder until it is within: tau' = 1 - (1 - tau) / 10, then
   1 - (1 - tau) / 100, then 1, then 1 without the rank cap, and last the dense
   slices (L_init = L_ref: drift 0). Either sign counts (the seed says "worse"):
   the swap layer is meant to start as the model before the group, and a lower
   loss on this task's prompts is no promise about the earlier tasks'. The reference is the slice init, not
   the model before the task, because at t >= 1 routing tokens to a new group
   moves the loss whatever its experts are (Standard upcycling's new group does
   too); tau and the cap only set the experts' approximation error, which is
   what the guard bounds. lm_rel_change (against the model before) is recorded
   beside it. Cost: one calibration forward for L_ref, and one SVD fit and
   forward per rung tried (at most 6).
5. Training: L = L_task + L_lb + w * L_EESD, trainable = the new group and its
   router rows (old groups frozen, as Standard upcycling: methods/upcycle.py),
       L_EESD = T^2 * mean over answer tokens of KL(p_teacher || p_student),
   p = softmax(logits / T); the teacher is the model with an EMA of what trains
   substituted, run *densely*: every MoE layer routes each token to all E experts
   with the full softmax (top-k = E; the "swap" shared path removes each slot in
   proportion to its summed probability), y_ens = sum_i g_i^ema E_i^ema(x). EMA
   after every optimiser step: theta_ema <- d theta_ema + (1 - d) theta, over
   the parameters trainable in the task (+100% of them in memory, as the seed);
   frozen ones (old groups) enter the teacher at their fixed values. A new
   group's EMA starts at its initial weights. What trains across tasks (the
   shared weights with train_shared=true, s with shared=add) keeps its EMA from
   task to task (the seed: it then also acts like LwF); ema_reset=true restarts
   it at each task (the seed's ablation).

Defaults and sources. Paper (via the seed): spherical k-means, whitened SVD,
centroid router rows, EMA dense teacher, E = 8, top-2, Switch LB 0.01. Seed's
choices: ridge 1e-4 * mean diag, float64, k-means++ 30 iterations 3 restarts,
calibration from the task's prompts. Not public, *chosen* (the seed marks them
"choose"; all are recorded in run.json method_args): tau = 0.99, EMA decay
0.999 per step, EESD = KL(teacher || student) on answer tokens, T = 1,
weight 1.0. Chosen here: calib_examples 256 (the seed's 256 sequences),
calib_tokens 8192 (CPU scale; the seed suggests 256 x 512 tokens, 64k for
k-means: raise it on a GPU), min_cluster_tokens 16, rank cap (below); the
guard's max_drift 0.03 (the seed's ~3%; null turns it off) and its ladder.

Adaptation choices and where this differs from the paper:
- Expert shape. The paper's experts are full-FFN low-rank approximations (the
  seed's V1/V2). cl-bench's layer holds SwiGLU *slices* of width h = H/K in
  slots, so here expert e is the whitened truncated SVD of dense *slice* e on
  cluster e, stored dense (h x d, d x h). Each expert therefore approximates
  its slice, not the whole FFN, on its cluster; the clustering decides which
  input directions each expert keeps, and the centroid rows send the cluster's
  tokens to it.
- Rank cap "matching a slice's size": rank_cap=None (default) caps every matrix
  at floor(h d / (h + d)), the largest rank whose factorised form (h x r plus
  r x d) is no bigger than the slice matrix (tiny Llama 12 of 16; SmolLM2 144
  of 192; Llama-3.2-1B 682 of 1024). The seed's V2 cap d h / (d + H) (52 on
  SmolLM2) is for a full-width factorised expert; rank_cap=52 reproduces it.
  rank_cap=0: no cap (tau alone).
- Shared path: shared="swap" (default, kept from the family). A token's chosen
  experts stand in for their own slices, so the layer is
      dense(x) + sum_j w_j (E_j(x) - slice_{slot j}(x)),
  i.e. it moves from the dense model only by the approximation error of the
  chosen experts (zero with tau = 1 and no cap: tested). This is the slice form
  of the seed's advice to drop the always-on dense FFN for CAU (dense +
  experts would count the FFN twice). shared="add" (dense + s * routed, s = 1)
  is accepted but is not function-preserving: it adds the experts on top of
  the whole dense FFN. Measured on the tiny Llama at initialisation, smoke
  data, tasks 0 and 1 (test_initial_loss_moves_little_with_swap): with swap the
  answer-token LM loss moves by 0.02-0.05% (bound tested: 3%, the seed's
  threshold; the random tiny model's loss is insensitive, so the layer outputs
  are tested too) and each layer's output is 5-8% from the dense MLP's (bound
  tested: 15%); with add, ~30%. With tau = 1 and no cap, swap starts exactly as
  the dense model (tested). On SmolLM2 (the cpu profile's committed run, before
  the guard existed) tau 0.99 moved the loss by +1.6, +5.3, -0.6, +11.4, -5.1
  and -8.6% over the six stages (stage 3: 2.3k calibration tokens, the task's
  64 examples, against the seed's 64k; 149 of its 720 matrices kept rank <= 4):
  the drift guard (4b) now raises tau where that exceeds max_drift.
- Continual form (the seed's "per-task expansion" option): a new group of K
  CAU experts per task, calibrated on that task's prompts; old groups frozen.
  The model stays dense until task 0 starts (zero-shot rows are the dense model).
- EESD teacher runs every expert of every group (E/k times the routed FFN
  cost), with the EMA of the trainable parameters substituted
  (torch.func.functional_call); eesd_weight=0 drops the teacher and the EMA.
  At decay 0.999 the EMA moves ~0.1% a step: in a task of a few dozen steps
  (the cpu profile's) the teacher stays close to the task's initialisation, so
  EESD then mostly pulls the sparse student toward the dense-routed CAU init.
  The seed's cheaper layer-local MSE variant is not implemented.
- Not done: the paper's cross-penalty over other experts (the seed: not the
  closed form used), exclusion of outlier channels from X X^T (the ridge only),
  layer-sequential calibration. router_std (inherited) is unused: rows come
  from the centroids.

Records. Per step (metrics.jsonl): lm, lb, eesd. Per stage (run.json "params",
key "cluster_init"): calibration size, the tau and rank cap used (after the
guard), answer-token LM loss on the calibration examples before the new group
(lm_before), with it as dense slices (lm_reference), right after it
(lm_after; lm_rel_change against lm_before; drift against lm_reference: what the
guard bounds) and at the end of the task; drift_guard {max_drift, acted,
initial_drift, slices (the last rung was used), tries: [{tau, rank_cap, slices,
lm, drift}] in order}; per layer (the experts finally used): cluster sizes, k-means mean
cosine, the rank and kept energy of each expert's gate/up/down, copied experts,
Cholesky fallbacks, each expert's relative distance to its slice, the largest
cosine between two centroids, router row scale, and routing on the calibration
prompts at init and at the end of the task (mean entropy, the new group's share
of top-k assignments, load over its experts, share of tokens whose top-1
expert is their cluster's, out_rel_err = ||layer(x) - dense(x)|| / ||dense(x)||). "total" includes the EMA teacher ("ema_teacher"),
which "deployed" does not.
"""
from __future__ import annotations

import contextlib
import logging
import math
import random
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from cl_bench.cluster_svd import spherical_kmeans, whitened_truncated_svd
from cl_bench.data import IGNORE, Encoder, collate
from cl_bench.errors import UserError
from cl_bench.method import Stage
from cl_bench.methods.upcycle import Upcycle, UpcycleArgs
from cl_bench.models.moe import (UpcycledMoE, decoder_layers, load_balancing_loss, moe_layers,
                                 slice_experts)
from cl_bench.registry import register_method

log = logging.getLogger(__name__)

# Letters: B batch, T sequence, N tokens, d width, H FFN width, K experts per group,
# h = H / K, E experts in a layer, V vocabulary.


@dataclass
class ClusterUpcycleArgs(UpcycleArgs):
    # initialisation (module docstring, 1-4)
    tau: float = 0.99  # energy kept by each expert's whitened SVD (chosen: not public; sweep 0.95/0.999)
    rank_cap: int | None = None  # None: floor(h d / (h + d)), a slice's size; 0: no cap
    ridge: float = 1e-4  # lambda = ridge * mean diag(X X^T) before the Cholesky
    min_cluster_tokens: int = 16  # smaller clusters keep the dense slice (chosen)
    kmeans_iters: int = 30
    kmeans_restarts: int = 3
    calib_examples: int = 256  # training examples of the current task (the seed's 256)
    calib_tokens: int = 8192  # prompt tokens per layer (chosen, CPU scale; seed: 256 x 512)
    max_drift: float | None = 0.03  # drift guard: largest |relative loss drift| at init (seed: ~3%); None: off
    # expert-ensemble self-distillation (module docstring, 5)
    eesd_weight: float = 1.0  # chosen; 0 turns EESD (and the EMA teacher) off
    eesd_temperature: float = 1.0  # chosen
    ema_decay: float = 0.999  # per optimiser step (chosen)
    ema_reset: bool = False  # restart the EMA teacher at each task (ablation)

    def __post_init__(self):
        super().__post_init__()
        if not 0 < self.tau <= 1:
            raise UserError(f"method_args.tau={self.tau} must be in (0, 1]")
        if self.rank_cap is not None and self.rank_cap < 0:
            raise UserError(f"method_args.rank_cap={self.rank_cap} must be >= 0 (0: no cap), "
                            f"or null for a slice's size")
        for name in ("kmeans_iters", "kmeans_restarts", "calib_examples", "calib_tokens"):
            if getattr(self, name) < 1:
                raise UserError(f"method_args.{name}={getattr(self, name)} must be >= 1")
        for name in ("ridge", "min_cluster_tokens", "eesd_weight"):
            if getattr(self, name) < 0:
                raise UserError(f"method_args.{name}={getattr(self, name)} must be >= 0")
        if self.max_drift is not None and self.max_drift <= 0:
            raise UserError(f"method_args.max_drift={self.max_drift} must be > 0 (or null: no guard)")
        if self.eesd_temperature <= 0:
            raise UserError(f"method_args.eesd_temperature={self.eesd_temperature} must be > 0")
        if not 0 <= self.ema_decay < 1:
            raise UserError(f"method_args.ema_decay={self.ema_decay} must be in [0, 1)")


# ---- pieces ---------------------------------------------------------------------

def slice_rank_cap(h: int, d: int) -> int:
    """floor(h d / (h + d)): the largest r with r (h + d) <= h d, i.e. a rank-r
    factorisation of an h x d (or d x h) slice matrix no bigger than the slice."""
    return (h * d) // (h + d)


def cluster_experts(dense: nn.Module, x: torch.Tensor, assign: torch.Tensor, n_experts: int,
                    tau: float, rank_cap: int | None, ridge: float, min_tokens: int):
    """Expert e = the whitened truncated SVD of dense slice e on the tokens of
    cluster e (module docstring, 3). x: (N, d); assign: (N,) in [0, n_experts).
    Returns gate (K, h, d), up (K, h, d), down (K, d, h) and one info dict per expert."""
    gate0, up0, down0 = slice_experts(dense, n_experts)  # copies
    gate, up, down = gate0.clone(), up0.clone(), down0.clone()
    infos = []
    for e in range(n_experts):
        xe = x[assign == e]  # (n_e, d)
        info: dict[str, Any] = {"tokens": int(xe.shape[0]), "copied": xe.shape[0] < max(min_tokens, 1)}
        if info["copied"]:
            infos.append(info)
            continue
        xe64 = xe.double()
        cov_x = xe64.T @ xe64  # (d, d)
        gate[e], ig = whitened_truncated_svd(gate0[e], cov_x, tau, rank_cap, ridge)
        up[e], iu = whitened_truncated_svd(up0[e], cov_x, tau, rank_cap, ridge)
        x32 = xe.float()
        inter = (dense.act_fn(x32 @ gate0[e].float().T) * (x32 @ up0[e].float().T)).double()  # (n_e, h): H_e
        down[e], idn = whitened_truncated_svd(down0[e], inter.T @ inter, tau, rank_cap, ridge)
        for name, i in (("gate", ig), ("up", iu), ("down", idn)):
            info[name] = i
        infos.append(info)
    return gate, up, down, infos


def drift_ladder(tau: float, cap: int | None) -> list[tuple[float, int | None, bool]]:
    """The initialisations the drift guard tries, in order, as (tau, rank cap, copy
    the dense slices): tau as given; 1 - (1 - tau) / 10 and 1 - (1 - tau) / 100;
    1 (the cap kept); 1 without the cap; the dense slices themselves (the guard's
    reference, so its drift is 0). A rung equal to the one before is skipped."""
    rungs = [(tau, cap, False)]
    for t in (1 - (1 - tau) / 10, 1 - (1 - tau) / 100, 1.0):
        if t > rungs[-1][0]:
            rungs.append((t, cap, False))
    if cap is not None:
        rungs.append((1.0, None, False))
    rungs.append((1.0, None, True))
    return rungs


def eesd_loss(student: torch.Tensor, teacher: torch.Tensor, labels: torch.Tensor,
              temperature: float = 1.0) -> torch.Tensor:
    """T^2 * mean over answer tokens of KL(p_teacher || p_student), p = softmax(logits / T),
    in fp32. student, teacher: (B, T, V) logits; labels: (B, T), -100 off the answer.
    Logits at position i predict token i + 1, so position i counts when labels[i + 1]
    is an answer token (as the LM loss)."""
    mask = labels[:, 1:] != IGNORE  # (B, T-1)
    if not bool(mask.any()):
        return student.sum() * 0.0
    s = student[:, :-1][mask].float() / temperature  # (n, V)
    t = teacher[:, :-1][mask].float() / temperature
    log_t = t.log_softmax(dim=-1)
    kl = (log_t.exp() * (log_t - s.log_softmax(dim=-1))).sum(dim=-1)  # (n,)
    return kl.mean() * temperature ** 2


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


def _r(x: float, digits: int = 6) -> float:
    return round(float(x), digits)


class _RoutingStats:
    """Routing of one MoE layer on the calibration prompts: mean entropy, the new
    group's share of the top-k assignments and its load, top-1 = cluster agreement,
    and how far the layer's output is from the dense MLP's, ||y - dense(x)|| / ||dense(x)||."""

    def __init__(self, first: int, n_new: int, centroids: torch.Tensor):
        self.first, self.n_new, self.centroids = first, n_new, centroids  # (K, d)
        self.tokens = 0
        self.entropy = 0.0
        self.assignments = 0
        self.load = torch.zeros(n_new, dtype=torch.float64)
        self.agree = 0
        self.err = self.dense_sq = 0.0  # ||layer(x) - dense(x)||^2, ||dense(x)||^2

    def add(self, layer: UpcycledMoE, x: torch.Tensor, y: torch.Tensor) -> None:
        probs, _, indices = layer.route(x)  # (N, E), (N, k)
        dense = layer.dense(x)  # (N, d)
        self.err += float((y - dense).float().pow(2).sum())
        self.dense_sq += float(dense.float().pow(2).sum())
        self.tokens += x.shape[0]
        self.entropy += float(-(probs * probs.clamp_min(1e-30).log()).sum())
        self.assignments += indices.numel()
        local = indices.reshape(-1) - self.first
        local = local[(local >= 0) & (local < self.n_new)]
        self.load += torch.bincount(local, minlength=self.n_new).double().cpu()
        cluster = (F.normalize(x.float(), dim=1) @ self.centroids.T.float()).argmax(dim=1)
        self.agree += int((probs.argmax(dim=1) == cluster + self.first).sum())

    def report(self) -> dict[str, Any]:
        if not self.tokens:
            return {}
        in_new = float(self.load.sum())
        return {"entropy": _r(self.entropy / self.tokens),
                "new_group_share": _r(in_new / self.assignments),
                "load": [_r(v / in_new) if in_new else 0.0 for v in self.load.tolist()],
                "top1_is_cluster": _r(self.agree / self.tokens),
                "out_rel_err": _r((self.err / self.dense_sq) ** 0.5 if self.dense_sq else 0.0)}


# ---- the method ------------------------------------------------------------------

@register_method("cluster-upcycle")
class ClusterUpcycle(Upcycle):
    description = ("Cluster-aware upcycling: per task, experts by whitened SVD on k-means clusters of the "
                   "task's prompts, centroid router rows, EMA dense-teacher self-distillation")
    Args = ClusterUpcycleArgs
    zero_unsupported = dict.fromkeys((2, 3), (
        "its EMA teacher averages the live weights after every step and runs the model on its own copies "
        "(torch.func.functional_call); under the engine the live weights are bf16 casts of fp32 masters "
        "(ZeRO-2) or partitions (ZeRO-3)"))

    def __init__(self, args: ClusterUpcycleArgs, context):
        super().__init__(args, context)
        self._ema: dict[str, torch.Tensor] = {}  # parameter name -> EMA value (the teacher's)
        self._ema_pairs: list[tuple[torch.Tensor, nn.Parameter]] = []
        self._record: dict[str, Any] | None = None  # this stage's "cluster_init"
        self._probe: dict[str, Any] | None = None  # calibration rows and stats holders, until after_task
        self._placeholders = False  # param_schedule: shapes only, no data

    def setup(self, model: nn.Module) -> None:
        self.model = model  # dense until task 0: experts need the task's prompts
        self._set_trainable()

    # ---- task start ----------------------------------------------------------------
    def before_task(self, stage: Stage) -> None:
        if self._n_groups() <= stage.index:  # a resumed run already holds its groups
            if self._placeholders:
                self._add_placeholder_group()
            else:
                self._add_cluster_group(stage)
        self._set_trainable()
        if self.args.ema_reset:
            self._ema = {}
        self._sync_ema()

    def _n_groups(self) -> int:
        layers = moe_layers(self.model)
        return len(layers[0].groups) if layers else 0

    def _layers(self) -> list[UpcycledMoE]:
        """Every decoder layer's MoE, upcycling (without a group yet) those still dense."""
        out = []
        for block in decoder_layers(self.model):
            if not isinstance(block.mlp, UpcycledMoE):
                block.mlp = UpcycledMoE(block.mlp, **self._moe_settings())
            out.append(block.mlp)
        return out

    def _add_placeholder_group(self) -> None:
        for layer in self._layers():
            layer.add_group(slice_experts, router_std=0.0)

    def rank_cap(self, layer: UpcycledMoE) -> int | None:
        cap = self.args.rank_cap
        return slice_rank_cap(layer.h, layer.d) if cap is None else (cap or None)

    def calibration_rows(self, stage: Stage) -> list[dict[str, list[int]]]:
        """Training rows (prompt + answer) of the stage's own tasks, in a seeded order,
        until calib_examples rows or calib_tokens usable prompt tokens. Only
        `stage.tasks` is read: no other task's data, earlier or later."""
        a = self.args
        examples = [e for task in stage.tasks for e in task.train]
        if not examples:
            raise UserError(f"cluster-upcycle: stage {stage.label!r} has no training examples to "
                            f"calibrate its experts on")
        order = list(range(len(examples)))
        random.Random(f"{self.ctx.config.seed}/cluster-upcycle/{stage.index}").shuffle(order)
        encoder = Encoder.from_config(self.ctx.tokenizer, self.ctx.config.train)
        rows, tokens = [], 0
        for i in order:
            if len(rows) >= a.calib_examples or tokens >= a.calib_tokens:
                break
            row = encoder.train_example(examples[i].prompt, examples[i].answer)
            rows.append(row)
            tokens += max(sum(1 for label in row["labels"] if label == IGNORE) - 1, 0)
        return rows

    def _forward_rows(self, rows: list[dict], on_input=None) -> float:
        """Run `rows` through the model in micro-batches (eval mode, no gradient);
        on_input(layer index, mlp module, x, y) gets each decoder layer's FFN input x
        and output y at the calibration positions (prompt tokens but position 0; no
        padding), x, y: (n, d).
        Returns the answer-token LM loss over the rows."""
        model, blocks = self.model, decoder_layers(self.model)
        device = next(model.parameters()).device
        pad = self.ctx.tokenizer.pad_token_id
        selected: dict[str, torch.Tensor] = {}

        def hook(i):
            def post(module, args, output):
                m = selected["mask"]
                on_input(i, module, args[0][m], output[m])
            return post

        handles = [b.mlp.register_forward_hook(hook(i)) for i, b in enumerate(blocks)] if on_input else []
        was_training = model.training
        model.eval()
        total = n = 0.0
        try:
            with torch.no_grad():
                size = self.ctx.config.train.micro_batch_size
                for start in range(0, len(rows), size):
                    batch = {k: v.to(device) for k, v in collate(rows[start:start + size], pad).items()}
                    mask = (batch["attention_mask"] == 1) & (batch["labels"] == IGNORE)  # (B, T)
                    mask[:, 0] = False  # position 0: the attention sink
                    selected["mask"] = mask
                    out = model(**batch, use_cache=False)
                    answer = int((batch["labels"][:, 1:] != IGNORE).sum())
                    total += out.loss.item() * answer
                    n += answer
        finally:
            for handle in handles:
                handle.remove()
            model.train(was_training)
        return total / n if n else float("nan")

    def _add_cluster_group(self, stage: Stage) -> None:
        """Module docstring, 1-4 and the drift guard: calibrate, cluster, add the group
        (the dense slices with the centroid rows: the guard's reference), fit its
        experts, raising tau until the drift is within max_drift; and record."""
        a = self.args
        rows = self.calibration_rows(stage)
        captured: dict[int, list[torch.Tensor]] = {}
        lm_before = self._forward_rows(rows, lambda i, m, x, y: captured.setdefault(i, []).append(x.float()))
        seed = self.ctx.config.seed
        layers = self._layers()
        K = a.experts_per_task
        fits = []  # per layer: (x (N, d), its k-means, router row scale)
        for i, layer in enumerate(layers):
            x = torch.cat(captured.pop(i))[:a.calib_tokens]  # (N, d)
            if x.shape[0] < K:
                raise UserError(f"cluster-upcycle: {x.shape[0]} calibration tokens for {K} clusters in "
                                f"stage {stage.label!r}; raise calib_examples / calib_tokens")
            generator = torch.Generator().manual_seed(
                random.Random(f"{seed}/cluster-upcycle/{stage.index}/{i}").getrandbits(63))
            km = spherical_kmeans(x, K, a.kmeans_iters, a.kmeans_restarts, generator)
            if layer.groups:
                scale = layer.router_weight().detach().norm(dim=1).mean()
                bias = layer.router_bias().detach().mean()
            else:
                scale, bias = torch.ones(()), torch.zeros(())
            layer.add_group(slice_experts, router_std=0.0)  # experts fitted below
            group = layer.groups[-1]
            with torch.no_grad():
                group.router_weight.copy_(km.centroids.to(group.router_weight) * scale)
                group.router_bias.fill_(float(bias))
            fits.append((x, km, float(scale)))
        lm_reference = self._forward_rows(rows)  # the group as dense slices
        cap = self.rank_cap(layers[0])  # every layer has the same h and d
        rungs = drift_ladder(a.tau, cap) if a.max_drift is not None else [(a.tau, cap, False)]
        tries = []
        for tau, cap, use_slices in rungs:
            per_layer, holders = self._fit_group(layers, fits, tau, cap, use_slices)
            lm_after = self._forward_rows(rows, lambda i, m, x, y: holders[i].add(m, x, y))
            drift = (lm_after - lm_reference) / lm_reference
            tries.append({"tau": _r(tau), "rank_cap": cap, "slices": use_slices, "lm": _r(lm_after),
                          "drift": _r(drift)})
            if a.max_drift is None or not math.isfinite(drift) or abs(drift) <= a.max_drift:
                break
        acted = len(tries) > 1
        if acted:
            log.info("cluster-upcycle: stage %d: init drift %.4f above max_drift %.4f at tau %s; "
                     "%.4f at tau %s, rank cap %s%s", stage.index, tries[0]["drift"], a.max_drift,
                     tries[0]["tau"], drift, tries[-1]["tau"], cap, " (dense slices)" if use_slices else "")
        for rec in per_layer:
            rec["init_routing"] = holders[rec["layer"]].report()
        self._probe = {"rows": rows, "centroids": {i: h.centroids for i, h in holders.items()},
                       "first": {i: h.first for i, h in holders.items()}}
        self._record = {"calib_examples": len(rows), "tau": _r(tau), "rank_cap": cap,
                        "lm_before": _r(lm_before), "lm_reference": _r(lm_reference),
                        "lm_after": _r(lm_after),
                        "lm_rel_change": _r((lm_after - lm_before) / lm_before),
                        "drift": _r(drift),
                        "drift_guard": {"max_drift": a.max_drift, "acted": acted,
                                        "initial_drift": tries[0]["drift"], "slices": use_slices, "tries": tries},
                        "layers": per_layer}

    def _fit_group(self, layers: list[UpcycledMoE], fits: list, tau: float, cap: int | None,
                   use_slices: bool) -> tuple[list[dict[str, Any]], dict[int, _RoutingStats]]:
        """Write the experts of each layer's newest group: the whitened truncated SVD
        of each dense slice on its cluster at (tau, cap), or the dense slices themselves.
        Returns the per-layer records and fresh routing-stat holders."""
        a, K = self.args, self.args.experts_per_task
        per_layer, holders = [], {}
        for i, (layer, (x, km, scale)) in enumerate(zip(layers, fits)):
            min_tokens = x.shape[0] + 1 if use_slices else a.min_cluster_tokens  # every cluster "too small"
            gate, up, down, infos = cluster_experts(layer.dense, x, km.assign, K, tau, cap, a.ridge,
                                                    min_tokens)
            group = layer.groups[-1]
            with torch.no_grad():
                group.gate.copy_(gate)
                group.up.copy_(up)
                group.down.copy_(down)
            holders[i] = _RoutingStats(layer.n_experts - K, K, km.centroids)
            per_layer.append(self._layer_record(i, x.shape[0], km, infos, gate, up, down,
                                                slice_experts(layer.dense, K), scale))
        return per_layer, holders

    @staticmethod
    def _layer_record(i, n_tokens, km, infos, gate, up, down, slices, scale) -> dict[str, Any]:
        fitted = [w.detach() for w in (gate, up, down)]
        rel = []
        for e in range(len(infos)):
            num = sum(float((f[e] - s[e]).pow(2).sum()) for f, s in zip(fitted, slices))
            den = sum(float(s[e].pow(2).sum()) for s in slices)
            rel.append(_r((num / den) ** 0.5 if den else 0.0))
        c = km.centroids
        cos = c @ c.T - 2 * torch.eye(len(c), device=c.device)  # diagonal out of the max
        out: dict[str, Any] = {"layer": i, "tokens": n_tokens,
                               "cluster_sizes": [info["tokens"] for info in infos],
                               "kmeans_cos": _r(km.objective),
                               "copied": [e for e, info in enumerate(infos) if info["copied"]],
                               "fallbacks": sum(info[m].fallback for info in infos if not info["copied"]
                                                for m in ("gate", "up", "down")),
                               "rel_change": rel, "centroid_max_cos": _r(cos.max()),
                               "router_scale": _r(scale)}
        for m in ("gate", "up", "down"):
            out[f"rank_{m}"] = [info[m].rank if not info["copied"] else None for info in infos]
            out[f"energy_{m}"] = [_r(info[m].energy) if not info["copied"] else None for info in infos]
        return out

    # ---- EMA teacher and losses -----------------------------------------------------------
    def _sync_ema(self) -> None:
        """The EMA holds exactly the parameters trainable now: those already in it
        keep their average, new ones join at their current value, frozen ones leave
        (the teacher then uses their fixed value, where their EMA would converge)."""
        if self.args.eesd_weight == 0:
            self._ema, self._ema_pairs = {}, []
            return
        params = dict(self.model.named_parameters())
        self._ema = {name: self._ema[name] if name in self._ema else p.detach().clone()
                     for name, p in params.items() if p.requires_grad}
        self._ema_pairs = [(value, params[name]) for name, value in self._ema.items()]

    def after_step(self, step: int) -> None:
        d = self.args.ema_decay
        with torch.no_grad():
            for value, p in self._ema_pairs:
                value.lerp_(p.detach(), 1 - d)  # value <- d value + (1 - d) p

    def teacher_logits(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """(B, T, V) logits of the EMA model with every MoE layer dense (no gradient)."""
        kwargs = dict(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False)
        with torch.no_grad(), dense_routing(self.model):
            logits = torch.func.functional_call(self.model, self._ema, (), kwargs).logits
        load_balancing_loss(self.model)  # drop the teacher's balancing term
        return logits

    def loss(self, batch, step):
        a = self.args
        teacher = self.teacher_logits(batch) if a.eesd_weight > 0 else None
        out = self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                         labels=batch["labels"], use_cache=False)
        lm = out.loss
        lb = load_balancing_loss(self.model)
        total, parts = lm + lb, {"lm": lm.item(), "lb": lb.item()}
        if teacher is not None:
            kl = eesd_loss(out.logits, teacher, batch["labels"], a.eesd_temperature)
            total = total + a.eesd_weight * kl
            parts["eesd"] = kl.item()
        return total, parts

    # ---- task end, records, resume ------------------------------------------------------
    def after_task(self, stage: Stage) -> None:
        probe, self._probe = self._probe, None
        if probe is None or self._record is None:
            return
        holders = {i: _RoutingStats(probe["first"][i], self.args.experts_per_task, c)
                   for i, c in probe["centroids"].items()}
        self._record["lm_end"] = _r(self._forward_rows(probe["rows"], lambda i, m, x, y: holders[i].add(m, x, y)))
        for rec in self._record["layers"]:
            rec["end_routing"] = holders[rec["layer"]].report()

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "ema": {n: v.detach().clone() for n, v in self._ema.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)  # rebuilds the layout, sets what trains
        params = dict(self.model.named_parameters())
        self._ema = {n: v.to(params[n].device, params[n].dtype) for n, v in state["ema"].items()}
        self._ema_pairs = [(v, params[n]) for n, v in self._ema.items()]

    def param_report(self) -> dict[str, Any]:
        report = super().param_report()
        ema = sum(v.numel() for v in self._ema.values())
        report["total"] += ema  # held while training; never deployed
        report["ema_teacher"] = ema
        if self._record is not None:
            report["cluster_init"] = self._record
        return report

    @classmethod
    def param_schedule(cls, model: nn.Module, n_tasks: int, args: ClusterUpcycleArgs) -> list[dict[str, Any]]:
        """Shapes only: each stage adds a group of K experts (placeholder slices: the
        fitted ones need the task's data) and the EMA copy of what trains."""
        method = cls(args, context=None)
        method._placeholders = True
        method.setup(model)
        rows = []
        for t in range(n_tasks):
            method.before_task(Stage(t, [], f"task {t}"))
            rows.append({"stage": t, **method.param_report()})
        return rows
