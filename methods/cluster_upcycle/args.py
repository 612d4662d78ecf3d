"""cluster-upcycle's arguments (`method_args`): the family's (cl_bench/models/upcycling.py,
MoEArgs) and those of the cluster-aware initialisation and the self-distillation:

    W_e = U_r Sigma_r V_r^T S_e^-1 with r the energy rank at tau (capped),  S_e = chol(X_e X_e^T + lambda I)
    L = L_task + L_lb + eesd_weight * T^2 * KL(p_teacher || p_student),  theta_ema <- d theta_ema + (1 - d) theta

Source: CAU, CVPR 2026, arXiv 2604.13508 (no code); reference/seed-methods.md, section (a).
Differs from the paper: the defaults marked "chosen" are cl-bench's (the paper
publishes none); which is which: docs/methods/cluster-upcycle.md, "Defaults and sources".
"""
from __future__ import annotations

from dataclasses import dataclass

from cl_bench.errors import UserError
from cl_bench.models.upcycling import MoEArgs


@dataclass
class ClusterUpcycleArgs(MoEArgs):
    # initialisation (docs/methods/cluster-upcycle.md, steps 1-4b)
    tau: float = 0.99  # energy kept by each expert's whitened SVD (chosen: not public; sweep 0.95/0.999)
    rank_cap: int | None = None  # None: floor(h d / (h + d)), a slice's size; 0: no cap
    ridge: float = 1e-4  # lambda = ridge * mean diag(X X^T) before the Cholesky
    min_cluster_tokens: int = 16  # smaller clusters keep the dense slice (chosen)
    kmeans_iters: int = 30
    kmeans_restarts: int = 3
    calib_examples: int = 256  # training examples of the current task (the seed's 256)
    calib_tokens: int = 8192  # prompt tokens per layer (chosen, CPU scale; seed: 256 x 512)
    max_drift: float | None = 0.03  # drift guard: largest |relative loss drift| at init (seed: ~3%); None: off
    # expert-ensemble self-distillation (docs/methods/cluster-upcycle.md, step 5)
    eesd_weight: float = 1.0  # chosen; 0 turns EESD (and the EMA teacher) off
    eesd_temperature: float = 1.0  # chosen
    ema_decay: float = 0.999  # per optimiser step (chosen)
    ema_reset: bool = False  # restart the EMA teacher at each task (ablation)

    def __post_init__(self):
        super().__post_init__()
        if not 0 < self.tau <= 1:
            raise UserError(f"method_args.tau={self.tau} must be in (0, 1]")
        if self.rank_cap is not None and self.rank_cap < 0:
            raise UserError(f"method_args.rank_cap={self.rank_cap} must be >= 0 (0: no cap), "
                            f"or null for a slice's size")
        for name in ("kmeans_iters", "kmeans_restarts", "calib_examples", "calib_tokens"):
            if getattr(self, name) < 1:
                raise UserError(f"method_args.{name}={getattr(self, name)} must be >= 1")
        for name in ("ridge", "min_cluster_tokens", "eesd_weight"):
            if getattr(self, name) < 0:
                raise UserError(f"method_args.{name}={getattr(self, name)} must be >= 0")
        if self.max_drift is not None and self.max_drift <= 0:
            raise UserError(f"method_args.max_drift={self.max_drift} must be > 0 (or null: no guard)")
        if self.eesd_temperature <= 0:
            raise UserError(f"method_args.eesd_temperature={self.eesd_temperature} must be > 0")
        if not 0 <= self.ema_decay < 1:
            raise UserError(f"method_args.ema_decay={self.ema_decay} must be in [0, 1)")
