"""One DeepSpeed engine per training phase, and the way back to an ordinary module.

Between phases the method's model is an ordinary torch module holding full
weights (fp32, as loaded) on every rank, and the method's optimiser an ordinary
torch optimiser whose state holds per-parameter tensors in host memory (whole,
except at ZeRO-3: below). So every hook outside training (before_task adding experts
or LoRA pairs, after_task, evaluation, checkpoints, resume) sees the model and the
optimiser's parameters as on the torch backend, and checkpoints the state too.

`ZeroPhase(...)` builds an engine over the model and the parameters the
optimiser trains (which may be new since the last phase: that is how added
experts, branches and LoRA pairs get trained), carrying over the optimiser state
(Adam's moments and step) and the fp32 values of the weights; `close()` gathers
them back (ZeRO-3: every weight is re-assembled on every rank), destroys the
engine and strips what DeepSpeed added to the modules and parameters.

At ZeRO-3 a parameter's per-value optimiser state (Adam's two moments, twice the
fp32 weights) stays cut between phases. Each rank keeps its own partition of each
tensor in host memory (a `Piece`), so a rank holds 1/N of the state, not all of it
(at 7B on 8 ranks about 7 GB, not 56); a checkpoint loaded on `--resume` is cut so
too (load_held), never whole on a device. A piece goes straight back
into the next phase's engine (same ranks, same padded size), and the whole tensor
is assembled only where a checkpoint needs it: `whole_state`, on the rank that
writes, one value at a time (no hook reads a moment; one that did would need it
whole there too).
ZeRO-2 keeps whole state between phases: its partitions are ranges of a flat group
that move whenever the group's parameters change.

A parameter no micro-batch of a step reached (Method.idle_parameters) gets zeros from
ZeRO, where torch's AdamW would skip it: each group of Method.idle_units becomes a
DeepSpeed parameter group of its own (its own flat partition and Adam step count), and
a step pre-hook on the optimiser takes the gradient off the partitions of the groups
idle in this step, so the optimiser skips them as torch's does (weight, moments and
step count stay; DeepSpeed steps each group separately: ZeRO-2's and ZeRO-3's
`_optimizer_step`).

DeepSpeed internals used (tested with 0.19.8): the flat fp32 partitions of its
ZeRO optimisers and `_lazy_init_hp_params_optimizer_state` (ZeRO-2), to seed the
optimiser state; the parameters of each partition (bit16_groups and `_hp_mapping`,
ZeRO-2; fp16_groups and `ds_tensor`, ZeRO-3) for an optimiser that asks for the
layout (`bind_zero_layout`, cl_bench/step_gradients.py's ZeroLayout); the
handles of ZeRO-3's leaf-module reduction hooks (`_leaf_module_hooks`), which
`apart()` takes off the modules for a gradient outside the step; ZeRO-3's
partition size (a parameter's size over the ranks, rounded up: load_held cuts a
loaded checkpoint's state so, and _set_full checks it against `ds_tensor`); everything
else goes through deepspeed.utils (safe_get_full_*, safe_set_full_* at ZeRO-2 and
safe_set_local_* at ZeRO-3 (_set_full), safe_get_local_optimizer_state (close() at
ZeRO-3), set_z3_leaf_module) and
deepspeed.zero.GatheredParameters.
"""
from __future__ import annotations

import contextlib
import gc
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from cl_bench.models.modes import forward_readers
from cl_bench.run.checkpoint_shape import saved_pairs
from cl_bench.step_gradients import Segment, ZeroLayout


