"""Intervals of a run from its predictions (cl_bench/metrics/intervals.py) and the
paired comparison of runs (cl_bench/report/compare.py, `cl-bench compare`)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from cl_bench.report.compare import compare, differences, format_comparison
from cl_bench.metrics.intervals import ItemTable, replicates, run_intervals
from cl_bench.metrics.cl import SUMMARIES, summarise
from cl_bench.record.schema import RunRecord
from helpers import make_record, run_cli, write_run



SCORES = {(-1, 0): [0, 0, 0, 0], (-1, 1): [0, 100, 0, 0],
          (0, 0): [100, 100, 0, 100], (0, 1): [100, 0, 0, 0],
          (1, 0): [0, 100, 0, 0], (1, 1): [100, 100, 100, 0]}


def test_point_estimates_match_the_record_summary():
    record, preds = make_record(SCORES)
    iv = run_intervals(RunRecord.from_json(record), preds, resamples=200)
    expected = summarise(record["matrix"], record["zero_shot"])
    for key, value in expected.items():
        assert iv["summary"][key] == pytest.approx(value)
    assert iv["summary"]["bwt"] == pytest.approx(25.0 - 75.0)
    assert iv["n_items"] == [4, 4] and iv["resamples"] == 200
    lo, hi = iv["summary_ci"]["bwt"]
    assert lo <= -50.0 <= hi
    for row, cis in zip(record["matrix"], iv["matrix_ci"]):
        for v, ci in zip(row, cis):
            assert (v is None) == (ci is None)
            assert v is None or ci[0] <= v <= ci[1]
    # stage 1: the wrong answers "x" have neither form; stage 0's "8" and "B" have
    assert iv["form_share"] == [[1.0, 1.0], [0.25, 0.75]]
    assert iv["summary"]["bwt_format"] + iv["summary"]["bwt_content"] == pytest.approx(-50.0)


def test_the_summary_table_lists_every_summary_of_a_run_once():
    """cl_bench/metrics/cl.py's table holds exactly the summaries computed from a run
    (summarise's and bwt_split's parts), in their order, each under its own label:
    every view (show, compare, the leaderboard, the site) reads its labels there.
    Mutation caught: a summary left out of the table (or two sharing a label)."""
    record, preds = make_record(SCORES)
    iv = run_intervals(RunRecord.from_json(record), preds, resamples=20)
    assert [s.key for s in SUMMARIES] == list(iv["summary"]) == list(iv["summary_ci"])
    assert len({s.label for s in SUMMARIES}) == len(SUMMARIES)


def test_resamples_are_paired_across_stages():
    """A task whose items score the same at every stage has BWT exactly 0 in every
    replicate. Unpaired draws (a fresh draw per stage) would spread it."""
    same = {(0, 0): [100, 0, 100, 0], (0, 1): [0, 0, 100, 100],
            (1, 0): [100, 0, 100, 0], (1, 1): [100, 100, 0, 0]}
    record, preds = make_record(same)
    reps = replicates(ItemTable.from_run(RunRecord.from_json(record), preds), resamples=300)
    assert np.all(reps["bwt"] == 0.0)


def test_items_scored_differently_across_stages_are_refused():
    record, preds = make_record(SCORES)
    preds = [p for p in preds if not (p["stage"] == 1 and p["task"] == "C-STANCE" and p["index"] == 3)]
    with pytest.raises(ValueError, match="C-STANCE"):
        ItemTable.from_run(RunRecord.from_json(record), preds)




def test_compare_gives_paired_differences(tmp_path, capsys):
    forgets = {(0, 0): [100] * 8, (0, 1): [100] * 4 + [0] * 4, (1, 0): [0] * 8, (1, 1): [100] * 8}
    keeps = {**forgets, (1, 0): [100] * 6 + [0] * 2}  # keeps task 0: BWT -100 -> -25
    a = write_run(tmp_path / "a", *make_record(forgets, n_test=8))
    b = write_run(tmp_path / "b", *make_record(keeps, n_test=8))
    result = compare([a, b], resamples=500)
    (comp,) = result["comparisons"]
    bwt = comp["summaries"]["bwt"]
    assert bwt["diff"] == pytest.approx(75.0) and bwt["run"] == pytest.approx(-25.0)
    assert bwt["ci"][0] > 0 and bwt["p"] < 0.05
    assert comp["summaries"]["stage_acc"]["diff"] == pytest.approx(18.75)
    first, second = (comp["tasks"][t] for t in make_record(forgets)[0]["tasks"])  # final scores per task
    assert (first["run"], first["baseline"], first["diff"]) == (75.0, 0.0, 75.0) and first["ci"][0] > 0
    assert second["diff"] == 0.0 and second["ci"] == (0.0, 0.0) and second["p"] == 1.0
    same = compare([a, a], resamples=100)["comparisons"][0]["summaries"]["last_acc"]
    assert same["ci"] == (0.0, 0.0) and same["p"] == 1.0 and same["diff"] == 0.0
    assert "not distinguishable" in format_comparison(compare([a, a], resamples=100))
    assert run_cli("compare", a, b, "--format", "json", "--resamples", "100", "--output", tmp_path / "c.json") == 0
    assert json.loads(capsys.readouterr().out)["comparisons"][0]["method"] == "seqft"
    saved = json.loads((tmp_path / "c.json").read_text())
    assert saved["command"].startswith("cl-bench compare") and saved["comparisons"][0]["method"] == "seqft"


@pytest.mark.parametrize("change, message", [
    (lambda r: r.update(tasks=["NumGLUE-cm", "FOMC"]), "tasks"),
    (lambda r: r["data"]["C-STANCE"]["test"].update(indices=[9, 8, 7, 6]), "C-STANCE: the test items differ (seed"),
    (lambda r: r["data"]["C-STANCE"]["test"].update(indices=[0, 1]), "C-STANCE: the test items differ (4 vs 2 items)"),
    (lambda r: r["config"]["train"].update(batch_size=8), "train.batch_size: 4 vs 8"),
    (lambda r: r["config"].update(model="smollm2-135m"), "model"),
    (lambda r: r.update(backend={"name": "torch", "precision": {"train": "bf16", "eval": "bf16"}}),
     "precision: fp32 vs bf16"),
    (lambda r: r.update(backend={"name": "torch", "generator": "vllm"}), "generator: hf vs vllm"),
])
def test_compare_refuses_runs_that_differ_and_says_how(tmp_path, capsys, change, message):
    a_rec, a_preds = make_record(SCORES)
    b_rec, b_preds = make_record(SCORES)
    change(b_rec)
    assert any(message in d for d in differences(RunRecord.from_json(a_rec), RunRecord.from_json(b_rec)))
    a = write_run(tmp_path / "a", a_rec, a_preds)
    b = write_run(tmp_path / "b", b_rec, b_preds)
    assert run_cli("compare", a, b) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "not comparable" in err and message in err


def test_bwt_format_and_content_are_each_the_hand_value():
    """Catches: BWT's format and content parts swapped where the summaries are
    assembled (intervals._summaries); their sum, checked above, is the same.

    SCORES, task 0: R[0][0] = 75 with every answer well formed (F = 1, C = 75);
    R[1][0] = 25 with one answer in four well formed (F = 0.25, C = 25 / 0.25 =
    100). format = (0.25 - 1)·(100 + 75)/2 = -65.625; content = BWT - format
    = -50 + 65.625 = 15.625 (one earlier task: no averaging)."""
    record, preds = make_record(SCORES)
    iv = run_intervals(RunRecord.from_json(record), preds, resamples=50)
    assert iv["summary"]["bwt_format"] == pytest.approx(-65.625)
    assert iv["summary"]["bwt_content"] == pytest.approx(15.625)
    lo, hi = iv["summary_ci"]["bwt_format"]
    assert lo <= -65.625 <= hi


# Two runs over 10 items per task whose last-stage item scores vary and are
# correlated: the second differs from the first on three last-stage items only.
VARIED = {(0, 0): [100] * 7 + [0] * 3, (0, 1): [0, 100] * 5,
          (1, 0): [100, 0, 100, 100, 0, 0, 100, 0, 100, 0], (1, 1): [100, 100, 0, 100, 0, 100, 0, 0, 100, 100]}
VARIED_B = {**VARIED, (1, 0): [100, 100, 100, 100, 0, 100, 100, 0, 100, 0],
            (1, 1): [100, 100, 0, 100, 0, 100, 100, 0, 100, 100]}


def test_a_run_compared_with_itself_on_varying_items_differs_by_exactly_zero(tmp_path):
    """Catches: the baseline's replicates unpaired from the run's (permuted, or
    drawn with another seed): a run against itself then gets a spread interval.

    The items vary (each summary's own interval is wide), yet every summary's
    difference with itself is 0 in every replicate: interval (0, 0), p = 1."""
    record, preds = make_record(VARIED, n_test=10)
    a = write_run(tmp_path / "a", record, preds)
    own = run_intervals(RunRecord.from_json(record), preds, resamples=200)
    assert own["summary_ci"]["last_acc"][1] - own["summary_ci"]["last_acc"][0] > 10
    rows = compare([a, a], resamples=200)["comparisons"][0]["summaries"]
    assert {"last_acc", "stage_acc", "bwt", "forgetting"} <= rows.keys()
    for name, r in rows.items():
        assert r["diff"] == 0.0 and r["ci"] == (0.0, 0.0) and r["p"] == 1.0, name


def test_compare_interval_is_the_hand_paired_difference_and_narrower_than_unpaired(tmp_path):
    """Catches: the pairing of compare's bootstrap lost (the baseline's replicates
    permuted or drawn with another seed).

    Last Acc's difference, by hand: replicate r draws items idx_j[r] of each task j
    (bootstrap.draws, seed intervals.SEED) and is mean_j mean_i (b - a)[1][j][idx_j[r, i]];
    compare's interval is the percentile interval of those. Two independent draws,
    one per run, give a wider interval: the runs' item scores are correlated."""
    from cl_bench.metrics.intervals import SEED
    from cl_bench.metrics import bootstrap

    a = write_run(tmp_path / "a", *make_record(VARIED, n_test=10))
    b = write_run(tmp_path / "b", *make_record(VARIED_B, n_test=10))
    B = 400
    got = compare([a, b], resamples=B)["comparisons"][0]["summaries"]["last_acc"]
    sa = [np.array(VARIED[1, j], float) for j in range(2)]
    sb = [np.array(VARIED_B[1, j], float) for j in range(2)]
    idx = bootstrap.draws([10, 10], B, SEED)
    paired = np.mean([(sb[j] - sa[j])[idx[j]].mean(axis=1) for j in range(2)], axis=0)  # (B,)
    assert got["diff"] == pytest.approx(15.0)  # ((70 - 50) + (70 - 60)) / 2
    assert got["ci"] == pytest.approx(tuple(np.percentile(paired, [2.5, 97.5])))
    other = bootstrap.draws([10, 10], B, SEED + 1)
    unpaired = (np.mean([sb[j][idx[j]].mean(axis=1) for j in range(2)], axis=0)
                - np.mean([sa[j][other[j]].mean(axis=1) for j in range(2)], axis=0))
    lo, hi = np.percentile(unpaired, [2.5, 97.5])
    assert got["ci"][1] - got["ci"][0] < 0.6 * (hi - lo)
