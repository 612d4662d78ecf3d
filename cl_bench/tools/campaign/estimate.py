"""How long a planned run takes, from the committed records' measured timings.

A run's cost is its optimiser steps times the seconds a step of its task took, plus
its generation budget (items scored x each task's max_new_tokens) times the seconds
a budget token took, both read off complete records of the same method and the same
step shape (model, train precision, batch and micro-batch, prompt and answer
lengths, and the benchmark: its prompts' lengths and its answers' budgets are its own;
the profile's name and its epochs do not change a step). A method with no
such record gets a scaled estimate, marked as one: its record at another shape
times the median ratio between the two shapes of the methods of its family
(Method.lr_family: an MoE method scales as the MoE methods measured at both do,
not as dense fine-tuning), else of every method measured at both, else the
baseline's (SeqFT's) own rates at this shape. Records ran one thread each; so do the estimates.

Machines differ several-fold in speed, so a record's seconds are scaled to this
machine: x its `machine.matmul.gflops` (cl_bench/run/machine.py: a CALIBRATION_SHAPE
product at the run's training precision, taken at its start, and at each --resume's
for the stages from there) / the same product's rate here at one thread (in its
thread's CPU time, so this machine's other jobs do not read as a slower machine), measured once
per precision when first needed (a record at two threads has its calibration at two
threads too, so the ratio roughly carries it to one as well). Records made before runs named
their machine (all committed ones until issue 52) are used unscaled, and only where
the method has no record at that shape that names its machine, and the estimate
is marked `~` ("machine unrecorded"): nothing names their machine (the results/perf
records that name one are probes on an AVX2 EPYC, not these runs). So are those of
bf16 on a CPU without native bf16, where the product is emulated, far too slow to
time (and the campaign refuses bf16 there). `Timings.scale_line()` says what was used.
A run's own estimate at its start (`for_run`) reads the same records: its campaign's
(`records_for_run`), else its checkout's. A process reads each record file once while
it is unchanged, and keeps only the fields estimates use (`_read`): the committed
records are 18 MB of JSON, most of it probes, and parsing them took 0.5 s at every
run's start, a quarter of a smoke run in a process that makes many (the tests).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from statistics import mean, median

import torch

from cl_bench import registry
from cl_bench.run import machine, precision
from cl_bench.record import io as results


def shape(config: dict, train_precision: str) -> tuple:
    t = config["train"]
    return (config["model"], train_precision, t["batch_size"], t["micro_batch_size"], t["max_prompt_len"],
            t["max_answer_len"], config.get("data", {}).get("benchmark") or "trace")


@dataclass
class Rates:
    """Seconds per optimiser step of each task's stage, and per generation budget token."""

    step_s: dict[str, float]
    token_s: float
    source: str  # the records they come from, or how they were scaled
    scaled: bool = False  # from another step shape or another method
    unrecorded: int = 0  # records among them whose seconds could not be scaled to this machine

    @property
    def rough(self) -> bool:
        """Whether the estimate is marked `~`."""
        return self.scaled or self.unrecorded > 0

    def step(self, task: str) -> float:
        return self.step_s.get(task, mean(self.step_s.values()))


# The fields of a run record that estimates read; by path, the file's (mtime_ns, size) and
# those fields (None: not a JSON object), parsed once a process while the file is unchanged
ESTIMATED_FROM = ("status", "config", "backend", "method", "timing", "stages", "task_metrics", "machine", "resumes")
_READ: dict[Path, tuple[tuple[int, int], dict | None]] = {}


def _read(path: Path) -> dict | None:
    """`path`'s record, the fields of ESTIMATED_FROM it has (ValueError: not JSON)."""
    stat = path.stat()
    stamp = (stat.st_mtime_ns, stat.st_size)
    if path not in _READ or _READ[path][0] != stamp:
        record = json.loads(path.read_text(encoding="utf-8"))
        _READ[path] = stamp, ({k: record[k] for k in ESTIMATED_FROM if k in record}
                              if isinstance(record, dict) else None)
    return _READ[path][1]


def _stage_machines(record: dict) -> list[dict | None]:
    """The `machine` each stage ran on: the record's, from each --resume's at_stage its own."""
    machines = [record.get("machine")] * len(record["stages"])
    for r in record.get("resumes") or []:
        machines[r["at_stage"]:] = [r.get("machine")] * len(machines[r["at_stage"]:])
    return machines