class LossForward(nn.Module):
    """What the engine wraps: the method's model (a submodule, so the engine owns its
    parameters) and a forward that runs one of the method's loss hooks, so the
    engine's forward/backward machinery sees the loss the method computes through
    `method.model`. `anchors`: parameters to tie into every loss with weight 0 (below)."""

    def __init__(self, model: nn.Module, anchors: list[nn.Parameter]):
        super().__init__()
        self.model = model
        self._anchors = anchors  # a plain list: not registered twice

    def forward(self, loss_fn, batch: dict[str, torch.Tensor], step: int):
        # Built before the model's forward, so autograd runs its backward last: every
        # anchored parameter then gets its gradient, in this fixed order, at the end of
        # the backward on every rank. ZeRO-2 reduces gradients in the order they arrive
        # and expects the same parameters on every rank; a data-dependent graph (an MoE
        # group that receives no token of one rank's micro-batch) would break either.
        zero = torch.stack([p.reshape(-1)[0].float() for p in self._anchors]).sum() * 0.0 if self._anchors else None
        loss, parts = loss_fn(batch, step)
        return (loss if zero is None else loss + zero.to(loss.dtype)), parts


@dataclass
class Piece:
    """Between phases, at ZeRO-3: this rank's partition of one per-value optimiser-state
    tensor, in host memory, as ZeRO-3 cuts it: the flattened tensor's values
    rank x size on, zeros past its end (module docstring)."""

    value: torch.Tensor  # flat, the padded partition's size
    shape: torch.Size  # the whole tensor's
    rank: int
    ranks: int


def _per_value(v, p: nn.Parameter) -> bool:
    """Whether optimiser-state entry v holds one number per value of p (Adam's moments).
    Told by shape, which cannot tell them from Adam's 0-dim step where p is 0-dim:
    every phase refuses such a p (_holdable), so nothing misread trains."""
    return isinstance(v, Piece) or (torch.is_tensor(v) and v.shape == p.shape)


ZERO_DIM = ("the deepspeed backend cannot hold it (DeepSpeed views each parameter as bytes to broadcast it, "
            "0.19.8's engine._broadcast_model, which a 0-dim tensor cannot be)")


def zero_dim(named) -> str | None:
    """The name of the first 0-dim parameter of (name, parameter) pairs, or None. The
    deepspeed backend refuses such a parameter (ZERO_DIM): as the run starts (the
    model's) and as each phase starts (_holdable: one a method added), since its
    optimiser state could not be told from Adam's step either (_per_value)."""
    return next((name for name, p in named if p.dim() == 0), None)


