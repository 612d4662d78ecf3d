"""`leaderboard --view published`: a fake two-task run whose cells TRACE's code scores
differently from cl-bench, numbers worked out by hand."""

import json

import pytest

from cl_bench.report import published
from cl_bench.report.leaderboard import load_runs

pytest.importorskip("rouge", reason="the trace scorers need `rouge` (pip install -e '.[test]')")
pytest.importorskip("fuzzywuzzy", reason="the trace scorers need `fuzzywuzzy` (pip install -e '.[test]')")

TASKS = ["C-STANCE", "NumGLUE-cm"]
# (stage, task, prediction, answer). TRACE compares unstripped: "B" != "B " (cl-bench strips: equal).
ITEMS = [
    (0, "C-STANCE", "A", "A"), (0, "C-STANCE", "B", "B "),   # TRACE R[0][0] = 50 (cl-bench 100)
    (1, "C-STANCE", "C", "A"), (1, "C-STANCE", "B", "B "),   # TRACE R[1][0] = 0  (cl-bench 50)
    (1, "NumGLUE-cm", "3", "3"), (1, "NumGLUE-cm", "", "4"),  # TRACE R[1][1] = 50 (cl-bench 50)
]


def write_run(root, run_id, predictions=True, benchmark="trace"):
    run_dir = root / run_id
    run_dir.mkdir(parents=True)
    record = {
        "schema_version": 1, "run_id": run_id, "status": "complete", "method": "seqft", "method_args": {},
        "benchmark": benchmark,
        "model": {"id": "tiny"}, "profile": "cpu", "tasks": TASKS, "seed": 1,
        "matrix": [[100.0, None], [50.0, 50.0]],  # cl-bench's cells: the view must not use them
        "task_metrics": [{"stage": b, "task": t, "metric": "accuracy", "score": 0.0, "n": 2, "max_new_tokens": 4}
                         for b, t in ((0, TASKS[0]), (1, TASKS[0]),
                                                                                  (1, TASKS[1]))],
        "summary": {"last_acc": 50.0, "stage_acc": 75.0, "bwt": -50.0}, "params": [], "timing": {},
    }
    (run_dir / "run.json").write_text(json.dumps(record))
    if predictions:
        rows = [{"stage": b, "task": t, "index": i % 2, "prompt": "p", "prediction": p, "answer": a, "score": 0.0}
                for i, (b, t, p, a) in enumerate(ITEMS)]
        (run_dir / "predictions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_scores_come_from_the_trace_rescored_cells(tmp_path):
    write_run(tmp_path, "seqft-a")
    (row,) = published.build_table(load_runs(tmp_path)).to_dict("records")
    # OP = (R[1][0] + R[1][1]) / 2 = (0 + 50) / 2 = 25
    assert row["OP [TRACE]"] == pytest.approx(25.0)
    # TreeLoRA: (min(0 - 50, 0) + min(50 - 50, 0)) / T = -50 / 2 = -25
    assert row["BWT [TreeLoRA]"] == pytest.approx(-25.0)
    # TRACE's paper: ((0 - 50) + (50 - 50)) / T = -25 (no gain here to tell it from TreeLoRA's)
    assert row["BWT [TRACE]"] == pytest.approx(-25.0)
    assert row["C-STANCE [TRACE eval]"] == pytest.approx(0.0)
    assert row["NumGLUE-cm [TRACE eval]"] == pytest.approx(50.0)
    # cl-bench's own summary, passed through for comparison
    assert (row["Last Acc [cl-bench]"], row["BWT [cl-bench]"]) == (50.0, -50.0)


def test_a_run_without_predictions_shows_dashes_and_the_sources(tmp_path):
    write_run(tmp_path, "seqft-a")
    write_run(tmp_path, "seqft-b", predictions=False)
    df = published.build_table(load_runs(tmp_path))
    assert df.loc[1, ["OP [TRACE]", "BWT [TRACE]", "BWT [TreeLoRA]", "C-STANCE [TRACE eval]"]].isna().all()
    md = published.format_table(df, "md")
    first, second = md.splitlines()[2], md.splitlines()[3]
    assert " 25.00 |" in first
    assert " -25.00 |" in first and second.count(" – |") == 3 + len(TASKS)  # OP, both BWTs, cells
    assert "ZinYY/TreeLoRA inference/collect_results.py" in md and "BeyonderXX/TRACE metrics.py" in md
    csv = published.format_table(df, "csv")
    assert csv.splitlines()[0].startswith("Run,Method,Profile,Precision,Tasks,OP [TRACE],BWT [TRACE],BWT [TreeLoRA]")
    assert "TreeLoRA inference" not in csv  # raw numbers, no legend


def test_cli_view_published_prints_the_table(tmp_path, capsys):
    from helpers import run_cli

    write_run(tmp_path, "seqft-a")
    assert run_cli("leaderboard", "--runs", tmp_path, "--view", "published", "--format", "csv") == 0
    header, row = capsys.readouterr().out.splitlines()
    assert header.startswith("Run,Method,Profile,Precision,Tasks,OP [TRACE],BWT [TRACE],BWT [TreeLoRA]")
    assert row.startswith("seqft-a,seqft,cpu,") and ",25.0,-25.0,-25.0," in row


def test_runs_of_another_benchmark_are_left_out_and_named(tmp_path, caplog):
    """TRACE's scorers know TRACE's metrics only: a long-sequence run among the runs
    (results/ holds some) is named and left out, not scored into an error. Mutation
    caught: the benchmark filter dropped (its metric is unknown to the trace set)."""
    write_run(tmp_path, "seqft-a")
    write_run(tmp_path, "seqft-long", benchmark="long-sequence")
    record = json.loads((tmp_path / "seqft-long" / "run.json").read_text())
    for m in record["task_metrics"]:
        m["metric"] = "exact_match"  # a long-sequence task's metric: not in TRACE's set
    (tmp_path / "seqft-long" / "run.json").write_text(json.dumps(record))
    with caplog.at_level("WARNING"):
        df = published.build_table(load_runs(tmp_path))
    assert list(df["Run"]) == ["seqft-a"]
    assert "1 run(s) of other benchmarks left out" in caplog.text and "seqft-long" in caplog.text
