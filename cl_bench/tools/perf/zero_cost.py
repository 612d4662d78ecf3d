"""`cl-bench perf deepspeed`: a method's training stage on the deepspeed backend
(ZeRO-2 or ZeRO-3, at each rank count of `--ranks`) against the torch backend.

What is timed: with `--task A,B` (the default, Py150,NumGLUE-ds) stage 0 on A runs
its hooks only (nothing trains: a step's cost does not depend on the trained
values) and fills the replay buffer, so stage 1 on B carries what the method adds
from its second task on (EWC's penalty, OGD's projection, the flagship's outer
step on the replay micro-batch); with one task, its stage 0. The `cpu` profile's
batch sizes and lengths, `--n` items a task, one precision on both sides
(`--precision`, default fp32: the deepspeed backend's on a CPU).

Ranks: a rank count N > 1 is started the way `cl-bench run --nproc N` starts its
ranks (cl_bench/backends/launch.py: DeepSpeed's launcher; gloo on a CPU), each rank
running this same command; rank 0 hands its part back through a file. N = 1 runs
in this process. Inside one launch every rank sets the method up identically, then
each repeat runs the stage on the deepspeed backend (every rank) and on the torch
backend (rank 0, one process and the whole batch, as a torch run; the other ranks
wait at a barrier), alternating which goes first, after one warm-up of each.

Figures, per rank count:
- step_s: the median interval between successive steps of the stage (the step
  log's timestamps, so the first step's engine set-up is apart: before_first_step_s;
  after_last_step_s: gathering back, tear-down); mean_step_s: the stage's steps
  from the first to the last, over their number (an occasional costly step, the
  flagship's outer step, counts there); medians over repeats, and the ratios
  deepspeed / torch of those medians.
- state memory of each rank: distinct tensor storages (bytes) the rank holds
  between the step's last backward and the optimiser step (the largest over the
  stage's steps): weights (the model's working copies: ZeRO-2 every weight whole;
  ZeRO-3 this rank's partitions, and whole parameters ZeRO-3 keeps gathered),
  fp32 masters (ZeRO's own partitions; none on torch, whose weights are fp32
  masters themselves), gradients (ZeRO's reduced partitions and buckets; torch:
  every trainable parameter's .grad), optimiser state (Adam's moments of this
  rank's partitions), and the method's own tensors (Fisher, anchors, bases, mask
  logits: those reachable from the method object). Read from the engine's flat
  partitions and optimiser state (DeepSpeed 0.19.x attribute names: any tensor
  attribute of the ZeRO optimiser, classed by its name). Beside it, a second
  figure: the process's resident set size at those points (rss_mb, medians over
  repeats), which also holds the libraries, activations and allocator caches;
  rank 0's also holds the torch side's model copy.
- the machine (cl_bench/run/machine.py: CPU, cores, load average) at the start
  and the end of each rank count, and the command line (cl_bench/cli.py).
"""
from __future__ import annotations

import contextlib
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from cl_bench import registry
from cl_bench.backends.base import check_support
from cl_bench.backends.torch_backend import TorchBackend
from cl_bench.config import build
from cl_bench.data.encode import Encoder, phase_steps, tokenize_train
from cl_bench.data.replay import ReplayBuffer
from cl_bench.errors import UserError
from cl_bench.method import MethodContext
from cl_bench.models.loading import load
from cl_bench.profiles import PROFILES
from cl_bench.run.machine import machine
from cl_bench.tools.perf import data

DEFAULT_TASK = "Py150,NumGLUE-ds"
PART_ENV = "CL_BENCH_PERF_PART"  # a launched rank 0 writes its part of the record here
SIDES = ("torch", "deepspeed")
MEMORY_KINDS = ("weights", "fp32_masters", "gradients", "optimiser_state", "method_state")


