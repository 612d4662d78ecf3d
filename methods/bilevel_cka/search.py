"""The bilevel-cka search: the mask schedule fitted to a task, what a task holds
while it trains (the supernets, the masks), the outer step on the mask logits
alpha, and the deep-layer features the CKA term compares.

    L_out = L_replay(pi) - gamma * G + beta * B(r),   G = sg(L_recycle - L_expand) * r,  r = mean(pi)
    N_eff = min(N, max(1, steps // min_mask_updates)),  U = steps // N_eff
    rho_eff = min(rho, (tau_final / tau0)^(1 / U)),  mask_lr_eff = max(mask_lr, min(g0, R / 2) / U)

Adam on alpha every N_eff optimiser steps; tau_k = max(tau_final, tau0 * rho_eff^k)
after update k.

Source: CKA-guided bilevel MoE upcycling (ICML 2026), as METHODS.md ("bilevel-cka").

Differs from the paper/code (why: docs/methods/bilevel-cka.md, "Schedule"):
- N, rho and mask_lr are fitted to each task's step count, so tau reaches
  tau_final within the task and Recycle stays reachable (the code's tau ends
  near 3.4; the paper's ~78 updates keep mask_lr);
- the CKA reference is the model before the task on each step's replay batch (its
  features cached per replay row for the task), not cached task-0 activations.
"""
from __future__ import annotations

import contextlib
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from cl_bench.data.encode import IGNORE
from cl_bench.errors import UserError
from cl_bench.method import Stage, lm_loss
from cl_bench.models.modes import eval_mode, substituted
from cl_bench.models.moe import decoder_layers

from .supernet import Supernet, balance, straight_through_gumbel

if TYPE_CHECKING:
    from .args import BilevelCKAArgs

CHECK_BATCHES = 4  # task micro-batches (the last ones) the deploy check at finalisation runs on


