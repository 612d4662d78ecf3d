"""The leaderboard's forms and winners views (cl_bench/report/leaderboard/forms.py,
winners.py): runs written from hand-set item scores, numbers worked out by hand."""

import pytest

from cl_bench.metrics.cl import summarise
from cl_bench.report.leaderboard import (build_forms_table, build_winners_table, format_forms_table,
                                         load_runs)
from helpers import make_record, write_run


def test_forms_view_splits_each_rows_bwt_into_answer_form_and_content(tmp_path):
    """KEEPS loses half of task 0's answers, each one malformed: BWT -50, all of it
    form (content 0 in every resample: not told from 0). FORGETS loses every
    answer, malformed: the product rule gives half to form (-50), half to content.
    Two seeds of KEEPS pool into one row. Mutations caught: the parts swapped, the
    marks read from the wrong part, the seeds not pooled."""
    forgets = {(0, 0): [100] * 8, (0, 1): [100] * 4 + [0] * 4, (1, 0): [0] * 8, (1, 1): [100] * 8}
    keeps = {**forgets, (1, 0): [100] * 4 + [0] * 4}
    for name, method, scores, seed in (("k1", "lora", keeps, 1), ("k2", "lora", keeps, 2),
                                       ("f", "seqft", forgets, 1)):
        record, preds = make_record(scores, n_test=8, seed=seed)
        record.update(status="complete", run_id=name, method=method, stages_done=2, profile="cpu",
                      model={"id": "tiny-llama", "n_params": 10},
                      summary={"last_acc": 0.0, "stage_acc": 0.0, "bwt": 0.0}, params=[], timing={"total_s": 1})
        write_run(tmp_path / name, record, preds)
    df = build_forms_table(load_runs(tmp_path))
    lora, seqft = (df[df["Method"] == m].iloc[0] for m in ("lora", "seqft"))
    assert lora["Runs"] == 2 and lora["BWT mean"] == pytest.approx(-50.0)
    assert (lora["BWT format mean"], lora["BWT content mean"]) == (pytest.approx(-50.0), pytest.approx(0.0))
    assert (lora["Format ≠ 0"], lora["Content ≠ 0"]) == ("yes", "no")
    assert (seqft["BWT format mean"], seqft["BWT content mean"]) == (pytest.approx(-50.0), pytest.approx(-50.0))
    assert (seqft["Format ≠ 0"], seqft["Content ≠ 0"]) == ("yes", "yes")
    text = format_forms_table(df)
    assert "| lora" in text and "-50.0 ± 0.0 [" in text


def test_winners_view_does_not_rank_on_bwt_a_row_that_learned_nothing(tmp_path):
    """idle scores its zero-shot answers at every stage (Gain 0, BWT 0); learns lifts
    each task from 0 to 100 and then forgets a quarter of task 0 (BWT -25). On BWT
    learns is the best and idle is named as not ranked; on Last Acc idle still is
    ranked. With idle alone, the BWT line stays, naming it, with and without its
    predictions (no interval: the Gain's mean decides). Mutations caught: the Gain
    filter dropped (idle, BWT 0, wins BWT); the line dropped when every row is idle;
    a row without a Gain interval ranked whatever its Gain."""
    half = [100] * 4 + [0] * 4
    idle = {(b, j): half for b in (-1, 0, 1) for j in (0, 1)}
    learns = {(-1, 0): [0] * 8, (-1, 1): [0] * 8, (0, 0): [100] * 8, (0, 1): [0] * 8,
              (1, 0): [100] * 6 + [0] * 2, (1, 1): [100] * 8}
    for name, method, scores in (("idle", "care", idle), ("learns", "seqft", learns)):
        record, preds = make_record(scores, n_test=8)
        record.update(status="complete", run_id=name, method=method, stages_done=2, profile="cpu",
                      model={"id": "tiny-llama", "n_params": 10}, params=[],
                      summary=summarise(record["matrix"], record["zero_shot"]), timing={"total_s": 60})
        write_run(tmp_path / name, record, preds)
    df = build_winners_table(load_runs(tmp_path)).set_index("On")
    assert df.loc["BWT", "Best"] == "seqft" and df.loc["BWT", "Value"].startswith("-25.0 [")
    assert df.loc["BWT", "Not distinguishable from it"].endswith("; not ranked (Gain not above 0): care")
    assert df.loc["Last Acc", "Best"] == "seqft" and "not ranked" not in df.loc["Last Acc", "Not distinguishable from it"]

    (tmp_path / "learns" / "run.json").unlink()  # every row idle: the BWT line says so, Best "–"
    alone = build_winners_table(load_runs(tmp_path)).set_index("On")
    assert alone.loc["BWT", "Best"] == "–" and alone.loc["BWT", "Not distinguishable from it"] == (
        "not ranked (Gain not above 0): care")
    (tmp_path / "idle" / "predictions.jsonl").unlink()  # no interval: its Gain's mean, 0, decides
    alone = build_winners_table(load_runs(tmp_path)).set_index("On")
    assert alone.loc["BWT", "Best"] == "–"


