"""cl_bench/progress.py: with bars off (a campaign's runs), training and evaluation
still report where they are, as log lines at most every EVERY_S seconds."""
from __future__ import annotations

import logging

from cl_bench import progress
from helpers import make_trace, run_cli, smoke_args


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_a_line_at_most_every_interval_with_rate_and_time_left(caplog):
    """A resumed phase (20 of 100 steps done) at 30 s a step: a line once 60 s have
    passed since the last one, its rate over this process's steps only, and none at
    the last step. Mutations caught: a line at every update; the rate over the
    initial steps too (20 steps counted as taken in no time: 7.5 s/step)."""
    clock = Clock()
    bar = progress.LoggedProgress(100, "stage 2/3 [Py150] train", "step", initial=20, every_s=60, clock=clock)
    with caplog.at_level(logging.INFO, logger="cl_bench.progress"):
        for _ in range(80):
            clock.t += 30.0
            bar.set_postfix({"loss": "1.234"})
            bar.update()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 39, lines  # every second step (60 s), not after the 100th
    assert lines[0] == "stage 2/3 [Py150] train: 22/100 step (22%), 30.0 s/step, ~39 min left; loss=1.234"
    assert lines[-1].startswith("stage 2/3 [Py150] train: 98/100 step (98%), 30.0 s/step, ~1 min left")


def test_a_run_without_bars_logs_its_training_and_evaluation(tmp_path, monkeypatch, caplog):
    """`cl-bench run --no-progress` (how a campaign runs each run) logs where each
    stage's training and evaluation stand. Mutation caught: with bars off, the silent
    bar (nothing logged between a stage's start and its end)."""
    monkeypatch.setattr(progress, "EVERY_S", 0.0)
    trace_dir = make_trace(tmp_path / "trace")
    with caplog.at_level(logging.INFO, logger="cl_bench.progress"):
        assert run_cli(*smoke_args(trace_dir, tmp_path / "runs")) == 0
    lines = [r.getMessage() for r in caplog.records if r.name == "cl_bench.progress"]
    assert any(" train: " in line and " step (" in line and "left" in line for line in lines), lines
    assert any(" eval: " in line and " ex (" in line for line in lines), lines