def _record_rates(record: dict, where: Path, factors: list[float | None] | None = None) -> Rates | None:
    """`record`'s rates, each stage's seconds x its factor and the zero-shot row's x the
    last one (it ran at the first start); a factor None leaves them unscaled, counted
    `unrecorded`."""
    timing = record.get("timing") or {}
    stages = timing.get("stages") or []
    if not stages:
        return None
    factors = factors or [1.0] * (len(stages) + 1)  # the stages', then the zero-shot row's
    f = [1.0 if x is None else x for x in factors]
    step_s: dict[str, list[float]] = {}
    for stage, timed, x in zip(record["stages"], stages, f):
        if timed["steps"]:
            for task in stage["tasks"]:  # a multi-task stage: each task at the stage's mean
                step_s.setdefault(task, []).append(timed["train_s"] * x / timed["steps"])
    budget = sum(m["n"] * m["max_new_tokens"] for m in record["task_metrics"])
    eval_s = sum(s["eval_s"] * x for s, x in zip(stages, f)) + (timing.get("zero_shot_s") or 0.0) * f[-1]
    if not step_s or not budget:
        return None
    return Rates({k: mean(v) for k, v in step_s.items()}, eval_s / budget, str(where),
                 unrecorded=int(None in factors))


def _rate_here(precision_name: str) -> float | None:
    """GFLOP/s of machine.CALIBRATION_SHAPE at `precision_name` on this machine, one thread
    (None for bf16 without native bf16: emulated, minutes to time)."""
    if precision_name not in ("fp32", "bf16") or (
            precision_name == "bf16" and not precision.native_bf16(torch.device("cpu"))):
        return None
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return machine.matmul_rate(precision_name, *machine.CALIBRATION_SHAPE)
    finally:
        torch.set_num_threads(threads)


