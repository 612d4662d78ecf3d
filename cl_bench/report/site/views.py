"""What the site's pages show, as plain values for the templates (cl_bench/report/site/templates):
leaderboard rows with their sort keys and interval bars, a run's matrix as coloured
cells with intervals, its summaries, timings and parameters, a comparison's rows,
and each test item's story over the stages. No I/O here: cl_bench/report/site/build.py reads
the runs and writes the pages.
"""
from __future__ import annotations

import json
import math

import pandas as pd

from cl_bench import registry
from cl_bench.report import leaderboard
from cl_bench.errors import UserError
from cl_bench.record.schema import RunRecord
from cl_bench.report.text import summary_cells

MISSING = leaderboard.MISSING
SCORE_STEMS = [s.label for s in leaderboard.SCORES]
# The leaderboard's columns a reader compares first, shown at 1,400 px; the others
# (model, profile, counts, wall time, ...) behind the index's "every column" switch.
FIRST = ("Method", *SCORE_STEMS, "Last ≠ base", "BWT ≠ base", "Last ≠ best", "Added")


def secondary(header: str) -> bool:
    """Whether a leaderboard column is shown only on demand (FIRST's are always shown)."""
    return header.replace(f"≠ {registry.baseline()}", "≠ base") not in FIRST


def family(method: str) -> str:
    """The method's family for the index's filter: its `lr_family` (full, adapter,
    expert), "other" where it declares none or is a plugin not installed here."""
    try:
        return registry.get(method).lr_family or "other"
    except UserError:
        return "other"


def _number(value) -> float | None:
    return None if value is None or pd.isna(value) else float(value)


def interval_bar(lo, mean, hi, low: float, high: float) -> dict | None:
    """The interval [lo, hi] and the mean as percentages of the column's span [low, high]."""
    if lo is None or hi is None or mean is None or high <= low:
        return None
    pos = lambda v: round(100 * (v - low) / (high - low), 2)  # noqa: E731
    return {"left": pos(lo), "width": round(max(pos(hi) - pos(lo), 0.5), 2), "mean": pos(mean)}


def leaderboard_rows(df: pd.DataFrame, members: list[list[RunRecord]], page_of) -> tuple[list[str], list[dict]]:
    """The headers and rows of one leaderboard table: leaderboard.display_rows' cells,
    each with the value it sorts by (the mean for scores, the count for parameters)
    and, for scores, the interval drawn as a bar on the column's span. `page_of(record)`
    is the run page's link. Rows: {cells, runs: [{label, href}], profile, precision,
    family, reference, rank}."""
    headers, texts = leaderboard.display_rows(df)
    headers = [h.replace("≠ base", f"≠ {registry.baseline()}") for h in headers]
    records = df.to_dict("records")
    span = {}
    for stem in SCORE_STEMS:
        values = [_number(r[f"{stem} {k}"]) for r in records for k in ("lo", "hi", "mean")]
        values = [v for v in values if v is not None]
        span[stem] = (min(values), max(values)) if values else (0.0, 0.0)
    sort_of = {"Method": None, "Model": "Model", "Profile": "Profile", "Precision": "Precision", "Tasks": "Tasks",
               "Runs": "Runs", **{m: m for m in leaderboard.MARKS}, **{c: c for _, c in leaderboard.PARAMS},
               "Added": "Added", "Expansion": "Expansion", "Wall time (min)": "Wall time (min)"}
    rows, rank = [], 0
    for rec, cells, runs in zip(records, texts, members):
        out = []
        for header, text in zip(headers, cells):
            key = header.replace(f"≠ {registry.baseline()}", "≠ base")
            cell = {"text": str(text), "sort": None, "bar": None, "more": secondary(header)}
            if key in SCORE_STEMS:
                mean = _number(rec[f"{key} mean"])
                cell["sort"] = mean
                cell["text"] = MISSING if mean is None else f"{mean:.1f}"
                lo, hi = _number(rec[f"{key} lo"]), _number(rec[f"{key} hi"])
                cell["detail"] = text if mean is not None else ""
                cell["bar"] = interval_bar(lo, mean, hi, *span[key])
                cell["interval"] = "" if lo is None or hi is None else f"[{lo:.1f}, {hi:.1f}]"
            elif key == "Method":
                cell["sort"] = str(text)
            elif sort_of.get(key):
                raw = rec[sort_of[key]]
                cell["sort"] = _number(raw) if isinstance(raw, (int, float)) and not isinstance(raw, bool) \
                    else (None if raw is None or (isinstance(raw, float) and math.isnan(raw)) else str(raw))
            out.append(cell)
        reference = bool(rec["Reference"])
        if not reference:
            rank += 1
        rows.append({"cells": out, "reference": reference, "rank": None if reference else rank,
                     "profile": str(rec["Profile"]), "precision": str(rec["Precision"]),
                     "family": family(rec["Method"]),
                     "runs": [{"label": f"seed {r.seed}" if r.seed is not None else r.run_id, "href": page_of(r)}
                              for r in sorted(runs, key=lambda r: r.seed or 0)]})
    return headers, rows


