"""The typed run record (cl_bench/record/schema.py): every committed record loads through
the one reader, old schema versions are read into the current form, what is
written parses back to the same record, and a damaged record fails in one line
naming the file and its schema version."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from cl_bench.errors import UserError
from cl_bench.record.schema import SCHEMA_VERSION, ParamReport, RunRecord, StageTiming, Timing
from cl_bench.record.io import read_finished, read_record

ROOT = Path(__file__).resolve().parents[2]
COMMITTED = sorted((ROOT / "results").rglob("run.json"))  # every schema version cl-bench has written
sys.path.insert(0, str(ROOT / "scripts"))
from smoke_digests import pre_typed_params  # noqa: E402


def minimal(**extra) -> dict:
    return {"schema_version": 1, "method": "seqft", "tasks": ["A", "B"], **extra}


def write(folder: Path, data: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "run.json").write_text(json.dumps(data))
    return folder


@pytest.mark.skipif(not COMMITTED, reason="no committed run records")
@pytest.mark.parametrize("path", COMMITTED, ids=[str(p.parent.relative_to(ROOT)) for p in COMMITTED])
def test_every_committed_record_loads_and_writes_back_the_same_fields(path):
    record = read_record(path.parent)
    assert record.source == path and len(record.params) == len(record.timing.stages) == record.stages_done
    assert all(isinstance(p, ParamReport) for p in record.params)
    assert all(isinstance(s, StageTiming) for s in record.timing.stages)
    original = json.loads(path.read_text())
    written = record.to_json()
    assert written["schema_version"] == SCHEMA_VERSION
    assert all(set(p) == {"stage", "total", "trainable", "active_per_token", "deployed", "experts_per_layer",
                          "expansion_rate", "diagnostics"} for p in written["params"])
    # what the params rows held before (schema 1) is what smoke_digests reconstructs
    back = {**written, "schema_version": original["schema_version"],
            "params": pre_typed_params(written) if original["schema_version"] == 1 else written["params"]}
    assert back == original and list(back) == list(original)  # same fields, same order


def test_a_method_report_keeps_declared_fields_and_puts_the_rest_under_diagnostics():
    report = {"total": 10, "trainable": 4, "active_per_token": 8, "deployed": 10, "experts_per_layer": [2],
              "expansion_rate": 0.5, "decisions": [[1, 0]], "decision_layers": [3]}
    row = ParamReport.from_method(1, report)
    assert (row.stage, row.total, row.expansion_rate, row.experts_per_layer) == (1, 10, 0.5, [2])
    assert row.diagnostics == {"decisions": [[1, 0]], "decision_layers": [3]}
    assert row.to_json() == {"stage": 1, **{k: report[k] for k in list(report)[:6]},
                             "diagnostics": {"decisions": [[1, 0]], "decision_layers": [3]}}
    dense = ParamReport.from_method(0, {"total": 1, "trainable": 1, "active_per_token": 1, "deployed": 1,
                                        "experts_per_layer": None})
    assert dense.expansion_rate is None and dense.diagnostics == {}


def test_a_schema_1_row_reads_its_undeclared_keys_as_diagnostics(tmp_path):
    rows = [{"stage": 0, "total": 5, "expansion_rate": None},
            {"stage": 1, "total": 6, "expansion_rate": 1.0, "decisions": [[1]], "basis_vectors": 8}]
    record = read_record(write(tmp_path / "r", minimal(params=rows, stages_done=2)))
    assert record.schema_version == 1
    assert record.params[1].diagnostics == {"decisions": [[1]], "basis_vectors": 8}
    assert record.params[1].expansion_rate == 1.0 and record.params[0].diagnostics == {}
    assert read_finished(tmp_path / "r").params == record.params


def test_what_is_written_parses_back_to_the_same_record(tmp_path):
    rows = [ParamReport.from_method(0, {"total": 3, "trainable": 3, "active_per_token": 3, "deployed": 3,
                                        "experts_per_layer": None, "spectrum": [1.0, 0.5]})]
    record = RunRecord(run_id="r", status="running", method="seqft", tasks=["A"], matrix=[[50.0]], params=rows,
                       timing=Timing(stages=[StageTiming(0, 1.5, 0.5, 2, 100.0)], total_s=2.0), stages_done=1)
    data = record.to_json()
    assert data["schema_version"] == SCHEMA_VERSION and "error" not in data and "intervals" not in data
    assert data["params"][0]["diagnostics"] == {"spectrum": [1.0, 0.5]}
    assert RunRecord.from_json(json.loads(json.dumps(data)), "x") == record


@pytest.mark.parametrize("data, message", [
    (minimal(params="no"), "field params must be list, found str (schema_version 1)"),
    (minimal(tasks=[1, 2]), "field tasks must be a list of task names (schema_version 1)"),
    ({"schema_version": 1, "tasks": ["A"]}, "missing field method (schema_version 1)"),
    (minimal(stages=[{"index": 0}]), "missing field stages[0].label (schema_version 1)"),
    (minimal(timing={"stages": [{"stage": 0, "train_s": "1"}]}),
     "field timing.stages[0].train_s must be int or float, found str"),
    (minimal(extra_field=1), "unknown field extra_field (schema_version 1)"),
    (minimal(schema_version=2, params=[{"stage": 0, "decisions": [[1]]}]),
     "unknown field params[0].decisions (schema_version 2)"),
    (minimal(reference="yes"), "field reference must be bool, found str"),
    (minimal(seed=True), "field seed must be int, found bool"),
    (minimal(schema_version=SCHEMA_VERSION + 1), f"schema_version {SCHEMA_VERSION + 1} is newer"),
])
def test_a_damaged_record_fails_in_one_line_naming_the_file_and_the_version(tmp_path, data, message):
    folder = write(tmp_path / "r", data)
    with pytest.raises(UserError) as err:
        read_record(folder)
    text = str(err.value)
    assert message in text and str(folder / "run.json") in text and "\n" not in text


def test_params_decisions_reads_a_schema_2_record_by_the_one_reader(tmp_path):
    from cl_bench.models.params import load_decisions

    maps = [[[1, 0]], [[0, 1]]]
    rows = [{"stage": 0, "diagnostics": {}}] + [{"stage": b + 1, "diagnostics": {"decisions": m}}
                                                 for b, m in enumerate(maps)]
    folder = write(tmp_path / "r", minimal(schema_version=2, params=rows))
    assert load_decisions(folder) == load_decisions(folder / "run.json") == [None, *maps]
    write(tmp_path / "dense", minimal(schema_version=2, params=rows[:1] * 2))
    with pytest.raises(UserError, match="stages without decisions"):
        load_decisions(tmp_path / "dense")
