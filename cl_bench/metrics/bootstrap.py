"""Bootstrap intervals over test items: pure functions of per-item scores.

A run scores the same test items of task j at every stage that evaluates j, so
one draw of item indices per task is reused for every stage (paired): replicate
r of the matrix is R_r[b][j] = mean_i s[b][j][idx_j[r, i]], and every summary
of R (Last Acc, BWT, ...) is computed on each replicate. The 95% interval is the
2.5th-97.5th percentile of the replicates (percentile bootstrap; Efron &
Tibshirani, 1993, ch. 13). Two runs over the same items use the same draws, so
the difference of a summary is bootstrapped paired, item by item.

Shapes: B = resamples, S = stages (rows of R), T = tasks, n_j = test items of j.
"""
from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

RESAMPLES = 1000  # the default; every result records the count it used
LEVEL = 0.95


def draws(n_items: Sequence[int], resamples: int, seed: int) -> list[np.ndarray]:
    """Per task j, a (B, n_j) array of item indices drawn with replacement;
    seeded, so the same (n_items, resamples, seed) always gives the same draws."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, n, size=(resamples, n)) if n else np.zeros((resamples, 0), int)
            for n in n_items]


def resample_cells(cells: Mapping[tuple[int, int], np.ndarray], idx: Sequence[np.ndarray],
                   shape: tuple[int, int]) -> np.ndarray:
    """(B, S, T) replicate matrices: cell (b, j) is the mean of s[b][j] over draw
    idx[j]; cells not in `cells` are NaN (not evaluated)."""
    B = len(idx[0]) if idx else 0
    out = np.full((B, *shape), np.nan)
    for (b, j), scores in cells.items():
        out[:, b, j] = np.asarray(scores, float)[idx[j]].mean(axis=1)
    return out


def interval(values: np.ndarray, level: float = LEVEL) -> tuple[float, float] | None:
    """The percentile interval of the finite replicates, or None if there are none."""
    v = np.asarray(values, float)
    v = v[np.isfinite(v)]
    if not v.size:
        return None
    tail = (1 - level) / 2 * 100
    lo, hi = np.percentile(v, [tail, 100 - tail])
    return float(lo), float(hi)


def paired_difference(a: np.ndarray, b: np.ndarray, estimate: float,
                      level: float = LEVEL) -> dict[str, float | None]:
    """Difference a - b of one summary from paired replicates (the same item draws
    for both runs) and its point `estimate`: the percentile interval, and the
    two-sided p-value that inverts it, p = 2·min(#{d_r <= 0} + 1, #{d_r >= 0} + 1)
    / (B + 1), capped at 1. So p < 1 - level exactly when the interval excludes 0
    (up to the resolution 1/B)."""
    d = np.asarray(a, float) - np.asarray(b, float)
    d = d[np.isfinite(d)]
    if not d.size:
        return {"diff": estimate, "ci": None, "p": None}
    p = 2 * min(int(np.sum(d <= 0)) + 1, int(np.sum(d >= 0)) + 1) / (d.size + 1)
    return {"diff": estimate, "ci": interval(d, level), "p": min(1.0, p)}


def pooled(per_run: Sequence[np.ndarray], resamples: int, seed: int) -> np.ndarray:
    """Replicates of the mean over runs (seeds) of one configuration: each
    replicate draws the runs with replacement and averages their own item-level
    replicates, so the spread covers both the seeds and the items."""
    runs = np.stack([np.asarray(r, float)[:resamples] for r in per_run])  # (K, B)
    k, b = runs.shape
    pick = np.random.default_rng(seed).integers(0, k, size=(b, k))  # (B, K) run indices
    return runs[pick, np.arange(b)[:, None]].mean(axis=1)
