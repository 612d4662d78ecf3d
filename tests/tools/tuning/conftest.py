"""Synthetic run folders for the tuning tests: a record and its predictions made from
item scores, so that Last Acc, BWT and their paired intervals are known by hand."""
from __future__ import annotations

from pathlib import Path

import pytest

from cl_bench.metrics.cl import summarise
from helpers import write_run as write_folder

SMOKE_ORDER = ["NumGLUE-cm", "Py150", "20Minuten"]


def write_run(folder: Path, method: str, args: dict, final: list[int], *, peak: int = 30, n: int = 40,
              tasks=SMOKE_ORDER, split: str = "eval", seed: int = 1234, profile: str = "smoke",
              precision: str = "fp32", items_seed: int = 0) -> Path:
    """A complete run: every task scores `peak` of `n` items right after its own stage
    and `final[j]` of `n` after the last; items right are the first ones, shifted by
    `items_seed` (two runs with other shifts disagree item by item)."""
    T = len(tasks)
    matrix = [[None] * T for _ in range(T)]
    preds = []
    for b in range(T):
        for j in range(b + 1):
            right = final[j] if b == T - 1 else peak
            matrix[b][j] = 100.0 * right / n
            for i in range(n):
                ok = (i + items_seed) % n < right
                preds.append({"stage": b, "task": tasks[j], "index": i, "prompt": "p", "answer": "7",
                              "prediction": "7" if ok else "8", "score": 100.0 if ok else 0.0})
    record = {
        "schema_version": 1, "run_id": folder.name, "status": "complete", "method": method, "method_args": args,
        "reference": False, "model": {"id": "tiny-llama", "n_params": 1000}, "profile": profile,
        "tasks": list(tasks), "seed": seed, "matrix": matrix, "summary": summarise(matrix),
        "params": [{"stage": b, "total": 1000, "trainable": 1000, "active_per_token": 1000, "deployed": 1000,
                    "experts_per_layer": None} for b in range(T)],
        "timing": {"total_s": 60.0}, "backend": {"name": "torch", "precision": {"train": precision, "eval": precision}},
        "data": {t: {"test": {"indices": list(range(n)), "sha256": "t"}, "train": {"indices": [1], "sha256": "r"}}
                 for t in tasks},
        "config": {"model": "tiny-llama", "profile": profile, "seed": seed,
                   "data": {"order": list(tasks), "test_split": split}, "train": {"batch_size": 4}, "eval": {},
                   "replay": {}},
    }
    return write_folder(folder, record, preds)


@pytest.fixture
def fake_run():
    return write_run
