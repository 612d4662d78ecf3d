"""`cl-bench score` (cl_bench/metrics/predictions.py): score predictions made elsewhere; a run's own predictions re-score."""
from __future__ import annotations

import json

import pytest

from helpers import run_cli, smoke_args


def write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_score_prints_one_json_object(tmp_path, capsys):
    f = write(tmp_path / "p.jsonl", [{"prompt": "q", "prediction": " 7 ", "answer": "7"},
                                     {"prompt": "q", "prediction": "8", "answer": "9"}])
    assert run_cli("score", "--task", "NumGLUE-ds", "--predictions", f) == 0
    assert json.loads(capsys.readouterr().out) == {"task": "NumGLUE-ds", "metric": "accuracy",
                                                   "score": 50.0, "n": 2}


def test_score_errors(tmp_path, capsys):
    f = write(tmp_path / "p.jsonl", [{"prompt": "q", "prediction": 7, "answer": "7"}])
    assert run_cli("score", "--task", "NumGLUE-ds", "--predictions", f) == 2
    assert "p.jsonl:1: field 'prediction' must be a string" in capsys.readouterr().err
    (tmp_path / "bad.jsonl").write_text("{not json\n")
    assert run_cli("score", "--task", "NumGLUE-ds", "--predictions", tmp_path / "bad.jsonl") == 2
    assert "bad.jsonl:1: not valid JSON" in capsys.readouterr().err
    assert run_cli("score", "--task", "NumGlue-ds", "--predictions", f) == 2
    assert "NumGLUE-ds" in capsys.readouterr().err


@pytest.mark.slow
def test_rescoring_a_runs_predictions_matches_its_matrix(trace_dir, tmp_path, capsys):
    out = tmp_path / "runs"
    assert run_cli(*smoke_args(trace_dir, out)) == 0
    (run_dir,) = [p.parent for p in out.glob("*/run.json")]
    record = json.loads((run_dir / "run.json").read_text())
    capsys.readouterr()
    for j, task in enumerate(record["tasks"]):  # --stage 3: show's row 3, the matrix's row 2 (0-based)
        assert run_cli("score", "--task", task, "--predictions", run_dir / "predictions.jsonl",
                       "--stage", "3") == 0
        shown = json.loads(capsys.readouterr().out)
        assert shown["score"] == pytest.approx(record["matrix"][2][j])