def _winner_runs(runs_dir):
    """a: Last 87.5; b: 81.25 (one item fewer kept than a); c: 50; r: a reference
    scoring 100; x: 100 in another profile."""
    forgets = {(0, 0): [100] * 8, (0, 1): [100] * 4 + [0] * 4, (1, 0): [0] * 8, (1, 1): [100] * 8}
    runs = (("a", "lora", {**forgets, (1, 0): [100] * 6 + [0] * 2}, 50, False),
            ("b", "ewc", {**forgets, (1, 0): [100] * 5 + [0] * 3}, 20, False),
            ("c", "seqft", forgets, 0, False),
            ("r", "individual", {**forgets, (1, 0): [100] * 8}, 0, True),
            ("x", "replay", {**forgets, (1, 0): [100] * 8}, 0, False))  # another profile: its own set
    for name, method, scores, added, reference in runs:
        record, preds = make_record(scores, n_test=8)
        params = [{"stage": 1, "total": 10 + added, "trainable": 1, "active_per_token": 10, "deployed": 10 + added,
                   "experts_per_layer": None}]
        record.update(status="complete", run_id=name, method=method, stages_done=2,
                      profile="cpu-long" if name == "x" else "cpu", reference=reference, model={"id": "tiny-llama", "n_params": 10}, params=params,
                      summary={"last_acc": sum(sum(scores[(1, j)]) / 8 for j in (0, 1)) / 2, "stage_acc": 0.0,
                               "bwt": 0.0}, timing={"total_s": {"a": 600, "b": 60, "c": 120, "r": 1, "x": 1}[name]})
        write_run(runs_dir / name, record, preds)
    return load_runs(runs_dir)


def test_winners_view_names_the_best_row_and_those_not_told_apart_from_it(tmp_path):
    """a: Last 87.5; b: 81.25 (one item fewer kept: not told apart from a); c: 50
    (told apart); a reference row scoring higher is never the best, nor a row of
    another profile. Mutations caught: the best taken by the lowest mean, reference
    rows ranked, tied rows listed without the interval test, the cheapest taken as
    the largest, all profiles ranked together."""
    table = build_winners_table(_winner_runs(tmp_path))
    assert table[table["Runs"].str.startswith("cpu-long")]["Best"].tolist()[0] == "replay"
    df = table[table["Runs"].str.startswith("cpu,")].set_index("On")
    assert df.loc["Last Acc", "Best"] == "lora" and df.loc["Last Acc", "Value"].startswith("87.5 [")
    assert df.loc["Last Acc", "Not distinguishable from it"] == "ewc"
    assert (df.loc["Added (lowest)", "Best"], df.loc["Added (lowest)", "Value"]) == ("seqft", "0")
    assert (df.loc["Wall time (lowest)", "Best"], df.loc["Wall time (lowest)", "Value"]) == ("ewc", "1.0 min")


def test_winners_view_takes_the_lowest_row_where_lower_is_better(tmp_path, monkeypatch):
    """The winners read `higher_is_better` from the summary table: with Last Acc
    declared lower-is-better, the best row is c (50), not a (87.5). Mutation caught:
    the best always taken as the highest mean."""
    from cl_bench.metrics.cl import SUMMARY, Summary
    from cl_bench.report.leaderboard import winners

    lower = Summary("last_acc", SUMMARY["last_acc"].label, higher_is_better=False)
    monkeypatch.setattr(winners, "WINNER_SCORES", (lower,))
    table = build_winners_table(_winner_runs(tmp_path))
    df = table[table["Runs"].str.startswith("cpu,")].set_index("On")
    assert df.loc["Last Acc", "Best"] == "seqft" and df.loc["Last Acc", "Value"].startswith("50.0 [")
