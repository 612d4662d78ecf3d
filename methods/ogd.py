"""OGD: orthogonal gradient descent on the parameters of one LoRA adapter.

After each task t, gradients of that task's examples at the weights the task
ended with are orthonormalised into a basis V (rows, fp32) of the directions to
protect. While later tasks train, every accumulated step gradient g of the
adapter is replaced by
    g ← g − Vᵀ (V g)
before clipping and the optimiser step (Farajtabar et al., 2020, "Orthogonal
Gradient Descent for Continual Learning"). The LoRA itself is `lora`'s (peft,
q_proj+v_proj, r 8, alpha 32, dropout 0.1, lr 1e-4), so OGD differs from `lora`
only by the projection.

Stored gradients: per-example gradients of the answer cross-entropy (the
harness's loss on one example, dropout off), for up to `max_per_task` examples
of each task (a seeded sample when the task has more). The paper's preferred
variant ("GTL") differentiates the true-class logit of a classifier; for a
generative LM the loss gradient is the natural analogue.
Orthonormalisation: the new gradients are projected off V twice (classical
Gram-Schmidt, repeated because one fp32 pass leaves visible overlap), and an
SVD of the residuals gives an orthonormal basis of their span, strongest
directions first; directions below 1e-4 of the largest gradient norm are
numerically dependent and dropped. If the basis would pass `max_basis`
vectors, only the strongest new directions that fit are kept (the earliest
tasks keep their protection), and a warning says how many were dropped.
Memory: max_basis × n_lora × 4 bytes (SmolLM2-135M: n_lora ≈ 0.46M, so
200 vectors ≈ 0.37 GB).

Differences from TRACE's OGD.py (reference/baselines.md, "OGD"), all fixes:
- TRACE stores the mini-batch gradient of every step of the last epoch (its
  `max_memories=150` is unused) in bf16; here per-example gradients at the
  end-of-task weights, capped per task, basis in fp32.
- TRACE projects inside per-parameter gradient hooks with a countdown index;
  here the flattened accumulated gradient is projected once per step (on N
  ranks, each rank its fragment after one all-reduce of the k coefficients:
  `before_step`).
- TRACE's script uses lr 1e-5; here lora's 1e-4, for the clean comparison above.
As in TRACE, the projected gradient feeds AdamW (the harness's optimiser, whose
moments carry across tasks), not SGD as in the paper: Adam's per-coordinate
scaling, and first moments still holding the previous task's gradients at a
task boundary, mean the applied update is not exactly orthogonal to V, only the
gradient is.

Composition: the adapter is `cl_bench.models.lora_adapters`' (`inject_lora`, its
`lora_parameters` as the basis's coordinates, `merged_adapter_report`), the same
pieces `lora` is made of; the per-example gradients come from
`cl_bench.data.gradients.batch_gradients`, as EWC's Fisher does.
"""
from __future__ import annotations

import logging
import random
from dataclasses import dataclass

import torch
from torch import nn

from cl_bench.data.gradients import batch_gradients
from cl_bench.method import Method, MethodArgs, Stage, lm_loss
from cl_bench.models.lora_adapters import LoRAAdapterArgs, inject_lora, lora_parameters, merged_adapter_report
from cl_bench.models.modes import eval_mode
from cl_bench.registry import register_method

log = logging.getLogger(__name__)

DEPENDENT_RTOL = 1e-4  # residual singular values below this × max ‖g‖ are dropped


@dataclass
class OGDArgs(LoRAAdapterArgs, MethodArgs):
    lr: float = 1e-4  # lora's, so OGD differs from lora only by the projection (TRACE's script: 1e-5)
    max_per_task: int = 200  # stored gradients per task (baselines.md: about 200)
    max_basis: int = 1600  # total basis vectors (8 TRACE tasks × 200): caps memory


