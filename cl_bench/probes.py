"""Representation probes: how far each layer's representation of an earlier task
has moved since that task was learned (the data behind `cl-bench analyze`'s CKA
figure, the upcycling paper's figure 4a).

After every stage the probe runs the model, teacher-forced, on a fixed probe set
of each task trained so far: the first `n_examples` test examples of the task
(prompt + answer + EOS, as in training), keeping at most `max_tokens` of their
non-pad tokens, evenly spaced. For each decoder layer l it takes the layer's
output at those tokens, Phi_l: [tokens, d]. The first time a task is probed (the
stage that trained it) Phi_l becomes the task's reference; at every later stage
the probe records

    CKA_l(task j, stage b) = linear CKA(Phi_l after stage b, Phi_l after stage j)

(cl_bench/cka.py; 1 = the geometry of the task's representation is unchanged).
Outputs of decoder layer l are transformers' hidden_states[l + 1]; for Llama-style
models the last one has the final norm applied, which CKA does not see through
(scale per token changes it slightly), so the last layer is the final-norm output.

The references live in the method-independent probe state (checkpointed, so a
resumed run keeps them); only the CKA values reach the run record.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from cl_bench.cka import linear_cka
from cl_bench.data import Encoder, collate


class RepresentationProbe:
    def __init__(self, n_examples: int, max_tokens: int = 512, batch_size: int = 4):
        if n_examples < 1:
            raise ValueError("n_examples must be >= 1")
        self.n_examples = n_examples
        self.max_tokens = max_tokens
        self.batch_size = batch_size
        self.references: dict[str, list[torch.Tensor]] = {}  # task -> per layer [tokens, d]

    @torch.no_grad()
    def features(self, model: nn.Module, encoder: Encoder, task) -> list[torch.Tensor]:
        """Per decoder layer, its output at the probe tokens of `task`: [tokens, d] fp32 (CPU)."""
        rows = [encoder.train_example(e.prompt, e.answer) for e in task.test[: self.n_examples]]
        was_training = model.training
        model.eval()
        per_layer: list[list[torch.Tensor]] = []
        device = next(model.parameters()).device
        for start in range(0, len(rows), self.batch_size):
            batch = collate(rows[start:start + self.batch_size], encoder.tokenizer.pad_token_id)
            out = model(input_ids=batch["input_ids"].to(device),
                        attention_mask=batch["attention_mask"].to(device),
                        output_hidden_states=True, use_cache=False)
            keep = batch["attention_mask"].bool().to(device)  # (B, T)
            for layer, hidden in enumerate(out.hidden_states[1:]):  # outputs of layers 0..L-1
                if len(per_layer) <= layer:
                    per_layer.append([])
                per_layer[layer].append(hidden[keep].float().cpu())  # (tokens, d)
        model.train(was_training)
        feats = [torch.cat(chunks) for chunks in per_layer]
        n = feats[0].shape[0]
        if n > self.max_tokens:
            index = torch.linspace(0, n - 1, self.max_tokens).round().long()
            feats = [f[index] for f in feats]
        return feats

    def after_stage(self, model: nn.Module, encoder: Encoder, tasks: list) -> dict[str, list[float]]:
        """Probe every task in `tasks` (those trained so far). A task seen for the
        first time stores its reference (and gets no entry); the others get CKA
        per layer against their reference."""
        out = {}
        for task in tasks:
            feats = self.features(model, encoder, task)
            ref = self.references.get(task.name)
            if ref is None:
                self.references[task.name] = feats
                continue
            out[task.name] = [round(float(linear_cka(a, b)), 5) for a, b in zip(feats, ref)]
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"references": self.references}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.references = dict(state["references"])


def expert_sharpness(model: nn.Module, batch: dict[str, torch.Tensor], iters: int = 10,
                     layers: list[int] | None = None, seed: int = 0) -> list[dict[str, Any]]:
    """Sharpness of each expert of the newest group of each MoE layer (or of the
    MoE layers whose decoder index is in `layers`) on `batch` (the task loss,
    answer-token CE): the token share (its part of the N*k routing assignments
    over non-pad tokens), the norm of the loss gradient w.r.t. its weights, and
    the top Hessian eigenvalue (largest |lambda|) of the loss w.r.t. its weights
    alone, from `iters` Lanczos steps on exact Hessian-vector products (double
    backward), with its Ritz residual ||Hv - lambda v||. Lanczos rather than
    plain power iteration: Hessian blocks are indefinite, and a +/- pair of
    similar size stalls power iteration. One backward per HVP: cost ~ layers x
    experts x iters backwards."""
    from cl_bench.method import lm_loss
    from cl_bench.models.moe import decoder_layers

    blocks = decoder_layers(model)
    chosen = [(i, b.mlp) for i, b in enumerate(blocks) if hasattr(b.mlp, "groups")
              and (layers is None or i in layers)]
    inputs: dict[int, torch.Tensor] = {}
    hooks = [moe.register_forward_pre_hook(lambda m, args, i=i: inputs.__setitem__(i, args[0].detach()))
             for i, moe in chosen]
    params = [p for _, moe in chosen for p in (moe.groups[-1].gate, moe.groups[-1].up, moe.groups[-1].down)]
    flags = [p.requires_grad for p in params]
    for p in params:
        p.requires_grad_(True)
    was_training = model.training
    model.eval()  # no dropout; MoE layers skip the balancing loss
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(SDPBackend.MATH):  # fused attention kernels have no double backward
            loss = lm_loss(model, batch)
            grads = torch.autograd.grad(loss, params, create_graph=True)
    finally:
        for h in hooks:
            h.remove()
    keep = batch["attention_mask"].reshape(-1).bool()
    gen = torch.Generator().manual_seed(seed)
    out = []
    for n, (index, moe) in enumerate(chosen):
        group = moe.groups[-1]
        g_layer = grads[3 * n: 3 * n + 3]
        p_layer = params[3 * n: 3 * n + 3]
        x = inputs[index].reshape(-1, moe.d)[keep.to(inputs[index].device)]
        _, _, picked = moe.route(x)
        counts = torch.bincount(picked.reshape(-1), minlength=moe.n_experts)[-len(group):]
        share = (counts.float() / picked.numel()).tolist()
        for e in range(len(group)):
            grad_norm = float(torch.sqrt(sum(g[e].float().square().sum() for g in g_layer)))

            def hvp(vec: torch.Tensor, e=e) -> torch.Tensor:  # H_ee vec, vec flat over expert e's weights
                full = [torch.zeros_like(p) for p in p_layer]
                offset = 0
                for t in full:
                    size = t[e].numel()
                    t[e] = vec[offset:offset + size].view_as(t[e]).to(t)
                    offset += size
                hv = torch.autograd.grad(g_layer, p_layer, grad_outputs=full, retain_graph=True)
                return torch.cat([h[e].reshape(-1).float() for h in hv])

            size = sum(p[e].numel() for p in p_layer)
            eig, residual = _lanczos_top(hvp, torch.randn(size, generator=gen), iters)
            out.append({"layer": index, "expert": moe.n_experts - len(group) + e, "token_share": share[e],
                        "grad_norm": grad_norm, "top_hessian_eig": eig, "residual": residual})
    for p, flag in zip(params, flags):
        p.requires_grad_(flag)
    model.train(was_training)
    return out


def _lanczos_top(hvp, start: torch.Tensor, steps: int) -> tuple[float, float]:
    """The eigenvalue of largest magnitude of the symmetric operator `hvp` and its
    Ritz residual, from `steps` Lanczos steps with full reorthogonalisation
    (exact in exact arithmetic once steps reaches the operator's rank)."""
    basis, alphas, betas = [], [], []
    q = start / start.norm()
    beta = 0.0
    for _ in range(steps):
        w = hvp(q)
        alpha = float(q @ w)
        basis.append(q)
        alphas.append(alpha)
        for b in basis:  # full reorthogonalisation (removes alpha q and beta q_prev too)
            w = w - (b @ w) * b
        beta = float(w.norm())
        if beta <= 1e-10 * max(1.0, abs(alpha)):
            beta = 0.0
            break
        betas.append(beta)
        q = w / beta
    m = len(alphas)
    tri = torch.diag(torch.tensor(alphas, dtype=torch.float64))
    if m > 1:
        off = torch.tensor(betas[:m - 1], dtype=torch.float64)
        tri += torch.diag(off, 1) + torch.diag(off, -1)
    values, vectors = torch.linalg.eigh(tri)
    top = int(values.abs().argmax())
    return float(values[top]), abs(beta * float(vectors[-1, top]))
