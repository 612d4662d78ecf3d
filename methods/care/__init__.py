"""CaRE: bi-level routing over per-task adapters, adapted to a frozen decoder LLM.

Beside every decoder layer's MLP, task t adds a triplet (expert E_t, router R_t,
perceiver C_t); a shared adapter Ebar is there from the start:

    z' = z_a + MLP(N2 z_a) + sum_{r in S} sum_{e <= r} a^r_e E_e(z_a) + Ebar(z_a)
    L  = LM + lambda * L_perceiver

S holds the M routers whose perceivers have the lowest entropy on the prompt
(training: task t's own plus M-1 earlier ones); a^r is router r's top-K softmax;
the perceivers learn k-means pseudo-classes of the prompts; Ebar is pulled back
toward its task-start value after every step from task 1 on.
Arguments and schedule: args.py; layer: layer.py; pseudo-labels and L_perceiver:
pseudo_labels.py.

Source: CaRE, ICML 2026, arXiv 2602.03473; code LMMMEng/CaRE; the adaptation of
reference/seed-methods.md, section (c).

Differs from the paper/code (why, defaults, records: docs/methods/care.md):
- sequence-level routing on prompt tokens, not the CLS token; k-means
  pseudo-classes, not the task's classes;
- no cosine classifier and no classifier alignment (the LM loss replaces both);
- one pass at inference (no `iter_pred`);
- the anchor pull after each optimiser step, not before each forward; one
  anchor per task (no halfway re-anchor).
"""
from __future__ import annotations

import hashlib
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from cl_bench.data.encode import IGNORE, Encoder, collate
from cl_bench.errors import UserError
from cl_bench.losses import answer_forward
from cl_bench.method import Method, Stage
from cl_bench.models.modes import device_of, eval_mode
from cl_bench.models.moe import decoder_layers
from cl_bench.models.params import count
from cl_bench.models.prompt_pool import PromptPool, masked_mean, prompt_mask, prompt_tokens
from cl_bench.record.schema import rounded
from cl_bench.registry import register_method

from .args import ROUTER_INPUTS, UNIFORM_CE_TOL, CareArgs
from .layer import Adapter, CareMLP, RMSNorm, Triplet, Control, entropy, select_routers, top_k_softmax
from .pseudo_labels import prompt_key, kmeans, perceiver_loss
from .record import relative_change, diagnostics, uniformity

__all__ = ["CaRE", "CareArgs", "UNIFORM_CE_TOL", "ROUTER_INPUTS", "Adapter", "CareMLP", "RMSNorm",
           "Triplet", "entropy", "select_routers", "top_k_softmax", "kmeans", "perceiver_loss"]


# Letters: B batch, T tokens, d width, n triplets in a layer (tasks so far), G
# pseudo-classes, L decoder layers.


# ---- the method -----------------------------------------------------------------------

