"""Run records -> the leaderboard's rows: one per (benchmark, method, method arguments,
model id, profile, precision, task order, reference) group, mean ± std over its runs (seeds).

Runs of different benchmarks never pool: not into one row (the benchmark is part of
the group), nor into one ranking (each benchmark's rows are ranked, and marked against
its own baseline and best row, apart from the others'). `by_benchmark` splits runs so,
for the tables that show one benchmark each (`cl-bench leaderboard`, the site).

The summaries come from the records (a summary a record predates, from its
predictions). Each score also carries a 95% interval, bootstrapped over the test
items from the run's predictions (cl_bench/metrics/intervals.py) and, over several
seeds, over the seeds too (bootstrap.pooled). Each row is marked by whether it can
be told apart at 95% from the baseline row (the method that declares
`Method.baseline`, SeqFT) and from the best ranked row: the interval of the
difference, paired over items where the runs share them, excludes 0.
table.py formats these rows; nothing here formats.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from cl_bench import registry
from cl_bench.benchmark import DEFAULT as DEFAULT_BENCHMARK
from cl_bench.errors import UserError
from cl_bench.metrics import bootstrap
from cl_bench.metrics.cl import summaries
from cl_bench.metrics.intervals import ItemTable, point_summaries, replicates
from cl_bench.record.io import PREDICTIONS_FILE, read_jsonl
from cl_bench.record.schema import RunRecord
from cl_bench.report.compare import differences
from cl_bench.report.general import DELTA_G, LIMA, STATS, group_stats

log = logging.getLogger(__name__)

# The summaries the table shows (cl_bench/metrics/cl.py's table); each label is a column stem
# with "mean", "std", "lo" and "hi" columns. learn_gain (Gain): mean over tasks of
# R[j][j] - zero-shot (runs with the zero-shot row)
SCORES = summaries("last_acc", "stage_acc", "bwt", "learn_gain")
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
GROUP_KEYS = ["Benchmark", "Method", "Args", "Model", "Profile", "Precision", "Order", "Reference"]
MARKS = ["Last ≠ base", "BWT ≠ base", "Last ≠ best"]  # "yes" / "no" at 95%; "–" when not computable
COLUMNS = (
    ["Method", "Args", "Model", "Profile", "Precision", "Tasks", "Order", "Reference", "Runs"]
    + [f"{s.label} {stat_}" for s in SCORES for stat_ in ("mean", "std", "lo", "hi")]
    + MARKS
    + [col for _, col in PARAMS]
    + EXTRA
    + SPREAD
    + ["Wall time (min)"]
    + ["Benchmark"]  # the tables show one benchmark each (by_benchmark); a CSV leaves it out
)


@dataclass
class Entry:
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


def _flatten(entry: Entry) -> dict:
    """One run -> one flat row of raw numbers (None where the record has null)."""
    run = entry.record
    tasks = run.tasks
    summary = _field(run, "summary")
    last = max(run.params, key=lambda p: p.stage) if run.params else None
    total_s = run.timing.total_s
    row = {
        "Benchmark": run.benchmark,
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
    row.update({s.label: summary[s.key] if s.key in summary else point.get(s.key) for s in SCORES})
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


def entries(runs: list[RunRecord]) -> list[Entry]:
    """Each run with its item table (read from the predictions beside its record)."""
    return [Entry(run, _items(run)) for run in runs]


def _run_replicates(entry: Entry) -> dict | None:
    """Bootstrap replicates of the run's summaries from its predictions."""
    return None if entry.items is None else replicates(entry.items, bootstrap.RESAMPLES)


def group_replicates(members: list[Entry]) -> dict | None:
    """One group's replicates: its run's, or pooled over its runs (seeds) in seed order."""
    reps = [_run_replicates(e) for e in sorted(members, key=lambda e: e.record.seed or 0)]
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


def distinct(a: dict | None, b: dict | None, runs_a: list[Entry], runs_b: list[Entry], key: str) -> str | None:
    """'yes' when the 95% interval of a - b in `key` excludes 0, 'no' when it holds
    0, None when the groups differ in tasks or budget, or have no replicates."""
    if a is None or b is None or differences(runs_a[0].record, runs_b[0].record, items=False):
        return None
    ci = bootstrap.interval(a[key] - b[key])
    return None if ci is None else ("no" if ci[0] <= 0 <= ci[1] else "yes")


def by_benchmark(runs: list[RunRecord]) -> dict[str, list[RunRecord]]:
    """The runs of each benchmark, in their order: the default benchmark (TRACE) first,
    then the others by name."""
    out: dict[str, list[RunRecord]] = {}
    for run in runs:
        out.setdefault(run.benchmark, []).append(run)
    return {name: out[name] for name in sorted(out, key=lambda n: (n != DEFAULT_BENCHMARK, n))}


