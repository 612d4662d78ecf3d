"""`cl-bench perf` takes the method it times from --method (cl_bench/perf/)."""
from __future__ import annotations

import json

from conftest import run_cli


def _harness(trace_dir, tmp_path, *extra) -> dict:
    out = tmp_path / f"harness{len(extra)}.json"
    assert run_cli("perf", "harness", "--model", "tiny-llama", "--n", "4", "--repeats", "1",
                   "--data-dir", trace_dir, "--task", "NumGLUE-cm", "--output", out, *extra) == 0
    return json.loads(out.read_text())


def test_harness_times_the_method_it_is_given(trace_dir, tmp_path):
    """Mutation caught: --method ignored (the baseline timed whatever was asked)."""
    full, lora = _harness(trace_dir, tmp_path), _harness(trace_dir, tmp_path, "--method", "lora")
    assert full["method"] == "seqft" and lora["method"] == "lora"
    assert 0 < lora["trainable_params"] < full["trainable_params"] / 10
    assert lora["median_ratio"] > 0 and len(lora["harness_s"]) == 1


def test_an_unknown_method_fails_in_one_line(trace_dir, tmp_path, capsys):
    assert run_cli("perf", "harness", "--model", "tiny-llama", "--method", "LoRA", "--data-dir", trace_dir) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "lora" in err
