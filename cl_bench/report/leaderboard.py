"""Run records -> leaderboard tables (Markdown, CSV, LaTeX), mean ± std over seeds.

Reads `<runs_dir>/**/run.json` (results.read_record, any schema version), groups runs by
(method, method arguments, model id, profile, precision, task order, reference),
aggregates, and formats. Where one method appears with several argument sets
(a sweep), its rows are labelled with the arguments that differ.
The summaries come from the records. Each score also carries a 95% interval,
bootstrapped over the test items from the run's predictions (cl_bench/metrics/intervals.py)
and, over several seeds, over the seeds too (bootstrap.pooled). Each row is marked
by whether it can be told apart at 95% from the baseline row (the method that
declares `Method.baseline`, SeqFT) and from the best ranked row: the interval of
the difference, paired over items where the runs share them, excludes 0.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
from tabulate import tabulate

from cl_bench import registry
from cl_bench.report.compare import differences
from cl_bench.errors import UserError
from cl_bench.report.general import DELTA_G, LIMA, STATS, cell, group_stats
from cl_bench.metrics.intervals import ItemTable, point_summaries, replicates
from cl_bench.metrics import bootstrap
from cl_bench.record.schema import RunRecord
from cl_bench.record.io import PREDICTIONS_FILE, atomic_write_text, read_jsonl, read_record

log = logging.getLogger(__name__)

FORMATS = ("md", "csv", "latex")
MISSING = "–"  # en dash, for md and latex; csv leaves the cell empty

# (record field under "summary", column stem); each gets "<stem> mean" and "<stem> std"
# learn_gain: mean over tasks of R[j][j] - zero-shot (runs with the zero-shot row)
SCORES = (("last_acc", "Last Acc"), ("stage_acc", "Stage Acc"), ("bwt", "BWT"), ("learn_gain", "Gain"))
# (field of the last stage's ParamReport, column)
PARAMS = (
    ("total", "Total params"),
    ("trainable", "Trainable"),
    ("active_per_token", "Active/token"),
    ("deployed", "Deployed"),
)
# Added: deployed minus the base model's parameters; Expansion: the mean over stages of the
# ParamReport's expansion_rate (share of candidate experts expanded), where the method reports one
EXTRA = ["Added", "Expansion"]
COUNTS = [col for _, col in PARAMS] + ["Added"]  # parameter counts: integers, shown as 134.5M
SPREAD = [f"{col} std" for col in EXTRA]  # over seeds: a method's decisions (bilevel-cka's) differ by seed
GROUP_KEYS = ["Method", "Args", "Model", "Profile", "Precision", "Order", "Reference"]
MARKS = ["Last ≠ base", "BWT ≠ base", "Last ≠ best"]  # "yes" / "no" at 95%; "–" when not computable
COLUMNS = (
    ["Method", "Args", "Model", "Profile", "Precision", "Tasks", "Order", "Reference", "Runs"]
    + [f"{stem} {stat_}" for _, stem in SCORES for stat_ in ("mean", "std", "lo", "hi")]
    + MARKS
    + [col for _, col in PARAMS]
    + EXTRA
    + SPREAD
    + ["Wall time (min)"]
)


def load_runs(runs_dir: Path, exclude: list[str] = (), include: list[str] = ()) -> list[RunRecord]:
    """Every complete run under runs_dir (recursive), parsed, sorted by path,
    except run folders matching a glob of `exclude` (relative to runs_dir); with
    `include`, only run folders matching one of its globs.

    Each record's `source` is the run.json it came from, so later errors can name
    the file. Incomplete runs are skipped with a warning.
    """
    runs_dir = Path(runs_dir)
    if not runs_dir.is_dir():
        raise UserError(f"runs directory {runs_dir} does not exist; pass the folder holding <run-id>/run.json")
    paths = [p for p in sorted(runs_dir.rglob("run.json")) if not _matches(p.parent.relative_to(runs_dir), exclude)
             and (not include or _matches(p.parent.relative_to(runs_dir), include))]
    if not paths:
        chosen = f" matching {', '.join(include)}" if include else ""
        raise UserError(f"no run.json{chosen} found under {runs_dir}; run `cl-bench run` first or point at the "
                        f"right folder")
    runs, skipped = [], []
    for path in paths:
        run = read_record(path.parent)
        if run.status != "complete":
            log.warning("skipping %s: status is %r, not 'complete'", path, run.status)
            skipped.append(str(path))
            continue
        runs.append(run)
    if not runs:
        raise UserError(
            f"no complete run under {runs_dir}; all {len(skipped)} found are unfinished: {', '.join(skipped)}"
        )
    return runs


def _matches(folder: Path, globs) -> bool:
    """`folder` (relative) or one of its parent folders matches a glob ('*' spans '/')."""
    import fnmatch

    names = [folder.as_posix()] + [q.as_posix() for q in folder.parents if q != Path(".")]
    return any(fnmatch.fnmatch(name, g) for name in names for g in globs)


@dataclass
class _Entry:
    """One run of the table: its record and its item table (None: no predictions)."""

    record: RunRecord
    items: ItemTable | None


def _field(run: RunRecord, *keys: str):
    """run.k0[k1]..., or a UserError naming the file and the missing field."""
    value = getattr(run, keys[0])
    for key in keys[1:]:
        value = value.get(key) if isinstance(value, dict) else None
    if value is None:
        raise UserError(f"{run.source or '<run>'}: missing field {'.'.join(keys)}; the record is incomplete")
    return value


def _flatten(entry: _Entry) -> dict:
    """One run -> one flat row of raw numbers (None where the record has null)."""
    run = entry.record
    tasks = run.tasks
    summary = _field(run, "summary")
    last = max(run.params, key=lambda p: p.stage) if run.params else None
    total_s = run.timing.total_s
    row = {
        "Method": run.method,
        "Args": json.dumps(run.method_args, sort_keys=True),
        "Model": _field(run, "model", "id"),
        "Profile": _field(run, "profile"),
        "Precision": run.precision,  # runs of one method in bf16 and in fp32 are not seeds of one row
        "Order": ",".join(tasks),
        "Reference": run.reference,
        "Tasks": len(tasks),
        "Seed": run.seed,
        "Wall time (min)": None if total_s is None else total_s / 60,
    }
    # a summary the record predates (learn_gain) comes from its predictions
    point = point_summaries(entry.items) if entry.items is not None else {}
    row.update({stem: summary[key] if key in summary else point.get(key) for key, stem in SCORES})
    row.update({col: None if last is None else getattr(last, key) for key, col in PARAMS})
    base = run.model.get("n_params")
    row["Added"] = None if base is None or last is None or last.deployed is None else last.deployed - base
    rates = [p.expansion_rate for p in run.params if p.expansion_rate is not None]
    row["Expansion"] = sum(rates) / len(rates) if rates else None
    return row


def _items(run: RunRecord) -> ItemTable | None:
    """The run's item table from its predictions; None when the run folder has none
    (a record copied without them)."""
    predictions = read_jsonl(Path(run.source).parent / PREDICTIONS_FILE) if run.source else []
    return ItemTable.from_run(run, predictions) if predictions else None


def _run_replicates(entry: _Entry) -> dict | None:
    """Bootstrap replicates of the run's summaries from its predictions."""
    return None if entry.items is None else replicates(entry.items, bootstrap.RESAMPLES)


