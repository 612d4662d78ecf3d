"""bilevel-cka: CKA-guided bilevel MoE upcycling, the paper's algorithm done as
METHODS.md ("bilevel-cka") fixes it.

Task 0 is Standard upcycling (the core's pieces, cl_bench/models/upcycling.py:
K = 8 slice experts, top-2, Switch balancing, the frozen dense MLP as the shared
path). Task t >= 1, in each candidate layer: a trainable clone of each active
expert a_c, with a router row of its own, routable beside a_c where its hard
straight-through Gumbel mask pi_c = 1 (supernet.py), and

    L_in  = L_task + lambda_CKA * L_CKA + lambda_replay * L_replay       every step
    L_CKA = mean_{l in deep} 1 - CKA(Phi_l, Phi_l^old)                  replay batch, layer outputs
    L_out = L_replay(pi) - gamma * G + beta * B(r),  G = sg(L_recycle - L_expand) * r,  r = mean(pi)

the outer loss trained on the mask logits alpha every N steps (search.py), from
the guided init (guidance.py: the prior, the replay flatness per expert and the
measured CKA drift per layer); at the end, sigmoid(alpha_e - alpha_r) > 0.5 ->
Expand (the clone joins as a new expert), else Recycle (record.py). Arguments: args.py.

Source: CKA-guided bilevel MoE upcycling (ICML 2026); its published code as
bilevel-reference.md describes it. Full account (routing choice, schedule,
defaults, records, provenance): docs/methods/bilevel-cka.md.

Differs from the paper/code (bilevel-reference.md §8), on purpose:
- the clones really train (the code never steps its experts: clone = old, G = 0);
- L_CKA carries gradient, on each deep layer's output, on every step's replay
  batch, against the model before this task (the code: a float every 20 steps,
  layer inputs, task 0's batches);
- router rows stay aligned with experts; each clone's own row is searched and deployed;
- masks on every candidate layer, the guided init's flatness term too; its depth
  term measured (the code's fixed bias: depth_prior=fixed); no adaptive gamma /
  beta / r_target, CKA warm-up or layer weights; balance above target sigmoid;
- tau reaches tau_final within each task; mask_lr raised where the task's updates
  are fewer than the paper's, up to the paper's reach;
- shared weights frozen by default (train_shared=true trains them).

On the deepspeed backend (ZeRO-2 as the paper, or ZeRO-3) every rank takes the same
outer step: the replay micro-batch runs on every rank (replay_on_every_rank, at
weight 1/N), the outer step's task micro-batch is the step's last whichever rank
computes it (step_batches), and the Gumbel noise comes from the task's own
generator, drawn once per step: the mask logits, the records and the decisions are
the torch backend's (tests/backends/test_deepspeed_ranks.py). The outer step's
forward and gradient run inside `ctx.grads.apart()`: at ZeRO-3 they would otherwise
run the MoE layers' reduction hooks a second time in the step
(cl_bench/backends/zero_engine.py, ZeroPhase.apart); outer_sample=shared, whose
outer gradient goes back through the inner replay forward, is refused at ZeRO-3.
Nor does that forward count as reaching the experts it routes to (ExpertReach.uncounted):
its gradient goes to the mask logits only, so on one process a clone only it reached
has no gradient and AdamW skips it, and ZeRO must skip it too.
"""
from __future__ import annotations

import dataclasses
import math
import random
from typing import Any

import torch
from torch import nn

from cl_bench.run import precision
from cl_bench.eval.probes.cka import linear_cka
from cl_bench.errors import UserError
from cl_bench.method import Method, MethodContext, Stage, lm_loss
from cl_bench.models.balancing import balancing_losses
from cl_bench.models.expert_init import slice_experts
from cl_bench.models.modes import device_of
from cl_bench.models.moe import decoder_layers, group_sizes, moe_layers, rebuild, upcycle_model
from cl_bench.models.reach import ExpertReach
from cl_bench.models.params import count
from cl_bench.models.upcycling import grow_groups, lm_and_balancing, moe_settings, train_newest_group
from cl_bench.registry import register_method

