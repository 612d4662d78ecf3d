"""CaRE: bi-level routing over per-task adapters (ICML 2026, arXiv 2602.03473; code
LMMMEng/CaRE), adapted to a frozen decoder LLM on TRACE as
reference/seed-methods.md, section (c), lays out.

Block. The LLM stays frozen. In every decoder layer l a BR-MoE runs beside the
MLP on z_a, the residual after attention:
    z' = z_a + MLP(N2 z_a) + sum_{r in S} sum_{e <= r} a^r_e E_e(z_a) + Ebar(z_a)
(the paper's ViT block; N2 is the layer's own post-attention norm, which moves
inside the wrapper, so the MLP sees exactly what it saw before). Task t adds one
triplet per layer:
- expert E_t: RMSNorm -> Linear(d, 16) -> ReLU -> dropout 0.1 -> Linear(16, d)
  -> x per-channel scale, the scale initialised to 0 (a fresh expert starts
  silent; from task 2 on E_t starts as a mean of earlier experts, below);
- router R_t: Linear(d, t+1), one logit per expert 0..t;
- perceiver C_t: RMSNorm -> Linear(d, G), G = 8 pseudo-classes.
Ebar, the shared adapter, is an expert of width 64 (`shared_dim`, scale from 0
too), present from the start. With every scale at 0 the model is the base
model exactly.

Routing, per sequence. c_i = the mean of E_i(z_a) over the sequence's prompt
tokens (as the code, which reads the CLS token of E_i(z_a); `router_input=
residual` pools z_a itself, the paper note's reading). Which tokens are the
prompt, in training (labels -100), at the prefill (left padded: every attended
token) and at decode steps (none: the prefill's routing is reused from a
per-layer cache), and that position 0 (the first attended token) is left out:
cl_bench/prompt_pool.py. Pooling is non-causal within the prompt, so the
prefill must hold the whole prompt; a chunked prefill is refused.
Then, per layer and sequence,
    H_i = entropy(softmax(C_i(c_i)))       (fp32)
    a^i = softmax(R_i(c_i) with logits outside the top K set to -100)   (K = 3)
    S   = training task t: {t} + the M-1 routers i < t of lowest H_i;
          inference: the M routers of lowest H_i                         (M = 2)
The routers' weights are summed over S (the output grows with M after task 0,
as in the code) and applied to every token of the sequence. All experts run
densely. Entropies, router and perceiver logits are computed in fp32.

Perceiver (pseudo-class, "chosen" in the reference notes). At the start of task
t the task's training prompts go through the frozen base model; their
final-layer hidden states (after the final norm) are mean-pooled over the same
prompt tokens, L2-normalised and clustered by k-means (k-means++ seeding from
the run seed and the stage, Lloyd iterations; chosen) into G = 8 groups: the
pseudo-labels y. G is the same for every task, so entropies compare across
tasks. A training row's label is looked up by its prompt's token ids; a prompt
not seen at clustering gets its nearest centroid.

Loss (layer-wise supervision of the code, its classifier replaced by the LM):
    L = LM + lambda * (1/L) sum_l 1/2 [ CE(s * C_t^l(c_t^l), y)
                                        + T_l^2 KL(softmax(sg(C_t^L)/T_l) || softmax(C_t^l/T_l)) ]
LM: cross-entropy on answer tokens (+ EOS); s = 20; lambda = 1; T_l = 1 in the
lower half of the layers, 2 in the upper half; the teacher is the detached
last-layer perceiver (the code's teacher, the final classifier's logits, does
not exist here). The entropy and the KL read C's raw logits, the CE s times
them, as the code.

Trainable in task t: E_t, R_t, C_t of every layer and Ebar; every earlier
triplet is frozen (out of the optimiser, so exactly fixed). Ebar trains freely
in task 0; from task 1 on it is pulled back after every optimiser step,
    Ebar <- mu * Ebar_start + (1 - mu) * Ebar,   mu = 0.999 (`anchor`),
Ebar_start its value when the task began: nearly frozen (the paper's "EMA").

Schedule: AdamW, lr 5e-4, linear warm-up over the first 3% of a task's steps,
then cosine to 0 (per task; betas (0.9, 0.95) and weight decay 0 as
MethodArgs: chosen, the notes give none). Each task is one stage (no
classifier alignment: no classifier).

Defaults and sources. From the code (reference notes): expert width 16, shared
width 64, dropout 0.1, M = 2, K = 3, s = 20, T_l 1/2, lambda = 1, anchor 0.999,
router and perceiver weights trunc-normal(0.02), biases 0, the perceiver
norm's gain trunc-normal(0.02) (a quirk of the code kept on purpose: with
s = 20 it keeps s * C's logits near unit scale at the start), a new E_t the mean
of E_0..E_{t-2} (the code leaves out the most recent expert; E_0 and E_1 start
fresh). From the reference notes' adaptation: G = 8, AdamW 5e-4, 3% warm-up,
cosine, RMSNorm for LayerNorm, sequence-level pooling. Chosen (no published
value): the adapters' Linear layers trunc-normal(0.02) with zero biases, as
the router and perceiver (not nn.Linear's Kaiming-uniform, whose std
1/sqrt(3 fan_in) would be 0.14 for the up-projection from width 16); every
trunc-normal here is torch's, cut at +-2 absolute, so at std 0.02 the cut never
bites and the std is 0.02; the
k-means details (L2-normalised features, k-means++, <= 50 iterations); the
diagnostics below (16 test examples per seen task, 0 turns them off).

Records. Per step (metrics.jsonl): lm, perceiver (the bracketed term),
perceiver_ce, perceiver_kl, task_id_acc (share of the batch's rows whose
lowest-entropy perceiver is the task's own, mean over layers). Per stage
(run.json "params"), on the first `diag_examples` test examples of every seen
task (diag_n: how many; read for this record only, never trained on), in eval
mode: task_id_acc per layer (the lowest-entropy perceiver is the example's
task) and task_id_acc_by_task; answer_ce, the answer-token cross-entropy with
the model's own entropy routing, and answer_ce_oracle with the task's router
forced as in its training (R_j plus the M-1 lowest-entropy routers i < j);
oracle_gap, the mean of their differences (nats; a run with oracle routing is
impossible, as the harness evaluates every task through one model without its
task ID). Also pseudo_label_sizes; shared_drift = ||Ebar - Ebar_start|| /
||Ebar_start|| over the task (task 0: from initialisation) and
shared_drift_since_task0 (against Ebar after task 0). And perceiver_ce_end:
the mean perceiver_ce of the stage's last ceil(10%) of steps (at least one; the
current perceivers on the training batches, as logged). perceiver_uniform is
true when |perceiver_ce_end - ln G| <= 0.05 ln G (0.10 nats at G = 8;
UNIFORM_CE_TOL): the perceivers still give s * logits about as flat as
uniform, so their entropies cannot tell this task from others, and entropy
routing decides nothing. Such a stage logs a warning and lists it in warnings
(a list of messages, empty when none).

Differences from the code and the paper, and why:
- Sequence-level routing on prompt tokens replaces the CLS token; perceivers
  predict k-means pseudo-classes instead of the task's classes (TRACE tasks
  have no shared class set; reference notes, adaptation).
- No cosine classifier, no classifier alignment: the LM loss replaces both.
- Single pass at inference (the code's `iter_pred`, T+1 passes, is not
  reproduced, as the notes ask).
- The anchor pull runs after each optimiser step rather than before each
  forward: every forward sees the same weights as in the code; only the final
  weights differ (pulled here, un-pulled there, by one step's update).
- One anchor per task (the code re-anchors halfway through a task, at its
  classifier alignment, which does not exist here).
- The harness weights micro-batch losses by their answer tokens; the perceiver
  term is a mean over sequences, so it follows that weighting too.
"""
from __future__ import annotations

