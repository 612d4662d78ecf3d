"""What cluster-upcycle writes into the run record per layer (run.json "params",
key "cluster_init"; schema in docs/methods/cluster-upcycle.md, "Records"): the
fitted experts' ranks, energies and distance to their slices, and the routing on
the calibration prompts.

Formulas: rel_change_e = ||fitted_e - slice_e||_F / ||slice_e||_F over gate, up and
down together; out_rel_err = ||layer(x) - dense(x)|| / ||dense(x)||.
Source: none (cl-bench's own diagnostics; the paper reports none of these).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from cl_bench.models.moe import UpcycledMoE
from cl_bench.record.schema import rounded


class RoutingStats:
    """Routing of one MoE layer on the calibration prompts: mean entropy, the new
    group's share of the top-k assignments and its load, top-1 = cluster agreement,
    and how far the layer's output is from the dense MLP's, ||y - dense(x)|| / ||dense(x)||."""

    def __init__(self, first: int, n_new: int, centroids: torch.Tensor):
        self.first, self.n_new, self.centroids = first, n_new, centroids  # (K, d)
        self.tokens = 0
        self.entropy = 0.0
        self.assignments = 0
        self.load = torch.zeros(n_new, dtype=torch.float64)
        self.agree = 0
        self.err = self.dense_sq = 0.0  # ||layer(x) - dense(x)||^2, ||dense(x)||^2

    def add(self, layer: UpcycledMoE, x: torch.Tensor, y: torch.Tensor) -> None:
        probs, _, indices = layer.route(x)  # (N, E), (N, k)
        dense = layer.dense(x)  # (N, d)
        self.err += float((y - dense).float().pow(2).sum())
        self.dense_sq += float(dense.float().pow(2).sum())
        self.tokens += x.shape[0]
        self.entropy += float(-(probs * probs.clamp_min(1e-30).log()).sum())
        self.assignments += indices.numel()
        local = indices.reshape(-1) - self.first
        local = local[(local >= 0) & (local < self.n_new)]
        self.load += torch.bincount(local, minlength=self.n_new).double().cpu()
        cluster = (F.normalize(x.float(), dim=1) @ self.centroids.T.float()).argmax(dim=1)
        self.agree += int((probs.argmax(dim=1) == cluster + self.first).sum())

    def report(self) -> dict[str, Any]:
        if not self.tokens:
            return {}
        in_new = float(self.load.sum())
        return {"entropy": rounded(self.entropy / self.tokens),
                "new_group_share": rounded(in_new / self.assignments),
                "load": [rounded(v / in_new) if in_new else 0.0 for v in self.load.tolist()],
                "top1_is_cluster": rounded(self.agree / self.tokens),
                "out_rel_err": rounded((self.err / self.dense_sq) ** 0.5 if self.dense_sq else 0.0)}


def layer_record(i, n_tokens, km, infos, gate, up, down, slices, scale) -> dict[str, Any]:
    """One layer's entry of "cluster_init"/"layers" for the experts finally used."""
    fitted = [w.detach() for w in (gate, up, down)]
    rel = []
    for e in range(len(infos)):
        num = sum(float((f[e] - s[e]).pow(2).sum()) for f, s in zip(fitted, slices))
        den = sum(float(s[e].pow(2).sum()) for s in slices)
        rel.append(rounded((num / den) ** 0.5 if den else 0.0))
    c = km.centroids
    cos = c @ c.T - 2 * torch.eye(len(c), device=c.device)  # diagonal out of the max
    out: dict[str, Any] = {"layer": i, "tokens": n_tokens,
                           "cluster_sizes": [info["tokens"] for info in infos],
                           "kmeans_cos": rounded(km.objective),
                           "copied": [e for e, info in enumerate(infos) if info["copied"]],
                           "fallbacks": sum(info[m].fallback for info in infos if not info["copied"]
                                            for m in ("gate", "up", "down")),
                           "rel_change": rel, "centroid_max_cos": rounded(cos.max()),
                           "router_scale": rounded(scale)}
    for m in ("gate", "up", "down"):
        out[f"rank_{m}"] = [info[m].rank if not info["copied"] else None for info in infos]
        out[f"energy_{m}"] = [rounded(info[m].energy) if not info["copied"] else None for info in infos]
    return out