def project_out(basis: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """g − Vᵀ(V g) for V (k, n) with orthonormal rows; g (..., n)."""
    return g - (g @ basis.T) @ basis


def extend_basis(basis: torch.Tensor, grads: torch.Tensor, cap: int) -> tuple[torch.Tensor, int]:
    """Append an orthonormal basis of span(grads) ⊥ span(basis) to `basis` (k, n),
    at most up to `cap` rows in all. grads: (m, n). Returns (basis, directions dropped by the cap)."""
    grads = grads.to(basis.dtype)
    residual = project_out(basis, project_out(basis, grads))
    _, s, vh = torch.linalg.svd(residual, full_matrices=False)  # vh: (min(m, n), n)
    found = int((s > DEPENDENT_RTOL * grads.norm(dim=1).max()).sum())
    new = vh[:min(found, max(cap - len(basis), 0))]
    if len(new):
        # The 1/s in vh amplifies what is left of V in the residuals: project once
        # more, then re-orthonormalise the (nearly orthonormal) new rows.
        q, _ = torch.linalg.qr(project_out(basis, new).T)  # (n, j)
        basis = torch.cat([basis, q.T])
    return basis, found - len(new)


@register_method("ogd")
class OGD(Method):
    description = "OGD on LoRA params: gradients projected off a basis of earlier tasks' per-example gradients"
    lr_family = "adapter"
    Args = OGDArgs

    def setup(self, model: nn.Module) -> None:
        self.model = inject_lora(model, self.args)
        self.adapter = lora_parameters(self.model)  # fixed order: the basis's coordinates
        sizes = [p.numel() for p in self.adapter]
        self.offsets = dict(zip(map(id, self.adapter), [sum(sizes[:i]) for i in range(len(sizes))]))
        self.basis = torch.zeros(0, sum(sizes), dtype=torch.float32, device=self.adapter[0].device)  # (k, n)

    def before_step(self, step: int) -> None:
        """g ← g − Vᵀ(V g) over the adapter's coordinates. On N ranks each holds a
        fragment of g (cl_bench/step_gradients.py): c = V g is the sum over ranks of each
        fragment's V[:, slice] g[slice] (one all-reduce of k floats), then each rank
        subtracts its slice of Vᵀ c."""
        if not len(self.basis):
            return
        grads = self.ctx.grads
        frags = grads.fragments(self.adapter)
        cols = [self.basis[:, self.offsets[id(f.param)] + f.start:self.offsets[id(f.param)] + f.stop] for f in frags]
        coeff = self.basis.new_zeros(len(self.basis))  # V g, (k,)
        for f, v in zip(frags, cols):
            coeff += v @ f.grad.float()
        coeff = grads.all_reduce(coeff)
        for f, v in zip(frags, cols):
            f.grad.copy_((f.grad.float() - coeff @ v).to(f.grad.dtype))
        grads.write(frags)

    def after_task(self, stage: Stage) -> None:
        grads = self.task_gradients(stage)
        if not len(grads):
            return
        self.basis, dropped = extend_basis(self.basis, grads, self.args.max_basis)
        if dropped:
            log.warning("ogd: basis full at max_basis=%d; %d directions of %s not stored",
                        self.args.max_basis, dropped, stage.label)

    def task_gradients(self, stage: Stage) -> torch.Tensor:
        """Per-example adapter gradients (m, n) of the stage's training examples, fp32."""
        examples = []
        for task in stage.tasks:
            chosen = list(task.train)
            if len(chosen) > self.args.max_per_task:
                rng = random.Random(f"{self.ctx.config.seed}/ogd/{task.name}")
                chosen = rng.sample(chosen, self.args.max_per_task)
            examples += chosen
        with eval_mode(self.model):  # no dropout: the gradient of the function the task ended with
            rows = [torch.cat([g.reshape(-1).float() for g in grads])
                    for grads in batch_gradients(self.model, self.ctx.encoder, examples, self.adapter, lm_loss)]
        return torch.stack(rows) if rows else self.basis.new_zeros(0, self.basis.shape[1])

    def state_dict(self) -> dict:
        return {"basis": self.basis.cpu()}

    def load_state_dict(self, state: dict) -> None:
        self.basis = state["basis"].to(device=self.basis.device, dtype=torch.float32)

    def param_report(self) -> dict:
        report = merged_adapter_report(self.model)
        report["total"] += self.basis.numel()  # the basis is held in memory beside the model
        report["basis_vectors"] = len(self.basis)
        return report