import hashlib
import logging
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from cl_bench.data import IGNORE, Encoder, collate
from cl_bench.errors import UserError
from cl_bench.method import Method, MethodArgs, Stage
from cl_bench.models.moe import decoder_layers
from cl_bench.models.params import count
from cl_bench.prompt_pool import DECODE, PromptPool, masked_mean, prompt_mask
from cl_bench.registry import register_method

ROUTER_INPUTS = ("expert", "residual")
UNIFORM_CE_TOL = 0.05  # perceiver_uniform: |CE - ln G| <= this share of ln G (module docstring)

log = logging.getLogger(__name__)

# Letters: B batch, T tokens, d width, n triplets in a layer (tasks so far), G
# pseudo-classes, L decoder layers.


@dataclass
class CareArgs(MethodArgs):
    lr: float = 5e-4  # AdamW (reference notes, adaptation)
    warmup: float = 0.03  # share of a task's steps with linear warm-up; cosine to 0 after
    expert_dim: int = 16  # bottleneck of each task's expert
    shared_dim: int = 64  # bottleneck of the shared adapter Ebar
    dropout: float = 0.1  # inside the adapters
    routers: int = 2  # M: routers summed per sequence
    top_k: int = 3  # K: experts kept per router
    pseudo_classes: int = 8  # G: k-means groups per task, the perceivers' outputs
    logit_scale: float = 20.0  # s: the perceiver CE reads s * logits
    perceiver_weight: float = 1.0  # lambda
    kl_temp_low: float = 1.0  # T_l in the lower half of the layers
    kl_temp_high: float = 2.0  # T_l in the upper half
    anchor: float = 0.999  # mu: Ebar's pull back to its task-start value, tasks >= 1
    router_input: str = "expert"  # expert: pool E_i(z_a) (code); residual: pool z_a (paper note)
    init_std: float = 0.02  # trunc-normal std of the new Linear weights and the perceiver gain
    kmeans_iters: int = 50  # Lloyd iterations at most (chosen)
    diag_examples: int = 16  # test examples per seen task for the stage record; 0: none (chosen)

    def __post_init__(self):
        for name in ("expert_dim", "shared_dim", "routers", "top_k", "pseudo_classes", "kmeans_iters"):
            if getattr(self, name) < 1:
                raise UserError(f"method_args.{name}={getattr(self, name)} must be >= 1")
        if not 0 <= self.dropout < 1 or not 0 <= self.warmup < 1 or not 0 <= self.anchor <= 1:
            raise UserError(f"method_args: dropout ({self.dropout}) and warmup ({self.warmup}) must be "
                            f"in [0, 1), anchor ({self.anchor}) in [0, 1]")
        for name in ("logit_scale", "kl_temp_low", "kl_temp_high", "lr"):
            if getattr(self, name) <= 0:
                raise UserError(f"method_args.{name}={getattr(self, name)} must be > 0")
        for name in ("perceiver_weight", "init_std", "diag_examples"):
            if getattr(self, name) < 0:
                raise UserError(f"method_args.{name}={getattr(self, name)} must be >= 0")
        if self.router_input not in ROUTER_INPUTS:
            raise UserError(f"method_args.router_input={self.router_input!r}: choose one of "
                            f"{', '.join(ROUTER_INPUTS)}")


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