from .args import MASK_INITS, MASK_MODES, RANDOM_INIT_STD, BilevelCKAArgs
from .guidance import (drift, expert_sensitivity, fixed_depth, guidance_record, guided_logits, layer_outputs,
                       replay_batches, scale_over_layers, scale_per_layer)
from .record import decisions_for_schedule, finalise, spread_decisions
from .search import (CHECK_BATCHES, LayerFeatures, TaskSearch, mask_schedule, no_update_error, outer_step,
                     reachable_mask_lr)
from .supernet import Supernet, balance, pair_shares, straight_through_gumbel

__all__ = ["BilevelCKA", "BilevelCKAArgs", "MASK_MODES", "MASK_INITS", "RANDOM_INIT_STD", "CHECK_BATCHES",
           "straight_through_gumbel", "balance", "mask_schedule", "reachable_mask_lr", "no_update_error",
           "pair_shares", "spread_decisions"]

# Letters: L_c candidate layers, K slots (experts per task), B, T, N, d, E as in moe.py.


@register_method("bilevel-cka")
class BilevelCKA(Method):
    description = "CKA-guided bilevel upcycling: clones of the active experts, learned masks pick Expand/Recycle"
    lr_family = "expert"
    Args = BilevelCKAArgs
    uses_replay = True
    # the outer step (Adam on the mask logits), the CKA record and the reference cache live in
    # replay_loss: every rank takes the same outer step on the same batches with the same noise
    replay_on_every_rank = True

    def __init__(self, args: BilevelCKAArgs, context):
        super().__init__(args, context)
        if context is not None:
            self.check_run(args, context.config)
        self._active: dict[int, list[int]] = {}  # candidate layer -> expert index per slot
        self._task: TaskSearch | None = None
        self._record: dict[str, Any] | None = None  # this stage's per-task record
        # guided init, depth_prior=cka: the last task's drift per candidate layer and what it
        # was measured on; the model before task 0 (its trainable values) while task 0 trains
        self._drift: tuple[list[float], str] | None = None
        self._pre0: dict[str, torch.Tensor] | None = None

    @classmethod
    def check_run(cls, args: BilevelCKAArgs, config) -> None:
        if config.replay.policy != "interleave":
            raise UserError(f"bilevel-cka needs replay.policy=interleave (its CKA term and outer step use "
                            f"the replay micro-batch of each step), not {config.replay.policy!r}; "
                            f"set --set replay.policy=interleave")
        if args.outer_sample == "shared" and config.backend == "deepspeed" and config.deepspeed.zero == 3:
            raise UserError("method_args.outer_sample=shared cannot run at ZeRO-3: its outer gradient goes back "
                            "through the inner replay forward, whose graph holds ZeRO-3's reduction hooks; use "
                            "outer_sample=own (the default) or --zero 2")

    def setup(self, model: nn.Module) -> None:
        self.model = model
        # an expert group no token of a step reached takes no optimiser step, on either backend
        self._reach = ExpertReach(model, self.ctx)
        self.idle_units, self.idle_parameters = self._reach.units, self._reach.idle
        a = self.args
        upcycle_model(model, init=slice_experts, router_std=a.router_std, **moe_settings(a))
        train_newest_group(model, a.train_shared)
        n = len(decoder_layers(model))
        self._candidates = _layers(a.candidate_layers, list(range(n)), n, "candidate_layers")
        self._cka_layers = _layers(a.cka_layers, list(range(n - math.ceil(n / 3), n)), n, "cka_layers")
        self._features = LayerFeatures(model, self._cka_layers, a.cka_max_tokens)
        self._depth_features = LayerFeatures(model, self._candidates, a.cka_max_tokens)
        self._active = {i: list(range(a.experts_per_task)) for i in self._candidates}

    # ---- task start ------------------------------------------------------------
    def plan(self, tasks: list) -> list[Stage]:
        """Standard stages; refuses, before anything trains, a task whose masks would
        get no outer update (docs/methods/bilevel-cka.md, "Schedule")."""
        stages = super().plan(tasks)
        if self.args.mask == "on":
            for stage in stages[1:]:
                n_steps = self.ctx.stage_steps(stage)
                if n_steps is not None and not mask_schedule(n_steps, self.args)[1]:
                    raise no_update_error(stage, n_steps, self.args)
        return stages

    def before_task(self, stage: Stage) -> None:
        self._record = None
        a = self.args
        if stage.index == 0:  # task 0: plain upcycling
            grow_groups(self.model, 1, slice_experts, a.router_std)
            train_newest_group(self.model, a.train_shared)
            if self._measures_drift():  # the model before task 0, for task 0's own drift (guidance.py)
                self._pre0 = {n: p.detach().clone() for n, p in self.model.named_parameters() if p.requires_grad}
            return
        n_steps = self.ctx.stage_steps(stage)
        every, updates, decay = mask_schedule(n_steps, a)
        if a.mask == "on" and updates == 0:
            raise no_update_error(stage, n_steps, a)
        seed = 0 if self.ctx.shapes_only else self.ctx.config.seed
        generator = torch.Generator().manual_seed(
            random.Random(f"{seed}/bilevel-cka/{stage.index}").getrandbits(63))
        rows = torch.Generator().manual_seed(  # the clones' router rows: their own stream
            random.Random(f"{seed}/bilevel-cka/{stage.index}/rows").getrandbits(63))
        init = guidance = None
        if a.mask == "on":
            shape = (len(self._candidates), a.experts_per_task, 2)
            if a.mask_init == "random":
                init = torch.randn(shape, generator=generator) * RANDOM_INIT_STD
            elif a.mask_init == "guided":  # measured on the model before the task, before the supernets
                init, guidance = self._guided_init(stage)
            else:
                init = torch.zeros(shape)
                init[..., 1] = math.log(a.init_expand_prob / (1 - a.init_expand_prob))
        blocks = decoder_layers(self.model)
        train_newest_group(self.model, a.train_shared, newest=False)  # only the clones (and s) train
        nets = {}
        for i in self._candidates:
            nets[i] = blocks[i].mlp = Supernet(blocks[i].mlp, self._active[i], a.router_std, rows, a.supernet)
        clones = {id(p) for net in nets.values() for p in net.clones.parameters()}
        snapshot = {n: p.detach().clone() for n, p in self.model.named_parameters()
                    if p.requires_grad and id(p) not in clones}
        logits = optimizer = mask_lr = init_gap = None
        if init is not None:
            init_gap = float((init[..., 1] - init[..., 0]).abs().max())
            mask_lr = reachable_mask_lr(updates, init_gap, a.mask_lr, a.mask_reach)
            logits = nn.Parameter(init.to(device_of(self.model), copy=True))  # init stays the start
            optimizer = torch.optim.Adam([logits], lr=mask_lr)
        self._task = TaskSearch(nets, snapshot, generator, n_steps, every, decay, logits, optimizer, a.tau0,
                           mask_lr, init_gap, init=init, guidance=guidance)

    # ---- guided initialisation (guidance.py) -------------------------------------------
    def _measures_drift(self) -> bool:
        a = self.args
        return (a.mask == "on" and a.mask_init == "guided" and a.depth_prior == "cka"
                and not self.ctx.shapes_only and self.ctx.replay is not None)

    def _autocast(self):
        config, device = self.ctx.config, self.ctx.device
        return precision.autocast(precision.resolve(config.train.precision, device), device)

    def _probe_batches(self, examples: list, stage: Stage, what: str) -> list[dict]:
        return replay_batches(self.ctx, examples, self.args.probe_batches,
                              f"{self.ctx.config.seed}/bilevel-cka/{what}/{stage.index}")

    def _guided_init(self, stage: Stage) -> tuple[torch.Tensor, dict]:
        """The guided mask logits (L_c, K, 2) for task `stage` and their record: the
        flatness of each active expert on the replay buffer (tasks before this one) and
        the depth term (guidance.py)."""
        a = self.args
        examples = self.ctx.replay.examples() if self.ctx.replay is not None else []
        batches = self._probe_batches(examples, stage, "flatness")
        if batches:
            raw = expert_sensitivity(self.model, self._candidates, self._active, batches, self._autocast)
        else:  # no replay data (replay.per_task=0): no flatness information
            raw = torch.zeros(len(self._candidates), a.experts_per_task)
        s = scale_per_layer(raw)
        measured = None
        if a.depth_prior == "fixed":
            depth, source = fixed_depth(self._candidates, len(decoder_layers(self.model))), "fixed: last 3/16 of the layers"
        elif self._drift is not None:
            measured, source = self._drift
            depth = scale_over_layers(measured)
        else:
            depth, source = [0.0] * len(self._candidates), "none: no drift measured"
        init = guided_logits(len(self._candidates), a.experts_per_task, a.init_expand_prob, s, depth,
                             a.kappa_flat, a.kappa_depth)
        n_rows = sum(len(b["input_ids"]) for b in batches)
        return init, guidance_record(raw, s, measured, depth, source, n_rows)

    def _measure_drift(self, before: dict[int, torch.Tensor], batches: list[dict], source: str) -> None:
        """Keep 1 - CKA per candidate layer between `before` and the model as it is now,
        on `batches`, for the next task's depth term."""
        after = layer_outputs(self.model, self._depth_features, batches, self._autocast)
        self._drift = (drift(before, after), source)

    # ---- losses ----------------------------------------------------------------------
    def _masks(self, step: int) -> torch.Tensor:
        """This step's pi, set on the supernets."""
        pi = self._task.step_masks(step, self.args.experts_per_task, device_of(self.model))
        self._task.set_masks(pi)
        return pi

    def loss(self, batch, step):
        task = self._task
        if task is None:
            return lm_and_balancing(self.model, batch)  # task 0: Standard upcycling's CE + balancing
        pi = self._masks(step)
        with balancing_losses() as balance_terms:
            lm = lm_loss(self.model, batch)
        lb = balance_terms.total(device_of(self.model))
        return lm + lb, {"lm": lm.item(), "lb": lb.item(), "expand": float(pi.mean())}

    def step_batches(self, step, micro_batches, replay):
        """The outer step's task micro-batch (the step's last) and the deploy check's last
        ones: the step's, on every rank, whichever computes them."""
        if self._task is not None:
            self._task.task_batch = micro_batches[-1]
            self._task.task_batches.extend(micro_batches)

    def replay_loss(self, batch, step):
        a, task = self.args, self._task
        if task is None:  # task 0 replays only with replay.lima > 0; balancing belongs to the task loss
            lm = lm_loss(self.model, batch)
            return a.lambda_replay * lm, {"lm": lm.item()}
        parts: dict[str, float] = {}
        if a.mask == "on" and (step + 1) % task.every == 0 and task.task_batch is not None:
            if a.outer_sample == "shared":  # one replay forward: the outer sample's, for both losses
                pi = straight_through_gumbel(task.logits, task.tau, task.generator)[..., 1]  # (L_c, K)
                loss, inner, lm = self._inner_replay(batch, step, pi)
                parts.update(outer_step(self.model, task, batch, a, pi, lm))
                return loss, {**parts, **inner}
            parts.update(self._outer_apart(batch))
        loss, inner, _ = self._inner_replay(batch, step)
        return loss, {**parts, **inner}

    def _outer_apart(self, batch) -> dict[str, float]:
        """The outer step on a forward of its own, outside the step's gradient reduction and
        its expert reach (module docstring)."""
        with self.ctx.grads.apart(), self._reach.uncounted():
            return outer_step(self.model, self._task, batch, self.args)

    def _inner_replay(self, batch, step, pi=None):
        """lambda_replay L_replay + lambda_CKA L_CKA on the replay micro-batch, with this
        step's pi (or `pi`, outer_sample=shared); the loss, its parts and L_replay."""
        a, task = self.args, self._task
        parts: dict[str, float] = {}
        features = self._features
        reference = features.reference(task, batch)
        if pi is None:
            self._masks(step)
        else:
            task.set_masks(pi)
        with features.capture() as feats:
            lm = lm_loss(self.model, batch)
        current = {l: features.tokens(feats[l], batch) for l in self._cka_layers}
        if a.lambda_cka == 0:  # measured for the record only
            current = {l: f.detach() for l, f in current.items()}
        ckas = torch.stack([linear_cka(current[l], reference[l]) for l in self._cka_layers])  # (n_deep,)
        cka_loss = (1 - ckas).mean()
        values = ckas.detach().tolist()
        task.cka.append(values)
        task.replay_batch = batch
        parts.update({"lm": lm.item(), "cka": sum(values) / len(values), "cka_loss": cka_loss.item(),
                      **{f"cka_{l}": c for l, c in zip(self._cka_layers, values)}})
        return a.lambda_replay * lm + a.lambda_cka * cka_loss, parts, lm

    def before_step(self, step: int) -> None:
        if self._task is not None and self._task.logits is not None:
            self._task.logits.grad = None  # outer_sample=shared: the inner backward reached alpha too

    def step_passes(self, micro_batches, replay, step):
        """The passes a step of task t >= 1 needs beyond the task micro-batches (docs/methods/
        bilevel-cka.md, "Passes per step"): the inner replay forward and backward (its CKA
        reference as the step finds it: cached for rows the task has seen), the outer step
        (a replay forward with backward to alpha, two no-grad forwards of the last task
        micro-batch, Adam on alpha) and, once per replay row and task, the reference's forward."""
        task = self._task
        if task is None:
            return {}
        self.step_batches(step, micro_batches, replay)  # the outer step's task micro-batch
        self.loss(micro_batches[-1], step)  # this step's pi
        rows = self._features.rows(replay)

        def replay_pass():
            loss, _, _ = self._inner_replay(replay, step)
            loss.backward()

        def reference_row():
            self._features.reference(task, replay, refresh=rows[:1])

        passes = {"replay forward and backward": replay_pass, "reference forward of one row": reference_row}
        if task.logits is not None:
            passes["outer step"] = lambda: self._outer_apart(replay)
        return passes

    # ---- task end -----------------------------------------------------------------------
    def after_task(self, stage: Stage) -> None:
        task = self._task
        last = self.ctx.n_stages is not None and stage.index + 1 >= self.ctx.n_stages
        if task is None:
            if self._pre0 is not None and not last:  # task 0's drift on its own replay items
                examples = [e for t in stage.tasks for e in self.ctx.replay.chosen(t)]
                batches = self._probe_batches(examples, stage, "drift")
                if batches:
                    before = layer_outputs(self.model, self._depth_features, batches, self._autocast, self._pre0)
                    self._measure_drift(before, batches, "task 0's replay items, before and after task 0")
            self._pre0 = None
            return
        if task.logits is None:
            expand = torch.ones(len(self._candidates), self.args.experts_per_task, dtype=torch.bool)
        else:
            expand = (task.logits[..., 1] - task.logits[..., 0]).detach().cpu().sigmoid() > 0.5
        batches = before = None
        if self._measures_drift() and not last:
            batches = self._probe_batches(self.ctx.replay.examples(), stage, "drift")
            if batches:  # the model before this task: the supernets without clones, the snapshot
                with task.pre_task():
                    before = layer_outputs(self.model, self._depth_features, batches, self._autocast,
                                           task.snapshot)
        self._finalise(expand)
        if before is not None:
            lima = " and Lima" if self.ctx.config.replay.lima else ""
            self._measure_drift(before, batches, f"replay items of tasks 0..{stage.index - 1}{lima}, "
                                                        f"before and after task {stage.index}")

    def _finalise(self, expand: torch.Tensor) -> None:
        """Expand where `expand` (L_c, K) is true, Recycle elsewhere; keep the stage's record."""
        self._record = finalise(self.model, self._task, expand, self._active, self._features, self.args)
        self._task = None

    # ---- records and resume ------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        if self._task is not None:  # inside a task (an in-stage checkpoint): its search so far
            return {"task": self._task.state_dict()}
        return {"layout": group_sizes(self.model), "active": {i: list(v) for i, v in self._active.items()},
                "drift": None if self._drift is None else list(self._drift)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "task" in state:  # before_task has built the task again (cl_bench/run/checkpoint.py)
            self._task.load_state_dict(state["task"])
            return
        rebuild(self.model, state["layout"], **moe_settings(self.args))
        train_newest_group(self.model, self.args.train_shared)
        self._active = {int(i): list(v) for i, v in state["active"].items()}
        if "drift" not in state and self._measures_drift():
            raise UserError("bilevel-cka: this checkpoint was written before the guided mask init (it holds no "
                            "'drift'), so its run searched from the uniform prior and the code now would not; "
                            "resume it with the commit it started with (the record's git_commit), or start a new run")
        drift_ = state.get("drift")
        self._drift = None if drift_ is None else (list(drift_[0]), drift_[1])

    def param_report(self) -> dict[str, Any]:
        report = count(self.model)
        report["expansion_rate"] = None  # task 0: nothing offered
        report.update(self._record or {})
        return report

    @classmethod
    def param_schedule(cls, model: nn.Module, n_tasks: int, args: BilevelCKAArgs, *,
                       decisions: list | None = None,
                       experts_per_layer: float | None = None) -> list[dict[str, Any]]:
        """Without training the decisions are unknown: by default every stage t >= 1 is
        reported as if every decision were Expand, the upper bound (as many experts
        as Standard upcycling; exact with mask=off). `decisions`: a map
        [task][candidate layer][slot] of 0/1 for tasks 1..T-1 (a run record's, or a
        paper's), counted as given; `experts_per_layer`: the mean experts per MoE
        layer after the last task, made into such a map by `spread_decisions`.
        "trainable" is the supernet's: the clones of the active experts and their
        router rows."""
        if decisions is not None and experts_per_layer is not None:
            raise UserError("give a decision map or an expert count per layer, not both")
        # mask=off: no mask logits (on the meta device they hold no values); every slot
        # expands unless `decisions` say otherwise
        method = cls(dataclasses.replace(args, mask="off"), MethodContext.for_shapes(n_tasks))
        method.setup(model)
        decisions, bound = decisions_for_schedule(decisions, experts_per_layer, n_tasks, len(moe_layers(model)),
                                                  len(method._candidates), args.experts_per_task)
        rows = []
        for t in range(n_tasks):
            stage = Stage(t, [], f"task {t}")
            method.before_task(stage)
            if t and decisions is not None:
                method._finalise(torch.tensor(decisions[t - 1], dtype=torch.bool))
            else:
                method.after_task(stage)
            rows.append({"stage": t, **method.param_report(), "bound": bound})
        return rows


def _layers(chosen: list[int] | None, default: list[int], n: int, name: str) -> list[int]:
    layers = default if chosen is None else sorted(set(chosen))
    bad = [i for i in layers if not 0 <= i < n]
    if bad or not layers:
        raise UserError(f"method_args.{name}={chosen}: give decoder layers in 0..{n - 1} "
                        f"(the model has {n}), or null for the default")
    return layers