def _group_replicates(entries: list[_Entry]) -> dict | None:
    """One group's replicates: its run's, or pooled over its runs (seeds) in seed order."""
    reps = [_run_replicates(e) for e in sorted(entries, key=lambda e: e.record.seed or 0)]
    if not reps or any(r is None for r in reps):
        return None
    if len(reps) == 1:
        return reps[0]
    return {k: bootstrap.pooled([r[k] for r in reps], bootstrap.RESAMPLES, seed=0) for k in reps[0]}


def _is_baseline(method: str) -> bool:
    try:
        return bool(registry.get(method).baseline)
    except UserError:  # a plugin that is not installed here
        return False


def _distinct(a: dict | None, b: dict | None, runs_a: list[_Entry], runs_b: list[_Entry], key: str) -> str | None:
    """'yes' when the 95% interval of a - b in `key` excludes 0, 'no' when it holds
    0, None when the groups differ in tasks or budget, or have no replicates."""
    if a is None or b is None or differences(runs_a[0].record, runs_b[0].record, items=False):
        return None
    ci = bootstrap.interval(a[key] - b[key])
    return None if ci is None else ("no" if ci[0] <= 0 <= ci[1] else "yes")


def build_table(runs: list[RunRecord]) -> pd.DataFrame:
    """One row per (method, arguments, model, profile, precision, task order, reference)
    group: build_rows' table."""
    return build_rows(runs)[0]