def perceiver_loss(logits: list[torch.Tensor], labels: torch.Tensor, scale: float,
                   temps: list[float]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(1/L) sum_l 1/2 [CE(scale * z_l, y) + T_l^2 KL(softmax(sg(z_L)/T_l) || softmax(z_l/T_l))]
    over the layers' current perceiver logits z_l (B, G); returns (loss, mean CE, mean KL)."""
    teacher = logits[-1].detach()
    ces, kls = [], []
    for z, temp in zip(logits, temps):
        ces.append(F.cross_entropy(scale * z, labels))
        kls.append(temp ** 2 * F.kl_div((z / temp).log_softmax(-1), (teacher / temp).log_softmax(-1),
                                        reduction="batchmean", log_target=True))
    ce, kl = torch.stack(ces).mean(), torch.stack(kls).mean()
    return 0.5 * (ce + kl), ce, kl


def kmeans(x: torch.Tensor, k: int, iters: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Lloyd's k-means with k-means++ seeding: x (N, d) -> (labels (N,), centroids (k', d)),
    k' = min(k, N). An emptied cluster keeps its centroid. The labels are the final
    nearest-centroid assignment."""
    n = x.shape[0]
    if n <= k:
        return torch.arange(n), x.clone()
    centroids = x[torch.randint(n, (1,), generator=generator)]
    for _ in range(k - 1):
        d2 = torch.cdist(x, centroids).min(dim=1).values.pow(2)  # (N,)
        if d2.sum() <= 0:  # fewer distinct points than k
            pick = torch.randint(n, (1,), generator=generator)
        else:
            pick = torch.multinomial(d2 / d2.sum(), 1, generator=generator)
        centroids = torch.cat([centroids, x[pick]])
    for _ in range(iters):
        labels = torch.cdist(x, centroids).argmin(dim=1)
        sums = torch.zeros_like(centroids).index_add(0, labels, x)
        sizes = torch.bincount(labels, minlength=k).unsqueeze(1)
        moved = torch.where(sizes > 0, sums / sizes.clamp(min=1), centroids)
        if torch.equal(moved, centroids):
            break
        centroids = moved
    return torch.cdist(x, centroids).argmin(dim=1), centroids


def lr_factor(step: int, n_steps: int, warmup: float) -> float:
    """Linear warm-up over ceil(warmup * n_steps) steps, then cosine from 1 to 0."""
    w = math.ceil(warmup * n_steps)
    if step < w:
        return (step + 1) / w
    return 0.5 * (1 + math.cos(math.pi * (step - w) / max(1, n_steps - w)))


# ---- the layer -----------------------------------------------------------------------

@dataclass
class _Control:
    """Shared by the method and its layers: how the running forward routes."""

    pool: PromptPool
    forced: torch.Tensor | None = None  # (B,): the router each row must use (training, oracle)
    bypass: bool = False  # the frozen base model alone (pseudo-label features)
    records: list | None = None  # a list: each layer appends its routing record (depth order)


class CareMLP(nn.Module):
    """A decoder layer's MLP slot: MLP(N2 z_a) + routed experts + Ebar; input z_a (B, T, d),
    the layer's post-attention norm N2 moved in here."""

    def __init__(self, norm: nn.Module, mlp: nn.Module, d: int, eps: float, args: CareArgs,
                 control: _Control):
        super().__init__()
        self.norm = norm
        self.mlp = mlp
        self.shared = Adapter(d, args.shared_dim, args.dropout, eps, args.init_std)
        self.triplets = nn.ModuleList()
        self.d, self.eps, self.args = d, eps, args
        self.control = control
        self.routing: torch.Tensor | None = None  # (B, n): the last pooled forward's weights

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


