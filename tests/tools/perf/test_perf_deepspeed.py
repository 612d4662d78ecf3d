"""`cl-bench perf deepspeed` (cl_bench/tools/perf/zero_cost.py): a method's stage on the
deepspeed backend against the torch backend, at each rank count of --ranks; the
record's shape, ratios of the medians, and each rank's state memory."""
from __future__ import annotations

import json
import os
import statistics
from pathlib import Path

import pytest

from cl_bench.tools.perf import zero_cost
from helpers import make_trace, run_cli

SIDES = ("torch", "deepspeed")


def test_ratios_are_those_of_the_medians_over_repeats():
    """Mutations caught: the median of the per-repeat ratios (1.0 here), the ratio of
    the means (0.69), a ratio torch / deepspeed."""
    runs = {"torch": {"step_s": [1.0, 2.0, 10.0], "mean_step_s": [2.0, 2.0, 2.0]},
            "deepspeed": {"step_s": [3.0, 2.0, 4.0], "mean_step_s": [1.0, 5.0, 3.0]}}
    out = zero_cost.summarise(runs)
    assert out["median"]["torch"]["step_s"] == 2.0 and out["median"]["deepspeed"]["step_s"] == 3.0
    assert out["step_s_ratio"] == 1.5 and out["mean_step_s_ratio"] == 1.5
    memory = {"torch": {"total": 400}, "deepspeed": {"0": {"total": 300}, "1": {"total": 100}}}
    assert zero_cost.memory_ratios(memory) == {"0": 0.75, "1": 0.25}


def test_the_launcher_gets_n_spelled_in_full():
    """DeepSpeed's launcher reads `--n` as an ambiguous abbreviation of its own options."""
    assert zero_cost.launch_argv(["perf", "deepspeed", "--n", "8", "--n=4", "--name", "x"]) == [
        "perf", "deepspeed", "--items", "8", "--items=4", "--name", "x"]


def test_bad_rank_counts_fail_in_one_line(trace_dir, capsys):
    assert run_cli("perf", "deepspeed", "--model", "tiny-llama", "--ranks", "2,0", "--data-dir", trace_dir) == 2
    assert capsys.readouterr().err.strip() == ("error: --ranks 2,0: give distinct rank counts of at least 1, "
                                               "comma-separated (e.g. 1,2)")


def _check_part(part: dict, repeats: int) -> None:
    """Medians of the repeats, and the ratios of those medians. Mutations caught (one rank,
    checked): the ratio of the means; the median of the per-repeat ratios."""
    for side in SIDES:
        for key, values in part["runs"][side].items():
            assert len(values) == repeats and part["median"][side][key] == statistics.median(values)
    for key in ("step_s", "mean_step_s"):
        assert part[f"{key}_ratio"] == part["median"]["deepspeed"][key] / part["median"]["torch"][key]
    memory = part["memory"]
    for rank, m in memory["deepspeed"].items():
        assert m["total"] == sum(m[k] for k in zero_cost.MEMORY_KINDS) > 0 and m["rss_mb"] > 0
        assert part["memory_ratio"][rank] == m["total"] / memory["torch"]["total"]
    assert sorted(memory["deepspeed"]) == [str(r) for r in range(part["world_size"])]
    assert memory["torch"]["fp32_masters"] == 0
    for point in ("start", "end"):
        assert len(part["machine"][point]["loadavg"]) == 3 and part["machine"][point]["logical_cores"] >= 1


def _record(trace, out: Path, *extra) -> dict:
    """3 repeats: their median is not their mean (the check of the ratios then tells the two apart)."""
    assert run_cli("perf", "deepspeed", "--model", "tiny-llama", "--task", "Py150,NumGLUE-cm", "--n", "24",
                   "--repeats", "3", "--data-dir", trace, "--output", out, *extra) == 0
    return json.loads(out.read_text())


@pytest.mark.slow
def test_one_rank_in_this_process_against_the_torch_backend(tmp_path):
    """ewc's stage 1 (stage 0's hooks run: the Fisher and the anchor weights exist):
    3 steps of 8 examples; its method state is F and theta*, two copies of the weights,
    held whole by the rank as by the torch process."""
    trace = make_trace(tmp_path / "trace", n_train=24)
    record = _record(trace, tmp_path / "ds.json", "--method", "ewc")
    assert record["command"].startswith("cl-bench perf deepspeed --model tiny-llama")
    assert (record["method"], record["tasks"], record["timed_stage"], record["steps"], record["zero"],
            record["precision"], record["bf16"]) == ("ewc", ["Py150", "NumGLUE-cm"], "NumGLUE-cm", 3, 2,
                                                     "fp32", False)
    assert list(record["ranks"]) == ["1"]
    part = record["ranks"]["1"]
    _check_part(part, 3)
    torch_m, ds_m = part["memory"]["torch"], part["memory"]["deepspeed"]["0"]
    weights = torch_m["weights"]
    assert torch_m["method_state"] == ds_m["method_state"] >= 2 * weights
    assert ds_m["weights"] == weights and ds_m["fp32_masters"] == weights  # one rank: the whole flat partition
    assert ds_m["optimiser_state"] >= 2 * weights  # Adam's two moments


@pytest.mark.slow
@pytest.mark.xdist_group("deepspeed-ranks")
def test_two_ranks_are_launched_and_each_holds_half_the_partitions(tmp_path, monkeypatch):
    """--ranks 1,2 at ZeRO-2: the 2-rank part comes from a launch (rank 0's file), each
    rank holds every weight but half of the fp32 masters and of Adam's moments."""
    here = Path(__file__).parents  # this checkout's cl_bench and tests, for the launched ranks
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(map(str, (here[2], here[3]))))
    monkeypatch.setenv("CL_BENCH_DIST_TIMEOUT_MIN", "3")
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    trace = make_trace(tmp_path / "trace", n_train=24)
    record = _record(trace, tmp_path / "ds.json", "--ranks", "2,1")
    assert record["method"] == "seqft" and list(record["ranks"]) == ["2", "1"]
    for n, part in record["ranks"].items():
        assert part["world_size"] == int(n)
        _check_part(part, 3)
    one, two = record["ranks"]["1"]["memory"]["deepspeed"]["0"], record["ranks"]["2"]["memory"]["deepspeed"]
    for m in two.values():
        assert m["weights"] == one["weights"]
        assert abs(m["fp32_masters"] - one["fp32_masters"] / 2) <= 64 * 4  # ZeRO-2's alignment padding
        assert abs(m["optimiser_state"] - one["optimiser_state"] / 2) <= 2 * 64 * 4 + 8