def build_rows(runs: list[RunRecord]) -> tuple[pd.DataFrame, list[list[RunRecord]]]:
    """The table, and per row the runs pooled in it (`cl-bench site` links each row
    to its runs' pages). One row per (method, arguments, model, profile, precision,
    task order, reference) group.

    Scores: mean and sample std (ddof=1; NaN for one run) over the group's runs,
    ignoring nulls, and the 95% interval ("lo", "hi") over items (and seeds).
    Params: the last stage's report, mean over the group's runs (they differ by
    seed where a method's decisions do, as bilevel-cka's Expand / Recycle), with
    the sample std of Added and Expansion. Wall time: mean total_s in minutes.
    Marks: MARKS.
    Sorted by Last Acc mean descending, reference rows last.
    """
    if not runs:
        return pd.DataFrame(columns=COLUMNS), []
    entries = [_Entry(run, _items(run)) for run in runs]
    flat = pd.DataFrame([{**_flatten(entry), "_run": i} for i, entry in enumerate(entries)])
    for col in [stem for _, stem in SCORES] + [col for _, col in PARAMS] + EXTRA + ["Wall time (min)"]:
        flat[col] = pd.to_numeric(flat[col], errors="coerce")  # all-null columns would stay object
    for key, group in flat.groupby(GROUP_KEYS, sort=False, dropna=False):
        seeds = group["Seed"].dropna()
        if seeds.duplicated().any():
            log.warning(
                "%s on %s: seed repeated across runs %s; a copied run counts twice", key[0], key[1], seeds.tolist()
            )
    agg = {"Tasks": ("Tasks", "first"), "Runs": ("Seed", "size"), "_runs": ("_run", list)}
    for _, stem in SCORES:
        agg[f"{stem} mean"] = (stem, "mean")
        agg[f"{stem} std"] = (stem, "std")
    agg.update({col: (col, "mean") for col in [c for _, c in PARAMS] + EXTRA})
    agg.update({f"{col} std": (col, "std") for col in EXTRA})
    agg["Wall time (min)"] = ("Wall time (min)", "mean")
    table = flat.groupby(GROUP_KEYS, sort=False, dropna=False).agg(**agg).reset_index()
    for col in COUNTS:
        table[col] = table[col].round().astype("Int64")
    table = table.sort_values(
        ["Reference", "Last Acc mean", "Method"], ascending=[True, False, True], na_position="last"
    ).reset_index(drop=True)
    members = [[entries[i] for i in idx] for idx in table["_runs"]]
    reps = [_group_replicates(m) for m in members]
    for key, stem in SCORES:
        cis = [None if r is None else bootstrap.interval(r[key]) for r in reps]
        table[f"{stem} lo"] = [None if c is None else c[0] for c in cis]
        table[f"{stem} hi"] = [None if c is None else c[1] for c in cis]
    ranked = [i for i in range(len(table)) if not table.loc[i, "Reference"]]
    base = next((i for i in ranked if _is_baseline(table.loc[i, "Method"])), None)
    best = ranked[0] if ranked else None
    for col, other, key in (("Last ≠ base", base, "last_acc"), ("BWT ≠ base", base, "bwt"),
                            ("Last ≠ best", best, "last_acc")):
        table[col] = [None if i not in ranked or other is None or i == other
                      else _distinct(reps[i], reps[other], members[i], members[other], key)
                      for i in range(len(table))]
    groups = [[e.record for e in m] for m in members]
    general = []  # ΔG and ΔLima columns, only where runs have them
    for stem in (DELTA_G, LIMA):
        stats = [group_stats(stem, g) for g in groups]
        if any(x["mean"] is not None for x in stats):
            general += [f"{stem} {x}" for x in STATS]
            for x in STATS:
                table[f"{stem} {x}"] = [row[x] for row in stats]
    return table[COLUMNS + general], groups


