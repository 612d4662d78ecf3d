"""End-to-end runs on the tiny model: the record, resume, the reference rows."""
from __future__ import annotations

import json

import pytest

from cl_bench.record import io as results
from helpers import SMOKE_TASKS, interrupted_run, only_run, run_cli, smoke_args

pytestmark = pytest.mark.slow  # every test here is an end-to-end run

REQUIRED = ["schema_version", "method", "method_args", "model", "tasks", "matrix", "summary",
            "params", "config", "seed", "timing", "versions", "git_commit"]




def test_smoke_run_writes_a_complete_record(trace_dir, tmp_path, capsys):
    out = tmp_path / "runs"
    assert run_cli(*smoke_args(trace_dir, out)) == 0
    run_dir = only_run(out)
    record = json.loads((run_dir / "run.json").read_text())
    for key in REQUIRED:
        assert key in record, key
    assert record["status"] == "complete"
    assert record["tasks"] == SMOKE_TASKS
    # lower-triangular: task j is scored after every stage b >= j, never before
    for b, row in enumerate(record["matrix"]):
        assert [v is not None for v in row] == [j <= b for j in range(3)]
    assert set(record["summary"]) >= {"last_acc", "stage_acc", "bwt"}
    assert record["summary"]["last_acc"] == pytest.approx(sum(record["matrix"][-1]) / 3)
    assert len(record["params"]) == 3 and record["params"][0]["trainable"] == record["params"][0]["total"]
    predictions = results.read_jsonl(run_dir / "predictions.jsonl")
    assert len(predictions) == 4 * (1 + 2 + 3)  # n_test=4, tasks seen after each stage
    assert {"stage", "task", "prompt", "prediction", "answer", "score"} <= set(predictions[0])
    assert not (run_dir / "checkpoint").exists()  # removed once complete
    shown = capsys.readouterr().out
    assert str(run_dir / "run.json") in shown and "Last Acc" in shown
    assert run_cli("show", run_dir) == 0
    assert capsys.readouterr().out.strip() in shown  # the same screen, from the record


def test_training_lowers_the_loss(trace_dir, tmp_path):
    out = tmp_path / "runs"
    assert run_cli(*smoke_args(trace_dir, out, "--set", "train.epochs=8", "--order", "NumGLUE-cm")) == 0
    losses = [r["lm"] for r in results.read_jsonl(only_run(out) / "metrics.jsonl")]
    assert len(losses) == 8 * 2  # 8 examples / batch 4 = 2 steps per epoch
    assert sum(losses[-2:]) < 0.8 * sum(losses[:2])


def test_interrupted_run_resumes_to_the_same_matrix(trace_dir, tmp_path, monkeypatch):
    straight = tmp_path / "straight"
    assert run_cli(*smoke_args(trace_dir, straight)) == 0
    expected = json.loads((only_run(straight) / "run.json").read_text())

    broken = tmp_path / "broken"  # Ctrl-C while stage 2 trains
    run_dir = interrupted_run(monkeypatch, *smoke_args(trace_dir, broken), at_stage=1)
    partial = json.loads((run_dir / "run.json").read_text())
    assert partial["status"] == "interrupted" and partial["stages_done"] == 1
    assert partial["matrix"][0] == expected["matrix"][0]
    assert partial["matrix"][1] == partial["matrix"][2] == [None, None, None]
    assert (run_dir / "checkpoint" / "state.pt").exists()

    assert run_cli("run", "--resume", run_dir, "--no-progress") == 0
    resumed = json.loads((run_dir / "run.json").read_text())
    assert resumed["status"] == "complete" and "error" not in resumed  # the interrupt's error is gone
    assert resumed["matrix"] == expected["matrix"]
    assert len({v for row in expected["matrix"] for v in row if v is not None}) > 1  # not trivial
    losses = lambda d: [r["lm"] for r in results.read_jsonl(d / "metrics.jsonl")]
    assert losses(run_dir) == losses(only_run(straight))
    preds = lambda d: [r["prediction"] for r in results.read_jsonl(d / "predictions.jsonl")]
    assert preds(run_dir) == preds(only_run(straight))


