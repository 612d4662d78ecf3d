"""upcycle and drop-upcycle end to end: smoke runs on the tiny Llama and resume.
The MoE layer they build: tests/models/test_moe.py."""
from __future__ import annotations

import json

import pytest

from cl_bench import results
from helpers import interrupted_run, only_run, run_cli, smoke_args

pytestmark = pytest.mark.slow  # every test here is an end-to-end run


@pytest.mark.parametrize("method", ["upcycle", "drop-upcycle"])
def test_smoke_run_grows_8_experts_per_layer_per_task(trace_dir, tmp_path, method):
    out = tmp_path / "runs"
    assert run_cli(*smoke_args(trace_dir, out, "--method", method)) == 0
    record = json.loads((only_run(out) / "run.json").read_text())
    assert record["status"] == "complete"
    assert [p["experts_per_layer"] for p in record["params"]] == [[8, 8], [16, 16], [24, 24]]
    for p in record["params"]:
        assert p["active_per_token"] < p["total"] and p["trainable"] < p["total"]
    rows = results.read_jsonl(only_run(out) / "metrics.jsonl")
    assert {"lm", "lb"} <= set(rows[0])


def test_upcycle_resumes_to_the_same_run(trace_dir, tmp_path, monkeypatch):
    straight = tmp_path / "straight"
    assert run_cli(*smoke_args(trace_dir, straight, "--method", "upcycle")) == 0
    expected = json.loads((only_run(straight) / "run.json").read_text())

    broken = tmp_path / "broken"
    run_dir = interrupted_run(monkeypatch, *smoke_args(trace_dir, broken, "--method", "upcycle"), at_stage=2)
    assert run_cli("run", "--resume", run_dir, "--no-progress") == 0
    resumed = json.loads((run_dir / "run.json").read_text())
    assert resumed["status"] == "complete"
    assert resumed["matrix"] == expected["matrix"]
    assert resumed["params"] == expected["params"]
    rows = lambda d: [(r["lm"], r["lb"]) for r in results.read_jsonl(d / "metrics.jsonl")]
    assert rows(run_dir) == rows(only_run(straight))