def parse_ranks(text: str) -> list[int]:
    try:
        ranks = [int(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        ranks = []
    if not ranks or min(ranks) < 1 or len(set(ranks)) != len(ranks):
        raise UserError(f"--ranks {text}: give distinct rank counts of at least 1, comma-separated (e.g. 1,2)")
    return ranks


def configs(args):
    """(torch backend's config, deepspeed backend's config): the `cpu` profile for
    `args.model`, one training precision on both."""
    wanted = args.precision or "fp32"
    base = {**PROFILES["cpu"], "profile": "cpu", "model": args.model}
    torch_config = build({**base, "train": {**base["train"], "precision": wanted}}, "perf")
    from cl_bench.run import precision

    resolved = precision.resolve(wanted, torch.device("cpu"))
    ds_config = build({**base, "train": {**base["train"], "precision": wanted}, "backend": "deepspeed",
                       "deepspeed": {"zero": args.zero or 2, "bf16": resolved == "bf16"}}, "perf")
    return torch_config, ds_config


def method_args(args) -> dict[str, str]:
    out = {}
    for item in args.method_arg or []:
        if "=" not in item:
            raise UserError(f"--method-arg {item}: give K=V")
        key, value = item.split("=", 1)
        out[key] = value
    return out


# ---- the record -------------------------------------------------------------------------
def summarise(runs: dict[str, dict[str, list[float]]]) -> dict[str, Any]:
    """Medians over repeats of each side's figures, and the deepspeed / torch ratios
    of those medians (not the median of per-repeat ratios)."""
    median = {side: {k: statistics.median(v) for k, v in figures.items()} for side, figures in runs.items()}
    ratios = {f"{k}_ratio": median["deepspeed"][k] / median["torch"][k]
              for k in ("step_s", "mean_step_s") if k in median["deepspeed"] and median["torch"].get(k)}
    return {"median": median, **ratios}


def memory_ratios(memory: dict[str, Any]) -> dict[str, float]:
    """Each rank's state total on deepspeed over the torch backend's one process."""
    torch_total = memory["torch"]["total"]
    return {rank: m["total"] / torch_total for rank, m in memory["deepspeed"].items()}


# ---- state memory ------------------------------------------------------------------------
def _storage(t: torch.Tensor) -> tuple[int, int] | None:
    if not torch.is_tensor(t) or t.device.type == "meta":
        return None
    s = t.untyped_storage()
    return (s.data_ptr(), s.nbytes()) if s.nbytes() else None


class Ledger:
    """Bytes by kind, each storage counted once (in the first kind it is seen in)."""

    def __init__(self):
        self.seen: set[int] = set()
        self.bytes = {k: 0 for k in MEMORY_KINDS}

    def add(self, kind: str, t) -> None:
        key = _storage(t) if torch.is_tensor(t) else None
        if key is not None and key[0] not in self.seen:
            self.seen.add(key[0])
            self.bytes[kind] += key[1]

    def result(self) -> dict[str, int]:
        return {**self.bytes, "total": sum(self.bytes.values())}


def _tensors(value, depth: int = 0, seen: set[int] | None = None):
    """Tensors reachable from `value` (containers, modules, plain objects), a few levels deep."""
    seen = set() if seen is None else seen
    if depth > 4 or id(value) in seen:
        return
    seen.add(id(value))
    if torch.is_tensor(value):
        yield value
        if value.grad is not None:
            yield value.grad
    elif isinstance(value, nn.Module):
        yield from (t for t in value.state_dict(keep_vars=True).values())
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v, depth + 1, seen)
    elif isinstance(value, (list, tuple, set)):
        for v in value:
            yield from _tensors(v, depth + 1, seen)
    elif isinstance(value, torch.optim.Optimizer):
        yield from _tensors(list(value.state.values()), depth + 1, seen)
    elif hasattr(value, "__dict__") and not isinstance(value, type) and type(value).__module__.split(".")[0] in (
            "cl_bench", "methods"):
        yield from _tensors(vars(value), depth + 1, seen)


def _method_state(ledger: Ledger, method) -> None:
    skip = {"model", "ctx", "args"}
    for key, value in vars(method).items():
        if key not in skip:
            for t in _tensors(value):
                ledger.add("method_state", t)


def torch_state(method, optimizer) -> dict[str, int]:
    ledger = Ledger()
    for p in method.model.parameters():
        ledger.add("weights", p)
    for p in method.model.parameters():
        if p.grad is not None:
            ledger.add("gradients", p.grad)
    for state in optimizer.state.values():
        for v in state.values():
            ledger.add("optimiser_state", v)
    _method_state(ledger, method)
    return ledger.result()


def _zero_kind(name: str) -> str:
    name = name.lower()
    if "grad" in name:
        return "gradients"
    if "fp32" in name:
        return "fp32_masters"
    return "weights"


def zero_state(engine, method) -> dict[str, int]:
    """This rank's: see the module docstring. The inner optimiser's state first, then
    the ZeRO optimiser's tensor attributes by name (gradient buffers, fp32 partitions,
    flat working copies), then the model's parameters (ZeRO-3: their partitions)."""
    ledger = Ledger()
    zopt = engine.optimizer
    for flat, state in zopt.optimizer.state.items():
        for v in state.values():
            ledger.add("optimiser_state", v)
        if flat.grad is not None:
            ledger.add("gradients", flat.grad)
    for name, value in vars(zopt).items():
        if name == "optimizer":
            continue
        for t in _tensors(value, depth=2):
            ledger.add(_zero_kind(name), t)
    for p in method.model.parameters():
        ledger.add("weights", getattr(p, "ds_tensor", None))
        ledger.add("weights", p.data)
        ledger.add("gradients", p.grad)
    _method_state(ledger, method)
    return ledger.result()


def rss_mb() -> float:
    """The process's resident set size now."""
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2 ** 20


@contextlib.contextmanager
def _phases(found: list):
    """The deepspeed backend's ZeroPhase of each phase it trains, collected in `found`."""
    from cl_bench.backends import deepspeed_backend

    base = deepspeed_backend.ZeroPhase

    class Seen(base):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            found.append(self)

    deepspeed_backend.ZeroPhase = Seen
    try:
        yield
    finally:
        deepspeed_backend.ZeroPhase = base


# ---- one launch -----------------------------------------------------------------------------
def measure(args) -> dict[str, Any] | None:
    """Every rank of one launch (or this process alone): the part of the record for
    this world size, on rank 0; None on the others."""
    from cl_bench.backends.deepspeed_backend import DeepSpeedBackend

    start = machine()
    torch_config, ds_config = configs(args)
    ds = DeepSpeedBackend(ds_config)
    device = ds.device
    loaded = load(args.model, torch_config.seed)
    encoder = Encoder.from_config(loaded.tokenizer, torch_config.train)
    tasks = [data.load_task(args, name, args.n, args.n, torch_config.seed) for name in args.task.split(",")]
    if len(tasks) > 2:
        raise UserError(f"perf deepspeed: --task A,B (stage 0's hooks, then the timed stage) or one task, "
                        f"not {args.task!r}")
    cls = registry.get(args.method)
    replay = ReplayBuffer(torch_config.replay, torch_config.seed)
    ctx = MethodContext(torch_config, device, loaded.tokenizer, all_tasks=tasks, encoder=encoder, replay=replay)
    given = method_args(args)
    method = cls(cls.parse_args(cls.args_for(torch_config) | given), ctx)
    method.setup(loaded.model.to(device))
    stages = method.plan(tasks)
    ctx.n_stages = len(stages)
    if len(stages) > 1:  # stage 0's hooks, as the sequencer runs them, without its training
        method.before_task(stages[0])
        method.after_task(stages[0])
        for task in stages[0].tasks:
            replay.add_task(task)
    stage = stages[-1]
    method.before_task(stage)
    phases = method.phases(stage)
    rows = [row for t in stage.tasks for row in tokenize_train(encoder, t.train, None)]
    replay_rows = (list(tokenize_train(encoder, replay.examples(), None))
                   if method.uses_replay and len(replay) and phases[-1].replay else None)
    backends = {"torch": TorchBackend(torch_config, device), "deepspeed": ds}
    pad = loaded.tokenizer.pad_token_id

    def timed(name: str) -> tuple[dict[str, float], dict[str, int] | None]:
        """One stage on `name`; its figures (rank 0) and this rank's state memory."""
        if name == "torch" and not ds.is_main:
            ds.barrier()  # rank 0 runs the torch backend alone
            return {}, None
        found: list = []
        peak: dict[str, Any] = {"total": -1}
        rss: list[float] = []
        optimizers: list = []
        own_before_step = method.before_step

        def before_step(step: int) -> None:  # after the step's last backward, before the optimiser step
            own_before_step(step)
            state = (zero_state(found[-1].engine, method) if name == "deepspeed"
                     else torch_state(method, optimizers[-1]))
            rss.append(rss_mb())
            if state["total"] > peak["total"]:
                peak.clear()
                peak.update(state)

        marks: list[float] = []
        method.before_step = before_step
        try:
            with _phases(found):
                t0 = time.perf_counter()
                optimizer = None
                for phase in phases:
                    method.before_phase(stage, phase)
                    optimizer = method.optimizer_for_stage(stage, None)
                    optimizers.append(optimizer)
                    backends[name].train_stage(method, optimizer, stage, [rows], pad,
                                               lambda s, parts: marks.append(time.perf_counter()),
                                               replay_rows if phase.replay else None)
                end = time.perf_counter()
        finally:
            del method.before_step  # the class's again
        if name == "torch":
            ds.barrier()
        gaps = [b - a for a, b in zip(marks, marks[1:])]
        step = statistics.median(gaps)
        return ({"step_s": step, "mean_step_s": (marks[-1] - marks[0]) / len(gaps), "total_s": end - t0,
                 "before_first_step_s": marks[0] - t0 - step,  # deepspeed: the engine's set-up
                 "after_last_step_s": end - marks[-1],  # deepspeed: gathering back, tear-down
                 "rss_mb": max(rss)}, peak)

    n_steps = phase_steps([len(rows)], torch_config.train.batch_size)
    if n_steps < 3:
        raise UserError(f"perf deepspeed: {n_steps} steps a stage give fewer than 2 intervals between steps; "
                        f"raise --n (batch size {torch_config.train.batch_size})")
    timed("deepspeed")  # warm-up: the first engine, allocator, first-call costs
    timed("torch")
    runs: dict[str, dict[str, list[float]]] = {n: {} for n in SIDES}
    memory: dict[str, Any] = {}
    rss: dict[str, Any] = {"torch": [], "deepspeed": {str(r): [] for r in range(ds.world_size)}}
    for i in range(args.repeats):  # alternate which side goes first
        for name in (SIDES if i % 2 else SIDES[::-1]):
            figures, state = timed(name)
            if name == "deepspeed":  # every rank's state and resident set
                per_rank: list[Any] = [None] * ds.world_size
                torch.distributed.all_gather_object(per_rank, (state, figures.pop("rss_mb")))
                memory["deepspeed"] = {str(r): m for r, (m, _) in enumerate(per_rank)}
                for r, (_, mb) in enumerate(per_rank):
                    rss["deepspeed"][str(r)].append(mb)
            elif state is not None:
                memory["torch"] = state
                rss["torch"].append(figures.pop("rss_mb"))
            for key, value in figures.items():
                runs[name].setdefault(key, []).append(value)
    if not ds.is_main:
        return None
    memory["torch"]["rss_mb"] = statistics.median(rss["torch"])
    for r, values in rss["deepspeed"].items():
        memory["deepspeed"][r]["rss_mb"] = statistics.median(values)
    return {"what": "deepspeed", "model": args.model, "method": args.method, "method_args": given,
            "tasks": [t.name for t in tasks], "timed_stage": stage.label, "examples": len(rows),
            "replay_rows": len(replay_rows or []), "steps": n_steps, "batch_size": torch_config.train.batch_size,
            "micro_batch_size": torch_config.train.micro_batch_size, "zero": ds_config.deepspeed.zero,
            "world_size": ds.world_size, "precision": backends["torch"].train_precision, "bf16": ds.bf16,
            "device": str(device), "repeats": args.repeats, "runs": runs, **summarise(runs),
            "memory": memory, "memory_ratio": memory_ratios(memory), "rss_mb": rss,
            "machine": {"start": start, "end": machine()}, "torch_threads": torch.get_num_threads(),
            "deepspeed_version": ds.ds.__version__}



# ---- the command --------------------------------------------------------------------------
COMMON = ("what", "model", "method", "method_args", "tasks", "timed_stage", "examples", "replay_rows", "steps",
          "batch_size", "micro_batch_size", "zero", "precision", "bf16", "device", "repeats", "torch_threads",
          "deepspeed_version")


def deepspeed(args) -> dict[str, Any] | None:
    """The record (None on a launched rank other than 0, and on rank 0 of a launch
    this command started, which hands its part back through PART_ENV's file)."""
    if "RANK" in os.environ:  # one rank of a launch: this command's (PART_ENV), or one from outside
        part = measure(args)
        target = os.environ.get(PART_ENV)
        if part is None or not target:
            return _record([part]) if part is not None else None
        Path(target).write_text(json.dumps(part))
        return None
    ranks = parse_ranks(args.ranks)
    _, ds_config = configs(args)
    check_support(registry.get(args.method), ds_config)  # a refused method fails here, in one line
    parts = [_launched(args, n) for n in ranks if n > 1]
    if 1 in ranks:  # in this process, after the launches (which then find all the memory free)
        parts.append(measure(args))
    order = {n: i for i, n in enumerate(ranks)}
    return _record(sorted(parts, key=lambda p: order[p["world_size"]]))


def _record(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """The parts of each rank count under `ranks`, what they share once."""
    shared = {k: parts[0][k] for k in COMMON}
    for part in parts[1:]:
        differ = [k for k in COMMON if part[k] != shared[k]]
        if differ:
            raise RuntimeError(f"perf deepspeed: the launches differ in {differ}")
    return {**shared, "ranks": {str(p["world_size"]): {k: v for k, v in p.items() if k not in COMMON}
                                for p in parts}}


def launch_argv(argv: list[str]) -> list[str]:
    """`argv` for DeepSpeed's launcher, which reads every option it can abbreviate to one
    of its own: `--n` (ambiguous there: --num_gpus, --node_rank ...) as `--items`."""
    return ["--items" + a[3:] if a == "--n" or a.startswith("--n=") else a for a in argv]


def _launched(args, n: int) -> dict[str, Any]:
    """This command on `n` ranks, started as `cl-bench run --nproc n` starts its ranks."""
    from cl_bench.backends.launch import launch

    handle, target = tempfile.mkstemp(prefix="cl-bench-perf-", suffix=".json")
    os.close(handle)
    before = os.environ.get(PART_ENV)
    os.environ[PART_ENV] = target
    try:
        code, interrupted = launch(n, launch_argv(args.argv), args.command_line)
        if interrupted:
            raise KeyboardInterrupt
        text = Path(target).read_text()
        if code or not text:
            raise UserError(f"perf deepspeed: the launch of {n} ranks failed (exit code {code}); "
                            f"its ranks' output is above")
        return json.loads(text)
    finally:
        if before is None:
            os.environ.pop(PART_ENV, None)
        else:
            os.environ[PART_ENV] = before
        Path(target).unlink(missing_ok=True)
