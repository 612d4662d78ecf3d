"""The leaderboard's forms view: per row, BWT and its split into answer form and
content (metrics.cl.bwt_split), with intervals and whether each part is told apart from 0."""

from __future__ import annotations

import pandas as pd

from cl_bench.metrics import bootstrap
from cl_bench.metrics.cl import summaries
from cl_bench.metrics.intervals import point_summaries
from cl_bench.record.schema import RunRecord
from cl_bench.report.leaderboard.rows import build_rows, entries, group_replicates
from cl_bench.report.leaderboard.table import MISSING, method_labels, render, score_cell

FORM_PARTS = summaries("bwt", "bwt_format", "bwt_content")
FORM_MARKS = ("Format ≠ 0", "Content ≠ 0")


def build_forms_table(runs: list[RunRecord]) -> pd.DataFrame:
    """Per leaderboard row (the same groups, in the same order) with predictions and
    a BWT: BWT and its split into answer form and content (metrics.cl.bwt_split: the
    part of each old task's drop explained by answers leaving the task's form, and
    the rest), mean and std over seeds, the 95% interval over items (and seeds), and
    whether each part can be told apart from 0 at 95%."""
    df, groups = build_rows(runs)
    rows = []
    for label, rec, group in zip(method_labels(df), df.to_dict("records"), groups):
        members = entries(group)
        reps = group_replicates(members)
        if reps is None:
            continue
        points = [point_summaries(e.items) for e in members]
        if any(p["bwt"] is None for p in points):
            continue
        row = {"Method": label, "Profile": rec["Profile"], "Precision": rec["Precision"], "Runs": len(group)}
        for part in FORM_PARTS:
            values = pd.Series([p[part.key] for p in points], dtype=float)
            ci = bootstrap.interval(reps[part.key])
            col = part.label
            row.update({f"{col} mean": values.mean(), f"{col} std": values.std(),
                        f"{col} lo": None if ci is None else ci[0], f"{col} hi": None if ci is None else ci[1]})
        for mark, part in zip(FORM_MARKS, FORM_PARTS[1:]):
            lo, hi = row[f"{part.label} lo"], row[f"{part.label} hi"]
            row[mark] = None if lo is None else ("no" if lo <= 0 <= hi else "yes")
        rows.append(row)
    return pd.DataFrame(rows)


def format_forms_table(df: pd.DataFrame, fmt: str = "md") -> str:
    """build_forms_table's frame: 'md', 'latex' or 'csv' (raw numbers)."""
    if fmt == "csv":
        return df.to_csv(index=False, na_rep="")
    headers = ["Method", "Profile", "Precision", "Runs"] + [part.label for part in FORM_PARTS] + list(FORM_MARKS)
    rows = [[r["Method"], str(r["Profile"]), str(r["Precision"]), str(r["Runs"])]
            + [score_cell(*(r[f"{part.label} {x}"] for x in ("mean", "std", "lo", "hi"))) for part in FORM_PARTS]
            + [MISSING if r[m] is None else r[m] for m in FORM_MARKS] for r in df.to_dict("records")]
    return render(rows, headers, fmt, ["left"] * 3 + ["right"] * (len(headers) - 3)) + "\n"