# ---- one run ------------------------------------------------------------------

NOT_EVALUATED = "#eeeeee", "#777777"


def score_colours(value: float | None) -> tuple[str, str]:
    """(background, text colour) of a 0-100 score on the figures' scale (plots.score_rgba);
    grey where not evaluated."""
    if value is None:
        return NOT_EVALUATED
    from matplotlib.colors import to_hex

    from cl_bench.report.figures.plots import score_rgba, text_colour

    rgba = score_rgba(value)
    return to_hex(rgba), text_colour(rgba)


def score_legend() -> dict:
    """The colour legend of every HTML matrix: the scale as a CSS gradient, its ticks
    (position in %, label), and the not-evaluated grey."""
    from cl_bench.report.figures.plots import SCORE_CMAP, SCORE_RANGE

    lo, hi = SCORE_RANGE
    stops = [lo + (hi - lo) * k / 10 for k in range(11)]
    gradient = ", ".join(f"{score_colours(v)[0]} {100 * k / 10:.0f}%" for k, v in enumerate(stops))
    ticks = [(100 * k / 4, f"{lo + (hi - lo) * k / 4:.0f}") for k in range(5)]
    return {"gradient": f"linear-gradient(to right, {gradient})", "ticks": ticks, "missing": NOT_EVALUATED[0],
            "cmap": SCORE_CMAP}


def _ci_text(ci) -> str:
    return "" if not ci else f"[{ci[0]:.1f}, {ci[1]:.1f}]"


def matrix_rows(record: RunRecord, iv: dict | None) -> list[dict]:
    """The heatmap: the zero-shot row (where the run has one), then R[b][j] per stage;
    each cell {text, ci, title, bg, fg}. The title is what hovering shows."""
    iv = iv or {}
    n = [None] * len(record.tasks)
    rows = []
    if record.zero_shot is not None:
        rows.append(("zero-shot", "zero-shot", record.zero_shot, iv.get("zero_shot_ci") or n))
    cis = iv.get("matrix_ci") or [n] * len(record.matrix)
    for stage, values, ci_row in zip(record.stages, record.matrix, cis):
        rows.append((f"{stage.index + 1}: {stage.label}", f"after stage {stage.index + 1} ({stage.label})",
                     values, ci_row))
    items = iv.get("n_items") or n
    out = []
    for label, long, values, ci_row in rows:
        cells = []
        for task, value, ci, count in zip(record.tasks, values, ci_row, items):
            bg, fg = score_colours(value)
            title = (f"{task} {long}: not evaluated" if value is None else
                     f"{task} {long}: {value:.1f}" + (f", 95% interval {_ci_text(ci)}" if ci else "")
                     + (f" over {count} items" if count else ""))
            cells.append({"text": MISSING if value is None else f"{value:.1f}", "ci": _ci_text(ci),
                          "title": title, "bg": bg, "fg": fg, "value": value})
        out.append({"label": label, "cells": cells})
    return out


def majority_row(record: RunRecord) -> list[str] | None:
    """The majority-class level of each label task ('–' for the others), or None."""
    if not record.majority:
        return None
    return [f"{m['score']:.1f} ('{m['answer']}')" if (m := record.majority.get(t)) else MISSING
            for t in record.tasks]


