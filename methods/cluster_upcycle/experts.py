"""Expert initialisation of cluster-upcycle (docs/methods/cluster-upcycle.md, steps 3
and 4b): expert e of a new group is the whitened truncated SVD of dense SwiGLU slice
e on the tokens of cluster e, refitted down the drift guard's ladder if needed.

Formula, per matrix W of slice e with the cluster's inputs X_e to it:
    S_e = chol(X_e X_e^T + lambda I),  W S_e = U Sigma V^T,  W_e = U_r Sigma_r V_r^T S_e^-1,
r = min(energy rank at tau, cap); gate and up see X_e, down sees
H_e = silu(G_slice x) * (U_slice x); lambda = ridge * mean diag(X_e X_e^T).
Source: cluster-aware upcycling (CAU, CVPR 2026, arXiv 2604.13508; no code) and
SVD-LLM's whitening.

Differs from the paper:
- experts approximate dense *slices* of width h = H/K, not the whole FFN;
- rank cap floor(h d / (h + d)) by default (the seed's V2 cap is rank_cap=52);
- a cluster with fewer than min_cluster_tokens tokens keeps its dense slice;
- the drift guard (the seed's §4) raises tau until the init is within max_drift.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from cl_bench.methods.cluster_upcycle.records import RoutingStats, layer_record
from cl_bench.methods.cluster_upcycle.whiten import whitened_truncated_svd
from cl_bench.models.expert_init import slice_experts
from cl_bench.models.moe import UpcycledMoE


def slice_rank_cap(h: int, d: int) -> int:
    """floor(h d / (h + d)): the largest r with r (h + d) <= h d, i.e. a rank-r
    factorisation of an h x d (or d x h) slice matrix no bigger than the slice."""
    return (h * d) // (h + d)


def cluster_experts(dense: nn.Module, x: torch.Tensor, assign: torch.Tensor, n_experts: int,
                    tau: float, rank_cap: int | None, ridge: float, min_tokens: int):
    """Expert e = the whitened truncated SVD of dense slice e on the tokens of
    cluster e (docs/methods/cluster-upcycle.md, step 3). x: (N, d); assign: (N,) in
    [0, n_experts). Returns gate (K, h, d), up (K, h, d), down (K, d, h) and one info
    dict per expert."""
    gate0, up0, down0 = slice_experts(dense, n_experts)  # copies
    gate, up, down = gate0.clone(), up0.clone(), down0.clone()
    infos = []
    for e in range(n_experts):
        xe = x[assign == e]  # (n_e, d)
        info: dict[str, Any] = {"tokens": int(xe.shape[0]), "copied": xe.shape[0] < max(min_tokens, 1)}
        if info["copied"]:
            infos.append(info)
            continue
        xe64 = xe.double()
        cov_x = xe64.T @ xe64  # (d, d)
        gate[e], ig = whitened_truncated_svd(gate0[e], cov_x, tau, rank_cap, ridge)
        up[e], iu = whitened_truncated_svd(up0[e], cov_x, tau, rank_cap, ridge)
        x32 = xe.float()
        inter = (dense.act_fn(x32 @ gate0[e].float().T) * (x32 @ up0[e].float().T)).double()  # (n_e, h): H_e
        down[e], idn = whitened_truncated_svd(down0[e], inter.T @ inter, tau, rank_cap, ridge)
        for name, i in (("gate", ig), ("up", iu), ("down", idn)):
            info[name] = i
        infos.append(info)
    return gate, up, down, infos


def drift_ladder(tau: float, cap: int | None) -> list[tuple[float, int | None, bool]]:
    """The initialisations the drift guard tries, in order, as (tau, rank cap, copy
    the dense slices): tau as given; 1 - (1 - tau) / 10 and 1 - (1 - tau) / 100;
    1 (the cap kept); 1 without the cap; the dense slices themselves (the guard's
    reference, so its drift is 0). A rung equal to the one before is skipped."""
    rungs = [(tau, cap, False)]
    for t in (1 - (1 - tau) / 10, 1 - (1 - tau) / 100, 1.0):
        if t > rungs[-1][0]:
            rungs.append((t, cap, False))
    if cap is not None:
        rungs.append((1.0, None, False))
    rungs.append((1.0, None, True))
    return rungs


def fit_group(layers: list[UpcycledMoE], fits: list, args, tau: float, cap: int | None,
              use_slices: bool) -> tuple[list[dict[str, Any]], dict[int, RoutingStats]]:
    """Write the experts of each layer's newest group: the whitened truncated SVD
    of each dense slice on its cluster at (tau, cap), or the dense slices themselves.
    fits: per layer (x (N, d), its k-means, router row scale); args: the method's
    ClusterUpcycleArgs. Returns the per-layer records and fresh routing-stat holders."""
    K = args.experts_per_task
    per_layer, holders = [], {}
    for i, (layer, (x, km, scale)) in enumerate(zip(layers, fits)):
        min_tokens = x.shape[0] + 1 if use_slices else args.min_cluster_tokens  # every cluster "too small"
        gate, up, down, infos = cluster_experts(layer.dense, x, km.assign, K, tau, cap, args.ridge,
                                                min_tokens)
        group = layer.groups[-1]
        with torch.no_grad():
            group.gate.copy_(gate)
            group.up.copy_(up)
            group.down.copy_(down)
        holders[i] = RoutingStats(layer.n_experts - K, K, km.centroids)
        per_layer.append(layer_record(i, x.shape[0], km, infos, gate, up, down,
                                      slice_experts(layer.dense, K), scale))
    return per_layer, holders
