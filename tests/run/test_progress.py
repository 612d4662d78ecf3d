"""cl_bench/run/progress.py: with bars off (a campaign's runs), training and evaluation
still report where they are, as log lines at most every EVERY_S seconds."""
from __future__ import annotations

import logging

from cl_bench.run import progress
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
    with caplog.at_level(logging.INFO, logger="cl_bench.run.progress"):
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
    monkeypatch.setattr(progress, "TICK_S", 0.0)
    trace_dir = make_trace(tmp_path / "trace")
    with caplog.at_level(logging.INFO, logger="cl_bench.run.progress"):
        assert run_cli(*smoke_args(trace_dir, tmp_path / "runs")) == 0
    lines = [r.getMessage() for r in caplog.records if r.name == "cl_bench.run.progress"]
    assert any(" train: " in line and " step (" in line and "left" in line for line in lines), lines
    assert any(" eval: " in line and " ex (" in line for line in lines), lines
    # and inside a batch, before its items are counted: where the batch is (the tiny model
    # stops at EOS at once here; test_decoding_shows... follows the tokens)
    assert any(" eval: 0/" in line and " in; NumGLUE-cm: reading the prompts" in line for line in lines), lines


def test_decoding_shows_where_a_batch_stands_before_it_is_scored(monkeypatch):
    """Within one batch of greedy decoding, the bar says the prompts are read, layer by
    layer, then each token as it is computed, for the task named; nothing after the
    hooks are removed. Mutations caught: no hook (the bar silent until the batch ends,
    as the zero-shot row's first batch was for minutes); no layer hooks (a CPU's reading
    of 16 long prompts alone took 1 min 50 s with nothing moving); tokens not reset at
    a new batch's prompts."""
    import torch

    from cl_bench.eval.generation import greedy_generate
    from cl_bench.models.loading import tiny_llama

    monkeypatch.setattr(progress, "TICK_S", 0.0)
    model, _, _ = tiny_llama(0)
    shown = []
    bar = type("Bar", (), {"set_postfix_str": lambda self, text: shown.append(text)})()
    prompts = [[5, 6, 7], [8, 9, 10, 11]]
    with progress.decoding(model, bar) as task:
        task("Py150", 4)
        greedy_generate(model, prompts, 4, eos_id=-1, pad_id=0, batch_size=1)
    n = len(model.model.layers)
    prompts_read = ["Py150: reading the prompts"] + [f"Py150: reading the prompts, layer {i}/{n}" for i in range(1, n + 1)]
    assert n > 1 and shown == (prompts_read + ["Py150: token 2/4", "Py150: token 3/4", "Py150: token 4/4"]) * 2
    with torch.no_grad():
        model(input_ids=torch.tensor([[5, 6]]))
    assert len(shown) == 2 * (n + 4)


def test_a_terminal_without_width_gets_plain_lines_soon(monkeypatch):
    """A terminal reporting 0 columns cannot draw a bar (tqdm draws nothing there):
    the bar is log lines every NARROW_S seconds instead. A terminal with width keeps
    tqdm; stderr that is no terminal keeps tqdm's own behaviour. Mutation caught: the
    width check removed (a tqdm bar in a 0-column terminal)."""
    import os
    from tqdm import tqdm

    size = {"columns": 0}

    def terminal_size(fd):
        return os.terminal_size((size["columns"], 24))

    monkeypatch.setattr(progress.os, "get_terminal_size", terminal_size)
    narrow = progress.bar(10, "stage 1/3 [Py150] train", "step", show=True, main=True)
    assert isinstance(narrow, progress.LoggedProgress) and narrow.every_s == progress.NARROW_S <= 10
    size["columns"] = 80
    assert isinstance(progress.bar(10, "d", "step", show=True, main=True), tqdm)

    def no_terminal(fd):
        raise OSError("not a terminal")

    monkeypatch.setattr(progress.os, "get_terminal_size", no_terminal)
    assert isinstance(progress.bar(10, "d", "step", show=True, main=True), tqdm)
    assert isinstance(progress.bar(10, "d", "step", show=False, main=True), progress.LoggedProgress)  # bars off