def humanise(n) -> str:
    """134515008 -> '134.5M', 1235814400 -> '1.24B'; missing -> '–'."""
    if n is None or pd.isna(n):
        return MISSING
    n = int(n)
    for scale, suffix, digits in ((1e9, "B", 2), (1e6, "M", 1), (1e3, "K", 1)):
        if abs(n) >= scale:
            return f"{n / scale:.{digits}f}{suffix}"
    return str(n)


def _score_cell(mean, std, lo=None, hi=None) -> str:
    """'45.0 ± 7.1 [40.2, 49.9]': mean, std over seeds (left out for one run, ddof=1)
    and the 95% interval (left out when the runs have no predictions)."""
    if pd.isna(mean):
        return MISSING
    text = f"{mean:.1f}" if pd.isna(std) else f"{mean:.1f} ± {std:.1f}"
    return text if lo is None or pd.isna(lo) else f"{text} [{lo:.1f}, {hi:.1f}]"


def display_rows(df: pd.DataFrame) -> tuple[list[str], list[list[str]]]:
    """The headers and the formatted cells of every row (the Markdown and LaTeX tables', and the site's)."""
    headers = ["Method", "Model", "Profile", "Precision", "Tasks", "Runs"] + [stem for _, stem in SCORES]
    headers += MARKS + [col for _, col in PARAMS] + EXTRA + ["Wall time (min)"]
    general = [stem for stem in (DELTA_G, LIMA) if f"{stem} mean" in df.columns]
    headers += general
    rows = []
    for rec, label in zip(df.to_dict("records"), _method_labels(df)):
        method = f"{label} (reference)" if rec["Reference"] else label
        row = [method, str(rec["Model"]), str(rec["Profile"]), str(rec["Precision"]), str(rec["Tasks"]),
               str(rec["Runs"])]
        row += [_score_cell(*(rec[f"{stem} {x}"] for x in ("mean", "std", "lo", "hi"))) for _, stem in SCORES]
        row += [MISSING if pd.isna(rec[col]) else rec[col] for col in MARKS]
        row += [humanise(rec[col]) for col in COUNTS[:-1]]
        row.append(_with_spread(humanise(rec["Added"]), rec["Added std"], humanise))
        row.append(MISSING if pd.isna(rec["Expansion"]) else
                   _with_spread(f"{100 * rec['Expansion']:.0f}%", rec["Expansion std"], lambda s: f"{100 * s:.0f}"))
        wall = rec["Wall time (min)"]
        row.append(MISSING if pd.isna(wall) else f"{wall:.1f}")
        row += [cell(stem, *(rec[f"{stem} {x}"] for x in STATS)) for stem in general]
        rows.append(row)
    return headers, rows


def _with_spread(text: str, std, fmt) -> str:
    """`text ± fmt(std)` where the seeds differ (std > 0), else `text`."""
    return text if pd.isna(std) or not std else f"{text} ± {fmt(std)}"


def _method_labels(df: pd.DataFrame) -> list[str]:
    """The method's name, followed by "(key=value, ...)" for the arguments that
    differ between the rows of that method (none when it has one argument set)."""
    args = [json.loads(a) for a in df["Args"]]
    labels = []
    for method, own in zip(df["Method"], args):
        others = [a for m, a in zip(df["Method"], args) if m == method]
        keys = sorted({k for a in others for k in set(a) | set(own) if a.get(k) != own.get(k)})
        shown = ", ".join(f"{k}={own.get(k)}" for k in keys)
        labels.append(f"{method} ({shown})" if shown else str(method))
    return labels


