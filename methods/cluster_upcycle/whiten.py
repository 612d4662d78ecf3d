"""Spherical k-means and the whitened (data-aware) truncated SVD: the numerics of
cluster-upcycle (docs/methods/cluster-upcycle.md, "Numerics").

Letters: N tokens, d_in / d_out a weight's input / output width, k clusters.

Formula: for W (d_out, d_in) and inputs X (d_in, n), C = X X^T = S S^T (Cholesky),
W S = U Sigma V^T, W' = U_r Sigma_r V_r^T S^-1 = argmin_{rank(W') <= r} ||W X - W' X||_F;
r = smallest with sum_{j<=r} sigma_j^2 >= tau * sum_j sigma_j^2, capped.

Sources: SVD-LLM's whitening (Wang et al. 2024); spherical k-means (Dhillon &
Modha, 2001) with k-means++ seeds (Arthur & Vassilvitskii, 2007).

Differs: a ridge on C before the Cholesky, and an eigen-decomposition square root
with a pseudo-inverse when the Cholesky fails; cosine distance in k-means++.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class KMeansResult:
    centroids: torch.Tensor  # (k, d) unit rows
    assign: torch.Tensor  # (N,) cluster of each point
    objective: float  # mean cosine of each point to its centroid (higher is better)
    iterations: int  # of the kept restart


def spherical_kmeans(x: torch.Tensor, k: int, iters: int = 30, restarts: int = 3,
                     generator: torch.Generator | None = None) -> KMeansResult:
    """Spherical k-means (Dhillon & Modha, 2001) on the directions of x (N, d):
    x_hat = x / ||x||; assign each point to argmax_e mu_e^T x_hat; mu_e = the
    normalised sum of its members. k-means++ seeding in cosine distance 1 - cos;
    a cluster left empty is re-seeded at the point worst served by its
    centroid. Of `restarts` runs the one with the highest mean cosine is kept.
    `generator` (CPU) makes it deterministic."""
    N = x.shape[0]
    if N < k:
        raise ValueError(f"spherical k-means: {N} points for {k} clusters")
    xn = F.normalize(x.float(), dim=1)  # (N, d)
    best = None
    for _ in range(max(restarts, 1)):
        mu = _kmeans_pp(xn, k, generator)  # (k, d)
        done = 0
        for done in range(1, iters + 1):
            sim = xn @ mu.T  # (N, k)
            best_sim, assign = sim.max(dim=1)
            sums = torch.zeros_like(mu).index_add_(0, assign, xn)  # (k, d)
            counts = torch.bincount(assign, minlength=k)
            for e in (counts == 0).nonzero().flatten().tolist():
                worst = int(best_sim.argmin())  # the point farthest from its centroid
                sums[e] = xn[worst]
                best_sim[worst] = float("inf")  # not chosen twice
            new = F.normalize(sums, dim=1)
            if torch.equal(new, mu):
                break
            mu = new
        sim = xn @ mu.T
        top, assign = sim.max(dim=1)
        objective = float(top.mean())
        if best is None or objective > best.objective:
            best = KMeansResult(mu, assign, objective, done)
    return best


def _kmeans_pp(xn: torch.Tensor, k: int, generator: torch.Generator | None) -> torch.Tensor:
    """k-means++ seeds (Arthur & Vassilvitskii, 2007) with distance 1 - cos."""
    N = xn.shape[0]
    first = int(torch.randint(N, (1,), generator=generator))
    chosen = [first]
    dist = (1 - xn @ xn[first]).clamp_min(0)  # (N,)
    for _ in range(1, k):
        weights = (dist ** 2).cpu().double()
        if float(weights.sum()) <= 0:  # fewer distinct directions than k: any point
            weights = torch.ones(N, dtype=torch.float64)
        nxt = int(torch.multinomial(weights, 1, generator=generator))
        chosen.append(nxt)
        dist = torch.minimum(dist, (1 - xn @ xn[nxt]).clamp_min(0))
    return xn[chosen].clone()


@dataclass
class LowRankInfo:
    rank: int  # r kept
    full_rank: int  # min(d_out, rank of the whitening factor)
    energy: float  # share of the whitened output energy kept
    fallback: bool  # Cholesky failed: eigen-decomposition square root used


def energy_rank(s: torch.Tensor, tau: float, cap: int | None = None) -> int:
    """Smallest r with sum_{j<=r} s_j^2 >= tau * sum_j s_j^2 (s descending), then
    min(r, cap) when cap is given (> 0)."""
    e = s.double() ** 2
    total = float(e.sum())
    if total <= 0:
        return 0
    cum = torch.cumsum(e, 0) / total
    # tolerance: tau = 1 must keep every non-zero direction, not fail on rounding
    r = int((cum < tau - 1e-12).sum()) + 1
    r = min(r, len(s))
    if cap:
        r = min(r, cap)
    return r


def whitened_truncated_svd(weight: torch.Tensor, cov: torch.Tensor, tau: float,
                           rank_cap: int | None = None, ridge: float = 1e-4
                           ) -> tuple[torch.Tensor, LowRankInfo]:
    """The rank-r minimiser W' of ||W X - W' X||_F (module docstring) for a weight
    W (d_out, d_in) and the input second moment cov = X X^T (d_in, d_in); r from
    the energy threshold `tau` and `rank_cap`. Computed in float64, returned in
    W's dtype.

    cov gets a ridge `ridge * mean(diag(cov))` (0: none) before the Cholesky
    S S^T = cov. If the Cholesky still fails (cov singular: fewer tokens than
    d_in without ridge, or rounding), the fallback is the symmetric square root
    over the eigenvalues above 1e-12 * the largest: S = Q_+ Lambda_+^(1/2),
    S^+ = Lambda_+^(-1/2) Q_+^T, W' = U_r Sigma_r V_r^T S^+, which still reaches
    the minimum over X (W' S = U_r Sigma_r V_r^T, S^+ S = I); W' is then 0 on
    directions X never visits. A zero cov returns W unchanged (rank: full)."""
    W = weight.detach().double()  # (d_out, d_in)
    C = cov.detach().double()
    C = (C + C.T) / 2
    d_in = C.shape[0]
    scale = float(C.diagonal().mean())
    if scale <= 0:
        return weight.detach().clone(), LowRankInfo(min(W.shape), min(W.shape), 1.0, False)
    A = C + ridge * scale * torch.eye(d_in, dtype=C.dtype, device=C.device) if ridge > 0 else C
    L, info = torch.linalg.cholesky_ex(A)
    fallback = bool(info.item() != 0)
    if not fallback:
        U, s, Vh = torch.linalg.svd(W @ L, full_matrices=False)
        r = energy_rank(s, tau, rank_cap)
        # V_r^T S^-1: solve Z L = V_r^T with L lower-triangular
        Z = torch.linalg.solve_triangular(L, Vh[:r], upper=False, left=False)  # (r, d_in)
    else:
        lam, Q = torch.linalg.eigh(A)
        keep = lam > 1e-12 * lam.max()
        root = lam[keep].sqrt()
        S = Q[:, keep] * root  # (d_in, p)
        S_pinv = (Q[:, keep] / root).T  # (p, d_in)
        U, s, Vh = torch.linalg.svd(W @ S, full_matrices=False)
        r = energy_rank(s, tau, rank_cap)
        Z = Vh[:r] @ S_pinv  # (r, d_in)
    new = (U[:, :r] * s[:r]) @ Z  # (d_out, d_in)
    energy = float((s[:r] ** 2).sum() / (s ** 2).sum()) if float((s ** 2).sum()) > 0 else 1.0
    return new.to(weight.dtype), LowRankInfo(r, len(s), energy, fallback)