class Timings:
    """The complete records under `folder`, by (method, step shape); their seconds are
    scaled to this machine (module docstring) when their rates are asked for."""

    def __init__(self, folder: Path, root: Path | None = None):
        self.by_key: dict[tuple, list[tuple[dict, str]]] = {}
        self.here: dict[str, float | None] = {}  # this machine's rate by precision, once measured
        root = root or folder
        for path in sorted(folder.rglob(results.RUN_FILE)) if folder.is_dir() else []:
            try:
                record = _read(path)
                if record is None or record.get("status") != "complete" or not record.get("config"):
                    continue
                trained = ((record.get("backend") or {}).get("precision") or {}).get("train", "fp32")
                rates = _record_rates(record, path.parent.relative_to(root) if path.is_relative_to(root)
                                      else path.parent)
                key = (record["method"], shape(record["config"], trained))
                _stage_machines(record)
            except (ValueError, KeyError, TypeError):
                continue  # not a run record of this schema: no timings to learn from
            if rates is not None:
                self.by_key.setdefault(key, []).append((record, rates.source))

    def rate_here(self, precision_name: str) -> float | None:
        if precision_name not in self.here:
            self.here[precision_name] = _rate_here(precision_name)
        return self.here[precision_name]

    def factor(self, calibration: dict | None) -> float | None:
        """Seconds here per second on the machine `calibration` (a record's `machine`)
        describes: its matmul rate over this machine's at the same precision; None where
        either is unknown."""
        try:
            there, name = float(calibration["matmul"]["gflops"]), calibration["matmul"]["precision"]
        except (TypeError, KeyError, ValueError):
            return None
        here = self.rate_here(name)
        return there / here if here and there > 0 else None

    def _factors(self, record: dict) -> list[float | None]:
        return [self.factor(m) for m in _stage_machines(record)] + [self.factor(record.get("machine"))]

    def _pooled(self, method: str, at: tuple) -> Rates | None:
        """The mean rates of the method's records at `at`; of those that name their machine
        (scaled to this one) where there are any: an unrecorded record's machine and
        threads are unknown (the committed ones read 0.6-2x those of the same method
        that name theirs), so it only stands in where nothing better was measured."""
        found = [_record_rates(record, where, self._factors(record))
                 for record, where in self.by_key.get((method, at), [])]
        if not found:
            return None
        known = [r for r in found if not r.unrecorded]
        left_out = len(found) - len(known) if known else 0
        found = known or found
        tasks = {t for r in found for t in r.step_s}
        names = [r.source for r in found]
        unrecorded = sum(r.unrecorded for r in found)
        return Rates({t: mean(r.step_s[t] for r in found if t in r.step_s) for t in tasks},
                     mean(r.token_s for r in found),
                     (names[0] if len(names) == 1 else f"{len(names)} records: {names[-1]}, {names[0]}, ...")
                     + ("; machine unrecorded" if unrecorded else "")
                     + (f"; {left_out} more whose machine is unrecorded left out" if left_out else ""),
                     unrecorded=unrecorded)

    def scale_line(self) -> str:
        """`--dry-run`'s and `--status`'s line on the scale: this machine's rates (at the
        precisions of the records read), and how many records were scaled, by how much."""
        records = [record for found in self.by_key.values() for record, _ in found]
        for name in sorted({key[1][1] for key in self.by_key}):
            self.rate_here(name)  # also where no record names its machine: for comparison
        factors = [self._factors(record) for record in records]
        scaled = [f for f in factors if None not in f]
        here = ", ".join(f"{name} {'not measured (no native bf16)' if rate is None else f'{rate:.1f} GFLOP/s'}"
                         for name, rate in sorted(self.here.items())) or "not measured (no records)"
        ratio = f" (seconds x {min(map(min, scaled)):.2f}-{max(map(max, scaled)):.2f})" if scaled else ""
        unscaled = len(records) - len(scaled)
        why = "machine unrecorded" + (", or no rate here" if None in self.here.values() else "")
        return (f"scale: this machine's {'x'.join(map(str, machine.CALIBRATION_SHAPE))} product at one thread: "
                f"{here} (load {machine.machine()['loadavg'][0]:.1f}); of {len(records)} records read, "
                f"{len(scaled)} scaled by their machine's rate over this one{ratio}"
                + (f", {unscaled} unscaled ({why}: their estimates marked ~)" if unscaled else ""))

    def rates(self, method: str, at: tuple) -> Rates | None:
        """The method's rates at step shape `at`: measured, else scaled (module docstring)."""
        own = self._pooled(method, at)
        if own is not None:
            return own
        for (m, other) in sorted(self.by_key, key=str):
            if m != method:
                continue
            ratio = self._ratio(method, other, at)
            if ratio is not None:
                mine, (step, token, why) = self._pooled(method, other), ratio
                return Rates({t: v * step for t, v in mine.step_s.items()}, mine.token_s * token,
                             f"scaled: {mine.source} x {why}", scaled=True, unrecorded=mine.unrecorded)
        base = registry.baseline()
        here = self._pooled(base, at)
        if here is None:
            return None
        return dataclasses.replace(here, source=f"scaled: {base}'s rates ({here.source}), no record of {method}",
                                   scaled=True)

    def _ratio(self, method: str, other: tuple, at: tuple) -> tuple[float, float, str] | None:
        """How much dearer a step and a budget token are at `at` than at `other`: the
        median over the methods of `method`'s family (Method.lr_family: full, adapter,
        expert) measured at both, else over every method measured at both. The median,
        as one method's record can be slow for reasons of its own (SeqFT's long-sequence
        run shared its 2 cores with other runs: its steps read twice as dear as TRACE's
        where the other three methods' read 0.8-1.4x)."""
        family = registry.get(method).lr_family
        others = sorted({m for m, _ in self.by_key if m != method})
        peers = [m for m in others if family and registry.get(m).lr_family == family]
        for group, kind in ((peers, f"the {family} family's"), (others, "")):
            found = [(m, self._pooled(m, at), self._pooled(m, other)) for m in group]
            pairs = [(a, b) for _, a, b in found if a is not None and b is not None]
            if pairs:
                names = [m for m, a, b in found if a is not None and b is not None]
                ratio = "ratio between the shapes" if len(names) == 1 else "median ratio between the shapes"
                if kind:
                    why = f"{kind} {ratio} ({', '.join(names)})"
                elif len(names) == 1:
                    why = f"{names[0]}'s {ratio}"
                else:
                    why = f"the {ratio} of the methods measured at both ({', '.join(names)})"
                step = median(mean(a.step(t) / b.step(t) for t in b.step_s) for a, b in pairs)
                token = median(a.token_s / b.token_s for a, b in pairs)
                return step, token, why
        return None