def test_killed_process_resumes_to_the_same_matrix(trace_dir, tmp_path):
    """SIGKILL (no handler runs) once stage 1's checkpoint exists, then --resume."""
    import os
    import signal
    import subprocess
    import sys
    import time

    slow = ["--set", "train.epochs=20"]  # stages of a few seconds (as test_signals.py LONG), so the kill lands mid-run
    cli = [sys.executable, "-m", "cl_bench.cli"]
    straight = tmp_path / "straight"
    assert run_cli(*smoke_args(trace_dir, straight, *slow)) == 0
    expected = json.loads((only_run(straight) / "run.json").read_text())

    out = tmp_path / "killed"
    proc = subprocess.Popen([*cli, *smoke_args(trace_dir, out, *slow, "--run-id", "k")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    checkpoint = out / "k" / "checkpoint" / "state.pt"
    deadline = time.time() + 120
    while not checkpoint.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    partial = json.loads((out / "k" / "run.json").read_text())
    assert partial["status"] == "running" and partial["stages_done"] < 3  # died mid-run
    assert subprocess.run([*cli, "run", "--resume", out / "k", "--no-progress"],
                          capture_output=True).returncode == 0
    resumed = json.loads((out / "k" / "run.json").read_text())
    assert resumed["status"] == "complete" and resumed["matrix"] == expected["matrix"]
    assert resumed["resumes"][0]["at_stage"] == partial["stages_done"]


def test_resume_of_a_complete_run_is_refused(trace_dir, tmp_path, capsys):
    out = tmp_path / "runs"
    assert run_cli(*smoke_args(trace_dir, out)) == 0
    assert run_cli("run", "--resume", only_run(out)) == 2
    assert "already complete" in capsys.readouterr().err


def test_individual_reference_row_scores_only_the_diagonal(trace_dir, tmp_path):
    out = tmp_path / "runs"
    assert run_cli(*smoke_args(trace_dir, out, "--method", "individual")) == 0
    record = json.loads((only_run(out) / "run.json").read_text())
    assert record["reference"] is True
    for b, row in enumerate(record["matrix"]):
        assert [v is not None for v in row] == [j == b for j in range(3)]
    diagonal = [record["matrix"][j][j] for j in range(3)]
    assert record["summary"]["last_acc"] == pytest.approx(sum(diagonal) / 3)
    assert record["summary"]["bwt"] is None


def test_individual_restarts_from_the_pretrained_weights(trace_dir, tmp_path):
    """Each task of `individual` starts from the pretrained weights with a fresh
    optimiser: its Py150 stage matches a one-task Py150 run step for step."""
    solo = tmp_path / "solo"
    assert run_cli(*smoke_args(trace_dir, solo, "--order", "Py150")) == 0
    out = tmp_path / "ind"
    assert run_cli(*smoke_args(trace_dir, out, "--method", "individual")) == 0
    losses = lambda d, stage: [r["lm"] for r in results.read_jsonl(d / "metrics.jsonl")
                               if r["stage"] == stage]
    assert losses(only_run(out), 1) == pytest.approx(losses(only_run(solo), 0), rel=1e-5)
    seqft = tmp_path / "seq"
    assert run_cli(*smoke_args(trace_dir, seqft)) == 0
    assert losses(only_run(seqft), 1) != pytest.approx(losses(only_run(solo), 0), rel=1e-5)


def test_multitask_reference_trains_once_and_scores_all(trace_dir, tmp_path):
    out = tmp_path / "runs"
    assert run_cli(*smoke_args(trace_dir, out, "--method", "multitask")) == 0
    record = json.loads((only_run(out) / "run.json").read_text())
    assert len(record["matrix"]) == 1 and None not in record["matrix"][0]
    assert record["stages"][0]["tasks"] == SMOKE_TASKS
    assert record["timing"]["stages"][0]["steps"] == 3 * 8 // 4
    assert record["summary"]["bwt"] is None


def test_eval_all_adds_zero_shot_row_and_fwt(trace_dir, tmp_path):
    out = tmp_path / "runs"
    assert run_cli(*smoke_args(trace_dir, out, "--eval-all")) == 0
    record = json.loads((only_run(out) / "run.json").read_text())
    assert len(record["zero_shot"]) == 3
    assert all(v is not None for row in record["matrix"] for v in row)
    assert record["summary"]["fwt"] is not None


def test_leaderboard_command_reads_real_runs(trace_dir, tmp_path, capsys):
    out = tmp_path / "runs"
    for method in ("seqft", "replay"):
        assert run_cli(*smoke_args(trace_dir, out, "--method", method)) == 0
    capsys.readouterr()
    readme = tmp_path / "README.md"
    readme.write_text("# x\n<!-- leaderboard:begin -->\nold\n<!-- leaderboard:end -->\n")
    assert run_cli("leaderboard", "--runs", out, "--update-readme", readme) == 0
    shown = capsys.readouterr().out
    assert "| seqft" in shown and "| replay" in shown
    assert "old" not in readme.read_text() and "| replay" in readme.read_text()
    assert run_cli("leaderboard", "--runs", out, "--format", "csv") == 0
    assert capsys.readouterr().out.startswith("Method,Args,Model")
