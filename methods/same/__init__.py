"""SAME on decoder LLMs: a LoRA mixture of per-task experts (E = T, expert t for task t)
on every FFN linear (gate/up/down), each linear with its own router, trained with
three mechanisms:

    y = W0 x + s * sum_i w_i B_i A_i dropout(x)                    (layer.py)
    1. router gradient  G <- G - (G V_par) diag(1 - g) V_par^T,  g_i = max(1 - rho, sqrt(lambda_k / lambda_i))
    2. expert A gradient G <- G P,  P = V_k (Lambda_k + mu I)^-1 V_k^T + mu^-1 (I - V_k V_k^T)  (C^{t-1})
    3. freeze experts with minmax(U) - minmax(F_ref) < tau_score (never expert t)

V, lambda: the delta-energy eigenpairs of each layer's running uncentred input
covariance (subspace.py). Arguments and schedule: args.py; per-stage record: record.py.

Source: SAME, ICML 2026, arXiv 2602.01990; code LAMDA-CL/Prism; the faithful variant
"SAME-LoRA" of reference/seed-methods.md, section (b).

Differs from the paper/code (why, defaults, records, costs: docs/methods/same.md):
- routing per sequence over the prompt in training and inference (the code: per
  batch in training, per sample top-2 at inference);
- the covariance is uncentred, accumulated over every task, eigendecomposed
  exactly (the code: the current batch, centred, randomized, every 20 steps);
- the router projection runs from step 0 on the running C^t (the code: step 10);
- F_ref is the running max of F over the earlier tasks (importance="previous");
  masking waits W steps (the code: none);
- the warm-up and the refresh interval shrink with a short task;
- no iter_pred.
"""
from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any

import torch
from torch import nn

from cl_bench.errors import UserError
from cl_bench.method import Method, Stage, lm_loss
from cl_bench.models.modes import device_of
from cl_bench.models.moe import decoder_layers
from cl_bench.models.prompt_pool import DECODE, PromptPool, first_tokens
from cl_bench.registry import register_method

from .args import IMPORTANCE, INPUT_OF, PRECONDITION, TARGETS, SAMEArgs, activation_schedule
from .layer import A_STD, SAMELinear, Routing, activation_scores, minmax
from .record import Task, stage_record
from .subspace import InputCovariance, Subspace, damped_inverse, spectral_projection

__all__ = ["SAME", "SAMEArgs", "activation_schedule", "activation_scores", "minmax", "SAMELinear",
           "InputCovariance", "Subspace", "damped_inverse", "spectral_projection",
           "TARGETS", "INPUT_OF", "PRECONDITION", "IMPORTANCE", "A_STD"]

log = logging.getLogger(__name__)

# Letters: B batch, T sequence, E experts, r r_e, d_in / d_out a linear's widths,
# k kept eigen-directions, L decoder layers.