@register_method("care")
class CaRE(Method):
    description = ("CaRE: per-task adapter, router and perceiver in every layer; routers chosen by "
                   "lowest perceiver entropy, anchored shared adapter, frozen LLM")
    Args = CareArgs
    lr_schedule = ("cosine", 0.03)  # linear warm-up over 3% of each task's steps, cosine to 0 (adaptation)

    def setup(self, model: nn.Module) -> None:
        self.model = model
        model.requires_grad_(False)
        config = getattr(model, "config", None)
        d = getattr(config, "hidden_size", None)
        if d is None:
            raise UserError(f"care: {type(model).__name__} has no config.hidden_size; only Hugging Face "
                            f"causal LMs are supported")
        eps = getattr(config, "rms_norm_eps", 1e-6)
        self.control = Control(PromptPool())
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
        self._record, self._perceiver_ce = {}, {}
        self._labels, self._centroids = {}, None
        if not self.ctx.shapes_only and stage.tasks:
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

    # ---- pseudo-labels ----------------------------------------------------------------
    def _cluster(self, stage: Stage) -> None:
        """k-means pseudo-labels of the stage's training prompts (docs/methods/care.md, Perceiver)."""
        a, encoder = self.args, self._encoder()
        prompts = [encoder.prompt_ids(e.prompt) for task in stage.tasks for e in task.train]
        if not prompts:
            return
        pad = self.ctx.tokenizer.pad_token_id
        size = self.ctx.config.train.micro_batch_size
        feats = []
        for start in range(0, len(prompts), size):
            rows = [{"input_ids": p, "labels": [IGNORE] * len(p)} for p in prompts[start:start + size]]
            b = {k: v.to(device_of(self.model)) for k, v in collate(rows, pad).items()}
            feats.append(self._base_features(b["input_ids"], b["attention_mask"]))
        x = F.normalize(torch.cat(feats).cpu(), dim=-1)  # (N, d)
        seed = int.from_bytes(hashlib.sha256(f"{self.ctx.config.seed}/care/{stage.index}".encode())
                              .digest()[:8], "big") >> 1
        labels, self._centroids = kmeans(x, a.pseudo_classes, a.kmeans_iters,
                                         torch.Generator().manual_seed(seed))
        self._labels = {prompt_key(p): int(y) for p, y in zip(prompts, labels)}
        self._record["pseudo_label_sizes"] = torch.bincount(labels, minlength=a.pseudo_classes).tolist()

    @torch.no_grad()
    def _base_features(self, ids: torch.Tensor, mask: torch.Tensor,
                       labels: torch.Tensor | None = None) -> torch.Tensor:
        """The frozen base model's final hidden states pooled over the prompt: (B, d) fp32."""
        with eval_mode(self.model):
            self.control.bypass = True
            try:
                hidden = self.model.base_model(input_ids=ids, attention_mask=mask).last_hidden_state
            finally:
                self.control.bypass = False
        return masked_mean(hidden, prompt_mask(mask, labels))

    def _batch_labels(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Pseudo-labels (B,) of a training batch, by each row's prompt token ids."""
        ids, labels, mask = batch["input_ids"], batch["labels"], batch["attention_mask"]
        prompt = prompt_tokens(mask, labels)
        keys = [prompt_key(ids[b][prompt[b]].tolist()) for b in range(ids.shape[0])]
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
    def _forward(self, batch: dict[str, torch.Tensor], forced: int | torch.Tensor | None):
        """The model on `batch` (labels included) with `forced` routers; returns the output
        and each layer's routing record."""
        control = self.control
        if isinstance(forced, int):
            forced = torch.full((batch["input_ids"].shape[0],), forced, dtype=torch.long,
                                device=batch["input_ids"].device)
        control.forced, control.records = forced, []
        try:
            out = answer_forward(self.model, batch)  # logits at the answer positions only
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
        if not self.ctx.padding:
            self._perceiver_ce.setdefault(step, []).append(ce.item())
        return lm + a.perceiver_weight * pc, {"lm": lm.item(), "perceiver": pc.item(), "perceiver_ce": ce.item(),
                                              "perceiver_kl": kl.item(), "task_id_acc": hits.mean().item()}

    def before_step(self, step: int) -> None:
        """Every rank's perceiver CE of this step's micro-batches (each rank's loss saw its share)."""
        self._perceiver_ce[step] = self.ctx.grads.all_gather(self._perceiver_ce.get(step, []))

    @torch.no_grad()
    def after_step(self, step: int) -> None:
        """Ebar <- mu * Ebar_start + (1 - mu) * Ebar on the weights the optimiser steps
        (ZeRO: this rank's fp32 master fragment; the working copies follow)."""
        if self._anchor is None:
            return
        start = {id(p): s for p, s in zip(self._shared_params(), self._anchor)}
        params, grads = [p for p in self._shared_params() if p.requires_grad], self.ctx.grads  # what the optimiser steps
        fragments = grads.fragments(params, grad=False)
        for f in fragments:
            f.weight.lerp_(f.of(start[id(f.param)]).to(f.weight.dtype), self.args.anchor)
        grads.set_weights(params, fragments)

    # ---- task end -----------------------------------------------------------------------
    def after_task(self, stage: Stage) -> None:
        now = self._shared_vector()
        self._record["shared_drift"] = rounded(relative_change(now, self._shared_start))
        self._record["shared_drift_since_task0"] = (None if self._shared_task0 is None
                                                    else rounded(relative_change(now, self._shared_task0)))
        self._record.update(uniformity(self._perceiver_ce, self.args.pseudo_classes, stage))
        if not self.ctx.shapes_only and self.args.diag_examples > 0:
            self._record.update(self.diagnostics(self.ctx.all_tasks[:stage.index + 1]))

    def diagnostics(self, tasks: list) -> dict[str, Any]:
        """Per-layer task-ID accuracy and the oracle gap on the first `diag_examples`
        test examples of each of `tasks` (task j = the j-th triplet; record.diagnostics)."""
        encoder = self._encoder()
        n = self.args.diag_examples
        examples = [(task.name, [encoder.train_example(e.prompt, e.answer) for e in task.test[:n]]) for task in tasks]
        with eval_mode(self.model):
            return diagnostics(self._forward, examples, len(self.layers), self.ctx.tokenizer.pad_token_id,
                               self.ctx.config.train.micro_batch_size, device_of(self.model))

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
