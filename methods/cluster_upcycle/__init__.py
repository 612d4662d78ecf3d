"""Cluster-aware upcycling (CAU), continual form on cl-bench's upcycled MoE layer:
per task, a new group of K experts, each the whitened truncated SVD of a dense
SwiGLU slice on a spherical k-means cluster of the task's prompt tokens, with the
centroids as router rows, trained with expert-ensemble self-distillation.

Formula: L = L_task + L_lb + w * T^2 * KL(p_teacher || p_student) on answer tokens,
the teacher the EMA model routed densely; expert e: W_e = U_r Sigma_r V_r^T S_e^-1
with S_e = chol(X_e X_e^T + lambda I), W S_e = U Sigma V^T.
Source: CAU, CVPR 2026, arXiv 2604.13508 (abstract, project page, a third-party
note; no code); reference/seed-methods.md, section (a).

Differs from the paper (details, defaults, records and measurements in
docs/methods/cluster-upcycle.md):
- experts approximate dense *slices* (width H/K), rank cap a slice's size;
- shared="swap": chosen experts stand in for their slices (function-preserving);
- per-task expansion: a new group per task, old groups frozen, dense until task 0;
- a drift guard raises tau when the init moves the loss by more than max_drift;
- not done: the cross-penalty, outlier-channel exclusion, layer-sequential
  calibration, the layer-local MSE variant of EESD.
"""
from __future__ import annotations

import logging
import math
from typing import Any

import torch
from torch import nn

from cl_bench.losses import answer_forward, distillation_kl
from cl_bench.method import Method, Stage
from cl_bench.methods.cluster_upcycle.args import ClusterUpcycleArgs
from cl_bench.methods.cluster_upcycle.clustering import add_centroid_groups, calibration_rows, forward_rows
from cl_bench.methods.cluster_upcycle.experts import cluster_experts, drift_ladder, fit_group, slice_rank_cap
from cl_bench.methods.cluster_upcycle.records import RoutingStats
from cl_bench.methods.cluster_upcycle.teacher import (dense_routing, ema_step, sync_ema,
                                                      teacher_logits)
from cl_bench.models.balancing import balancing_losses
from cl_bench.models.expert_init import slice_experts
from cl_bench.models.modes import device_of
from cl_bench.models.moe import UpcycledMoE, group_sizes, moe_layers, rebuild
from cl_bench.models.reach import ExpertReach
from cl_bench.models.upcycling import grown_param_report, moe_everywhere, moe_settings, train_newest_group
from cl_bench.record.schema import rounded
from cl_bench.registry import register_method

__all__ = ["ClusterUpcycle", "ClusterUpcycleArgs", "cluster_experts", "dense_routing", "drift_ladder",
           "slice_rank_cap"]

log = logging.getLogger(__name__)

# Letters: B batch, T sequence, N tokens, d width, H FFN width, K experts per group,
# h = H / K, E experts in a layer, V vocabulary.