def _holdable(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """A phase refuses a 0-dim parameter of the model or of the optimiser's groups, by name."""
    named = [*model.named_parameters(), *((f"param_groups[{g}].params[{i}]", p) for g, group in
                                          enumerate(optimizer.param_groups) for i, p in enumerate(group["params"]))]
    name = zero_dim(named)
    if name is not None:
        raise RuntimeError(f"parameter {name!r} is 0-dim: {ZERO_DIM}; give it shape (1,), as "
                           f"cl_bench/models/moe.py's routed_scale")


@contextlib.contextmanager
def whole_state(optimizer: torch.optim.Optimizer, device: torch.device, keep: bool):
    """Inside: on the rank that keeps (rank 0, the one that writes checkpoints) the
    optimiser's state holds every Piece's whole tensor (host memory); after, the
    pieces again. Collective: every rank enters it, with the same parameters in the
    same order; each value is gathered on its own (through `device`: NCCL moves device
    tensors only), and the other ranks hold nothing more."""
    if keep and torch.distributed.get_rank() != 0:
        raise RuntimeError("whole_state: only rank 0 can keep the gathered state")
    held: list[tuple[dict, str, int, int]] = []  # (state, key, piece size, ranks): cut again after
    try:
        for group in optimizer.param_groups:
            for p in group["params"]:
                state = optimizer.state.get(p, {})
                for key in sorted(k for k, v in state.items() if isinstance(v, Piece)):
                    piece = state[key]
                    mine = piece.value.to(device)
                    flat = mine.new_empty(mine.numel() * piece.ranks) if keep else None
                    torch.distributed.gather(mine, list(flat.chunk(piece.ranks)) if keep else None, dst=0)
                    if keep:  # in the piece's place, so rank 0 holds the whole state once, not once and a half
                        state[key] = flat[:piece.shape.numel()].reshape(piece.shape).cpu()
                        held.append((state, key, mine.numel(), piece.ranks))
                    del piece, mine, flat
        yield
    finally:
        for state, key, size, ranks in held:
            state[key] = Piece(_cut(state[key], 0, size), state[key].shape, 0, ranks)


class _Held:
    """An optimiser-state tensor on its way through torch's Optimizer.load_state_dict,
    which moves every tensor it finds onto its parameter's device and passes other
    values over as they are (torch 2.13's _cast)."""

    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value


def load_held(optimizer: torch.optim.Optimizer, state_dict: dict[str, Any], zero: int, rank: int,
              ranks: int) -> None:
    """optimizer.load_state_dict(state_dict) between phases (a checkpoint on --resume),
    each per-value tensor (Adam's moments) held as close() holds it there: in host
    memory, and at ZeRO-3 only this rank's Piece (ZeRO-3's partition: the tensor's size
    over the ranks, rounded up; the next phase's _set_full refuses a piece of another
    size). Loaded as torch loads it, the whole state would land on every rank's device
    beside the whole weights (at 7B, 56 + 28 GB: more than an 80 GB GPU holds). Saved
    entries pair with the optimiser's parameters in order, as torch pairs them; saved
    groups of other sizes are left for load_state_dict to refuse."""
    pairs = saved_pairs(state_dict, optimizer)
    if pairs is not None:
        state = dict(state_dict["state"])
        for i, p in pairs:
            if isinstance(state.get(i), dict):
                state[i] = {k: _Held(_host(v, p, zero, rank, ranks)) if _per_value(v, p) else v
                            for k, v in state[i].items()}
        state_dict = {**state_dict, "state": state}
    optimizer.load_state_dict(state_dict)
    for p in (p for group in optimizer.param_groups for p in group["params"]):
        entries = optimizer.state.get(p, {})
        for k, v in entries.items():
            if isinstance(v, _Held):
                entries[k] = v.value


def _host(value, p: nn.Parameter, zero: int, rank: int, ranks: int):
    """What a rank holds of a per-value optimiser-state tensor between phases (load_held)."""
    if zero == 3:
        return Piece(_cut(value, rank, -(-value.numel() // ranks)), value.shape, rank, ranks)
    return value.to("cpu", p.dtype if p.is_floating_point() else value.dtype)


def _cut(value: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """Rank `rank`'s ZeRO-3 partition of `value` (flattened, fp32): values rank x size
    on, zeros past its end."""
    piece = torch.zeros(size, dtype=torch.float32)
    mine = value.detach().reshape(-1)[rank * size:(rank + 1) * size]
    piece[:mine.numel()] = mine
    return piece


def _state_keys(make_optimizer, group: dict[str, Any]) -> list[str]:
    """The tensors the optimiser keeps per parameter value (AdamW: exp_avg, exp_avg_sq),
    from one step of a throwaway copy on a one-value parameter with a zero gradient."""
    probe = nn.Parameter(torch.zeros(1))
    probe.grad = torch.zeros(1)
    optimizer = make_optimizer([{**{k: v for k, v in group.items() if k != "params"}, "params": [probe]}])
    optimizer.step()
    return sorted(k for k, v in optimizer.state[probe].items() if torch.is_tensor(v) and v.shape == probe.shape)


def _forget_released_modules(top: nn.Module) -> None:
    """Let go of what DeepSpeed's ZeRO-3 keeps past an engine's destroy() (0.19.8):
    its parameter coordinator memoises __params_to_release in an unbounded
    functools.lru_cache on the class, keyed by (coordinator, submodule, step), and
    parameter_offload pushes each engine's top module onto its module-level
    FWD_MODULE_STACK and never pops it (that module's attributes lead to its
    coordinator). Either kept every phase's coordinator and every module the phase
    ran alive for the process: a module a method replaces between phases (the
    flagship's supernets, at 7B most of a layer) was never freed. Between phases no
    engine lives, so neither is needed. The memo is reached through the closure of
    DeepSpeed's NVTX wrapper; a DeepSpeed without either has nothing to let go of."""
    from deepspeed.runtime.zero import parameter_offload
    from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator

    stack = getattr(parameter_offload, "FWD_MODULE_STACK", [])
    stack[:] = [m for m in stack if m is not top]
    fn = vars(PartitionedParameterCoordinator).get("_PartitionedParameterCoordinator__params_to_release")
    while fn is not None and not hasattr(fn, "cache_clear"):
        inner = [c.cell_contents for c in getattr(fn, "__closure__", None) or () if callable(c.cell_contents)]
        fn = inner[0] if inner else None
    if fn is not None:
        fn.cache_clear()


def zero3_leaves(model: nn.Module) -> list[nn.Module]:
    """Modules ZeRO-3 must gather whole before their forward: the reader
    (forward_readers) of each module that holds parameters but has no forward (an MoE
    layer's expert groups, a ParameterList of LoRA pairs), since ZeRO-3 gathers a
    module's own parameters for its own forward and would not know to gather these."""
    leaves: list[nn.Module] = []
    for module, reader in forward_readers(model).items():
        if reader is not module and reader not in leaves:
            leaves.append(reader)
    return leaves


def _inputs_require_grad(module: nn.Module, args: tuple):
    """ZeRO-3 reduces a leaf module's gradients in the module's full backward hook,
    which PyTorch runs before the module's own backward when none of its inputs
    requires grad (a leaf above frozen layers: the first MoE layer of an upcycled
    model): the gradients would be taken as zero. Inputs that do not require grad
    get no gradient from anything below, so a detached copy that requires grad
    changes nothing else."""
    if not torch.is_grad_enabled():
        return None
    return tuple(a.detach().requires_grad_() if torch.is_tensor(a) and a.is_floating_point()
                 and not a.requires_grad else a for a in args)


@dataclass
class _Slot:
    """One DeepSpeed parameter group: params of one optimiser group sharing their
    scalar optimiser state (Adam's step), so the flat group can carry it."""

    source: int  # index of the optimiser's param group
    params: list[nn.Parameter]
    scalars: dict[str, Any]  # e.g. {"step": tensor(12.)}; {} for fresh parameters
    unit: int | None = None  # the Method.idle_units group it holds (alone), if any


class ZeroPhase:
    """The engine of one training phase; see the module docstring."""

    def __init__(self, deepspeed, model: nn.Module, optimizer: torch.optim.Optimizer, make_optimizer,
                 ds_config: dict[str, Any], zero: int, bf16: bool, idle_units: list[list[nn.Parameter]] = ()):
        self.ds = deepspeed
        self.model = model
        self.optimizer = optimizer
        self.zero = zero
        self.bf16 = bf16
        _holdable(model, optimizer)
        self._params = list(model.parameters())
        self._dtypes = [p.dtype for p in self._params]
        self._shapes = [p.shape for p in self._params]  # ZeRO-3 leaves partitioned ones with shape [0]
        self._shape_of = dict(zip(self._params, self._shapes))
        # What DeepSpeed will add to modules and parameters, removed again in close().
        self._module_keys = {m: set(vars(m)) for m in model.modules()}
        self._param_keys = {p: set(vars(p)) for p in self._params}

        self._unit_of = {p: u for u, unit in enumerate(idle_units) for p in unit}
        self.slots = self._slots()
        self.trainable = [p for s in self.slots for p in s.params]
        self._idle: set[int] = set()  # ids of the param groups idle in this step (skip)
        state = optimizer.state
        self._tensor_keys = sorted({k for p in self.trainable for k, v in state.get(p, {}).items()
                                    if _per_value(v, p)})
        if idle_units and not self._tensor_keys:
            # a group idle at its first step must still find its state (ZeRO-2 links each
            # parameter's view of it once, at the first step of any group): seed it all
            self._tensor_keys = _state_keys(make_optimizer, optimizer.param_groups[0])
        masters = ([p.detach().to("cpu", torch.float32, copy=True) for p in self.trainable]
                   if bf16 else None)  # the engine's own master copies would start from bf16

        self._hooks = []
        self._leaves = zero3_leaves(model) if zero == 3 else []
        if zero == 3:
            for module in self._leaves:
                self.ds.utils.set_z3_leaf_module(module, True)
                self._hooks.append(module.register_forward_pre_hook(_inputs_require_grad, prepend=True))
        groups = [{**{k: v for k, v in optimizer.param_groups[s.source].items() if k != "params"},
                   "params": s.params} for s in self.slots]
        self.ds_optimizer = make_optimizer(groups)
        if idle_units:
            self._hooks.append(self.ds_optimizer.register_step_pre_hook(self._take_idle_gradients))
        # An optimiser that needs whole parameters learns what its flat partitions hold
        # (layout()); written for them, it is one DeepSpeed would otherwise refuse as untested.
        self._bind = getattr(self.ds_optimizer, "bind_zero_layout", None)
        if self._bind is not None:
            ds_config = {**ds_config, "zero_allow_untested_optimizer": True}
        anchors = self.trainable if zero == 2 else []
        # ZeRO-3 installs its own F.linear for the whole process ("persists unless
        # manually reset"); close() puts this one back for evaluation and later runs
        self._linear = torch.nn.functional.linear
        self.engine, *_ = deepspeed.initialize(model=LossForward(model, anchors),
                                               optimizer=self.ds_optimizer, config=ds_config)
        if masters is not None:
            for p, value in zip(self.trainable, masters):
                self._set_full(p, value)
        if self._tensor_keys:
            self._seed_state()
        for p in self.trainable:  # held by the engine now, sharded; close() brings them back
            state.pop(p, None)
        if self._bind is not None:
            self._bind(self.layout())

    # ---- optimiser state in -------------------------------------------------------
    def _slots(self) -> list[_Slot]:
        slots: list[_Slot] = []
        for i, group in enumerate(self.optimizer.param_groups):
            by_scalars: dict[tuple, _Slot] = {}
            for p in group["params"]:
                if not p.requires_grad:
                    continue
                scalars = {k: v for k, v in self.optimizer.state.get(p, {}).items() if not _per_value(v, p)}
                unit = self._unit_of.get(p)
                key = (unit, *sorted((k, float(v) if torch.is_tensor(v) or isinstance(v, (int, float)) else repr(v))
                                     for k, v in scalars.items()))
                if key not in by_scalars:
                    by_scalars[key] = _Slot(i, [], scalars, unit)
                by_scalars[key].params.append(p)
            slots.extend(by_scalars.values())
        return slots

    def _flat_partitions(self) -> list[tuple[int, torch.Tensor]]:
        """(DeepSpeed group index, this rank's flat fp32 partition) pairs."""
        zopt = self.engine.optimizer
        if self.zero == 3:
            return [(zopt.sub_group_to_group_id[i], flat) for i, flat in enumerate(zopt.fp32_partitioned_groups_flat)]
        return list(enumerate(zopt.single_partition_of_fp32_groups))

    def layout(self) -> ZeroLayout:
        """Each flat partition's segments (cl_bench/step_gradients.py), every parameter of
        its DeepSpeed group in the group's order on every rank.
          ZeRO-2: the flat group is the group's parameters end to end (with alignment
            padding), cut into equal partitions; a parameter's `_hp_mapping` gives its
            slice (lp_fragment_address) and where it sits in this rank's partition
            (hp_fragment_address), and is None where the partition holds none of it.
          ZeRO-3: a sub-group's flat partition is its parameters' partitions end to end,
            each `ds_tensor.ds_numel` long (padded): values rank x that size on."""
        zopt, rank = self.engine.optimizer, torch.distributed.get_rank()
        segments: dict[torch.Tensor, list[Segment]] = {}
        for i, (_, flat) in enumerate(self._flat_partitions()):
            segments[flat] = out = []
            if self.zero == 3:
                offset = 0
                for p in zopt.fp16_groups[i]:
                    size = p.ds_tensor.ds_numel
                    start = rank * size
                    out.append(Segment(p, self._shape_of[p], offset, start, max(0, min(size, p.ds_numel - start))))
                    offset += size
                continue
            for p in zopt.bit16_groups[i]:
                m = p._hp_mapping
                out.append(Segment(p, self._shape_of[p], 0, 0, 0) if m is None else
                           Segment(p, self._shape_of[p], m.hp_fragment_address.start, m.lp_fragment_address.start,
                                   m.lp_fragment_address.numel))
        for flat, out in segments.items():  # how many ranks hold part of each: one all-reduce a partition
            held = torch.tensor([float(s.numel > 0) for s in out], device=flat.device)
            torch.distributed.all_reduce(held)
            for s, n in zip(out, held.tolist()):
                s.ranks = int(n)
        return ZeroLayout(segments, torch.distributed.all_reduce)

    def _seed_state(self) -> None:
        """Give the engine's (lazily initialised) optimiser state the carried values:
        each slot's scalars as they were, zero moments for parameters without state
        (exactly what Adam starts from), then every parameter's own moments."""
        zopt = self.engine.optimizer
        inner = zopt.optimizer
        for g, flat in self._flat_partitions():
            scalars = self.slots[g].scalars
            step = scalars.get("step", torch.tensor(0.0))
            inner.state[flat] = {"step": step.clone() if torch.is_tensor(step) else torch.tensor(float(step)),
                                 **{k: v for k, v in scalars.items() if k != "step"},
                                 **{k: torch.zeros_like(flat) for k in self._tensor_keys}}
        if self.zero == 2:
            zopt._lazy_init_hp_params_optimizer_state()  # ZeRO-2 links its per-parameter views here
        carried = self.optimizer.state
        for p in self.trainable:
            for key in self._tensor_keys:
                if key in carried.get(p, {}):
                    self._set_full(p, carried[p][key], key)

    def _set_full(self, p: nn.Parameter, value: torch.Tensor | Piece, key: str | None = None) -> None:
        """Parameter p's fp32 master (key None) or optimiser state `key`, from its full
        value or (state, ZeRO-3) this rank's Piece of it. ZeRO-3 through the local API,
        this rank's piece padded with zeros: DeepSpeed's safe_set_full_* (0.19.8,
        stage3.set_full_hp_param) cuts the value in partitions of the padded size and
        reads past its end on the last rank wherever the ranks do not divide p's size
        (3 ranks, or a one-value parameter on 2)."""
        utils = self.ds.utils
        if isinstance(value, Piece):
            where = (torch.distributed.get_rank(), torch.distributed.get_world_size())
            if (self.zero != 3 or (value.rank, value.ranks) != where or value.shape != self._shape_of[p]
                    or value.value.numel() != p.ds_tensor.numel()):
                raise RuntimeError(f"optimiser state {key!r}: a piece of rank {value.rank} of {value.ranks} "
                                   f"({value.value.numel()} values) does not fit rank {where[0]} of {where[1]} "
                                   f"at ZeRO-{self.zero}: the parameter changed between phases")
            utils.safe_set_local_optimizer_state(p, value.value, key)
            return
        if self.zero != 3:
            if key is None:
                utils.safe_set_full_fp32_param(p, value)
            else:
                utils.safe_set_full_optimizer_state(p, value, key)
            return
        # every rank's partition has ds_tensor's size, the last one's padding included
        piece = _cut(value, torch.distributed.get_rank(), p.ds_tensor.numel())
        if key is None:
            utils.safe_set_local_fp32_param(p, piece)
        else:
            utils.safe_set_local_optimizer_state(p, piece, key)

    # ---- every step -----------------------------------------------------------------
    def skip(self, idle: list[nn.Parameter]) -> None:
        """The next optimiser step leaves `idle` alone (Method.idle_parameters): each must be
        in a group of the phase's idle_units, and that group idle as a whole."""
        idle_ids = {id(p) for p in idle}
        self._idle, covered = set(), 0
        for slot, group in zip(self.slots, self.ds_optimizer.param_groups):
            n = sum(id(p) in idle_ids for p in slot.params)
            if n and (slot.unit is None or n != len(slot.params)):
                raise RuntimeError("Method.idle_parameters named a parameter outside its idle_units, or only "
                                   "part of a unit: a unit is skipped whole")
            if n:
                self._idle.add(id(group))
                covered += n
        if covered != len(idle_ids):
            raise RuntimeError("Method.idle_parameters named a parameter this phase does not train")

    def _take_idle_gradients(self, optimizer, args, kwargs) -> None:
        """Step pre-hook: the flat partitions of idle groups lose their (zero) gradient,
        so the optimiser passes them over, as torch's skips a parameter whose grad is None."""
        for group in optimizer.param_groups:
            if id(group) in self._idle:
                for flat in group["params"]:
                    flat.grad = None

    def sync_hyperparameters(self) -> None:
        """Hyperparameters a method changes on its optimiser (an lr schedule) reach the engine."""
        for slot, group in zip(self.slots, self.ds_optimizer.param_groups):
            for key, value in self.optimizer.param_groups[slot.source].items():
                if key != "params":
                    group[key] = value

    @contextlib.contextmanager
    def apart(self):
        """Inside: no leaf module runs ZeRO-3's reduction hook (StepGradients.apart).
        ZeRO-3 reduces a leaf module's gradients in a full backward hook, which PyTorch
        runs in every backward through the module, torch.autograd.grad to a method's own
        tensor too: the module's experts would be queued for reduction twice in one step
        (zeros first), and DeepSpeed asserts on the duplicate once both land in one
        bucket. PyTorch reads a module's backward hooks at its forward, so a forward
        inside builds a graph without them; a backward inside runs none. ZeRO-2 reduces
        in hooks on the parameters' gradient accumulation, which torch.autograd.grad to
        another tensor never runs."""
        handles = []
        if self.zero == 3 and self._leaves:
            handles = getattr(self.engine.optimizer, "_leaf_module_hooks", None)
            if handles is None:
                raise RuntimeError(f"DeepSpeed {self.ds.__version__}: its ZeRO-3 optimiser has no "
                                   f"_leaf_module_hooks (tested with 0.19.8); apart() cannot take the leaf "
                                   f"modules' reduction hooks off")
        taken: dict[int, tuple[dict, list, dict]] = {}  # a module's backward hooks: (them, order, taken off)
        for handle in handles:
            hooks = handle.hooks_dict_ref()
            if hooks is not None and handle.id in hooks:
                _, _, off = taken.setdefault(id(hooks), (hooks, list(hooks), {}))
                off[handle.id] = hooks.pop(handle.id)
        try:
            yield
        finally:  # each back in its place; hooks added inside after them, hooks removed inside stay out
            for hooks, order, off in taken.values():
                now = dict(hooks)
                hooks.clear()
                hooks.update({key: now[key] if key in now else off[key] for key in order if key in now or key in off})
                hooks.update({key: hook for key, hook in now.items() if key not in order})

    # ---- back to an ordinary module ---------------------------------------------------
    def _gather(self, to: str | None, cut: bool = False) -> tuple[dict[nn.Parameter, torch.Tensor],
                                                                  dict[nn.Parameter, dict[str, Any]]]:
        """Every weight whole (the trainable ones' fp32 masters; ZeRO-3's frozen ones
        gathered) and the optimiser's per-parameter state, whole or (`cut`) this rank's
        Pieces (collectives: every rank calls this, in the same order). `to`: where each
        value goes as it comes, one at a time: "device" (where DeepSpeed returns it),
        "host" (CPU memory), or None: nowhere, this rank only takes part in the
        collectives and holds nothing more after."""
        utils = self.ds.utils
        keep = {"device": lambda t: t.detach().clone(), "host": lambda t: t.detach().to("cpu", copy=True),
                None: lambda t: None}[to]
        values: dict[nn.Parameter, torch.Tensor] = {}
        for p in self.trainable:
            values[p] = keep(utils.safe_get_full_fp32_param(p))
        state = self._read_state(to is not None, cut)
        if self.zero == 3:
            for p in self._params:
                if p not in values:
                    with self.ds.zero.GatheredParameters([p]):
                        values[p] = keep(p.data)
        return ({p: v for p, v in values.items() if v is not None}, state)

    @contextlib.contextmanager
    def whole(self, keep: bool):
        """Inside, between two steps: on a rank that keeps (rank 0, the one that writes
        an in-stage checkpoint), the model's parameters hold what close() would give
        them (those gathered, in host memory) and the ordinary optimiser the state;
        after, the engine's own tensors, and the trained parameters' state out of the
        ordinary optimiser again. Every rank takes part
        in the gathering, one value at a time, and the other ranks keep nothing: beside
        the engine, a device holds one whole value at a time, and only rank 0 a host
        copy of the whole state. Nothing runs the model inside."""
        values, state = self._gather("host" if keep else None)
        held = [p.data for p in self._params]
        try:
            for p, dtype, shape in zip(self._params, self._dtypes, self._shapes):
                if p in values:  # ZeRO-2's frozen weights are whole on every rank already
                    p.data = values[p].reshape(shape).to(dtype)
            self.optimizer.state.update(state)
            yield
        finally:
            for p, data in zip(self._params, held):
                p.data = data
            for p in state:
                self.optimizer.state.pop(p, None)

    def close(self) -> None:
        """Full weights back on every rank, and the optimiser state (ZeRO-3: each rank's
        Pieces; collectives: every rank calls this, in the same order), then an
        ordinary module again."""
        values, state = self._gather("device", cut=self.zero == 3)
        if self._bind is not None:
            self._bind(None)  # between phases the optimiser is an ordinary one again
        self.engine.destroy()
        _forget_released_modules(self.engine.module)
        self.restore_linear()
        # The engine's __del__ calls destroy() again when it is collected, which would
        # unlink the parameters from whatever engine holds them by then: drop its optimiser.
        self.engine.optimizer = None
        for hook in self._hooks:
            hook.remove()
        for module, keys in self._module_keys.items():
            for key in set(vars(module)) - keys:
                delattr(module, key)
            if type(module._parameters) is not dict:  # ZeRO-3's ZeROOrderedDict
                module._parameters = dict(module._parameters.items())
        for p, dtype, shape in zip(self._params, self._dtypes, self._shapes):
            for key in set(vars(p)) - self._param_keys[p]:
                delattr(p, key)
            p.data = values.get(p, p.data).reshape(shape).to(dtype)
        self.optimizer.state.update(state)
        self.engine = self.ds_optimizer = None
        gc.collect()  # the engine's buffers sit in reference cycles: free them before the next one

    def restore_linear(self) -> None:
        """Put back the F.linear this phase found (ZeRO-3 replaced it for the process)."""
        torch.nn.functional.linear = self._linear

    def _read_state(self, keep: bool, cut: bool = False) -> dict[nn.Parameter, dict[str, Any]]:
        """Each trainable parameter's optimiser state, whole (collective) or (`cut`, ZeRO-3)
        this rank's Pieces (no collective), in host memory; keep False: only take part,
        return nothing."""
        inner = self.engine.optimizer.optimizer
        flats = self._flat_partitions()
        if not flats or flats[0][1] not in inner.state:
            return {}  # no step taken and nothing carried: Adam has no state yet
        keys = sorted(k for k, v in inner.state[flats[0][1]].items()
                      if torch.is_tensor(v) and v.shape == flats[0][1].shape)
        scalars = {}
        for g, flat in flats:
            scalars[g] = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in inner.state[flat].items()
                          if not (torch.is_tensor(v) and v.shape == flat.shape)}
        utils, out = self.ds.utils, {}
        where = (torch.distributed.get_rank(), torch.distributed.get_world_size())
        for g, slot in enumerate(self.slots):
            if float(scalars[g].get("step", 1)) == 0:
                continue  # seeded, never stepped: no state, as on torch
            for p in slot.params:
                if cut:
                    out[p] = {**scalars[g], **{k: Piece(utils.safe_get_local_optimizer_state(p, k).detach().to(
                        "cpu", copy=True), self._shape_of[p], *where) for k in keys}}
                    continue
                whole = {k: utils.safe_get_full_optimizer_state(p, k) for k in keys}
                if keep:
                    out[p] = {**scalars[g], **{k: v.detach().to("cpu", copy=True).reshape(self._shape_of[p])
                                               for k, v in whole.items()}}
        return out
