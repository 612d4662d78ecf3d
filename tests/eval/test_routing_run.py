"""The routing-drift probe inside a run: recorded per stage, kept across an
interrupt and --resume, drawn by `cl-bench analyze`; and the per-step metric
logger (--log) fed from the step loop."""
from __future__ import annotations

import json

import pytest

from helpers import interrupted_run, only_run, run_cli, smoke_args

pytestmark = pytest.mark.slow


def routing(run_dir):
    return json.loads((run_dir / "run.json").read_text())["probes"]["routing"]


def test_an_upcycle_run_records_routing_drift_of_earlier_tasks(trace_dir, tmp_path):
    out = tmp_path / "runs"
    assert run_cli(*smoke_args(trace_dir, out, "--method", "upcycle", "--set", "eval.routing_probe=2")) == 0
    run_dir = only_run(out)
    by_stage = routing(run_dir)
    assert sorted(by_stage) == ["0", "1", "2"]
    first, second, third = (by_stage[s] for s in ("0", "1", "2"))
    assert list(first) == ["NumGLUE-cm"] and "js" not in first["NumGLUE-cm"]  # the reference
    assert set(third) == {"NumGLUE-cm", "Py150", "20Minuten"}
    js = third["NumGLUE-cm"]["js"]
    assert len(js) == len(third["NumGLUE-cm"]["shares"]) and all(0 <= v <= 1 for v in js)
    # upcycle adds a group per task: the earlier task's tokens move to experts it never had
    assert len(third["NumGLUE-cm"]["shares"][0]) == 3 * len(first["NumGLUE-cm"]["shares"][0])
    assert max(js) > 0
    assert run_cli("analyze", run_dir) == 0
    assert (run_dir / "routing.png").stat().st_size > 0


@pytest.mark.parametrize("method", ["same", "care"])
def test_runs_that_route_per_sequence_record_routing_drift(trace_dir, tmp_path, method):
    """SAME's routed linears and CaRE's layers weight experts per sequence: the
    probe records their mean weights (shares summing to 1) and, from the stage
    after a task, their JS. Mutation caught: the probe seeing token routers only."""
    out = tmp_path / "runs"
    assert run_cli(*smoke_args(trace_dir, out, "--method", method, "--set", "eval.routing_probe=2")) == 0
    by_stage = routing(only_run(out))
    assert sorted(by_stage) == ["0", "1", "2"]
    first = by_stage["2"]["NumGLUE-cm"]
    assert first["shares"] and all(sum(layer) == pytest.approx(1, abs=1e-4) for layer in first["shares"])
    assert len(first["js"]) == len(first["shares"]) and all(0 <= v <= 1 for v in first["js"])


def test_a_dense_run_records_no_routing(trace_dir, tmp_path):
    out = tmp_path / "runs"
    assert run_cli(*smoke_args(trace_dir, out, "--set", "eval.routing_probe=2")) == 0
    record = json.loads((only_run(out) / "run.json").read_text())
    assert "routing" not in (record.get("probes") or {})


def test_routing_references_survive_an_interrupt(trace_dir, tmp_path, monkeypatch):
    whole = tmp_path / "whole"
    assert run_cli(*smoke_args(trace_dir, whole, "--method", "upcycle", "--set", "eval.routing_probe=2")) == 0
    cut = interrupted_run(monkeypatch, *smoke_args(trace_dir, tmp_path / "cut", "--method", "upcycle",
                                                   "--set", "eval.routing_probe=2"), at_stage=2)
    assert run_cli("run", "--resume", cut, "--no-progress") == 0
    assert routing(cut) == routing(only_run(whole))  # JS against the references of the first process


def test_log_tensorboard_writes_every_step_with_a_run_wide_step(trace_dir, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "runs"
    assert run_cli(*smoke_args(trace_dir, out, "--log", "tensorboard")) == 0
    run_dir = only_run(out)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    lm = events.Scalars("lm")
    assert [e.step for e in lm] == list(range(1, len(rows) + 1))  # grows through the stages
    assert [e.value for e in lm] == pytest.approx([r["lm"] for r in rows])
    assert json.loads((run_dir / "run.json").read_text())["config"]["log"] == "tensorboard"
