"""The Method contract: the hooks a continual-learning method may override.

The sequencer calls, for each stage b of plan(tasks):
    before_task(stage) -> for each of phases(stage) (one "train" phase by default):
        [before_phase(stage, phase) -> optimizer_for_stage(stage, previous) ->
         [loss(batch, step)* (+ replay_loss(batch, step) per replay micro-batch),
          before_step(step), optimiser step, after_step(step)]*]
    -> after_task(stage) -> (the harness prunes parameters that left the model from
    the optimiser) -> evaluation (eval_scope) -> param_report
and state_dict()/load_state_dict() around checkpoints. It never looks at a
method's name: anything a method needs from the harness is one of these hooks,
a declared class attribute, or in its MethodContext (config, device, tokenizer,
encoder, pad id, all tasks, the number of stages, the steps of a stage). The
table of hook -> methods is in docs/ARCHITECTURE.md.
"""
from __future__ import annotations

import contextlib
import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar, Iterator

import torch
from torch import nn

from cl_bench.step_gradients import StepGradients
from cl_bench.config_fields import ReplayConfig, RunConfig, field_hint
from cl_bench.config_values import coerce
from cl_bench.data.encode import Encoder, epoch_members, phase_steps
from cl_bench.errors import UserError, did_you_mean
from cl_bench.losses import lm_loss  # noqa: F401  (the methods import it from here too)


@dataclass
class MethodArgs:
    """Arguments every method has; a method's own Args subclass adds its fields."""

    lr: float = 1e-5  # constant learning rate (TRACE: no decay)
    weight_decay: float = 0.0
    beta1: float = 0.9  # AdamW betas (0.9, 0.95) as TRACE and the upcycling paper
    beta2: float = 0.95


@dataclass
class Stage:
    """One training stage: usually one task; a method may plan otherwise (multitask)."""

    index: int
    tasks: list  # list[TaskData] trained in this stage
    label: str


@dataclass(frozen=True)
class Phase:
    """One pass of training inside a stage (a method may train in several, e.g.
    Branch-Train-MiX: the branch, then the router). Each phase runs the profile's
    epochs over the stage's data; `replay`: the shared buffer joins this phase
    (for methods that declare `uses_replay`)."""

    name: str = "train"
    replay: bool = True


@dataclass
class MethodContext:
    """What the harness gives a method: the run's config, device, tokenizer, the
    encoder it batches with (prompt/answer -> ids and labels), all tasks in order,
    and the number of stages the method planned (set once `plan` has run)."""

    config: RunConfig
    device: torch.device
    tokenizer: Any
    all_tasks: list = field(default_factory=list)  # list[TaskData] in order
    encoder: Encoder | None = None
    n_stages: int | None = None
    shapes_only: bool = False  # `cl-bench params`: no data, tokenizer or encoder, the model on the meta device
    # the harness's replay buffer (cl_bench/data/replay.py), to read only: what it stores so
    # far (`examples()`) and what it will store of a task (`chosen(task)`); None without one
    replay: Any = None
    # the step's gradients and weights in before_step, this rank's part of each parameter
    # (cl_bench/step_gradients.py): one process's unless a backend sets its own for a phase
    grads: StepGradients = field(default_factory=StepGradients)
    # True while the deepspeed backend runs a weight-0 padding copy of a micro-batch (a rank
    # with fewer than the others): a loss keeps no statistics of it
    padding: bool = False

    @classmethod
    def for_shapes(cls, n_stages: int) -> MethodContext:
        """The context of `cl-bench params`: `n_stages` stages without data (every
        stage's `tasks` is empty), default config, no tokenizer."""
        return cls(config=RunConfig(), device=torch.device("meta"), tokenizer=None, n_stages=n_stages,
                   shapes_only=True)

    @property
    def pad_id(self) -> int:
        return self.tokenizer.pad_token_id

    def stage_steps(self, stage: Stage) -> int | None:
        """Optimiser steps one phase of `stage` takes, as the sequencer batches it
        (epoch e holds the tasks with more than e epochs; TRACE's extra replay epoch
        not counted); None for a stage without data (`cl-bench params`). For methods
        that fit a schedule to the task's length."""
        if not stage.tasks:
            return None
        t = self.config.train
        members = epoch_members([t.epochs_for(task.name) for task in stage.tasks])
        return phase_steps((sum(len(stage.tasks[i].train) for i in tasks) for tasks in members), t.batch_size)


