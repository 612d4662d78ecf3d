"""`cl-bench perf --benchmark` (cl_bench/tools/perf/data.py): the tasks a measurement
reads come through the benchmark registry, TRACE where none is named; a benchmark
other than TRACE needs --task (the defaults name TRACE's tasks), a synthetic
measurement refuses it, an unknown one is one line, and the result names it.

Mutations caught: perf reading TRACE's loader whatever --benchmark says (the folder's
task is not TRACE's: the harness fails); the check for --task dropped (TRACE's
NumGLUE-ds asked of another benchmark, failing deep in the loader, not in one line);
the result not naming the benchmark."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from helpers import run_cli

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from test_benchmarks import own_folder  # noqa: E402


def one_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


def test_harness_reads_the_benchmark_it_is_given(tmp_path):
    folder = own_folder(tmp_path / "mine")
    out = tmp_path / "harness.json"
    assert run_cli("perf", "harness", "--model", "tiny-llama", "--n", "4", "--repeats", "1", "--benchmark", folder,
                   "--task", "Add", "--output", out) == 0
    result = json.loads(out.read_text())
    assert result["benchmark"] == "toy" and result["method"] == "seqft"


@pytest.mark.parametrize("argv, says", [
    (["harness", "--benchmark", "long-sequence"], ["perf harness --benchmark long-sequence: give --task",
                                                   "CB", "COPA"]),
    (["moe", "--benchmark", "long-sequence"], ["perf moe reads no benchmark", "drop --benchmark long-sequence"]),
    (["harness", "--benchmark", "long-sequense", "--task", "CB"], ["unknown benchmark 'long-sequense'",
                                                                   "did you mean 'long-sequence'"]),
])
def test_a_measurement_another_benchmark_cannot_take_is_refused_in_one_line(argv, says, capsys):
    assert run_cli("perf", *argv, "--model", "tiny-llama") == 2
    err = one_line(capsys)
    assert all(s in err for s in says), err