def format_table(df: pd.DataFrame, fmt: str = "md") -> str:
    """Render build_table's frame: 'md' (pipe table), 'csv' (raw numbers), 'latex' (booktabs)."""
    if fmt == "csv":
        return df.to_csv(index=False, na_rep="")
    if fmt not in FORMATS:
        raise UserError(f"unknown leaderboard format {fmt!r}; choose one of {', '.join(FORMATS)}")
    headers, rows = display_rows(df)
    align = ["left"] * 4 + ["right"] * (len(headers) - 4)
    tablefmt = "pipe" if fmt == "md" else "latex_booktabs"
    # disable_numparse: the cells are already formatted; tabulate would re-round "45.0" to "45"
    return tabulate(rows, headers, tablefmt=tablefmt, colalign=align, disable_numparse=True) + "\n"


def update_readme(
    readme_path: Path,
    table_md: str,
    begin: str = "<!-- leaderboard:begin -->",
    end: str = "<!-- leaderboard:end -->",
) -> None:
    """Replace the text between the begin and end markers (kept) with table_md, atomically."""
    readme_path = Path(readme_path)
    if not readme_path.is_file():
        raise UserError(f"{readme_path} does not exist; pass the README that should hold the leaderboard")
    text = readme_path.read_text(encoding="utf-8")
    start = text.find(begin)
    stop = text.find(end, start + len(begin)) if start >= 0 else -1
    if start < 0 or stop < 0:
        raise UserError(
            f"{readme_path}: table markers not found; add a line {begin} and, below it, "
            f"a line {end} where the table should go"
        )
    new = text[: start + len(begin)] + "\n\n" + table_md.strip("\n") + "\n\n" + text[stop:]
    atomic_write_text(readme_path, new)


FORM_PARTS = (("bwt", "BWT"), ("bwt_format", "BWT format"), ("bwt_content", "BWT content"))
FORM_MARKS = ("Format ≠ 0", "Content ≠ 0")


def build_forms_table(runs: list[RunRecord]) -> pd.DataFrame:
    """Per leaderboard row (the same groups, in the same order) with predictions and
    a BWT: BWT and its split into answer form and content (metrics.cl.bwt_split: the
    part of each old task's drop explained by answers leaving the task's form, and
    the rest), mean and std over seeds, the 95% interval over items (and seeds), and
    whether each part can be told apart from 0 at 95%."""
    df, groups = build_rows(runs)
    rows = []
    for label, rec, group in zip(_method_labels(df), df.to_dict("records"), groups):
        entries = [_Entry(r, _items(r)) for r in group]
        reps = _group_replicates(entries)
        if reps is None:
            continue
        points = [point_summaries(e.items) for e in entries]
        if any(p["bwt"] is None for p in points):
            continue
        row = {"Method": label, "Profile": rec["Profile"], "Precision": rec["Precision"], "Runs": len(group)}
        for key, col in FORM_PARTS:
            values = pd.Series([p[key] for p in points], dtype=float)
            ci = bootstrap.interval(reps[key])
            row.update({f"{col} mean": values.mean(), f"{col} std": values.std(),
                        f"{col} lo": None if ci is None else ci[0], f"{col} hi": None if ci is None else ci[1]})
        for mark, (_, col) in zip(FORM_MARKS, FORM_PARTS[1:]):
            lo, hi = row[f"{col} lo"], row[f"{col} hi"]
            row[mark] = None if lo is None else ("no" if lo <= 0 <= hi else "yes")
        rows.append(row)
    return pd.DataFrame(rows)