class Method:
    name: ClassVar[str] = ""
    aliases: ClassVar[tuple[str, ...]] = ()
    description: ClassVar[str] = ""  # one line, shown by `cl-bench list`
    Args: ClassVar[type] = MethodArgs
    uses_replay: ClassVar[bool] = False  # draws from the harness's shared replay buffer
    reference: ClassVar[bool] = False  # a reference row (reported beside, never ranked)
    # Which tasks are scored after a stage: "seen" (every task trained so far: the
    # stage x task matrix) or "stage" (only the stage's own tasks: a reference row
    # that restarts from the pretrained model, R[j][j] only).
    eval_scope: ClassVar[str] = "seen"
    baseline: ClassVar[bool] = False  # the row the leaderboard marks every other against (SeqFT)
    # What the method trains, for the profile's learning rate (train.lr_by_family):
    # "full" (all weights), "adapter" (small added modules, base frozen) or "expert"
    # (new MoE experts); None: the method's own lr default in every profile.
    lr_family: ClassVar[str | None] = None
    # The lr schedule (cl_bench/run/schedule.py: "constant" | "cosine") and warm-up share the
    # harness runs each phase with, where the config's train.lr_schedule / warmup_ratio
    # leave them unset.
    lr_schedule: ClassVar[tuple[str, float]] = ("constant", 0.0)
    # Why the method cannot train on the deepspeed backend, per ZeRO stage (2, 3); a
    # stage not listed is supported (shown by `cl-bench list --verbose`; a run asking
    # for it is refused before anything loads). Outside a training phase the model is
    # an ordinary module on every rank, so setup, before/after_task, eval and state
    # hooks may do anything. Inside one, a method runs when its loss/replay_loss
    # compute losses through self.model, its before_step/after_step change gradients and
    # weights only through self.ctx.grads (cl_bench/step_gradients.py), and it keeps no
    # state built from the micro-batches its loss sees alone (step_batches gives every
    # rank the whole step; ctx.padding marks a padding copy): ZeRO partitions gradients
    # (2) and weights (3), keeps fp32 master copies of the weights inside its optimiser,
    # and each rank sees different micro-batches.
    zero_unsupported: ClassVar[dict[int, str]] = {}
    # Whether its replay_loss keeps state every rank must hold (an outer step on its own
    # parameters, records, caches): the deepspeed backend then runs each step's replay
    # micro-batch on every rank, at weight 1/N each (the same gradient), instead of on one.
    replay_on_every_rank: ClassVar[bool] = False

    def __init__(self, args: MethodArgs, context: MethodContext):
        self.args = args
        self.ctx = context
        self.model: nn.Module | None = None

    # ---- arguments -------------------------------------------------------
    @classmethod
    def parse_args(cls, raw: dict[str, Any]) -> MethodArgs:
        hints = typing.get_type_hints(cls.Args)
        names = [f.name for f in dataclasses.fields(cls.Args)]
        values = {}
        for key, value in raw.items():
            if key not in names:
                hint = field_hint(key) or did_you_mean(key, names)
                buffer = ("; the replay buffer is the harness's: --set replay."
                          + "|".join(f.name for f in dataclasses.fields(ReplayConfig)) + "=VALUE"
                          if cls.uses_replay else "")
                raise UserError(f"method '{cls.name}' has no argument '{key}'; {hint}"
                                f"its arguments: {', '.join(names)}{buffer}")
            values[key] = coerce(value, hints[key], f"method_args.{key}")
        return cls.Args(**values)

    @classmethod
    def check_run(cls, args: MethodArgs, config: RunConfig) -> None:
        """Refuse, before anything loads, arguments this run's config cannot carry
        (a UserError naming the field and the fix). Default: none."""

    @classmethod
    def args_for(cls, config: RunConfig) -> dict[str, Any]:
        """The run's raw method arguments: config.method_args, with the profile's lr for
        the method's family (train.lr_by_family) where `lr` is not given there."""
        raw = dict(config.method_args)
        family_lr = config.train.lr_by_family.get(cls.lr_family) if cls.lr_family else None
        if "lr" not in raw and family_lr is not None:
            raw["lr"] = family_lr
        return raw

    @classmethod
    def arg_table(cls) -> list[tuple[str, str, Any]]:
        hints = typing.get_type_hints(cls.Args)
        return [(f.name, getattr(hints[f.name], "__name__", str(hints[f.name])),
                 f.default if f.default is not dataclasses.MISSING else f.default_factory())
                for f in dataclasses.fields(cls.Args)]

    # ---- hooks ------------------------------------------------------------
    def setup(self, model: nn.Module) -> None:
        """Wrap or modify the dense model (PEFT, MoE, frozen parts). Default: train all."""
        self.model = model

    def plan(self, tasks: list) -> list[Stage]:
        """The stages to train. Default: one stage per task, in order."""
        return [Stage(i, [t], t.name) for i, t in enumerate(tasks)]

    def before_task(self, stage: Stage) -> None:
        """Called before a stage trains (expand experts, add an adapter, ...)."""

    def phases(self, stage: Stage) -> list[Phase]:
        """The training phases of `stage`, in order. Default: one."""
        return [Phase()]

    def before_phase(self, stage: Stage, phase: Phase) -> None:
        """Called before each phase trains, after before_task (change what trains)."""

    def make_optimizer(self, groups: list[dict]) -> torch.optim.Optimizer:
        a = self.args
        return torch.optim.AdamW(groups, lr=a.lr, betas=(a.beta1, a.beta2),
                                 weight_decay=a.weight_decay, fused=fused_adamw(groups))

    def optimizer_for_stage(self, stage: Stage,
                            previous: torch.optim.Optimizer | None) -> torch.optim.Optimizer:
        """Keep the optimiser (and its moments) while the trainable set is unchanged,
        as TRACE's single engine does; otherwise build a new one over the new set,
        carrying the state of parameters that persist."""
        groups = trainable_groups(self.model)
        params = [p for g in groups for p in g["params"]]
        if previous is not None:
            old = [p for g in previous.param_groups for p in g["params"]]
            if len(old) == len(params) and all(a is b for a, b in zip(old, params)):
                return previous
        optimizer = self.make_optimizer(groups)
        if previous is not None:
            for p in params:
                if p in previous.state:
                    optimizer.state[p] = previous.state[p]
        return optimizer

    def loss(self, batch: dict[str, torch.Tensor], step: int) -> tuple[torch.Tensor, dict[str, float]]:
        """Mean loss over the answer tokens of `batch`, and named parts for logging."""
        loss = lm_loss(self.model, batch)
        return loss, {"lm": loss.item()}

    def replay_loss(self, batch: dict[str, torch.Tensor], step: int) -> tuple[torch.Tensor, dict[str, float]]:
        """Loss on one replay micro-batch (interleave policy; only if `uses_replay`).
        Default: the ordinary loss, added with weight 1."""
        return self.loss(batch, step)

    def step_passes(self, micro_batches: list[dict[str, torch.Tensor]], replay: dict[str, torch.Tensor] | None,
                    step: int) -> dict[str, typing.Callable[[], Any]]:
        """For `cl-bench perf step`: the passes an optimiser step `step` of the current
        stage needs beyond the task micro-batches' forward and backward (which the
        harness times itself), by name, each a thunk that runs it alone on these
        batches (`replay`: the step's replay micro-batch). The caller clears gradients.
        Default: none."""
        return {}

    def step_batches(self, step: int, micro_batches: list[dict[str, torch.Tensor]],
                     replay: dict[str, torch.Tensor] | None) -> None:
        """Called at the start of each optimiser step on every rank with all of the step's
        task micro-batches and its replay micro-batch (None without one), whichever rank
        computes each: for what a method keeps of the step's data. `loss` sees only
        this rank's share on N ranks, and a weight-0 padding copy besides."""

    def before_step(self, step: int) -> None:
        """Called once a step's gradients are accumulated, before clipping and the
        optimiser step, on every rank (gradient projection, masking ...): change them
        through `self.ctx.grads` (cl_bench/step_gradients.py), which gives this rank's
        part of each parameter; collectives there are taken by every rank."""

    def idle_units(self) -> list[list[nn.Parameter]]:
        """Groups of trainable parameters that may take no part in some optimiser step,
        each group idle or not as a whole (an expert that routing leaves out, a frozen
        one): see idle_parameters. Asked once per training phase. Default: none."""
        return []

    def idle_parameters(self, step: int) -> list[nn.Parameter]:
        """The trainable parameters no micro-batch of step `step` reached, the same on
        every rank (on one process: those whose `.grad` is None after the step's
        backward), each in a group of idle_units. The optimiser step leaves them alone on
        every backend, as torch's AdamW leaves a parameter without a gradient: weight,
        moments and step count stay (ZeRO would give them zeros and move them by their
        momentum). Called after before_step. Default: none."""
        return []

    def after_step(self, step: int) -> None:
        """Called after each optimiser step, on every rank (weights changed through
        `self.ctx.grads.set_weights`)."""

    def after_task(self, stage: Stage) -> None:
        """Called after a stage trains (Fisher, finalise masks, ...)."""

    def before_checkpoint(self) -> None:
        """Called on every rank between two steps, before an in-stage checkpoint, which
        rank 0 writes from its own state_dict(): a method whose steps keep state split
        over the ranks sums it here (ctx.grads' collectives), so that rank 0's
        state_dict holds all of it, without changing what the run computes next."""

    def state_dict(self) -> dict[str, Any]:
        """Method state beyond the model weights, for resume."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def param_report(self) -> dict[str, Any]:
        """total: held in memory; trainable: with gradients this stage; active_per_token:
        touched per token at inference; deployed: what an exported model needs."""
        total = sum(p.numel() for p in self.model.parameters())
        trainable = sum(p.numel() for p in self.model.parameters() if p.requires_grad)
        return {"total": total, "trainable": trainable, "active_per_token": total,
                "deployed": total, "experts_per_layer": None}

    @classmethod
    def param_schedule(cls, model: nn.Module, n_tasks: int, args: MethodArgs) -> list[dict[str, Any]]:
        """param_report after each stage of `n_tasks` tasks, without training or data
        (`cl-bench params`): the method's own setup/before_task/before_phase run on
        `model` (on the meta device: shapes only), which they may change in place.
        The context is MethodContext.for_shapes: hooks that need data check
        `ctx.shapes_only`."""
        method = cls(args, MethodContext.for_shapes(n_tasks))
        method.setup(model)
        rows = []
        for t in range(n_tasks):
            stage = Stage(t, [], f"task {t}")
            method.before_task(stage)
            for phase in method.phases(stage):
                method.before_phase(stage, phase)
            rows.append({"stage": t, **method.param_report()})
        return rows


_PER_PARAMETER_ADAMW = False


@contextlib.contextmanager
def per_parameter_adamw() -> Iterator[None]:
    """Within: AdamW built here runs torch's per-parameter loop on the CPU (the harness
    before issue 53), to compare against (`cl-bench perf loss-path --before`)."""
    global _PER_PARAMETER_ADAMW
    was, _PER_PARAMETER_ADAMW = _PER_PARAMETER_ADAMW, True
    try:
        yield
    finally:
        _PER_PARAMETER_ADAMW = was


def fused_adamw(groups: list[dict]) -> bool | None:
    """Whether AdamW runs torch's fused kernel: wherever it can (floating parameters on
    the CPU or a CUDA device), else torch's own choice. On the CPU torch otherwise
    picks its per-parameter loop: `cl-bench perf step-options` measured the fused step
    3.7x faster over SmolLM2's parameters, 7% of a SeqFT step at the `cpu` shape
    (results/perf/step-options-smollm2-bf16.json). It rounds the update differently
    (weights within 1e-7 relative of the loop's after three steps), so runs made
    before it differ from runs after at float rounding: issue 53's twin bounds it."""
    if _PER_PARAMETER_ADAMW:
        return None
    params = [p for g in groups for p in g["params"]]  # none yet (a set that fills later): fused too
    if all(p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in params):
        return True
    return None


def trainable_groups(model: nn.Module) -> list[dict]:
    """One optimiser parameter group: the parameters that require gradients, in model order."""
    return [{"params": [p for p in model.parameters() if p.requires_grad]}]


def prune_optimizer(optimizer: torch.optim.Optimizer | None, model: nn.Module) -> None:
    """Remove from `optimizer` (and its state) the parameters no longer in `model`
    (a method that replaced or dropped modules, e.g. finalised search clones): the
    harness does this after every stage, before the checkpoint names what it holds."""
    if optimizer is None:
        return
    live = {id(p) for p in model.parameters()}
    for group in optimizer.param_groups:
        group["params"] = [p for p in group["params"] if id(p) in live]
    for p in [p for p in optimizer.state if id(p) not in live]:
        del optimizer.state[p]
