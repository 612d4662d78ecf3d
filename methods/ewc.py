"""EWC: elastic weight consolidation with a diagonal empirical Fisher per task.

Loss while training task t (Kirkpatrick et al., 2017; online accumulation as
Schwarz et al., 2018):
    L = L_t + (λ/2) · Σ_j F_j (θ_j − θ*_j)²
θ* = the weights at the end of task t−1, F the accumulated Fisher:
    F ← γ·F + F_new after each task,   F_new,j = (1/B) Σ_b (∂ℓ_b/∂θ_j)²
over B Fisher batches of `fisher_batch_size` training examples of the task
just trained (per-example when 1, the empirical Fisher), with ℓ_b the batch's
mean sequence negative log-likelihood:
    ℓ_b = (1/|b|) Σ_{i∈b} Σ_{k ∈ answer_i} −log p_θ(y_{i,k} | x_i, y_{i,<k})
(answer tokens + EOS, the tokens `lm_loss` trains on, summed per example; for
one example, ℓ = −log p_θ(y | x) of the whole answer). Each answer token's
gradient enters ∂ℓ with weight 1 whatever the answer's length L. The per-token
mean (the training loss) would weight it 1/L, so an example's F would scale
as 1/L² and a long-answer task would be protected far less than a two-token
one, a difference λ cannot absorb across tasks. Task 0 has no penalty. F and θ*
are fp32, on the model's device, and saved for resume; F is not computed after
the last stage (no later task to protect).

The penalty's gradient λ·F_j(θ_j − θ*_j) is added to the gradients once per
step in `before_step` (before clipping, like any loss term), not through
autograd: exact, and it spares an autograd graph over two model-sized tensors
per micro-batch. `loss` adds the penalty's value (detached) so the logged loss
is the whole objective; parts "lm" and "ewc" (the weighted penalty).

On N ranks (deepspeed, ZeRO-2/3) each rank adds the penalty's gradient to its
own fragment of each parameter's reduced gradient, at the fp32 master weights
(cl_bench/step_gradients.py), and the penalty's value is its fragments' sum
all-reduced: the step is the torch backend's. F and θ* are computed between
phases, where every rank holds the whole model: each rank computes the same F
from the same examples (F from each rank's own micro-batches, or with the
penalty's gradient in it, would not be the torch backend's F).

Differences from TRACE's EWC.py (reference/baselines.md, "EWC"), on purpose:
- TRACE adds g²/N_batches of every training step's mini-batch gradient to F
  through all epochs and tasks, including the task being trained; here F_new
  comes after the task, from per-example gradients of its data.
- TRACE's g is the gradient of the training loss, the per-token mean over the
  micro-batch's answer tokens; here ℓ is each example's sequence negative
  log-likelihood (above), the standard form's per-sample log-likelihood.
- TRACE keeps F in the parameters' dtype (bf16) and θ* on the CPU; here both
  are fp32 on the model's device.
- TRACE's λ = 400 matches its differently scaled F. The default λ = 1e4 comes
  from a sweep on the cpu profile with this F (SmolLM2, Py150 -> NumGLUE-ds ->
  C-STANCE, selected on the eval split; records in results/sweeps/ewc-lambda/,
  docs/results.md, "EWC's λ on the calibrated profile"): Last Acc 33.6 / 33.8 / 31.7 at
  λ = 1e3 / 1e4 / 1e5, rule best Last Acc then BWT; the three are not
  distinguishable at 95% (differences -0.2 [-2.4, +2.0] and -2.1 [-5.7, +1.6]).
  A larger λ keeps slightly more of the old tasks and learns C-STANCE less (1e5:
  only its majority answer). A different model or profile needs its own sweep.
  Every run records its λ.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass

import torch

from cl_bench.errors import UserError
from cl_bench.data.gradients import batch_gradients
from cl_bench.losses import answer_forward, summed_nll
from cl_bench.method import Method, MethodArgs, Stage, lm_loss
from cl_bench.models.modes import eval_mode
from cl_bench.registry import register_method


@dataclass
class EWCArgs(MethodArgs):
    lambda_ewc: float = 1e4  # from the cpu-profile sweep {1e3, 1e4, 1e5} (docstring)
    gamma: float = 1.0  # F <- gamma·F + F_new; 1 = sum over tasks
    fisher_examples: int = 32  # training examples of each task for F_new (all if fewer)
    fisher_batch_size: int = 1  # examples per squared gradient; 1 = per-example Fisher

    def __post_init__(self) -> None:
        if self.lambda_ewc < 0:
            raise UserError(f"method_args.lambda_ewc={self.lambda_ewc} must be >= 0")
        if self.gamma < 0:
            raise UserError(f"method_args.gamma={self.gamma} must be >= 0")
        for name in ("fisher_examples", "fisher_batch_size"):
            if getattr(self, name) < 1:
                raise UserError(f"method_args.{name}={getattr(self, name)} must be at least 1")


def sequence_nll(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The batch's mean over examples of each example's summed answer-token NLL,
    −(1/B) Σ_i log p(y_i | x_i), in fp32 (labels -100 excluded, as in `lm_loss`)."""
    # logits at the answer positions only (cl_bench/losses.py)
    return summed_nll(answer_forward(model, batch)) / batch["input_ids"].shape[0]