def format_forms_table(df: pd.DataFrame, fmt: str = "md") -> str:
    """build_forms_table's frame: 'md', 'latex' or 'csv' (raw numbers)."""
    if fmt == "csv":
        return df.to_csv(index=False, na_rep="")
    headers = ["Method", "Profile", "Precision", "Runs"] + [col for _, col in FORM_PARTS] + list(FORM_MARKS)
    rows = [[r["Method"], str(r["Profile"]), str(r["Precision"]), str(r["Runs"])]
            + [_score_cell(*(r[f"{col} {x}"] for x in ("mean", "std", "lo", "hi"))) for _, col in FORM_PARTS]
            + [MISSING if r[m] is None else r[m] for m in FORM_MARKS] for r in df.to_dict("records")]
    return tabulate(rows, headers, tablefmt="pipe" if fmt == "md" else "latex_booktabs",
                    colalign=["left"] * 3 + ["right"] * (len(headers) - 3), disable_numparse=True) + "\n"


WINNER_SCORES = (("last_acc", "Last Acc"), ("bwt", "BWT"), ("learn_gain", "Gain"))
# A row that did not learn its tasks has nothing to forget: on these scores only the rows
# whose Gain is above 0 at 95% (without an interval: its mean above 0; without a Gain, no
# zero-shot row, any row) are ranked.
NEEDS_LEARNING = ("bwt",)


def _learned(df: pd.DataFrame, i: int) -> bool:
    lo, mean = df.loc[i, "Gain lo"], df.loc[i, "Gain mean"]
    if pd.notna(lo):
        return lo > 0
    return pd.isna(mean) or mean > 0


def build_winners_table(runs: list[RunRecord]) -> pd.DataFrame:
    """Which ranked row wins on what, among the rows of one (profile, task order,
    precision): per score (higher is better) the best row by mean and every row
    that cannot be told apart from it at 95% (the leaderboard's "≠ best" test: the
    interval of the difference over items and seeds holds 0), rows that cannot be
    compared with it (no predictions, another budget) named as such; per cost
    (Added parameters, wall time; lower is better, no interval) the lowest row.
    Reference rows are not ranked, nor, on BWT (NEEDS_LEARNING), a row whose Gain is
    not above 0 at 95%: it is named as such."""
    df, groups = build_rows(runs)
    labels = _method_labels(df)
    ranked = [i for i in range(len(df)) if not df.loc[i, "Reference"]]
    entries = [[_Entry(r, _items(r)) for r in g] for g in groups]
    reps = {i: _group_replicates(entries[i]) for i in ranked}
    sets: dict[tuple, list[int]] = {}
    for i in ranked:
        sets.setdefault(tuple(df.loc[i, k] for k in ("Profile", "Order", "Precision")), []).append(i)
    rows = []
    for (profile, _, precision), members in sets.items():
        where = f"{profile}, {df.loc[members[0], 'Tasks']} tasks, {precision}"
        for key, name in WINNER_SCORES:
            scored = [i for i in members if pd.notna(df.loc[i, f"{name} mean"])]
            idle = [i for i in scored if key in NEEDS_LEARNING and not _learned(df, i)]
            scored = [i for i in scored if i not in idle]
            unranked = f"not ranked (Gain not above 0): {', '.join(labels[i] for i in idle)}" if idle else ""
            if not scored:
                if idle:  # every row idle: said, not dropped
                    rows.append({"On": name, "Runs": where, "Best": MISSING, "Value": MISSING,
                                 "Not distinguishable from it": unranked})
                continue
            best = max(scored, key=lambda i: df.loc[i, f"{name} mean"])
            marks = {i: _distinct(reps[i], reps[best], entries[i], entries[best], key) for i in scored if i != best}
            tied = ", ".join(labels[i] for i, m in marks.items() if m == "no") or "none"
            apart = [labels[i] for i, m in marks.items() if m is None]
            rows.append({"On": name, "Runs": where, "Best": labels[best], "Value": _score_cell(
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
    return tabulate(df.values.tolist(), list(df.columns), tablefmt="pipe" if fmt == "md" else "latex_booktabs",
                    disable_numparse=True) + "\n"
