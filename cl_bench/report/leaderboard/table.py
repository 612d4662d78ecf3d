"""The leaderboard's rows (rows.py) as text: Markdown (pipe), CSV (raw numbers) or
LaTeX (booktabs), and the cells the site shows. Formats only; computes nothing."""

from __future__ import annotations

import json
from typing import Callable

import pandas as pd
from tabulate import tabulate

from cl_bench.benchmark import DEFAULT as DEFAULT_BENCHMARK
from cl_bench.errors import UserError
from cl_bench.report.general import DELTA_G, LIMA, STATS, cell
from cl_bench.report.leaderboard.rows import COUNTS, EXTRA, MARKS, PARAMS, SCORES, by_benchmark

FORMATS = ("md", "csv", "latex")
MISSING = "–"  # en dash, for md and latex; csv leaves the cell empty


def humanise(n) -> str:
    """134515008 -> '134.5M', 1235814400 -> '1.24B'; missing -> '–'."""
    if n is None or pd.isna(n):
        return MISSING
    n = int(n)
    for scale, suffix, digits in ((1e9, "B", 2), (1e6, "M", 1), (1e3, "K", 1)):
        if abs(n) >= scale:
            return f"{n / scale:.{digits}f}{suffix}"
    return str(n)


def score_cell(mean, std, lo=None, hi=None) -> str:
    """'45.0 ± 7.1 [40.2, 49.9]': mean, std over seeds (left out for one run, ddof=1)
    and the 95% interval (left out when the runs have no predictions)."""
    if pd.isna(mean):
        return MISSING
    text = f"{mean:.1f}" if pd.isna(std) else f"{mean:.1f} ± {std:.1f}"
    return text if lo is None or pd.isna(lo) else f"{text} [{lo:.1f}, {hi:.1f}]"


def display_rows(df: pd.DataFrame) -> tuple[list[str], list[list[str]]]:
    """The headers and the formatted cells of every row (the Markdown and LaTeX tables', and the site's)."""
    headers = ["Method", "Model", "Profile", "Precision", "Tasks", "Runs"] + [s.label for s in SCORES]
    headers += MARKS + [col for _, col in PARAMS] + EXTRA + ["Wall time (min)"]
    general = [stem for stem in (DELTA_G, LIMA) if f"{stem} mean" in df.columns]
    headers += general
    rows = []
    for rec, label in zip(df.to_dict("records"), method_labels(df)):
        method = f"{label} (reference)" if rec["Reference"] else label
        row = [method, str(rec["Model"]), str(rec["Profile"]), str(rec["Precision"]), str(rec["Tasks"]),
               str(rec["Runs"])]
        row += [score_cell(*(rec[f"{s.label} {x}"] for x in ("mean", "std", "lo", "hi"))) for s in SCORES]
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


def method_labels(df: pd.DataFrame) -> list[str]:
    """The method's name, followed by "(key=value, ...)" for the arguments that
    differ between the rows of that method (none when it has one argument set). An
    argument one row's record lacks (written before the argument existed) tells the
    rows apart only where no argument both have does."""
    args = [json.loads(a) for a in df["Args"]]
    labels = []
    for method, own in zip(df["Method"], args):
        others = [a for m, a in zip(df["Method"], args) if m == method]
        keys = sorted({k for a in others for k in (_differing(a, own, set(a) & set(own))
                                                   or _differing(a, own, set(a) | set(own)))})
        shown = ", ".join(f"{k}={own.get(k)}" for k in keys)
        labels.append(f"{method} ({shown})" if shown else str(method))
    return labels


def _differing(a: dict, b: dict, keys: set) -> set:
    return {k for k in keys if a.get(k) != b.get(k)}


def format_table(df: pd.DataFrame, fmt: str = "md") -> str:
    """Render build_table's frame: 'md' (pipe table), 'csv' (raw numbers), 'latex' (booktabs).
    The benchmark is not a column: a table shows one (rows.by_benchmark), and its
    heading names it (cl-bench leaderboard)."""
    if fmt == "csv":
        return df.drop(columns=["Benchmark"], errors="ignore").to_csv(index=False, na_rep="")
    if fmt not in FORMATS:
        raise UserError(f"unknown leaderboard format {fmt!r}; choose one of {', '.join(FORMATS)}")
    headers, rows = display_rows(df)
    return render(rows, headers, fmt, ["left"] * 4 + ["right"] * (len(headers) - 4)) + "\n"


# The symbols of the cells and headers that pdflatex has no text glyph for (its input is
# UTF-8, but "Unicode character ≠ not set up for use with LaTeX"): as LaTeX writes them
LATEX_SYMBOLS = {"±": r"$\pm$", "≠": r"$\neq$", "Δ": r"$\Delta$", "ρ": r"$\rho$", "α": r"$\alpha$",
                 "λ": r"$\lambda$", "−": "$-$", "–": "--"}


def render(rows: list[list], headers: list[str], fmt: str, colalign: list[str] | None = None) -> str:
    """Formatted cells as a Markdown pipe table ('md') or a LaTeX booktabs one ('latex',
    pdflatex-safe: LATEX_SYMBOLS). disable_numparse: the cells are already formatted;
    tabulate would re-round "45.0" to "45"."""
    text = tabulate(rows, headers, tablefmt="pipe" if fmt == "md" else "latex_booktabs", colalign=colalign,
                    disable_numparse=True)
    return text.translate(str.maketrans(LATEX_SYMBOLS)) if fmt == "latex" else text



# A table's heading line, by format, where the runs are not all the default benchmark's (in
# Markdown a bold line, not a heading: the table often sits inside a document's own section)
HEADING = {"md": "**Benchmark: {}**\n\n", "latex": "% benchmark: {}\n", "csv": "# benchmark: {}\n"}


def per_benchmark(runs: list, build: Callable) -> list[tuple[str | None, object]]:
    """`build` of each benchmark's runs (rows.by_benchmark's order), so runs of two
    benchmarks never share a table: [(benchmark, table)], or [(None, table)] where
    every run is the default benchmark's (TRACE's), whose one table needs no heading."""
    groups = by_benchmark(runs)
    if list(groups) in ([], [DEFAULT_BENCHMARK]):
        return [(None, build(runs))]
    return [(name, build(group)) for name, group in groups.items()]


def render_tables(tables: list[tuple[str | None, object]], render: Callable, fmt: str = "md") -> str:
    """per_benchmark's tables in `fmt`: each after a line naming its benchmark (none
    for the default benchmark's table alone, which reads as it always did), a blank
    line between them."""
    return "\n".join(("" if name is None else HEADING[fmt].format(name)) + render(table, fmt)
                      for name, table in tables)