@register_method("cluster-upcycle")
class ClusterUpcycle(Method):
    description = ("Cluster-aware upcycling: per task, experts by whitened SVD on k-means clusters of the "
                   "task's prompts, centroid router rows, EMA dense-teacher self-distillation")
    lr_family = "expert"
    Args = ClusterUpcycleArgs

    def __init__(self, args: ClusterUpcycleArgs, context):
        super().__init__(args, context)
        self._ema: dict[str, torch.Tensor] = {}  # parameter name -> EMA value (the teacher's)
        self._ema_pairs: list[tuple[torch.Tensor, nn.Parameter]] = []
        self._record: dict[str, Any] | None = None  # this stage's "cluster_init"
        self._probe: dict[str, Any] | None = None  # calibration rows and stats holders, until after_task

    def setup(self, model: nn.Module) -> None:
        self.model = model  # dense until task 0: experts need the task's prompts
        # an expert group no token of a step reached takes no optimiser step, on either backend
        self._reach = ExpertReach(model, self.ctx)
        self.idle_units, self.idle_parameters = self._reach.units, self._reach.idle
        train_newest_group(model, self.args.train_shared)

    # ---- task start ----------------------------------------------------------------
    def before_task(self, stage: Stage) -> None:
        if self._n_groups() <= stage.index:  # a resumed run already holds its groups
            if self.ctx.shapes_only:  # `cl-bench params`: no data to cluster
                self._add_placeholder_group()
            else:
                self._add_cluster_group(stage)
        train_newest_group(self.model, self.args.train_shared)
        if self.args.ema_reset:
            self._ema = {}
        self._sync_ema()

    def _n_groups(self) -> int:
        layers = moe_layers(self.model)
        return len(layers[0].groups) if layers else 0

    def _add_placeholder_group(self) -> None:
        for layer in moe_everywhere(self.model, self.args):
            layer.add_group(slice_experts, router_std=0.0)

    def rank_cap(self, layer: UpcycledMoE) -> int | None:
        cap = self.args.rank_cap
        return slice_rank_cap(layer.h, layer.d) if cap is None else (cap or None)

    def calibration_rows(self, stage: Stage) -> list[dict[str, list[int]]]:
        """The stage's own training rows to calibrate on (clustering.calibration_rows)."""
        return calibration_rows(self.ctx, self.args, stage)

    def _forward_rows(self, rows: list[dict], on_input=None) -> float:
        """Answer-token LM loss over `rows`, hooks on each FFN (clustering.forward_rows)."""
        return forward_rows(self.model, self.ctx, rows, on_input)

    def _add_cluster_group(self, stage: Stage) -> None:
        """Steps 1-4 and the drift guard (docs/methods/cluster-upcycle.md): calibrate,
        cluster, add the group (the dense slices with the centroid rows: the guard's
        reference), fit its experts, raising tau until the drift is within max_drift;
        and record."""
        a = self.args
        rows = self.calibration_rows(stage)
        captured: dict[int, list[torch.Tensor]] = {}
        lm_before = self._forward_rows(rows, lambda i, m, x, y: captured.setdefault(i, []).append(x.float()))
        seed = self.ctx.config.seed
        layers = moe_everywhere(self.model, self.args)  # those still dense: no group yet
        fits = add_centroid_groups(layers, captured, a, seed, stage)
        lm_reference = self._forward_rows(rows)  # the group as dense slices
        cap = self.rank_cap(layers[0])  # every layer has the same h and d
        rungs = drift_ladder(a.tau, cap) if a.max_drift is not None else [(a.tau, cap, False)]
        tries = []
        for tau, cap, use_slices in rungs:
            per_layer, holders = fit_group(layers, fits, a, tau, cap, use_slices)
            lm_after = self._forward_rows(rows, lambda i, m, x, y: holders[i].add(m, x, y))
            drift = (lm_after - lm_reference) / lm_reference
            tries.append({"tau": rounded(tau), "rank_cap": cap, "slices": use_slices, "lm": rounded(lm_after),
                          "drift": rounded(drift)})
            if a.max_drift is None or not math.isfinite(drift) or abs(drift) <= a.max_drift:
                break
        acted = len(tries) > 1
        if acted:
            log.info("cluster-upcycle: stage %d: init drift %.4f above max_drift %.4f at tau %s; "
                     "%.4f at tau %s, rank cap %s%s", stage.index, tries[0]["drift"], a.max_drift,
                     tries[0]["tau"], drift, tries[-1]["tau"], cap, " (dense slices)" if use_slices else "")
        for rec in per_layer:
            rec["init_routing"] = holders[rec["layer"]].report()
        self._probe = {"rows": rows, "centroids": {i: h.centroids for i, h in holders.items()},
                       "first": {i: h.first for i, h in holders.items()}}
        self._record = {"calib_examples": len(rows), "tau": rounded(tau), "rank_cap": cap,
                        "lm_before": rounded(lm_before), "lm_reference": rounded(lm_reference),
                        "lm_after": rounded(lm_after),
                        "lm_rel_change": rounded((lm_after - lm_before) / lm_before),
                        "drift": rounded(drift),
                        "drift_guard": {"max_drift": a.max_drift, "acted": acted,
                                        "initial_drift": tries[0]["drift"], "slices": use_slices, "tries": tries},
                        "layers": per_layer}

    # ---- EMA teacher and losses (teacher.py) ----------------------------------------
    def _sync_ema(self) -> None:
        if self.args.eesd_weight == 0:
            self._ema, self._ema_pairs = {}, []
            return
        self._ema, self._ema_pairs = sync_ema(self.model, self._ema)

    def after_step(self, step: int) -> None:
        ema_step(self._ema_pairs, self.args.ema_decay, self.ctx.grads)

    def teacher_logits(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """(N, V) logits of the EMA model at the answer positions, every MoE layer dense (no gradient)."""
        return teacher_logits(self.model, self._ema, batch)

    def loss(self, batch, step):
        a = self.args
        teacher = self.teacher_logits(batch) if a.eesd_weight > 0 else None
        with balancing_losses() as balance:  # the student's terms only, not the teacher's
            out = answer_forward(self.model, batch)  # logits at the answer positions only
        lm = out.loss
        lb = balance.total(device_of(self.model))
        total, parts = lm + lb, {"lm": lm.item(), "lb": lb.item()}
        if teacher is not None:
            kl = distillation_kl(out.logits, teacher, None, a.eesd_temperature)
            total = total + a.eesd_weight * kl
            parts["eesd"] = kl.item()
        return total, parts

    # ---- task end, records, resume ------------------------------------------------------
    def after_task(self, stage: Stage) -> None:
        probe, self._probe = self._probe, None
        if probe is None or self._record is None:
            return
        holders = {i: RoutingStats(probe["first"][i], self.args.experts_per_task, c)
                   for i, c in probe["centroids"].items()}
        self._record["lm_end"] = rounded(self._forward_rows(probe["rows"],
                                                            lambda i, m, x, y: holders[i].add(m, x, y)))
        for rec in self._record["layers"]:
            rec["end_routing"] = holders[rec["layer"]].report()

    def state_dict(self) -> dict[str, Any]:
        return {"layout": group_sizes(self.model), "ema": {n: v.detach().clone() for n, v in self._ema.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        rebuild(self.model, state["layout"], **moe_settings(self.args))
        train_newest_group(self.model, self.args.train_shared)
        params = dict(self.model.named_parameters())
        self._ema = {n: v.to(params[n].device, params[n].dtype) for n, v in state["ema"].items()}
        self._ema_pairs = [(v, params[n]) for n, v in self._ema.items()]

    def param_report(self) -> dict[str, Any]:
        report = grown_param_report(self.model)
        ema = sum(v.numel() for v in self._ema.values())
        report["total"] += ema  # held while training; never deployed
        report["ema_teacher"] = ema
        if self._record is not None:
            report["cluster_init"] = self._record
        return report
