"""The leaderboard's winners view: per (benchmark, profile, task order, precision), the best
ranked row on each score and on each cost, and the rows that cannot be told apart from it."""

from __future__ import annotations

import pandas as pd

from cl_bench.benchmark import DEFAULT as DEFAULT_BENCHMARK
from cl_bench.metrics.cl import SUMMARY, summaries
from cl_bench.record.schema import RunRecord
from cl_bench.report.leaderboard.rows import build_rows, distinct, entries, group_replicates
from cl_bench.report.leaderboard.table import MISSING, humanise, method_labels, render, score_cell

WINNER_SCORES = summaries("last_acc", "bwt", "learn_gain")
# A row that did not learn its tasks has nothing to forget: on a summary that `needs_learning`
# (BWT) only the rows whose Gain is above 0 at 95% (without an interval: its mean above 0;
# without a Gain, no zero-shot row, any row) are ranked.
GAIN = SUMMARY["learn_gain"].label


def _learned(df: pd.DataFrame, i: int) -> bool:
    lo, mean = df.loc[i, f"{GAIN} lo"], df.loc[i, f"{GAIN} mean"]
    if pd.notna(lo):
        return lo > 0
    return pd.isna(mean) or mean > 0


def build_winners_table(runs: list[RunRecord]) -> pd.DataFrame:
    """Which ranked row wins on what, among the rows of one (benchmark, profile, task
    order, precision): per score the best row by mean (the highest, or the lowest where lower
    is better) and every row
    that cannot be told apart from it at 95% (the leaderboard's "≠ best" test: the
    interval of the difference over items and seeds holds 0), rows that cannot be
    compared with it (no predictions, another budget) named as such; per cost
    (Added parameters, wall time; lower is better, no interval) the lowest row.
    Reference rows are not ranked, nor, on BWT (it `needs_learning`), a row whose Gain
    is not above 0 at 95%: it is named as such."""
    df, groups = build_rows(runs)
    labels = method_labels(df)
    ranked = [i for i in range(len(df)) if not df.loc[i, "Reference"]]
    loaded = [entries(g) for g in groups]
    reps = {i: group_replicates(loaded[i]) for i in ranked}
    sets: dict[tuple, list[int]] = {}
    for i in ranked:
        sets.setdefault(tuple(df.loc[i, k] for k in ("Benchmark", "Profile", "Order", "Precision")), []).append(i)
    rows = []
    for (bench, profile, _, precision), members in sets.items():
        where = ("" if bench == DEFAULT_BENCHMARK else f"{bench}: ") + f"{profile}, {df.loc[members[0], 'Tasks']} " \
                f"tasks, {precision}"
        for score in WINNER_SCORES:
            name = score.label
            scored = [i for i in members if pd.notna(df.loc[i, f"{name} mean"])]
            idle = [i for i in scored if score.needs_learning and not _learned(df, i)]
            scored = [i for i in scored if i not in idle]
            unranked = f"not ranked ({GAIN} not above 0): {', '.join(labels[i] for i in idle)}" if idle else ""
            if not scored:
                if idle:  # every row idle: said, not dropped
                    rows.append({"On": name, "Runs": where, "Best": MISSING, "Value": MISSING,
                                 "Not distinguishable from it": unranked})
                continue
            best = (max if score.higher_is_better else min)(scored, key=lambda i: df.loc[i, f"{name} mean"])
            marks = {i: distinct(reps[i], reps[best], loaded[i], loaded[best], score.key)
                     for i in scored if i != best}
            tied = ", ".join(labels[i] for i, m in marks.items() if m == "no") or "none"
            apart = [labels[i] for i, m in marks.items() if m is None]
            rows.append({"On": name, "Runs": where, "Best": labels[best], "Value": score_cell(
                *(df.loc[best, f"{name} {x}"] for x in ("mean", "std", "lo", "hi"))),
                         "Not distinguishable from it": tied + (f"; not compared: {', '.join(apart)}" if apart else "")
                         + (f"; {unranked}" if unranked else "")})
        for col, shown in (("Added", humanise), ("Wall time (min)", lambda v: f"{v:.1f} min")):
            costs = [i for i in members if pd.notna(df.loc[i, col])]
            if costs:
                low = min(df.loc[i, col] for i in costs)
                rows.append({"On": f"{col.replace(' (min)', '')} (lowest)", "Runs": where, "Value": shown(low),
                             "Best": ", ".join(labels[i] for i in costs if df.loc[i, col] == low),
                             "Not distinguishable from it": "– (no interval)"})
    return pd.DataFrame(rows, columns=["On", "Runs", "Best", "Value", "Not distinguishable from it"])


def format_winners_table(df: pd.DataFrame, fmt: str = "md") -> str:
    if fmt == "csv":
        return df.to_csv(index=False, na_rep="")
    return render(df.values.tolist(), list(df.columns), fmt) + "\n"