def build_table(runs: list[RunRecord]) -> pd.DataFrame:
    """One row per (benchmark, method, arguments, model, profile, precision, task order,
    reference) group: build_rows' table."""
    return build_rows(runs)[0]


def build_rows(runs: list[RunRecord]) -> tuple[pd.DataFrame, list[list[RunRecord]]]:
    """The table, and per row the runs pooled in it (`cl-bench site` links each row
    to its runs' pages). One row per (benchmark, method, arguments, model, profile,
    precision, task order, reference) group.

    Scores: mean and sample std (ddof=1; NaN for one run) over the group's runs,
    ignoring nulls, and the 95% interval ("lo", "hi") over items (and seeds).
    Params: the last stage's report, mean over the group's runs (they differ by
    seed where a method's decisions do, as bilevel-cka's Expand / Recycle), with
    the sample std of Added and Expansion. Wall time: mean total_s in minutes.
    Marks: MARKS, against the baseline and best rows of the row's own benchmark.
    Sorted by benchmark (by_benchmark's order), then Last Acc mean descending,
    reference rows last.
    """
    if not runs:
        return pd.DataFrame(columns=COLUMNS), []
    loaded = entries(runs)
    flat = pd.DataFrame([{**_flatten(entry), "_run": i} for i, entry in enumerate(loaded)])
    for col in [s.label for s in SCORES] + [col for _, col in PARAMS] + EXTRA + ["Wall time (min)"]:
        flat[col] = pd.to_numeric(flat[col], errors="coerce")  # all-null columns would stay object
    for key, group in flat.groupby(GROUP_KEYS, sort=False, dropna=False):
        seeds = group["Seed"].dropna()
        if seeds.duplicated().any():
            log.warning(
                "%s on %s: seed repeated across runs %s; a copied run counts twice", key[0], key[1], seeds.tolist()
            )
    agg = {"Tasks": ("Tasks", "first"), "Runs": ("Seed", "size"), "_runs": ("_run", list)}
    for s in SCORES:
        agg[f"{s.label} mean"] = (s.label, "mean")
        agg[f"{s.label} std"] = (s.label, "std")
    agg.update({col: (col, "mean") for col in [c for _, c in PARAMS] + EXTRA})
    agg.update({f"{col} std": (col, "std") for col in EXTRA})
    agg["Wall time (min)"] = ("Wall time (min)", "mean")
    table = flat.groupby(GROUP_KEYS, sort=False, dropna=False).agg(**agg).reset_index()
    for col in COUNTS:
        table[col] = table[col].round().astype("Int64")
    table["_other"] = table["Benchmark"] != DEFAULT_BENCHMARK
    table = table.sort_values(
        ["_other", "Benchmark", "Reference", "Last Acc mean", "Method"], ascending=[True, True, True, False, True],
        na_position="last"
    ).reset_index(drop=True)
    members = [[loaded[i] for i in idx] for idx in table["_runs"]]
    reps = [group_replicates(m) for m in members]
    for s in SCORES:
        cis = [None if r is None else bootstrap.interval(r[s.key]) for r in reps]
        table[f"{s.label} lo"] = [None if c is None else c[0] for c in cis]
        table[f"{s.label} hi"] = [None if c is None else c[1] for c in cis]
    for col in MARKS:
        table[col] = None
    for bench in table["Benchmark"].unique():  # each benchmark ranked apart
        ranked = [i for i in range(len(table)) if table.loc[i, "Benchmark"] == bench and not table.loc[i, "Reference"]]
        base = next((i for i in ranked if _is_baseline(table.loc[i, "Method"])), None)
        best = ranked[0] if ranked else None
        for col, other, key in (("Last ≠ base", base, "last_acc"), ("BWT ≠ base", base, "bwt"),
                                ("Last ≠ best", best, "last_acc")):
            for i in ranked:
                if other is not None and i != other:
                    table.at[i, col] = distinct(reps[i], reps[other], members[i], members[other], key)
    groups = [[e.record for e in m] for m in members]
    general = []  # ΔG and ΔLima columns, only where runs have them
    for stem in (DELTA_G, LIMA):
        stats = [group_stats(stem, g) for g in groups]
        if any(x["mean"] is not None for x in stats):
            general += [f"{stem} {x}" for x in STATS]
            for x in STATS:
                table[f"{stem} {x}"] = [row[x] for row in stats]
    return table[COLUMNS + general], groups


