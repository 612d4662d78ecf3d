"""Do the deep layers expand more than the shallow ones? (The bilevel upcycling
paper's figure 4 says they do.) Read from a run's decision maps: the parameter
rows' diagnostics "decisions", [layer][slot] of 1 (Expand) / 0 (Recycle), with
"decision_layers" naming the decoder layers.

    rate_l  = mean over searched tasks t and slots k of d[t][l][k]
    diff    = mean_{l in deep} rate_l - mean_{l in shallow} rate_l

deep: the last ceil(L/3) of the L decided layers (as the CKA term's default
layers), shallow: the first ceil(L/3). The unit of evidence is the layer (slots
and tasks of one layer are not independent draws), so the 95% interval
resamples layers within each third (stratified percentile bootstrap) and the
p-value relabels them (two-sided permutation test over which layers are deep).
A verdict needs both the interval to exclude 0 and p < 0.05: with few layers a
third the bootstrap alone is too narrow (a third whose layers agree has an
interval of width 0), while the permutation test knows how few layers there are.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

from cl_bench.metrics.bootstrap import LEVEL, RESAMPLES, interval

SEED = 0


def depth_profile(maps: Sequence[Sequence[Sequence[int]]], layers: Sequence[int],
                  resamples: int = RESAMPLES, seed: int = SEED) -> dict[str, Any]:
    """`maps`: one decision map per searched task, (L, K) of 0/1, rows in the order
    of `layers`. Returns each layer's rate, the thirds, diff, its interval, p and
    the verdict (module docstring)."""
    d = np.asarray(maps, float)  # (T, L, K)
    if d.ndim != 3 or d.shape[1] != len(layers):
        raise ValueError(f"decision maps of shape {d.shape} for {len(layers)} layers")
    order = np.argsort(layers)
    rate = d.mean(axis=(0, 2))[order]  # (L,), shallow to deep
    n = math.ceil(len(rate) / 3)
    if 2 * n > len(rate):
        raise ValueError(f"{len(rate)} layers: too few for a shallow and a deep third")
    shallow, deep = rate[:n], rate[-n:]
    diff = float(deep.mean() - shallow.mean())
    rng = np.random.default_rng(seed)
    boot = deep[rng.integers(0, n, (resamples, n))].mean(1) - shallow[rng.integers(0, n, (resamples, n))].mean(1)
    both = np.concatenate([shallow, deep])
    perms = np.array([p[n:].mean() - p[:n].mean() for p in (rng.permutation(both) for _ in range(resamples))])
    p = (int(np.sum(np.abs(perms) >= abs(diff) - 1e-12)) + 1) / (resamples + 1)
    ci = interval(boot, LEVEL)
    clear = p < 1 - LEVEL
    verdict = ("deep layers expand more" if clear and ci[0] > 0 else
               "shallow layers expand more" if clear and ci[1] < 0 else "not distinguishable")
    ordered = [int(layers[i]) for i in order]
    return {"layers": ordered, "rate": rate.tolist(), "shallow": ordered[:n], "deep": ordered[-n:],
            "shallow_rate": float(shallow.mean()), "deep_rate": float(deep.mean()), "diff": diff,
            "ci": list(ci), "p": p, "verdict": verdict, "tasks": int(d.shape[0]), "resamples": resamples,
            "per_task": [{"deep_rate": float(m[order][-n:].mean()), "shallow_rate": float(m[order][:n].mean())}
                         for m in d]}


def decision_maps(params) -> tuple[list, list[int], list[int]] | None:
    """The decision maps of a run's parameter rows, their decoder layers and stages
    (None: the run decided nothing)."""
    rows = [p for p in params if p.diagnostics.get("decisions")]
    if not rows:
        return None
    layers = rows[0].diagnostics.get("decision_layers") or list(range(len(rows[0].diagnostics["decisions"])))
    return [r.diagnostics["decisions"] for r in rows], list(layers), [r.stage for r in rows]


def decision_agreement(params_a, params_b) -> dict[str, Any] | None:
    """How often two runs' decision maps agree, over the (stage, layer, expert) cells
    both decided: {"n", "agree" (fraction), "expand" (each run's expand rate), "kappa"
    (Cohen's: agreement beyond what the two rates give by chance; None when chance
    alone agrees everywhere, e.g. both expand every expert), "stages": per stage the
    same}. None when either run decided nothing, or the two decided on other layers."""
    found = decision_maps(params_a), decision_maps(params_b)
    if None in found or found[0][1] != found[1][1]:
        return None
    (maps_a, _, stages_a), (maps_b, _, stages_b) = found
    by_stage_b = dict(zip(stages_b, maps_b))
    pairs = [(s, np.asarray(m, dtype=int), np.asarray(by_stage_b[s], dtype=int))
             for s, m in zip(stages_a, maps_a) if s in by_stage_b]
    pairs = [(s, a, b) for s, a, b in pairs if a.shape == b.shape]
    if not pairs:
        return None

    def agreement(a: np.ndarray, b: np.ndarray) -> dict[str, Any]:
        ra, rb, po = float(a.mean()), float(b.mean()), float((a == b).mean())
        pe = ra * rb + (1 - ra) * (1 - rb)
        return {"n": int(a.size), "agree": po, "expand": [ra, rb],
                "kappa": None if pe >= 1 - 1e-12 else (po - pe) / (1 - pe)}

    both = agreement(np.concatenate([a.ravel() for _, a, _ in pairs]),
                     np.concatenate([b.ravel() for _, _, b in pairs]))
    return {**both, "stages": {int(s): agreement(a, b) for s, a, b in pairs}}


def record_depth(record) -> dict[str, Any] | None:
    """depth_profile of a run record's decision maps (None: the run decided nothing,
    or in a single layer)."""
    found = decision_maps(record.params)
    if found is None or len(found[1]) < 2:  # < 2 layers: no shallow and deep third to compare
        return None
    maps, layers, stages = found
    return {"stages": stages, **depth_profile(maps, layers)}
