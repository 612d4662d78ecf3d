"""The zero-shot row is checkpointed task by task (sequencer._zero_shot_row,
resume.keep_zero_shot): a stop inside it keeps the tasks scored, `--resume`
scores only the rest, and the run ends byte for byte as its uninterrupted twin
(predictions, metrics, matrix, zero-shot row, summary, intervals)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from cl_bench.record import io as results
from cl_bench.run import sequencer
from helpers import interrupted_run, only_run, run_cli, smoke_args

ROOT = Path(__file__).resolve().parents[2]
ZERO_SHOT = ("--set", "eval.zero_shot=true")


def _same_as_twin(run_dir, twin) -> None:
    for name in (results.PREDICTIONS_FILE, results.METRICS_FILE):
        assert (run_dir / name).read_bytes() == (twin / name).read_bytes(), name
    ours, theirs = (json.loads((d / results.RUN_FILE).read_text()) for d in (run_dir, twin))
    for key in ("matrix", "zero_shot", "summary", "intervals", "task_metrics", "params", "status"):
        assert ours[key] == theirs[key], key


def _evaluated(monkeypatch, stop_at: int | None = None) -> list[str]:
    """The tasks evaluate_task is called on, in order; with `stop_at`, a Ctrl-C
    at that call (0-based), before it scores anything."""
    real, calls = sequencer.evaluate_task, []

    def evaluate(model, encoder, task, *args, **kwargs):
        calls.append(task.name)
        if len(calls) - 1 == stop_at:
            raise KeyboardInterrupt
        return real(model, encoder, task, *args, **kwargs)

    monkeypatch.setattr(sequencer, "evaluate_task", evaluate)
    return calls


@pytest.fixture
def twin(trace_dir, tmp_path):
    assert run_cli(*smoke_args(trace_dir, tmp_path / "twin", *ZERO_SHOT)) == 0
    return only_run(tmp_path / "twin")


# kills itself (SIGKILL: nothing is caught) when evaluate_task is called for the KILL_AT-th time (0-based)
_KILLED_RUN = textwrap.dedent("""
    import os, signal, sys
    from cl_bench.run import sequencer
    from cl_bench.cli import main

    real, calls = sequencer.evaluate_task, []

    def evaluate(*args, **kwargs):
        calls.append(1)
        if len(calls) - 1 == int(os.environ["KILL_AT"]):
            os.kill(os.getpid(), signal.SIGKILL)
        return real(*args, **kwargs)

    sequencer.evaluate_task = evaluate
    sys.exit(main(sys.argv[1:]))
""")


@pytest.mark.slow
def test_sigkill_inside_the_zero_shot_row_keeps_what_was_scored(trace_dir, tmp_path, monkeypatch, twin):
    """Mutations caught: the record not written after each zero-shot task (nothing
    kept: zero_shot is null after the kill); resume.keep_zero_shot dropped (the
    resumed run scores NumGLUE-cm's zero-shot again)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "KILL_AT": "2",  # NumGLUE-cm and Py150 scored
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    killed = subprocess.run([sys.executable, "-c", _KILLED_RUN, *smoke_args(trace_dir, tmp_path / "runs", *ZERO_SHOT)],
                            env=env, capture_output=True, text=True, timeout=600)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    run_dir = only_run(tmp_path / "runs")
    record = json.loads((run_dir / results.RUN_FILE).read_text())
    assert record["status"] == "running" and record["stages_done"] == 0
    assert record["zero_shot"][:2] == json.loads((twin / results.RUN_FILE).read_text())["zero_shot"][:2]
    assert record["zero_shot"][2] is None
    kept = results.read_jsonl(run_dir / results.PREDICTIONS_FILE)
    assert {r["task"] for r in kept} == {"NumGLUE-cm", "Py150"} and {r["stage"] for r in kept} == {-1}

    calls = _evaluated(monkeypatch)
    assert run_cli("run", "--resume", run_dir, "--no-progress") == 0
    assert calls[0] == "20Minuten"  # the two scored tasks are not evaluated again
    _same_as_twin(run_dir, twin)


@pytest.mark.slow
def test_a_zero_shot_task_whose_predictions_were_not_written_is_scored_again(trace_dir, tmp_path, monkeypatch,
                                                                           capsys, twin):
    """Ctrl-C says what it keeps. A SIGKILL between the record's write and the predictions' leaves a score whose
    predictions are missing: that task is scored again. Mutation caught: the
    predictions count check in keep_zero_shot dropped (NumGLUE-cm's predictions
    are missing from the finished run)."""
    _evaluated(monkeypatch, stop_at=1)  # Ctrl-C in Py150's zero-shot
    capsys.readouterr()
    assert run_cli(*smoke_args(trace_dir, tmp_path / "runs", *ZERO_SHOT)) == 130
    err = capsys.readouterr().err.strip()
    assert "1 of 3 zero-shot scores are saved; continue with: cl-bench run --resume" in err, err
    run_dir = only_run(tmp_path / "runs")
    results.write_jsonl(run_dir / results.PREDICTIONS_FILE, [])  # as if killed before they were written
    calls = _evaluated(monkeypatch)
    assert run_cli("run", "--resume", run_dir, "--no-progress") == 0
    assert calls[0] == "NumGLUE-cm"
    _same_as_twin(run_dir, twin)


@pytest.mark.slow
def test_a_stop_in_stage_1_keeps_the_whole_zero_shot_row(trace_dir, tmp_path, monkeypatch, twin):
    """No stage checkpoint yet, so the run restarts from stage 1, keeping the row:
    it is not evaluated again, and the run equals its twin (the row's evaluation
    draws no random numbers that stage 1 would miss). Mutation caught: prepare not
    keeping the row on a restart (it is evaluated again first)."""
    run_dir = interrupted_run(monkeypatch, *smoke_args(trace_dir, tmp_path / "runs", *ZERO_SHOT), at_stage=0)
    assert None not in json.loads((run_dir / results.RUN_FILE).read_text())["zero_shot"]
    calls = _evaluated(monkeypatch)
    assert run_cli("run", "--resume", run_dir, "--no-progress") == 0
    # the three stages' evaluations only (the tasks trained so far), no zero-shot row
    assert calls == ["NumGLUE-cm", "NumGLUE-cm", "Py150", "NumGLUE-cm", "Py150", "20Minuten"]
    _same_as_twin(run_dir, twin)
