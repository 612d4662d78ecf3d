"""Expert sharpness: per expert of the newest MoE group, its token share, the norm
of the task loss's gradient w.r.t. its weights and the top Hessian eigenvalue
(Lanczos on exact Hessian-vector products); the data behind `cl-bench
analyze`'s sharpness figure (runs with eval.sharpness > 0).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

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
    from cl_bench.models.modes import eval_mode
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
    with eval_mode(model):  # no dropout; MoE layers skip the balancing loss
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
                eig, residual = lanczos_top(hvp, torch.randn(size, generator=gen), iters)
                out.append({"layer": index, "expert": moe.n_experts - len(group) + e, "token_share": share[e],
                            "grad_norm": grad_norm, "top_hessian_eig": eig, "residual": residual})
        for p, flag in zip(params, flags):
            p.requires_grad_(flag)
    return out


def lanczos_top(hvp, start: torch.Tensor, steps: int) -> tuple[float, float]:
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
