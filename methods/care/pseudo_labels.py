"""CaRE's pseudo-classes and the perceiver loss that learns them.

At the start of task t its training prompts go through the frozen base model;
their final-layer hidden states, mean-pooled over the prompt tokens and
L2-normalised, are clustered by k-means into G groups: the pseudo-labels y. The
current perceivers C_t^l of every layer l learn them, layer-wise, with a
self-distillation term from the last layer's:

    L_perceiver = (1/L) sum_l 1/2 [ CE(s * C_t^l(c_t^l), y)
                                    + T_l^2 KL(softmax(sg(C_t^L)/T_l) || softmax(C_t^l/T_l)) ]

Source: CaRE, ICML 2026, arXiv 2602.03473, code LMMMEng/CaRE (its layer-wise
supervision). Differs from the paper/code: k-means pseudo-classes replace the
task's classes (TRACE tasks have no shared class set); the teacher is the
detached last-layer perceiver, not the final classifier's logits (there is no
classifier). Details: docs/methods/care.md.
"""
from __future__ import annotations

import hashlib

import torch
import torch.nn.functional as F


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


def prompt_key(ids: list[int]) -> bytes:
    return hashlib.sha1(torch.tensor(ids, dtype=torch.long).numpy().tobytes()).digest()
