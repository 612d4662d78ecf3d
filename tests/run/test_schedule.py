"""The harness-owned learning-rate schedule (cl_bench/run/schedule.py): the factor, that
the harness applies it to the optimiser every step of a real run, that a method's
declaration is the default the config overrides, and that bad values are refused."""
from __future__ import annotations

import math

import pytest
import torch

from cl_bench.run.schedule import lr_factor
from helpers import only_run, record, run_cli, smoke_args


def test_factor_warms_up_then_holds_or_decays_by_cosine():
    assert [round(lr_factor("cosine", s, 100, 0.03), 4) for s in (0, 1, 2, 3)] == [0.3333, 0.6667, 1.0, 1.0]
    assert lr_factor("cosine", 51, 100, 0.03) == pytest.approx(0.5, abs=0.02)
    assert lr_factor("cosine", 99, 100, 0.03) < 1e-3
    assert lr_factor("cosine", 5, 10, 0.1) == pytest.approx(0.5 * (1 + math.cos(math.pi * 4 / 9)))
    assert lr_factor("cosine", 0, 2, 0.0) == 1.0
    assert [lr_factor("constant", s, 4, 0.5) for s in range(4)] == [0.5, 1.0, 1.0, 1.0]
    assert {lr_factor("constant", s, 7, 0.0) for s in range(7)} == {1.0}


def lrs_of_run(monkeypatch, *argv) -> tuple[list[float], dict]:
    """Run the CLI and return the lr of the first group at every AdamW step, and the record."""
    seen: list[float] = []
    real = torch.optim.AdamW.step

    def step(self, *args, **kwargs):
        seen.append(self.param_groups[0]["lr"])
        return real(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", step)
    assert run_cli(*argv) == 0
    return seen, record(only_run(argv[argv.index("--output-dir") + 1]))


def expected(rec: dict, lr: float) -> list[float]:
    t = rec["config"]["train"]
    return [lr * lr_factor(t["lr_schedule"], s, st["steps"], t["warmup_ratio"])
            for st in rec["timing"]["stages"] for s in range(st["steps"])]


def test_the_harness_runs_the_configured_schedule_every_step(trace_dir, tmp_path, monkeypatch):
    out = tmp_path / "cos"
    seen, rec = lrs_of_run(monkeypatch, *smoke_args(trace_dir, out, "--set", "train.lr_schedule=cosine",
                                                      "--set", "train.warmup_ratio=0.5",
                                                      "--set", "train.batch_size=2"))
    assert (rec["config"]["train"]["lr_schedule"], rec["config"]["train"]["warmup_ratio"]) == ("cosine", 0.5)
    assert all(st["steps"] == 4 for st in rec["timing"]["stages"])  # 8 examples, batch 2
    assert seen == pytest.approx(expected(rec, 1e-3), rel=1e-12)
    assert seen[:4] == pytest.approx([5e-4, 1e-3, 1e-3, 5e-4])  # 4 steps: warm-up over 2, cosine over 2


def test_constant_by_default_and_a_methods_declaration_is_the_default(trace_dir, tmp_path, monkeypatch):
    seen, rec = lrs_of_run(monkeypatch, *smoke_args(trace_dir, tmp_path / "seqft"))
    assert rec["config"]["train"]["lr_schedule"] == "constant" and set(seen) == {1e-3}
    monkeypatch.undo()
    seen, rec = lrs_of_run(monkeypatch, *smoke_args(trace_dir, tmp_path / "care", "--method", "care",
                                                      "--set", "train.batch_size=2"))
    t = rec["config"]["train"]
    assert (t["lr_schedule"], t["warmup_ratio"]) == ("cosine", 0.03)  # CaRE.lr_schedule
    assert seen == pytest.approx(expected(rec, 1e-3), rel=1e-12)
    assert seen[:4] == pytest.approx([1e-3, 1e-3, 7.5e-4, 2.5e-4])  # warm-up ceil(0.12) = 1, cosine over 3
    monkeypatch.undo()
    seen, rec = lrs_of_run(monkeypatch, *smoke_args(trace_dir, tmp_path / "care-const", "--method", "care",
                                                      "--set", "train.lr_schedule=constant",
                                                      "--set", "train.warmup_ratio=0"))
    assert set(seen) == {1e-3}  # the config overrides the method's declaration


@pytest.mark.parametrize("field, value, expect", [
    ("lr_schedule", "cosin", "did you mean 'cosine'"),
    ("warmup_ratio", "1.5", "must be in [0, 1)"),
])
def test_bad_schedule_values_are_one_line_exit_2(trace_dir, tmp_path, capsys, field, value, expect):
    assert run_cli(*smoke_args(trace_dir, tmp_path / "out", "--set", f"train.{field}={value}")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "Traceback" not in "\n".join(err) and f"train.{field}" in err[-1] and expect in err[-1]