def summary_rows(record: RunRecord, iv: dict | None) -> list[dict]:
    """Every summary with its interval: the record's, else the one from the predictions;
    BWT's format and content parts among them."""
    return [{"name": s.label, "key": s.key, "text": text} for s, text in summary_cells(record, iv)]


def timing_rows(record: RunRecord) -> list[dict]:
    labels = {s.index: s.label for s in record.stages}
    return [{"stage": f"{t.stage + 1}: {labels.get(t.stage, '')}", "train": f"{t.train_s / 60:.1f}",
             "eval": f"{t.eval_s / 60:.1f}", "steps": t.steps,
             "rss": MISSING if t.peak_rss_mb is None else f"{t.peak_rss_mb / 1024:.1f}"}
            for t in record.timing.stages]


def param_rows(record: RunRecord) -> list[dict]:
    return [{"stage": p.stage + 1, **{k: leaderboard.humanise(getattr(p, k)) for k in
                                      ("total", "trainable", "active_per_token", "deployed")},
             "experts": MISSING if not p.experts_per_layer else
             f"{sum(p.experts_per_layer) / len(p.experts_per_layer):.1f}",
             "expansion": MISSING if p.expansion_rate is None else f"{100 * p.expansion_rate:.0f}%"}
            for p in record.params]


def minutes(seconds) -> str:
    return MISSING if seconds is None else f"{seconds / 60:.1f}"


def pretty(value) -> str:
    return json.dumps(value, indent=1, sort_keys=True, ensure_ascii=False)


# ---- a comparison -------------------------------------------------------------

def comparison_rows(entries: dict, names: dict[str, str]) -> list[dict]:
    """compare.compare's rows (run, baseline, diff, ci, p) with the text shown and
    the exact values (data-value, so a test can read them back)."""
    out = []
    for key, r in entries.items():
        ci = r["ci"]
        verdict = ("not distinguishable" if ci is None or ci[0] <= 0 <= ci[1]
                   else "higher" if r["diff"] > 0 else "lower")
        out.append({"key": key, "name": names.get(key, key), "verdict": verdict,
                    "values": [(f"{r['run']:.1f}", r["run"]), (f"{r['baseline']:.1f}", r["baseline"]),
                               (f"{r['diff']:+.1f}", r["diff"])],
                    "ci": None if ci is None else [(f"{ci[0]:+.1f}", ci[0]), (f"{ci[1]:+.1f}", ci[1])],
                    "p": None if r["p"] is None else (f"{r['p']:.3f}", r["p"])})
    return out


# ---- the prediction browser -----------------------------------------------------

def item_story(scores: list[float | None], learned: int | None, labels: list[str]) -> tuple[str, str]:
    """(kind, sentence) of one test item over the stages: `scores[b]` after stage b
    (None: not evaluated), `learned` the stage that trains its task, `labels` the
    stages' labels. Kinds: forgotten, kept, never (not learned right after its
    stage), unseen (no score right after its stage). On 0/100 scores the sentence
    says right and wrong ("right after its stage, wrong after C-STANCE")."""
    if learned is None or learned >= len(scores) or scores[learned] is None:
        return "unseen", "not scored right after its own stage"
    at = scores[learned]
    binary = all(s in (0.0, 100.0) for s in scores if s is not None)
    later = [(b, s) for b, s in enumerate(scores) if b > learned and s is not None]
    if binary and at == 0:
        return "never", "wrong right after its stage" + (
            f"; right after {labels[next(b for b, s in later if s == 100)]}" if any(s == 100 for _, s in later)
            else "")
    drop = next(((b, s) for b, s in later if s < at), None)
    if drop is None:
        return "kept", ("right after its stage and after every later one" if binary else
                        f"{at:.0f} right after its stage, never lower after")
    b, s = drop
    text = (f"right after its stage, wrong after {labels[b]}" if binary else
            f"{at:.0f} right after its stage, {s:.0f} after {labels[b]}")
    final = later[-1][1]
    if final >= at:
        text += ", recovered by the last stage"
    return "forgotten", text
