"""Shared fixtures and pytest hooks; the helpers the tests import are in helpers.py."""
from __future__ import annotations

import os

# Tiny models are dominated by per-op overhead: one thread is faster, and on a
# busy 2-core machine it avoids oversubscription (subprocesses inherit this).
os.environ.setdefault("OMP_NUM_THREADS", "1")
# A campaign's records, which its runs' estimates read (cl_bench/tools/campaign/launch.py),
# are not the tests' (they give their own, or read the checkout's).
os.environ.pop("CL_BENCH_RECORDS", None)

from pathlib import Path

import pytest
import torch

from helpers import make_trace

torch.set_num_threads(1)


def pytest_addoption(parser):
    parser.addoption("--data-dir", help="the TRACE release for the real-data tests (default: $CL_BENCH_DATA, "
                                        "then ../shared/trace/LLM-CL-Benchmark_500)")


def pytest_configure(config):
    if config.getoption("--data-dir"):
        os.environ["CL_BENCH_DATA"] = str(Path(config.getoption("--data-dir")).resolve())


@pytest.fixture(autouse=True)
def _registry_restored():
    """Every test ends with the method and benchmark registries as it found them: a method
    or benchmark a test registers (or a plugin a test's discovery found) does not leak into
    the next test. Built-in ones a test imported stay: they register on import, which
    Python does once."""
    from cl_bench import registry

    methods, broken, discovered = dict(registry._METHODS), dict(registry._BROKEN), registry._DISCOVERED
    benchmarks = dict(registry._BENCHMARKS), dict(registry._BENCHMARKS_BROKEN), registry._BENCHMARKS_DISCOVERED
    yield
    for now, before in zip((registry._BENCHMARKS, registry._BENCHMARKS_BROKEN), benchmarks):
        builtin = {k: b for k, b in now.items() if k not in before and type(b).__module__.startswith("cl_bench.benchmarks")}
        now.clear()
        now.update({**before, **builtin})
    registry._BENCHMARKS_DISCOVERED = benchmarks[2]
    builtin = {k: c for k, c in registry._METHODS.items()
               if k not in methods and c.__module__.startswith("cl_bench.methods.")}
    registry._METHODS.clear()
    registry._METHODS.update({**methods, **builtin})
    registry._BROKEN.clear()
    registry._BROKEN.update(broken)
    registry._DISCOVERED = discovered


@pytest.fixture
def trace_dir(tmp_path: Path) -> Path:
    return make_trace(tmp_path / "trace")
