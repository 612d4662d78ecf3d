"""Loading TRACE data: `<root>/<Task>/{train,eval,test}.json`, each a JSON list of
{"prompt": str, "answer": str} (docs/PROTOCOL.md, "Data"). The layout is the
default of every benchmark (cl_bench/benchmark.py); these names are TRACE's
benchmark's methods, kept for the code and the tests that import them."""

from __future__ import annotations

from cl_bench.benchmark import Example, TaskData, file_sha256

from .tasks import TRACE

__all__ = ["CONVENTIONAL_DIRS", "ENV_VAR", "Example", "TaskData", "file_sha256", "load_benchmark", "load_split",
           "load_task", "resolve_data_dir"]

ENV_VAR = TRACE.env_var
CONVENTIONAL_DIRS = TRACE.default_dirs
resolve_data_dir = TRACE.resolve_data_dir
load_split = TRACE.load_split
load_task = TRACE.load_task
load_benchmark = TRACE.load_tasks
