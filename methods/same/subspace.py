"""Running input covariances, their energy subspaces, and the gradient maps built
from them (SAME's spectral routing and curvature scaling, methods/same/; any
method that protects old inputs of a linear layer can use them).

C = sum_x x x^T / n, uncentred, over every token added. Its delta-energy
subspace: the top eigenpairs (lambda_i, v_i), by decreasing lambda, up to the
smallest k with lambda_1 + .. + lambda_k >= delta * tr C (at most max_rank).
torch.linalg.eigh for d <= EIGH_MAX_DIM, else a randomized top-(max_rank +
OVERSAMPLE) decomposition (torch.svd_lowrank), whose top eigenpairs agree with
eigh's to float rounding on matrices of fast-decaying spectrum (tested).

Two maps on a gradient (or update) G (m, d) of a layer reading x:
- spectral_projection: G V diag(s) V^T + G (I - V V^T),
  s_i = max(1 - rho, sqrt(lambda_k / lambda_i)): high-energy directions shrink
  by at most rho, the rest passes;
- damped_inverse: G P, P = V (Lambda + mu I)^-1 V^T + mu^-1 (I - V V^T), the
  damped inverse of C in low-rank form (exact when C has rank k).

Source: SAME, ICML 2026, arXiv 2602.01990; code LAMDA-CL/Prism. Differs from
the code (docs/methods/same.md): C is uncentred and accumulated over every
token seen, not the current batch centred; its eigenpairs are exact and sorted
(eigh) up to EIGH_MAX_DIM, not one randomized range-finder pass.

Letters: d input width, k kept directions, m rows of G.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

EIGH_MAX_DIM = 4096  # wider covariances: randomized top eigenpairs
OVERSAMPLE = 16  # extra columns of the randomized decomposition


@dataclass
class Subspace:
    """The top eigenpairs of an uncentred covariance C, by decreasing eigenvalue."""

    V: torch.Tensor  # (d, k) orthonormal columns
    lam: torch.Tensor  # (k,) eigenvalues
    trace: float  # tr C
    top: float  # lambda_1 (whether or not kept)

    @property
    def k(self) -> int:
        return self.V.shape[1]

    def to(self, device) -> "Subspace":
        return dataclasses.replace(self, V=self.V.to(device), lam=self.lam.to(device))


def energy_rank(lam: torch.Tensor, trace: float, delta: float) -> int:
    """The smallest k with lam_1 + .. + lam_k >= delta * trace (lam decreasing);
    len(lam) when even all of them fall short (the cap)."""
    if delta <= 0 or trace <= 0:
        return 0
    reached = (lam.cumsum(0) >= delta * trace).nonzero()
    return int(reached[0]) + 1 if len(reached) else len(lam)


def top_subspace(cov: torch.Tensor, delta: float, max_rank: int) -> Subspace:
    """The delta-energy subspace of the PSD matrix `cov` (d, d), at most max_rank wide."""
    cov = cov.float()
    d = cov.shape[0]
    if d <= EIGH_MAX_DIM:
        lam, vec = torch.linalg.eigh(cov)  # ascending
        lam, vec = lam.flip(0)[:max_rank], vec.flip(1)[:, :max_rank]
    else:
        vec, lam, _ = torch.svd_lowrank(cov, q=min(d, max_rank + OVERSAMPLE), niter=6)
        lam, vec = lam[:max_rank], vec[:, :max_rank]
    lam = lam.clamp(min=0)
    trace = float(cov.diagonal().sum())
    k = energy_rank(lam, trace, delta)
    return Subspace(vec[:, :k].contiguous(), lam[:k].clone(), trace, float(lam[0]) if len(lam) else 0.0)


def spectral_projection(g: torch.Tensor, sub: Subspace | None, rho: float) -> torch.Tensor:
    """G V_par diag(s) V_par^T + G V_perp V_perp^T, s_i = max(1 - rho, sqrt(lam_k / lam_i)).
    g: (m, d) -> (m, d); the identity when sub is None or k = 0."""
    if sub is None or sub.k == 0:
        return g
    v, lam = sub.V.to(g.device, torch.float32), sub.lam.to(g.device, torch.float32)
    s = (lam[-1] / lam.clamp(min=1e-30)).sqrt().clamp(min=1 - rho, max=1.0)  # (k,)
    gf = g.float()
    return (gf - ((gf @ v) * (1 - s)) @ v.T).to(g.dtype)


def damped_inverse(g: torch.Tensor, sub: Subspace, mu: float) -> torch.Tensor:
    """g P with P = V (Lambda + mu I)^-1 V^T + mu^-1 (I - V V^T). g: (m, d) -> (m, d)."""
    gf = g.float()
    out = gf / mu
    if sub.k:
        v, lam = sub.V.to(g.device, torch.float32), sub.lam.to(g.device, torch.float32)
        out = out + ((gf @ v) * (1 / (lam + mu) - 1 / mu)) @ v.T
    return out.to(g.dtype)


class InputCovariance:
    """Running uncentred covariance sum_x x x^T / n over every token added (fp32). On N
    ranks each adds its own tokens to `fresh` (add(..., shared=True)); `merge` sums the
    ranks' fresh parts into the covariance, which every rank must call before reading it.
    An in-stage checkpoint between two merges holds the ranks' fresh parts summed
    (`hold`, then state_dict); a run resumed from it, on any number of ranks, adds them
    to the covariance as it loads them (read only after the next merge, which the
    uninterrupted run makes with them: equal up to float rounding)."""

    def __init__(self, dim: int):
        self.dim = dim
        self.sum: torch.Tensor | None = None  # (d, d) fp32, allocated on first use
        self.count = 0
        self.fresh: torch.Tensor | None = None  # this rank's tokens since the last merge (N ranks)
        self.fresh_count = 0
        # every rank's fresh tokens summed (sum on the host, count), taken by hold() on the
        # rank that writes the checkpoint, dropped at the next add or merge
        self.held: tuple[torch.Tensor, int] | None = None

    def add(self, x: torch.Tensor, shared: bool = False) -> None:
        """x: (n, d) tokens; `shared`: this rank's share of the data (merge sums the shares)."""
        self.held = None
        if not len(x):
            return
        x = x.float()
        if shared:
            if self.fresh is None:
                self.fresh = torch.zeros(self.dim, self.dim, device=x.device)
            self.fresh.addmm_(x.T, x)
            self.fresh_count += len(x)
        else:
            self._total(x.device).addmm_(x.T, x)
            self.count += len(x)

    def _total(self, device) -> torch.Tensor:
        if self.sum is None:
            self.sum = torch.zeros(self.dim, self.dim, device=device)
        elif self.sum.device != device:
            self.sum = self.sum.to(device)
        return self.sum

    def _summed_fresh(self, all_reduce, device) -> tuple[torch.Tensor, int]:
        """Every rank's fresh tokens summed (a collective: every rank calls it, in order)."""
        fresh = self.fresh if self.fresh is not None else torch.zeros(self.dim, self.dim, device=device)
        both = torch.cat([fresh.reshape(-1), fresh.new_tensor([float(self.fresh_count)])])
        all_reduce(both)
        return both[:-1].view(self.dim, self.dim), int(both[-1])

    def merge(self, all_reduce, device) -> None:
        """Every rank's fresh tokens into the covariance (`all_reduce` sums a tensor over
        the ranks in place; every rank calls this, in the same order)."""
        total, n = self._summed_fresh(all_reduce, device)
        if n:
            self._total(total.device).add_(total)
            self.count += n
        self.fresh, self.fresh_count, self.held = None, 0, None

    def hold(self, all_reduce, device, keep: bool) -> None:
        """Before an in-stage checkpoint (every rank, in the same order): every rank's
        fresh tokens summed; the rank that writes the checkpoint (`keep`) holds them in
        host memory for state_dict, the others nothing. Nothing the run computes
        changes: fresh stays, to be merged as before."""
        total, n = self._summed_fresh(all_reduce, device)
        self.held = (total.to("cpu", copy=True), n) if keep and n else None

    def subspace(self, delta: float, max_rank: int) -> Subspace | None:
        return None if not self.count else top_subspace(self.sum / self.count, delta, max_rank)

    def state_dict(self) -> dict[str, Any]:
        return {"sum": self.sum, "count": self.count, **({"unmerged": self.held} if self.held else {})}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sum, self.count = state["sum"], state["count"]
        self.fresh, self.fresh_count, self.held = None, 0, None
        if "unmerged" in state:  # the ranks' tokens after the last merge (hold)
            total, n = state["unmerged"]
            self.sum = total.clone() if self.sum is None else self.sum + total.to(self.sum.device)
            self.count += n
