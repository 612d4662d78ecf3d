"""TRACE (Wang et al., 2023, arXiv:2310.06762): task specs, orders and data loading;
the default benchmark (registered as `trace`)."""

from cl_bench.registry import register_benchmark

from .loader import (
    Example,
    TaskData,
    file_sha256,
    load_benchmark,
    load_split,
    load_task,
    resolve_data_dir,
)
from .tasks import CL_TASKS, METRICS, ORDERS, TASKS, TRACE, TaskSpec, get_task, resolve_order

register_benchmark(TRACE)

__all__ = [
    "CL_TASKS",
    "Example",
    "METRICS",
    "ORDERS",
    "TASKS",
    "TRACE",
    "TaskData",
    "TaskSpec",
    "file_sha256",
    "get_task",
    "load_benchmark",
    "load_split",
    "load_task",
    "resolve_data_dir",
    "resolve_order",
]