@dataclass
class Work:
    """A planned run's work, stage by stage: steps per task, generation budget tokens."""

    steps: list[dict[str, int]]
    budget: list[int]  # per stage
    zero_shot: int  # the zero-shot row's budget (0: none)
    at: tuple  # step shape

    def seconds(self, rates: Rates, from_stage: int = 0, zero_shot_done: bool = False) -> float:
        train = sum(n * rates.step(t) for s in self.steps[from_stage:] for t, n in s.items())
        tokens = sum(self.budget[from_stage:]) + (0 if zero_shot_done else self.zero_shot)
        return train + tokens * rates.token_s


def planned_work(config, method_args) -> Work:
    """What `config` trains and scores, from the data it would load (no model)."""
    from cl_bench.data.encode import phase_steps
    from cl_bench.eval.evaluation import max_new_tokens
    from cl_bench.method import MethodContext

    d = config.data
    benchmark = registry.get_benchmark(d.benchmark)
    quiet = logging.getLogger("cl_bench.benchmark")
    level = quiet.level
    quiet.setLevel(logging.WARNING)  # the sizes it would log belong to the run, not to its estimate
    try:
        tasks = benchmark.load_tasks(benchmark.resolve_data_dir(d.data_dir), d.order, d.n_train, d.n_test,
                                     config.seed, d.n_train_per_task, d.n_test_per_task, d.test_split)
    finally:
        quiet.setLevel(level)
    cls = registry.get(config.method)
    ctx = MethodContext(config=config, device=torch.device("cpu"), tokenizer=None, all_tasks=tasks)
    method = cls(method_args, ctx)
    stages = method.plan(tasks)
    ctx.n_stages = len(stages)
    ev = config.eval
    cost = [len(t.test) * max_new_tokens(t.spec, ev) for t in tasks]
    steps, budget = [], []
    for stage in stages:
        n_phases = len(method.phases(stage))
        t = config.train
        # Each task's steps as if it were trained alone, so each is priced at its own
        # task's rate; in a multi-task stage the sequencer batches the tasks' rows
        # together (MethodContext.stage_steps), at most one step per task per epoch fewer.
        steps.append({task.name: n_phases * phase_steps([len(task.train)] * t.epochs_for(task.name), t.batch_size)
                      for task in stage.tasks})
        trained = sorted({tasks.index(x) for s in stages[:stage.index + 1] for x in s.tasks})
        own = sorted(tasks.index(x) for x in stage.tasks)
        scored = set(range(len(tasks)) if ev.eval_all else own if cls.eval_scope == "stage" else trained)
        if ev.next_task and stage.index + 1 < len(stages):
            scored |= {tasks.index(x) for x in stages[stage.index + 1].tasks}
        budget.append(sum(cost[j] for j in scored))
    zero = sum(cost) if ev.eval_all or ev.zero_shot else 0
    trained_in = precision.resolve(config.train.precision, torch.device("cpu"))
    return Work(steps, budget, zero, shape(config.to_dict(), trained_in))


RECORDS = Path(__file__).resolve().parents[3] / "results"  # the committed records, in a checkout
RECORDS_ENV = "CL_BENCH_RECORDS"  # a campaign's records, for its runs (launch.environment)


def records_for_run() -> Path:
    """The records a run's estimate reads: its campaign's where a campaign launched it
    (its code is a clone of its commit, whose records lack every run committed since),
    else the checkout's."""
    given = os.environ.get(RECORDS_ENV)
    return Path(given) if given else RECORDS


def for_run(config, method_args, stages_done: int = 0, zero_shot_done: bool = False,
            records: Path | None = None) -> str:
    """What `cl-bench run` says at its start: the time left for `config`, as the campaign
    estimates it (module docstring), at one thread as the records ran, with the records it
    comes from; "~" and "scaled" where no record has this method at this step shape, "~" and
    "machine unrecorded" where its records name no machine to scale them from."""
    from cl_bench.errors import UserError

    records = records_for_run() if records is None else records
    try:
        work = planned_work(config, method_args)
    except UserError as e:
        return f"no estimate ({e})"
    rates = Timings(records, records).rates(config.method, work.at) if records.is_dir() else None
    if rates is None:
        return (f"no estimate (no complete record of this step shape, {work.at[0]} in {work.at[1]} on "
                f"{work.at[-1]}, under {records})")
    minutes = work.seconds(rates, stages_done, zero_shot_done) / 60
    shown = f"{minutes / 60:.1f} h" if minutes >= 90 else f"{minutes:.0f} min"
    return f"{'~' if rates.rough else ''}{shown} at one thread ({rates.source})"
