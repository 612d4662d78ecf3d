"""The tasks a perf measurement reads, through the benchmark registry: `--benchmark`
(TRACE where it is not given, as every measurement read before), its data folder
(`--data-dir`, else the benchmark's own) and its task names. Nothing here names a
benchmark's tasks: the defaults of `--task` are TRACE's (perf.DEFAULT_TASK), and
another benchmark is given its tasks with `--task`."""
from __future__ import annotations

from pathlib import Path

from cl_bench import registry
from cl_bench.benchmark import Benchmark, TaskData


def benchmark(args) -> Benchmark:
    """`--benchmark`'s benchmark (the default where not given); one UserError line where unknown."""
    return registry.get_benchmark(getattr(args, "benchmark", None))


def data_dir(args) -> Path:
    return benchmark(args).resolve_data_dir(args.data_dir)


def order(args) -> list[str]:
    """`--task` as the benchmark reads an order: a named order or comma-separated task names."""
    return benchmark(args).resolve_order(args.task)


def load_task(args, name: str, n_train: int | None, n_test: int | None, seed: int) -> TaskData:
    bench = benchmark(args)
    return bench.load_task(bench.resolve_data_dir(args.data_dir), name, n_train, n_test, seed)


def load_tasks(args, task_order, n_train: int | None, n_test: int | None, seed: int, **per_task) -> list[TaskData]:
    bench = benchmark(args)
    return bench.load_tasks(bench.resolve_data_dir(args.data_dir), task_order, n_train, n_test, seed, **per_task)