# ---- the method -----------------------------------------------------------------------

@register_method("care")
class CaRE(Method):
    description = ("CaRE: per-task adapter, router and perceiver in every layer; routers chosen by "
                   "lowest perceiver entropy, anchored shared adapter, frozen LLM")
    Args = CareArgs
    zero_unsupported = dict.fromkeys((2, 3), (
        "after_step pulls the shared adapter toward its task-start value in place, which the engine's fp32 "
        "master weights (ZeRO-2) would overwrite and partitioned weights (ZeRO-3) do not hold"))

    def setup(self, model: nn.Module) -> None:
        self.model = model
        model.requires_grad_(False)
        config = getattr(model, "config", None)
        d = getattr(config, "hidden_size", None)
        if d is None:
            raise UserError(f"care: {type(model).__name__} has no config.hidden_size; only Hugging Face "
                            f"causal LMs are supported")
        eps = getattr(config, "rms_norm_eps", 1e-6)
        self.control = _Control(PromptPool())
        self.layers: list[CareMLP] = []
        for i, block in enumerate(decoder_layers(model)):
            if not (hasattr(block, "post_attention_layernorm") and hasattr(block, "mlp")):
                raise UserError(f"care: decoder layer {i} ({type(block).__name__}) has no "
                                f"post_attention_layernorm and mlp; only Llama-style layers are supported")
            like = next(block.mlp.parameters())
            layer = CareMLP(block.post_attention_layernorm, block.mlp, d, eps, self.args, self.control)
            layer.shared.to(device=like.device, dtype=like.dtype)
            block.post_attention_layernorm = nn.Identity()  # now inside `layer`, before the MLP
            block.mlp = layer
            self.layers.append(layer)
        self.control.pool.install(model)
        self._task = 0
        self._optimizer: torch.optim.Optimizer | None = None
        self._n_steps: int | None = None
        self._anchor: list[torch.Tensor] | None = None
        self._shared_start = self._shared_vector()
        self._shared_task0: torch.Tensor | None = None
        self._labels: dict[bytes, int] = {}
        self._centroids: torch.Tensor | None = None
        self._record: dict[str, Any] = {}
        self._perceiver_ce: dict[int, list[float]] = {}  # step -> perceiver_ce of its micro-batches
        self._set_trainable()

    # ---- task start ---------------------------------------------------------------
    def before_task(self, stage: Stage) -> None:
        t = self._task = stage.index
        for layer in self.layers:
            while len(layer.triplets) < t + 1:  # idempotent: a resumed run rebuilt the earlier ones
                layer.add_triplet()
        self._set_trainable()
        self._shared_start = self._shared_vector()
        if t >= 1 and self._shared_task0 is None:
            self._shared_task0 = self._shared_start
        self._anchor = ([p.detach().clone() for p in self._shared_params()]
                        if t >= 1 and self.args.anchor > 0 else None)
        self._n_steps = self.stage_steps(stage)
        self._record, self._perceiver_ce = {}, {}
        self._labels, self._centroids = {}, None
        if self.ctx is not None and stage.tasks:
            self._cluster(stage)

    def _set_trainable(self) -> None:
        self.model.requires_grad_(False)
        for layer in self.layers:
            layer.shared.requires_grad_(True)
            if len(layer.triplets) > self._task:
                layer.triplets[self._task].requires_grad_(True)

    def _shared_params(self) -> list[nn.Parameter]:
        return [p for layer in self.layers for p in layer.shared.parameters()]

    def _shared_vector(self) -> torch.Tensor:
        flat = torch.cat([p.detach().float().flatten() for p in self._shared_params()])
        return flat if flat.is_meta else flat.cpu()  # meta: `cl-bench params` (shapes only)

    def _encoder(self) -> Encoder:
        return Encoder.from_config(self.ctx.tokenizer, self.ctx.config.train)

    def _device(self) -> torch.device:
        return next(self.model.parameters()).device

    # ---- pseudo-labels ----------------------------------------------------------------
    def _cluster(self, stage: Stage) -> None:
        """k-means pseudo-labels of the stage's training prompts (module docstring)."""
        a, encoder = self.args, self._encoder()
        prompts = [encoder.prompt_ids(e.prompt) for task in stage.tasks for e in task.train]
        if not prompts:
            return
        pad = self.ctx.tokenizer.pad_token_id
        size = self.ctx.config.train.micro_batch_size
        feats = []
        for start in range(0, len(prompts), size):
            rows = [{"input_ids": p, "labels": [IGNORE] * len(p)} for p in prompts[start:start + size]]
            b = {k: v.to(self._device()) for k, v in collate(rows, pad).items()}
            feats.append(self._base_features(b["input_ids"], b["attention_mask"]))
        x = F.normalize(torch.cat(feats).cpu(), dim=-1)  # (N, d)
        seed = int.from_bytes(hashlib.sha256(f"{self.ctx.config.seed}/care/{stage.index}".encode())
                              .digest()[:8], "big") >> 1
        labels, self._centroids = kmeans(x, a.pseudo_classes, a.kmeans_iters,
                                         torch.Generator().manual_seed(seed))
        self._labels = {_key(p): int(y) for p, y in zip(prompts, labels)}
        self._record["pseudo_label_sizes"] = torch.bincount(labels, minlength=a.pseudo_classes).tolist()

    @torch.no_grad()
    def _base_features(self, ids: torch.Tensor, mask: torch.Tensor,
                       labels: torch.Tensor | None = None) -> torch.Tensor:
        """The frozen base model's final hidden states pooled over the prompt: (B, d) fp32."""
        was_training = self.model.training
        self.model.eval()
        self.control.bypass = True
        try:
            hidden = self.model.base_model(input_ids=ids, attention_mask=mask).last_hidden_state
        finally:
            self.control.bypass = False
            self.model.train(was_training)
        return masked_mean(hidden, prompt_mask(mask, labels))

    def _batch_labels(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Pseudo-labels (B,) of a training batch, by each row's prompt token ids."""
        ids, labels, mask = batch["input_ids"], batch["labels"], batch["attention_mask"]
        prompt = (labels == IGNORE) & mask.bool()
        keys = [_key(ids[b][prompt[b]].tolist()) for b in range(ids.shape[0])]
        missing = [b for b, k in enumerate(keys) if k not in self._labels]
        if missing:
            if self._centroids is None:
                raise RuntimeError("care: no pseudo-label clusters for this task (before_task ran "
                                   "without training data)")
            feats = F.normalize(self._base_features(ids[missing], mask[missing], labels[missing]).cpu(), dim=-1)
            for b, y in zip(missing, torch.cdist(feats, self._centroids).argmin(dim=1).tolist()):
                self._labels[keys[b]] = y
        return torch.tensor([self._labels[k] for k in keys], device=ids.device)

    # ---- training -----------------------------------------------------------------------
    def optimizer_for_stage(self, stage, previous):
        self._optimizer = super().optimizer_for_stage(stage, previous)
        return self._optimizer

    def _forward(self, batch: dict[str, torch.Tensor], forced: int | torch.Tensor | None):
        """The model on `batch` (labels included) with `forced` routers; returns the output
        and each layer's routing record."""
        control = self.control
        if isinstance(forced, int):
            forced = torch.full((batch["input_ids"].shape[0],), forced, dtype=torch.long,
                                device=batch["input_ids"].device)
        control.forced, control.records = forced, []
        try:
            out = self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                             labels=batch["labels"], use_cache=False)
            records = control.records
        finally:
            control.forced, control.records = None, None
        return out, records

    def temperatures(self) -> list[float]:
        n = len(self.layers)
        return [self.args.kl_temp_low if l < n // 2 else self.args.kl_temp_high for l in range(n)]

    def loss(self, batch, step):
        t, a = self._task, self.args
        y = self._batch_labels(batch)
        out, records = self._forward(batch, t)
        lm = out.loss
        logits = [r["perceiver"][t] for r in records]  # L x (B, G): the current perceivers
        pc, ce, kl = perceiver_loss(logits, y, a.logit_scale, self.temperatures())
        hits = torch.stack([(r["entropy"].argmin(dim=1) == t).float().mean() for r in records])
        self._perceiver_ce.setdefault(step, []).append(ce.item())
        return lm + a.perceiver_weight * pc, {"lm": lm.item(), "perceiver": pc.item(), "perceiver_ce": ce.item(),
                                              "perceiver_kl": kl.item(), "task_id_acc": hits.mean().item()}

    def before_step(self, step: int) -> None:
        if self._optimizer is not None and self._n_steps:
            lr = self.args.lr * lr_factor(step, self._n_steps, self.args.warmup)
            for group in self._optimizer.param_groups:
                group["lr"] = lr

    @torch.no_grad()
    def after_step(self, step: int) -> None:
        if self._anchor is not None:  # Ebar <- mu * Ebar_start + (1 - mu) * Ebar
            for p, start in zip(self._shared_params(), self._anchor):
                p.lerp_(start, self.args.anchor)

    # ---- task end -----------------------------------------------------------------------
    def after_task(self, stage: Stage) -> None:
        now = self._shared_vector()
        self._record["shared_drift"] = _round(_relative(now, self._shared_start))
        self._record["shared_drift_since_task0"] = (None if self._shared_task0 is None
                                                    else _round(_relative(now, self._shared_task0)))
        self._record.update(self._uniformity(stage))
        if self.ctx is not None and self.args.diag_examples > 0:
            self._record.update(self.diagnostics(self.ctx.all_tasks[:stage.index + 1]))

    def _uniformity(self, stage: Stage) -> dict[str, Any]:
        """perceiver_ce_end, perceiver_uniform and warnings of the stage (module docstring)."""
        steps = sorted(self._perceiver_ce)
        if not steps:
            return {"perceiver_ce_end": None, "perceiver_uniform": None, "warnings": []}
        tail = [ce for s in steps[-math.ceil(0.1 * len(steps)):] for ce in self._perceiver_ce[s]]
        ce_end, uniform_ce = sum(tail) / len(tail), math.log(self.args.pseudo_classes)
        uniform = abs(ce_end - uniform_ce) <= UNIFORM_CE_TOL * uniform_ce
        warnings = []
        if uniform:
            warnings.append(f"stage {stage.index} ({stage.label}): the perceivers' cross-entropy at the "
                            f"stage's end, {ce_end:.4f}, is within {UNIFORM_CE_TOL:.0%} of ln G = "
                            f"{uniform_ce:.4f} (uniform): they did not learn the pseudo-classes, so "
                            f"entropy routing cannot tell this task apart")
            log.warning("care: %s", warnings[-1])
        return {"perceiver_ce_end": _round(ce_end), "perceiver_uniform": uniform, "warnings": warnings}

    @torch.no_grad()
    def diagnostics(self, tasks: list) -> dict[str, Any]:
        """Per-layer task-ID accuracy and the oracle gap on the first `diag_examples`
        test examples of each of `tasks` (task j = the j-th triplet)."""
        encoder, n_layers = self._encoder(), len(self.layers)
        pad, size = self.ctx.tokenizer.pad_token_id, self.ctx.config.train.micro_batch_size
        was_training = self.model.training
        self.model.eval()
        hits_all, seen = torch.zeros(n_layers), 0
        by_task, ce_entropy, ce_oracle, counts = {}, {}, {}, {}
        try:
            for j, task in enumerate(tasks):
                rows = [encoder.train_example(e.prompt, e.answer) for e in task.test[:self.args.diag_examples]]
                hits, sums, tokens = torch.zeros(n_layers), [0.0, 0.0], 0
                for start in range(0, len(rows), size):
                    b = {k: v.to(self._device()) for k, v in collate(rows[start:start + size], pad).items()}
                    n_tok = int((b["labels"][:, 1:] != IGNORE).sum())
                    out, records = self._forward(b, None)
                    hits += torch.stack([(r["entropy"].argmin(dim=1) == j).float().sum() for r in records]).cpu()
                    sums[0] += out.loss.item() * n_tok
                    sums[1] += self._forward(b, j)[0].loss.item() * n_tok
                    tokens += n_tok
                if not rows:
                    continue
                counts[task.name] = len(rows)
                by_task[task.name] = [_round(h / len(rows)) for h in hits.tolist()]
                ce_entropy[task.name] = _round(sums[0] / max(tokens, 1))
                ce_oracle[task.name] = _round(sums[1] / max(tokens, 1))
                hits_all += hits
                seen += len(rows)
        finally:
            self.model.train(was_training)
        if not seen:
            return {}
        gaps = [ce_entropy[k] - ce_oracle[k] for k in ce_entropy]
        return {"diag_n": counts,
                "task_id_acc": [_round(h / seen) for h in hits_all.tolist()],
                "task_id_acc_by_task": by_task, "answer_ce": ce_entropy, "answer_ce_oracle": ce_oracle,
                "oracle_gap": _round(sum(gaps) / len(gaps))}

    # ---- records and resume ---------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"tasks": len(self.layers[0].triplets), "shared_task0": self._shared_task0}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # Before the weights load: rebuild the triplets so their keys have somewhere to go.
        for layer in self.layers:
            while len(layer.triplets) < state["tasks"]:
                layer.add_triplet()
        self._shared_task0 = state["shared_task0"]

    def param_report(self) -> dict[str, Any]:
        report = count(self.model)  # every adapter runs on every token: active = deployed = total
        report["experts_per_layer"] = [len(layer.triplets) for layer in self.layers]
        report.update(self._record)
        return report


def _key(ids: list[int]) -> bytes:
    return hashlib.sha1(torch.tensor(ids, dtype=torch.long).numpy().tobytes()).digest()


def _relative(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x - ref).norm() / ref.norm().clamp(min=1e-12))


def _round(x) -> float:
    return round(float(x), 6)
