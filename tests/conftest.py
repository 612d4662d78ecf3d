"""Shared fixtures: a small synthetic TRACE tree and a helper to run the CLI."""
from __future__ import annotations

import os

# Tiny models are dominated by per-op overhead: one thread is faster, and on a
# busy 2-core machine it avoids oversubscription (subprocesses inherit this).
os.environ.setdefault("OMP_NUM_THREADS", "1")

import json
import random
from pathlib import Path

import pytest
import torch

from cl_bench.cli import main

torch.set_num_threads(1)

SMOKE_TASKS = ["NumGLUE-cm", "Py150", "20Minuten"]


def pytest_addoption(parser):
    parser.addoption("--data-dir", help="the TRACE release for the real-data tests (default: $CL_BENCH_DATA, "
                                        "then ../shared/trace/LLM-CL-Benchmark_500)")


def pytest_configure(config):
    if config.getoption("--data-dir"):
        os.environ["CL_BENCH_DATA"] = str(Path(config.getoption("--data-dir")).resolve())


def _example(task: str, rng: random.Random) -> dict:
    a, b = rng.randint(1, 9), rng.randint(1, 9)
    if task == "Py150":
        return {"prompt": f"<s> def f{a}(x):<EOL> y = x + {b}<EOL>", "answer": f"return y * <NUM_LIT:{a}>"}
    if task == "20Minuten":
        return {"prompt": f"Provide a simplified version of the following paragraph in German.\n\n"
                          f"Paragraph:\nDer Hund {a} lief heute sehr schnell nach Hause {b}.\n\nSimplification:",
                "answer": f"Der Hund {a} lief nach Hause."}
    return {"prompt": f"Solve the following math problem.\nQuestion:\n{a} plus {b}?\nAnswer:",
            "answer": str(a + b)}


def make_trace(root: Path, tasks=SMOKE_TASKS, n_train: int = 12, n_test: int = 6) -> Path:
    rng = random.Random(0)
    for task in tasks:
        folder = root / task
        folder.mkdir(parents=True, exist_ok=True)
        for split, n in (("train", n_train), ("eval", n_test), ("test", n_test)):
            (folder / f"{split}.json").write_text(json.dumps([_example(task, rng) for _ in range(n)]))
    return root


@pytest.fixture
def trace_dir(tmp_path: Path) -> Path:
    return make_trace(tmp_path / "trace")


def run_cli(*argv: str) -> int:
    return main([str(a) for a in argv])


def only_run(out: Path) -> Path:
    """The one run folder under `out` (which also holds the tokenisation cache)."""
    (run_dir,) = [p.parent for p in Path(out).glob("*/run.json")]
    return run_dir


def interrupted_run(monkeypatch, *argv, at_stage: int, backend: type | None = None) -> Path:
    """Run the CLI, raising KeyboardInterrupt (Ctrl-C) while stage `at_stage`
    (0-based) trains on `backend` (a Backend class; default TorchBackend), on every
    rank; returns the run folder, whose finished stages are saved."""
    import torch

    if backend is None:
        from cl_bench.backends.torch_backend import TorchBackend as backend
    real = backend.train_stage

    def interrupt(self, method, optimizer, stage, *args, **kwargs):
        if stage.index == at_stage:
            raise KeyboardInterrupt
        return real(self, method, optimizer, stage, *args, **kwargs)

    monkeypatch.setattr(backend, "train_stage", interrupt)
    try:
        assert run_cli(*argv) == 130
    finally:
        monkeypatch.setattr(backend, "train_stage", real)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()  # with several ranks: until rank 0 has written the record
    argv = [str(a) for a in argv]
    return only_run(Path(argv[argv.index("--output-dir") + 1]))


def smoke_args(trace_dir: Path, out: Path, *extra: str) -> list[str]:
    """A smoke run on the synthetic data; lr 1e-3 so the tiny model visibly learns."""
    return ["run", "--profile", "smoke", "--data-dir", str(trace_dir), "--output-dir", str(out),
            "--no-progress", "--method-arg", "lr=1e-3", *extra]
