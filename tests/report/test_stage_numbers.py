"""One stage numbering for what a user reads and types (issue 51, item 3): stages count
from 1 as `show` and the site number them, 0 is the zero-shot row; the files keep their
0-based `stage` (cl_bench/record/io.stage_number). Mutation caught by each test: the
conversion at the boundary dropped or doubled (`score --stage 2` scoring the file's
stage 2, show's row 3; `params` printing the record's 0-based index)."""
from __future__ import annotations

import json

import pytest

from cl_bench.models.params import schedule_report
from cl_bench.record.schema import ParamReport, RunRecord
from cl_bench.report.site import views
from helpers import make_record, run_cli, write_run

NUMGLUE = [0, 0, 0, 0], [100, 0, 0, 0], [100, 100, 100, 0]  # zero-shot, after stage 1, after stage 2


@pytest.fixture
def run_dir(tmp_path):
    record, preds = make_record({(-1, 0): NUMGLUE[0], (0, 0): NUMGLUE[1], (1, 0): NUMGLUE[2],
                                 (0, 1): [100] * 4, (1, 1): [0, 100, 100, 100]})
    record["stages"] = [{"index": b, "label": t, "tasks": [t]} for b, t in enumerate(record["tasks"])]
    return write_run(tmp_path / "run", record, preds)


def _show_rows(capsys, run_dir) -> dict[str, str]:
    """The first cell (NumGLUE-cm) of each row of show's matrix, by the row's label."""
    capsys.readouterr()
    assert run_cli("show", run_dir) == 0
    rows = {}
    for line in capsys.readouterr().out.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if line.startswith("|") and len(cells) == 3 and cells[0] not in rows:  # the matrix comes first
            rows[cells[0]] = cells[1].split(" ")[0]
    return rows


@pytest.mark.slow  # show's bootstrap intervals: ~5 s
def test_score_stage_n_scores_shows_row_n(run_dir, capsys):
    shown = _show_rows(capsys, run_dir)
    assert [k for k in shown if k[0].isdigit()] == ["1: NumGLUE-cm", "2: C-STANCE"]
    for number, label in ((0, "zero-shot"), (1, "1: NumGLUE-cm"), (2, "2: C-STANCE")):
        assert run_cli("score", "--task", "NumGLUE-cm", "--predictions", run_dir / "predictions.jsonl",
                       "--stage", str(number)) == 0
        score = json.loads(capsys.readouterr().out)["score"]
        assert f"{score:.1f}" == shown[label], (number, label, score, shown)
    assert [float(shown[k]) for k in ("zero-shot", "1: NumGLUE-cm", "2: C-STANCE")] == [0.0, 25.0, 75.0]


def test_score_refuses_a_stage_the_file_lacks_and_names_stages_as_show_does(run_dir, capsys):
    predictions = run_dir / "predictions.jsonl"
    assert run_cli("score", "--task", "NumGLUE-cm", "--predictions", predictions, "--stage", "3") == 2
    assert "no predictions for task NumGLUE-cm at stage 3" in capsys.readouterr().err
    assert run_cli("score", "--task", "NumGLUE-cm", "--predictions", predictions) == 2
    assert "has predictions of stages 0, 1, 2 (0: zero-shot); pass --stage" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        run_cli("score", "--task", "NumGLUE-cm", "--predictions", predictions, "--stage", "-1")
    assert "stages are numbered from 1" in capsys.readouterr().err


@pytest.mark.slow  # the schedule on tiny-llama: ~5 s
def test_params_prints_the_sites_numbering(capsys):
    """`params` (text and --json) numbers its rows as the run page's parameter table
    numbers a record's params (which keep the 0-based index)."""
    rows = schedule_report("tiny-llama", "upcycle", 3)
    record = RunRecord(method="upcycle", tasks=["A", "B", "C"], params=[ParamReport.from_method(r["stage"], r) for r in rows])
    site = [row["stage"] for row in views.param_rows(record)]
    assert site == [1, 2, 3]
    capsys.readouterr()
    assert run_cli("params", "--model", "tiny-llama", "--method", "upcycle", "--tasks", "3") == 0
    printed = [int(line.split()[0]) for line in capsys.readouterr().out.splitlines()[1:] if line.strip()[0].isdigit()]
    assert printed == site
    assert run_cli("params", "--model", "tiny-llama", "--method", "upcycle", "--tasks", "3", "--json") == 0
    assert [r["stage"] for r in json.loads(capsys.readouterr().out)] == site