@register_method("same")
class SAME(Method):
    description = ("SAME: a LoRA mixture (one expert per task) on gate/up/down with spectral routing, "
                   "curvature scaling and adaptive expert activation")
    Args = SAMEArgs
    def __init__(self, args: SAMEArgs, context):
        super().__init__(args, context)
        self._task: Task | None = None
        self._record: dict[str, Any] | None = None
        self._previous: list[dict[str, Subspace | None]] = []  # per layer: C^{t}'s subspaces at task end

    # ---- setup ---------------------------------------------------------------------------
    def setup(self, model: nn.Module) -> None:
        a = self.args
        n_tasks = None if self.ctx.shapes_only else len(self.ctx.all_tasks)
        self.n_experts = a.n_experts or n_tasks
        if self.n_experts is None:
            raise UserError("same: the number of experts is unknown without a run; set method_args.n_experts")
        if n_tasks is not None and n_tasks > self.n_experts:
            raise UserError(f"same: the run has {n_tasks} tasks but method_args.n_experts={self.n_experts}; "
                            f"SAME needs one expert per task (leave n_experts null)")
        if a.infer_top_k > self.n_experts:
            raise UserError(f"method_args.infer_top_k={a.infer_top_k} exceeds the {self.n_experts} experts")
        model.requires_grad_(False)
        self._routing = Routing()
        self._pool = PromptPool(skip_first=False, refuse_chunked=False)
        self.linears: list[dict[str, SAMELinear]] = []  # per layer: proj -> wrapper
        self.covs: list[dict[str, InputCovariance]] = []  # per layer: "x", "h"
        for i, block in enumerate(decoder_layers(model)):
            mlp = getattr(block, "mlp", None)
            bases = {name: getattr(mlp, name, None) for name in TARGETS}
            missing = [n for n, m in bases.items() if not isinstance(m, nn.Linear)]
            if missing:
                raise UserError(f"same: layer {i}'s mlp has no nn.Linear {', '.join(missing)}; SAME wraps "
                                f"the SwiGLU FFN of Llama-style models")
            wrapped = {name: SAMELinear(base, self.n_experts, a.expert_rank, a.lora_scale, a.dropout,
                                        a.infer_top_k, self._routing) for name, base in bases.items()}
            covs = {"x": InputCovariance(bases["gate_proj"].in_features),
                    "h": InputCovariance(bases["down_proj"].in_features)}
            for name, layer in wrapped.items():
                layer.cov = covs[INPUT_OF[name]]
                layer.collects = name != "up_proj"  # up reads the same x as gate
                setattr(mlp, name, layer)
            self.linears.append(wrapped)
            self.covs.append(covs)
        model.register_forward_pre_hook(self._before_forward, with_kwargs=True)
        self.model = model

    def _before_forward(self, module, args, kwargs):
        """Set the routing of this forward: reuse at a cached decoding step, else pool
        over the prompt (label -100 within the attention mask; a row without one: every
        attended token; cl_bench/models/prompt_pool.py)."""
        r, pool = self._routing, self._pool
        pool.read(args, kwargs)
        r.reuse = pool.kind == DECODE
        if not r.reuse:
            r.pool = pool.mask
            r.stat = pool.attended & ~first_tokens(pool.attended)  # not padding, not a row's first token
        return None

    def _wrappers(self):
        """(layer, proj, wrapper) over every routed linear."""
        return [(l, name, lin) for l, layer in enumerate(self.linears) for name, lin in layer.items()]

    # ---- task start ------------------------------------------------------------------------
    def before_task(self, stage: Stage) -> None:
        t = stage.index
        if t >= self.n_experts:
            raise UserError(f"same: stage {t} has no expert of its own (n_experts={self.n_experts})")
        for _, _, lin in self._wrappers():
            lin.requires_grad_(True)
            lin.base.requires_grad_(False)
            lin.frozen.zero_()
            lin.usage.zero_()
            lin.acc.zero_()
            if self.args.importance == "live":
                lin.importance_ref.copy_(lin.importance)
            # previous: importance_ref holds max over the earlier tasks' F (after_task)
        n_layers, device = len(self.linears), device_of(self.model)
        n_steps = self.ctx.stage_steps(stage)
        warmup, every = activation_schedule(n_steps, self.args)
        curvature = self._previous if (t > 0 and self.args.curvature_scaling) else []
        self._task = Task(
            t, [{k: (s.to(device) if s is not None else None) for k, s in c.items()} for c in curvature],
            bases=[{"x": None, "h": None} for _ in range(n_layers)],
            ranks=[{"x": [], "h": []} for _ in range(n_layers)],
            layer_norms={p: torch.zeros(n_layers) for p in TARGETS},
            frozen_steps={p: torch.zeros(n_layers, self.n_experts) for p in TARGETS},
            locked_at={p: [None] * n_layers for p in TARGETS},
            n_steps=n_steps, warmup=warmup, refresh_every=every)
        self._record = None

    # ---- training ------------------------------------------------------------------------
    def loss(self, batch, step):
        r = self._routing
        r.train, r.collect, r.shared = True, not self.ctx.padding, self.ctx.grads.world_size > 1
        try:
            lm = lm_loss(self.model, batch)
        finally:
            self._routing.train = False
        return lm, {"lm": lm.item(), "frozen": self._frozen_share()}

    def _frozen_share(self) -> float:
        t = self._task.index if self._task is not None else 0
        others = [lin.frozen[[i for i in range(self.n_experts) if i != t]] for _, _, lin in self._wrappers()]
        n = sum(len(o) for o in others)
        return sum(int(o.sum()) for o in others) / n if n else 0.0

    def before_step(self, step: int) -> None:
        """The step's statistics summed over the ranks, the routers' subspaces refreshed,
        then the routers' and experts' gradients preconditioned (or their weights saved,
        precondition=update), each rank on its fragment of each (cl_bench/step_gradients.py)."""
        task, a, grads = self._task, self.args, self.ctx.grads
        acc = [lin.acc for _, _, lin in self._wrappers()]
        summed = grads.all_reduce(torch.stack(acc))  # usage and importance of every rank's micro-batches
        for mine, total in zip(acc, summed):
            mine.copy_(total)
        refresh = a.spectral_routing and step % task.refresh_every == 0
        if grads.world_size > 1 and (refresh or step + 1 == task.n_steps):  # after_task reads them too
            device = device_of(self.model)
            for covs in self.covs:
                for cov in covs.values():
                    cov.merge(grads.all_reduce, device)
        if refresh:
            for l, covs in enumerate(self.covs):
                for key, cov in covs.items():
                    sub = cov.subspace(a.delta, a.max_rank)
                    task.bases[l][key] = sub
                    task.ranks[l][key].append(sub.k if sub is not None else 0)
        idle = {id(p) for p in self.idle_parameters(step)}
        wrappers = self._wrappers()
        routers = grads.fragments([lin.router for _, _, lin in wrappers if id(lin.router) not in idle])
        norms = dict.fromkeys(map(id, (lin.router for _, _, lin in wrappers)), 0.0)
        norms.update({id(f.param): float(f.grad.float().norm()) ** 2 for f in routers})
        norms = grads.all_reduce(torch.tensor(list(norms.values()), dtype=torch.float64)).sqrt().tolist()
        for (l, name, lin), norm in zip(wrappers, norms):
            task.layer_norms[name][l] += norm
            task.frozen_steps[name][l] += lin.frozen.float().cpu()
        task.grad_norms.append(math.sqrt(sum(n ** 2 for n in norms)))
        task.steps += 1
        maps = [(p, fn) for p, fn in self._maps() if id(p) not in idle]
        params = [p for p, _ in maps]
        if a.precondition == "grad":
            frags = grads.fragments(params)
            self._apply(maps, frags, {id(f.param): f.grad for f in frags}, lambda f: f.grad)
            grads.write(frags)
        else:
            frags = grads.fragments(params, grad=False)
            task.before = (maps, frags, {id(f.param): f.weight.clone() for f in frags})

    def _apply(self, maps, frags, values, target) -> None:
        """target(f) <- this rank's slice of map(whole), `whole` each parameter assembled
        from the ranks' `values` (the maps read whole rows)."""
        whole = self.ctx.grads.assemble([p for p, _ in maps], frags, values)
        fn = {id(p): m for p, m in maps}
        for f in frags:
            target(f).copy_(f.of(fn[id(f.param)](whole[id(f.param)].view(f.shape))))

    def _maps(self):
        """(parameter, map on its gradient or update) for what SAME preconditions:
        every router (spectral projection) and every expert's A (curvature, t >= 1)."""
        task, a = self._task, self.args
        out = []
        for l, name, lin in self._wrappers():
            key = INPUT_OF[name]
            if a.spectral_routing and task.bases[l][key] is not None:
                sub = task.bases[l][key]
                out.append((lin.router, lambda g, sub=sub: spectral_projection(g, sub, a.rho)))
            if task.curvature and task.curvature[l][key] is not None:
                sub = task.curvature[l][key]
                out.extend((A, lambda g, sub=sub: damped_inverse(g, sub, a.mu)) for A in lin.lora_A)
        return out

    def idle_units(self) -> list[list[nn.Parameter]]:
        """Each expert's (A, B) of each linear, and each router: a frozen expert, and the
        router of a linear with one expert left, get no gradient."""
        return [unit for _, _, lin in self._wrappers()
                for unit in [[lin.router], *([a, b] for a, b in zip(lin.lora_A, lin.lora_B))]]

    def idle_parameters(self, step: int) -> list[nn.Parameter]:
        """The frozen experts' A and B (left out of the forward), and the router of a linear
        where one expert is left (weight 1, no router gradient: layer.py)."""
        out = []
        for _, _, lin in self._wrappers():
            frozen = lin.frozen.tolist()
            if frozen.count(False) == 1:
                out.append(lin.router)
            out.extend(p for i, f in enumerate(frozen) if f for p in (lin.lora_A[i], lin.lora_B[i]))
        return out

    def after_step(self, step: int) -> None:
        task, a = self._task, self.args
        if task.before is not None:
            maps, frags, old = task.before
            with torch.no_grad():  # w <- w_old + map(w - w_old) on the fp32 weights
                update = {id(f.param): f.weight - old[id(f.param)] for f in frags}
                self._apply(maps, frags, update, lambda f: f.weight)
                for f in frags:
                    f.weight.add_(old[id(f.param)])
            self.ctx.grads.set_weights([p for p, _ in maps], frags)
            task.before = None
        for l, name, lin in self._wrappers():
            lin.end_step(a.ema, a.importance == "live")
            if a.adaptive_activation and step + 1 >= task.warmup and task.locked_at[name][l] is None:
                self._update_masks(lin, task.index)
                others = [i for i in range(self.n_experts) if i != task.index]
                if others and bool(lin.frozen[others].all()):
                    task.locked_at[name][l] = step + 1  # the first step trained with the locked masks

    def _update_masks(self, lin: SAMELinear, t: int) -> None:
        frozen = activation_scores(lin.usage, lin.importance_ref) < self.args.tau_score
        frozen[t] = False  # the task's own expert always trains
        lin.frozen.copy_(frozen)

    # ---- task end ------------------------------------------------------------------------
    def after_task(self, stage: Stage) -> None:
        a, task = self.args, self._task
        self._previous = [{k: cov.subspace(a.delta, a.max_rank) for k, cov in covs.items()}
                          for covs in self.covs]
        self._record = stage_record(task, self.linears, self._previous, self.n_experts)
        if self._record["all_frozen"]:
            log.warning("same: stage %d: every linear froze all experts but the task's own (from step %s): "
                        "the routers had no gradient from then on", stage.index, self._record["all_frozen_step"])
        for _, _, lin in self._wrappers():
            lin.frozen.zero_()  # inference and the next task start unmasked
            if a.importance == "previous":  # F_ref^{t+1} = max(F_ref^t, F at the end of task t)
                torch.maximum(lin.importance_ref, lin.importance, out=lin.importance_ref)
        self._task = None

    # ---- records and resume -----------------------------------------------------------
    def before_checkpoint(self) -> None:
        """On N ranks the covariance tokens each rank added since the last merge are its
        own: summed here for the checkpoint rank 0 writes (InputCovariance.hold). In one
        process they are in the covariance already."""
        grads = self.ctx.grads
        if grads.world_size == 1:
            return
        device = device_of(self.model)
        for covs in self.covs:
            for cov in covs.values():
                cov.hold(grads.all_reduce, device, keep=grads.rank == 0)

    def state_dict(self) -> dict[str, Any]:
        state = self._tables()
        if self._task is not None:  # inside a task (an in-stage checkpoint): what its steps changed
            state["task"] = self._task_state()
        return state

    def _task_state(self) -> dict[str, Any]:
        task = self._task
        sub = lambda s: None if s is None else dataclasses.asdict(s)  # noqa: E731
        return {"bases": [{k: sub(s) for k, s in b.items()} for b in task.bases], "ranks": task.ranks,
                "layer_norms": task.layer_norms, "frozen_steps": task.frozen_steps, "locked_at": task.locked_at,
                "steps": task.steps, "grad_norms": task.grad_norms,
                "buffers": [{p: {"frozen": lin.frozen.clone(), "usage": lin.usage.clone(), "acc": lin.acc.clone()}
                             for p, lin in layer.items()} for layer in self.linears]}

    def _load_task_state(self, state: dict[str, Any]) -> None:
        task, device = self._task, device_of(self.model)
        task.bases = [{k: None if s is None else Subspace(**s).to(device) for k, s in b.items()}
                      for b in state["bases"]]
        task.ranks, task.layer_norms, task.frozen_steps = state["ranks"], state["layer_norms"], state["frozen_steps"]
        task.locked_at, task.steps, task.grad_norms = state["locked_at"], state["steps"], state["grad_norms"]
        for layer, saved in zip(self.linears, state["buffers"]):
            for p, lin in layer.items():
                for name, value in saved[p].items():
                    getattr(lin, name).copy_(value)

    def _tables(self) -> dict[str, Any]:
        return {
            "n_experts": self.n_experts,
            "covs": [{k: cov.state_dict() for k, cov in covs.items()} for covs in self.covs],
            "previous": [{k: None if s is None else dataclasses.asdict(s) for k, s in prev.items()}
                         for prev in self._previous],
            "importance": [{p: lin.importance.clone() for p, lin in layer.items()} for layer in self.linears],
            "importance_ref": [{p: lin.importance_ref.clone() for p, lin in layer.items()}
                               for layer in self.linears],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["n_experts"] != self.n_experts:
            raise UserError(f"same: the checkpoint has {state['n_experts']} experts, this run "
                            f"{self.n_experts}; resume with the original method_args")
        device = device_of(self.model)
        for covs, saved in zip(self.covs, state["covs"]):
            for key, cov in covs.items():
                cov.load_state_dict(saved[key])
                if cov.sum is not None:
                    cov.sum = cov.sum.to(device)
        self._previous = [{k: None if s is None else Subspace(**s).to(device) for k, s in prev.items()}
                          for prev in state["previous"]]
        refs = state.get("importance_ref", state["importance"])  # older checkpoints: F at the last task end
        for layer, saved, ref in zip(self.linears, state["importance"], refs):
            for p, lin in layer.items():
                lin.importance.copy_(saved[p])
                lin.importance_ref.copy_(ref[p])
        if "task" in state:  # before_task has built the task again (cl_bench/run/checkpoint.py)
            self._load_task_state(state["task"])

    def param_report(self) -> dict[str, Any]:
        params = list(self.model.parameters())
        total = sum(p.numel() for p in params)
        idle = 0  # expert parameters a token does not touch (top-k inference)
        if self.args.infer_top_k:
            idle = sum((self.n_experts - self.args.infer_top_k) * self.args.expert_rank *
                       (lin.base.in_features + lin.base.out_features) for _, _, lin in self._wrappers())
        return {"total": total,
                "trainable": sum(p.numel() for p in params if p.requires_grad),
                "active_per_token": total - idle,
                # routing varies per sequence: the experts cannot fold into W0
                "deployed": total,
                "experts_per_layer": [self.n_experts] * len(self.linears),
                **(self._record or {})}

    @classmethod
    def param_schedule(cls, model: nn.Module, n_tasks: int, args: SAMEArgs) -> list[dict[str, Any]]:
        """E = n_tasks unless n_experts is set; nothing grows (E experts from the start)."""
        if args.n_experts is None:
            args = dataclasses.replace(args, n_experts=n_tasks)
        return super().param_schedule(model, n_tasks, args)
