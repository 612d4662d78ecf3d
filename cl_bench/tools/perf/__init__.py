"""`cl-bench perf WHAT`: the measurements behind the performance figures of docs/running.md.

harness.py   zero-shot (a method's zero-shot row against another's), generation (batched against one-at-a-time decoding), harness (a
             training stage of `--method` through the backend against a bare
             loop)
zero_cost.py deepspeed (a method's stage on ZeRO-2/3 at 1..N ranks against the torch
             backend: step time and per-rank state memory)
moe.py       moe (dispatch cost against the number of experts), upcycle-gap (the
             loss upcycling adds before any training)
precision.py precision (fp32 against bf16: training and decoding speed, agreement)
eval_profile.py eval-profile (one evaluation pass: prefill, decode, overhead; the bounds),
             eval-speed (the decoder against the plain loop it replaced)
device.py    train-step (median step and MFU against the device's peak), gen-throughput
             (tokens a second of each generator installed), on CUDA where visible
loss_path.py loss-path (training steps with vocabulary logits at the answer positions only
             against every position, per method, on the same batches)
step_options.py step-options (the optimiser step's loop against foreach and fused
             AdamW; frozen weights cast to bf16 once against at every forward)
step.py      step (one optimiser step of a method against another's, and the passes
             it needs, each timed alone on the same batches)

Each returns a JSON-ready dict (deepspeed: None on a launched rank that reports nothing);
repeats alternate the sides and report medians.
The tasks come through the benchmark registry (data.py): `--benchmark` (TRACE by
default), its data folder and its task names. The `--task` defaults are TRACE's;
a measurement of another benchmark that reads tasks is given them with `--task`
(or refused in one line), and its result names the benchmark.
"""
from __future__ import annotations

from typing import Any, Callable

from cl_bench.benchmark import DEFAULT as DEFAULT_BENCHMARK
from cl_bench.errors import UserError
from cl_bench.tools.perf import data
from cl_bench.tools.perf import device
from cl_bench.tools.perf import eval_profile
from cl_bench.tools.perf import harness
from cl_bench.tools.perf import loss_path
from cl_bench.tools.perf import moe
from cl_bench.tools.perf import precision
from cl_bench.tools.perf import step
from cl_bench.tools.perf import step_options
from cl_bench.tools.perf import zero_cost

MEASUREMENTS: dict[str, Callable[[Any], dict]] = {
    "generation": harness.generation,
    "harness": harness.harness,
    "deepspeed": zero_cost.deepspeed,
    "moe": lambda args: moe.moe_benchmark(repeats=args.repeats),
    "upcycle-gap": moe.upcycle_gap,
    "precision": precision.precision_benchmark,
    "step": step.step,
    "loss-path": loss_path.loss_path,
    "step-options": step_options.step_options,
    "zero-shot": harness.zero_shot,
    "eval-profile": eval_profile.eval_profile,
    "eval-speed": eval_profile.eval_speed,
    "train-step": device.train_step,
    "gen-throughput": device.gen_throughput,
}
# TRACE's tasks or order each measurement reads by default (the others: one task, NumGLUE-ds)
DEFAULT_TASK = {"upcycle-gap": "paper6", "zero-shot": "paper6", "eval-profile": "paper6", "eval-speed": "paper6",
                "step": "Py150,NumGLUE-ds", "deepspeed": zero_cost.DEFAULT_TASK, "loss-path": "Py150,NumGLUE-ds",
                "step-options": "Py150,NumGLUE-ds"}
NO_TASKS = ("moe",)  # synthetic: reads no benchmark
OWN_ORDER = ("precision",)  # reads the `cpu` profile's order and sizes of the benchmark
NEEDS_AGAINST = ("step", "zero-shot")  # measurements of --method against another method


def run(what: str, args) -> dict | None:
    if what in NEEDS_AGAINST and not args.against:
        raise UserError(f"perf {what} times --method against another method: give --against METHOD "
                        f"(see `cl-bench list`)")
    bench = data.benchmark(args)  # an unknown --benchmark: one line
    other = bench.name != DEFAULT_BENCHMARK
    if other and what in NO_TASKS:
        raise UserError(f"perf {what} reads no benchmark (synthetic tensors); drop --benchmark {bench.name}")
    if other and not args.task and what not in OWN_ORDER:
        raise UserError(f"perf {what} --benchmark {bench.name}: give --task (its defaults name TRACE's tasks); "
                        f"{bench.title}'s tasks: {', '.join(bench.cl_tasks)}")
    args.task = args.task or DEFAULT_TASK.get(what, "NumGLUE-ds")
    result = MEASUREMENTS[what](args)
    return {"benchmark": bench.name, **result} if other else result