def mask_schedule(n_steps: int | None, args: BilevelCKAArgs) -> tuple[int, int | None, float]:
    """(N_eff, outer updates U, rho_eff) for a task of `n_steps` optimiser steps
    (None: unknown, the arguments as given); see the module docstring and
    docs/methods/bilevel-cka.md, "Schedule"."""
    every, decay = args.mask_every, args.tau_decay
    if n_steps is None:
        return every, None, decay
    if args.min_mask_updates:
        every = max(1, min(every, n_steps // args.min_mask_updates))
    updates = n_steps // every
    if updates and args.tau0 * decay ** updates > args.tau_final:
        decay = (args.tau_final / args.tau0) ** (1 / updates)
    return every, updates, decay


def reachable_mask_lr(updates: int | None, init_gap: float, mask_lr: float, reach: float) -> float:
    """mask_lr_eff = max(mask_lr, min(g0, R / 2) / U): Adam moves each logit by at most
    ~lr per update, so the expand - recycle gap moves at most 2 U lr in U updates;
    this lr lets a gap g0 reach -g0, but never lets the task's updates move a gap by
    more than R = `reach` (the paper's 2 * 78 * 0.01) where mask_lr alone would not:
    a guided init's spread (up to ~5) stays larger than what a push common to every
    slot can undo (module docstring). U None (unknown): mask_lr."""
    if not updates:
        return mask_lr
    return max(mask_lr, min(init_gap, reach / 2) / updates)


def no_update_error(stage: Stage, n_steps: int, args: BilevelCKAArgs) -> UserError:
    return UserError(
        f"bilevel-cka: stage {stage.index} ({stage.label}) takes {n_steps} optimiser steps, fewer than "
        f"method_args.mask_every={args.mask_every} with method_args.min_mask_updates=0, so its masks "
        f"would get no outer update and every decision would be the initialisation; set "
        f"min_mask_updates >= 1 (the default 4 fits N to the task) or mask_every <= {max(n_steps, 1)}")


@dataclass
class TaskSearch:
    """What one task t >= 1 holds while it trains."""

    nets: dict[int, Supernet]  # candidate decoder layer -> its supernet, in candidate order
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
    init: torch.Tensor | None = None  # alpha at the start (L_c, K, 2), as the search got it
    guidance: dict | None = None  # mask_init=guided: what the init was computed from (guidance.py)
    updates: int = 0
    pi: torch.Tensor | None = None  # (L_c, K): this step's sample
    pi_step: int = -1
    task_batch: dict | None = None  # the last task micro-batch (outer step)
    task_batches: deque = field(default_factory=lambda: deque(maxlen=CHECK_BATCHES))  # deploy check
    replay_batch: dict | None = None  # the last replay micro-batch (final CKA)
    # the CKA reference's features per row: (autocast dtype, token ids) -> {layer: (n, d)}
    reference: dict[tuple, dict[int, torch.Tensor]] = field(default_factory=dict)
    cka: list[list[float]] = field(default_factory=list)  # per replay step, per deep layer

    def state_dict(self) -> dict[str, Any]:
        """What the task's steps have changed so far (an in-stage checkpoint); the rest
        (supernets, snapshot, schedule) is what before_task builds again."""
        return {"generator": self.generator.get_state(), "tau": self.tau, "updates": self.updates,
                "logits": None if self.logits is None else self.logits.detach().clone(),
                "optimizer": None if self.optimizer is None else self.optimizer.state_dict(),
                "pi": self.pi, "pi_step": self.pi_step, "task_batch": self.task_batch,
                "task_batches": list(self.task_batches), "replay_batch": self.replay_batch, "cka": self.cka}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.generator.set_state(state["generator"])
        self.tau, self.updates, self.pi, self.pi_step = state["tau"], state["updates"], state["pi"], state["pi_step"]
        if self.logits is not None:
            with torch.no_grad():
                self.logits.copy_(state["logits"])
            self.optimizer.load_state_dict(state["optimizer"])
        self.task_batch, self.replay_batch, self.cka = state["task_batch"], state["replay_batch"], state["cka"]
        self.task_batches.clear()
        self.task_batches.extend(state["task_batches"])

    @contextlib.contextmanager
    def pre_task(self):
        """Inside: every supernet is the layer before the task (pi None, no clones)."""
        pi = [net.pi for net in self.nets.values()]
        for net in self.nets.values():
            net.pi = None
        try:
            yield
        finally:
            for net, p in zip(self.nets.values(), pi):
                net.pi = p

    def set_masks(self, pi: torch.Tensor) -> None:
        """pi (L_c, K): row c gates the clones of the c-th candidate layer."""
        for c, net in enumerate(self.nets.values()):
            net.pi = pi[c]

    def step_masks(self, step: int, K: int, device: torch.device) -> torch.Tensor:
        """This step's pi (L_c, K): one sample per optimiser step, from alpha without
        its gradient (the inner step trains the model, not alpha); all ones with mask=off."""
        if self.pi_step != step:
            self.pi_step = step
            if self.logits is None:
                self.pi = torch.ones(len(self.nets), K, device=device)
            else:
                self.pi = straight_through_gumbel(self.logits.detach(), self.tau, self.generator)[..., 1]
        return self.pi


def outer_step(model: nn.Module, task: TaskSearch, replay: dict, args: BilevelCKAArgs, pi: torch.Tensor | None = None,
               l_replay: torch.Tensor | None = None) -> dict[str, float]:
    """One Adam step on the mask logits (module docstring); the model's gradients stay
    untouched. `pi`, `l_replay`: a sample and the replay loss already computed with it
    (outer_sample=shared: their graph is kept for the inner backward); else drawn here."""
    given = pi is not None
    if not given:
        pi = straight_through_gumbel(task.logits, task.tau, task.generator)[..., 1]  # (L_c, K)
        task.set_masks(pi)
        l_replay = lm_loss(model, replay)
    with torch.no_grad():
        task.set_masks(torch.ones_like(pi))
        l_expand = lm_loss(model, task.task_batch)
        task.set_masks(torch.zeros_like(pi))
        l_recycle = lm_loss(model, task.task_batch)
    rate = pi.mean()
    gain = (l_recycle - l_expand).detach() * rate
    bal = balance(rate, args.r_target)
    total = l_replay - args.gamma * gain + args.beta * bal
    (grad,) = torch.autograd.grad(total, [task.logits], retain_graph=given)
    task.logits.grad = grad
    task.optimizer.step()
    task.logits.grad = None
    task.updates += 1
    task.tau = max(args.tau_final, args.tau0 * task.decay ** task.updates)
    return {"mask_loss": total.item(), "mask_replay": l_replay.item(), "mask_gain": gain.item(),
            "mask_balance": bal.item(), "mask_rate": rate.item(), "tau": task.tau}


class LayerFeatures:
    """The outputs of the CKA layers (`layers`, decoder indices) of `model`: captured
    during forwards, reduced to at most `max_tokens` non-pad tokens."""

    def __init__(self, model: nn.Module, layers: list[int], max_tokens: int):
        self.model, self.layers, self.max_tokens = model, layers, max_tokens

    @contextlib.contextmanager
    def capture(self):
        """Collects the output (B, T, d) of each CKA layer during the forwards inside."""
        blocks = decoder_layers(self.model)
        feats: dict[int, torch.Tensor] = {}

        def hook(i):
            def store(module, inputs, output):
                feats[i] = output[0] if isinstance(output, tuple) else output  # (B, T, d)
            return store

        handles = [blocks[i].register_forward_hook(hook(i)) for i in self.layers]
        try:
            yield feats
        finally:
            for handle in handles:
                handle.remove()

    def tokens(self, h: torch.Tensor, batch: dict) -> torch.Tensor:
        """(B, T, d) -> (n, d): the non-pad tokens, at most max_tokens evenly spaced."""
        return self.spaced(h[batch["attention_mask"].bool()])

    def spaced(self, flat: torch.Tensor) -> torch.Tensor:
        """(n, d) -> (min(n, max_tokens), d): max_tokens rows evenly spaced when n is more."""
        n, m = flat.shape[0], self.max_tokens
        if n > m:
            flat = flat[torch.linspace(0, n - 1, m, device=flat.device).round().long()]
        return flat

    def of(self, batch: dict) -> dict[int, torch.Tensor]:
        """The CKA-layer tokens of `batch` through the model as it is, no gradient."""
        with torch.no_grad(), self.capture() as feats:
            self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False,
                       logits_to_keep=1)  # the layers' outputs are wanted, not the vocabulary logits
        return {l: self.tokens(feats[l], batch) for l in self.layers}

    def rows(self, batch: dict) -> list[tuple]:
        """The reference cache's key of each row of `batch`: (autocast dtype, its token ids)."""
        mask = batch["attention_mask"].bool()  # (B, T)
        lengths = mask.sum(dim=1)  # (B,)
        if not torch.equal(mask, torch.arange(mask.shape[1], device=mask.device) < lengths[:, None]):
            raise ValueError("bilevel-cka's CKA reference needs right-padded rows (the harness's collator)")
        kind = mask.device.type
        dtype = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else None
        return [(dtype, tuple(batch["input_ids"][i, :n].tolist())) for i, n in enumerate(lengths.tolist())]

    def reference(self, task: TaskSearch, batch: dict, refresh: list[tuple] = ()) -> dict[int, torch.Tensor]:
        """CKA-layer tokens of `batch` (as `tokens` picks them) through the model as it
        was before this task: every supernet without its clones (pi None) and the
        snapshot of whatever else trains. That model is fixed for the task, so each
        row's features come from its own forward, alone and unpadded, once per task:
        cached in `task.reference` under (autocast dtype, the row's token ids), all
        that decides them. A row's features so never depend on the rows beside it or
        on the padding (a batched forward's rounding does); the rows' non-pad tokens,
        in batch order, are then spaced as `tokens` spaces a batch's. `refresh`: keys
        computed again even when cached (`cl-bench perf step` times one row's forward)."""
        rows = self.rows(batch)
        missing = list(dict.fromkeys([*refresh, *(key for key in rows if key not in task.reference)]))
        if missing:
            with task.pre_task():
                for key in missing:
                    task.reference[key] = self._alone(task, key[1], batch["input_ids"].device)
        return {l: self.spaced(torch.cat([task.reference[key][l] for key in rows])) for l in self.layers}

    def _alone(self, task: TaskSearch, ids: tuple[int, ...], device: torch.device) -> dict[int, torch.Tensor]:
        """{layer: (n, d)}: one row's CKA-layer outputs, its own forward (B = 1, no padding)."""
        ids = torch.tensor([ids], device=device)  # (1, n)
        kwargs = dict(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False, logits_to_keep=1)
        with torch.no_grad(), self.capture() as feats, substituted(self.model, task.snapshot):
            self.model(**kwargs)
        return {l: feats[l][0] for l in self.layers}


def mean_loss(model: nn.Module, batches: list[dict]) -> float:
    """Answer-token CE over `batches` (token-weighted), in eval mode, no gradient."""
    total = tokens = 0.0
    with eval_mode(model), torch.no_grad():
        for b in batches:
            n = int((b["labels"] != IGNORE).sum())
            total += float(lm_loss(model, b)) * n
            tokens += n
    return total / max(tokens, 1)