@register_method("ewc")
class EWC(Method):
    description = "EWC: diagonal empirical Fisher after each task, accumulated; penalty λ·F·(θ − θ*)² toward the previous task's weights"
    lr_family = "full"
    Args = EWCArgs

    def __init__(self, args: EWCArgs, context):
        super().__init__(args, context)
        self.fisher: dict[str, torch.Tensor] = {}  # parameter name -> F, fp32
        self.anchor: dict[str, torch.Tensor] = {}  # parameter name -> θ*, fp32
        self._penalty_value: torch.Tensor | None = None  # this step's penalty, detached

    # ---- the penalty -------------------------------------------------------
    def _anchored(self, grad: bool = True) -> list:
        """This rank's fragments of the anchored parameters (cl_bench/step_gradients.py)."""
        named = [(n, p) for n, p in self.model.named_parameters() if n in self.fisher and p.requires_grad]
        frags = self.ctx.grads.fragments([p for _, p in named], grad)
        names = {id(p): n for n, p in named}
        return [(names[id(f.param)], f) for f in frags]

    def penalty_value(self) -> torch.Tensor:
        """(λ/2) Σ_j F_j (θ_j − θ*_j)² in fp32 at this step's weights (the fp32 masters),
        summed over the ranks' fragments."""
        total = torch.zeros((), dtype=torch.float32, device=self.ctx.device)
        for name, f in self._anchored(grad=False):
            total += (f.of(self.fisher[name]) * (f.weight.float() - f.of(self.anchor[name])).square()).sum()
        return 0.5 * self.args.lambda_ewc * self.ctx.grads.all_reduce(total)

    def loss(self, batch, step):
        lm = lm_loss(self.model, batch)
        if not self.fisher:
            return lm, {"lm": lm.item(), "ewc": 0.0}
        if self._penalty_value is None:  # the weights stay put across a step's micro-batches
            with torch.no_grad():  # every rank runs at least one micro-batch a step: the sum is collective
                self._penalty_value = self.penalty_value()
        # The value only: its gradient is added in before_step.
        return lm + self._penalty_value, {"lm": lm.item(), "ewc": self._penalty_value.item()}

    def before_step(self, step: int) -> None:
        """grad += ∂/∂θ (λ/2) Σ F (θ − θ*)² = λ F (θ − θ*), once per step, on each rank's
        own fragment of each parameter (no communication)."""
        if not self.fisher:
            return
        with torch.no_grad():
            anchored = self._anchored()
            for name, f in anchored:
                g = (f.of(self.fisher[name]) * (f.weight.float() - f.of(self.anchor[name]))).mul_(self.args.lambda_ewc)
                f.grad.add_(g.to(f.grad.dtype))
            self.ctx.grads.write([f for _, f in anchored])

    def after_step(self, step: int) -> None:
        self._penalty_value = None

    # ---- Fisher and anchor after each task -----------------------------------
    def after_task(self, stage: Stage) -> None:
        if stage.index == self.ctx.n_stages - 1:
            return  # no later task to protect
        fresh = self.fisher_of(stage)
        for name, f in fresh.items():
            self.fisher[name] = self.args.gamma * self.fisher[name] + f if name in self.fisher else f
        self.anchor = {name: p.detach().to(torch.float32, copy=True)
                       for name, p in self.model.named_parameters() if name in self.fisher}

    def fisher_of(self, stage: Stage) -> dict[str, torch.Tensor]:
        """F_new: the mean over Fisher batches of the squared gradient of the batch's
        mean sequence NLL (`sequence_nll`), for every trainable parameter, fp32."""
        a = self.args
        examples = [e for task in stage.tasks for e in task.train]
        order = list(range(len(examples)))
        # Which examples does not depend on the run's RNG state, only on seed and stage.
        random.Random(f"{self.ctx.config.seed}/ewc-fisher/{stage.label}").shuffle(order)
        chosen = [examples[i] for i in order[:a.fisher_examples]]
        named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        sums = {n: torch.zeros_like(p, dtype=torch.float32) for n, p in named}
        with eval_mode(self.model):  # no dropout: F of the deterministic model
            for grads in batch_gradients(self.model, self.ctx.encoder, chosen, [p for _, p in named],
                                         sequence_nll, a.fisher_batch_size):
                for (n, _), g in zip(named, grads):
                    if g is not None:
                        sums[n].add_(g.float().square())
        n_batches = max(math.ceil(len(chosen) / a.fisher_batch_size), 1)
        return {n: s.div_(n_batches) for n, s in sums.items()}

    # ---- resume and accounting ---------------------------------------------
    def state_dict(self) -> dict:
        return {"fisher": self.fisher, "anchor": self.anchor}

    def load_state_dict(self, state: dict) -> None:
        params = dict(self.model.named_parameters())
        self.fisher = {n: t.to(params[n].device, torch.float32) for n, t in state["fisher"].items()}
        self.anchor = {n: t.to(params[n].device, torch.float32) for n, t in state["anchor"].items()}

    def param_report(self) -> dict:
        report = super().param_report()
        # F and θ* are held beside the model (deployment needs neither).
        report["total"] += sum(t.numel() for t in (*self.fisher.values(), *self.anchor.values()))
        return report
