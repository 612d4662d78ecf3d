"""The sensitivity view, and the rank-order verdict between two leaderboards.

Sensitivity (`cl-bench tune sensitivity GRID`): for each method of the grid, its
Last Acc and BWT on the tuning order at each value of its rate grid (at the
strength's default) and, once the rate is decided, of its strength grid at the
chosen rate, each with its 95% interval over the eval items (the run's record,
cl_bench/metrics/intervals.py); a table (Markdown) and a figure (one panel per method:
Last Acc and BWT against the value, log scale).

Verdict (`cl-bench tune verdict GRID`): rows are the ranked methods present in both
leaderboards (the shared-rate one, every method at the arguments it has without
any, and the tuned one; tuned.select). The reference rows (multitask, individual)
are left out: they are the same runs in both, so they would pull rho toward 1 and
fill top places (decided 2026-12-06, before any finals run). Rank agreement is Spearman's rho between
the two orders of Last Acc,

    rho = 1 - 6 sum_i d_i^2 / (n (n^2 - 1))   (ranks with ties averaged: rho is
    then Pearson's r of the ranks),

its 95% interval the percentile interval of rho over the paired bootstrap
replicates (the same item draws for every run, cl_bench/metrics/intervals.py; pooled over
seeds as the leaderboard pools them). Two rows trade places at 95% when the
interval of Last Acc(a) - Last Acc(b) lies above 0 in one leaderboard and below 0
in the other. The top rows' order is each leaderboard's first `top` rows by mean
Last Acc.
"""
from __future__ import annotations

import math
from itertools import combinations
from pathlib import Path

import numpy as np

from cl_bench import registry
from cl_bench.metrics import bootstrap
from cl_bench.metrics.cl import summaries
from cl_bench.metrics.intervals import record_intervals
from cl_bench.record.io import read_record
from cl_bench.report.leaderboard.rows import entries, group_replicates
from cl_bench.report.text import point_and_interval
from cl_bench.tools.tuning import plan
from cl_bench.tools.tuning.grid import Grid

SHOWN = summaries("last_acc", "bwt")  # each grid value's scores, from metrics/cl.py's table


def _scores(folder: Path) -> dict:
    """Last Acc and BWT of a complete run with their intervals; {} when not done."""
    if not (folder / "run.json").is_file():
        return {}
    record = read_record(folder)
    if record.status != "complete":
        return {}
    iv = record_intervals(record, folder) or {}
    cis = iv.get("summary_ci") or {}
    return {s.key: (record.summary.get(s.key), *(cis.get(s.key) or (None, None))) for s in SHOWN}


def rows(grid: Grid, records: plan.Records, decided: dict[str, float]) -> list[dict]:
    """Per method and grid value: {method, argument, value, base, at, folder, last_acc, bwt}
    (each score a (point, lo, hi) triple; None where the run is not done)."""
    out = []
    for method, g in grid.methods.items():
        lines = [("lr", args, g.base_lr, None) for args in g.rate_points()]
        if g.strength and method in decided:
            lines += [(g.strength, args, g.base_strength, decided[method]) for args in g.strength_points(decided[method])]
        for arg, args, base, at in lines:
            folder, _, _ = plan.point(grid, records, method, args)
            scores = _scores(records.root / folder)
            out.append({"method": method, "argument": arg, "value": args[arg], "base": math.isclose(args[arg], base),
                        "at": at, "folder": str(folder), **{s.key: scores.get(s.key) for s in SHOWN}})
    return out


def format_table(table: list[dict]) -> str:
    head = (f"| method | argument | value | {' | '.join(s.label for s in SHOWN)} | run |\n"
            f"|---|---|---|{'---|' * len(SHOWN)}---|\n")
    body = []
    for r in table:
        value = f"{r['value']:g}" + (" (base)" if r["base"] else "")
        arg = r["argument"] + ("" if r["at"] is None else f" at lr {r['at']:g}")
        scores = " | ".join(point_and_interval(r[s.key]) for s in SHOWN)
        body.append(f"| {r['method']} | {arg} | {value} | {scores} | `{r['folder']}` |")
    return head + "\n".join(body) + "\n"


def figure(table: list[dict], path: Path) -> Path:
    """One panel per method: Last Acc and BWT (95% intervals) against each rate, log x."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    methods = list(dict.fromkeys(r["method"] for r in table))
    cols = 4
    nrows = -(-len(methods) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(3.2 * cols, 2.6 * nrows), squeeze=False)
    for ax, method in zip(axes.flat, methods):
        rates = [r for r in table if r["method"] == method and r["argument"] == "lr"]
        for (key, label), mark in zip(((s.key, s.label) for s in SHOWN), ("o-", "s--")):  # one mark a summary
            done = [r for r in rates if r[key] and r[key][0] is not None]
            x = [r["value"] for r in done]
            y = [r[key][0] for r in done]
            err = [[r[key][0] - (r[key][1] if r[key][1] is not None else r[key][0]) for r in done],
                   [(r[key][2] if r[key][2] is not None else r[key][0]) - r[key][0] for r in done]]
            ax.errorbar(x, y, yerr=err, fmt=mark, capsize=3, label=label)
        base = next((r["value"] for r in rates if r["base"]), None)
        if base is not None:
            ax.axvline(base, color="grey", lw=0.8, ls=":")
        ax.set_xscale("log")
        grid_values = [r["value"] for r in rates]  # every panel spans its whole grid, run or not
        ax.set_xlim(min(grid_values) / 1.6, max(grid_values) * 1.6)
        ax.set_xticks(grid_values, [f"{v:g}" for v in grid_values], fontsize=7)
        ax.minorticks_off()
        if not any(r[s.key] and r[s.key][0] is not None for r in rates for s in SHOWN):
            ax.text(0.5, 0.5, "not run yet", transform=ax.transAxes, ha="center", va="center", color="grey")
            ax.set_yticks([])
        else:
            ax.axhline(0, color="black", lw=0.5)
        ax.set_title(method, fontsize=9)
    for ax in list(axes.flat)[len(methods):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7)
    fig.supxlabel("learning rate (dotted: the shared rate)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _spearman(a: np.ndarray, b: np.ndarray) -> float:
    """Spearman's rho: Pearson's r of the ranks (ties averaged)."""
    def ranks(x):
        order = np.argsort(x, kind="stable")
        r = np.empty(len(x))
        r[order] = np.arange(len(x), dtype=float)
        for v in np.unique(x):  # ties share their mean rank
            r[x == v] = r[x == v].mean()
        return r
    ra, rb = ranks(np.asarray(a, float)), ranks(np.asarray(b, float))
    if ra.std() == 0 or rb.std() == 0:
        return float("nan")
    return float(np.corrcoef(ra, rb)[0, 1])


def _by_method(runs: list) -> dict[str, tuple[float, np.ndarray | None]]:
    """Method -> (mean Last Acc over its runs, its Last Acc replicates); one argument set a method."""
    groups: dict[str, list] = {}
    for run in runs:
        groups.setdefault(run.method, []).append(run)
    out = {}
    for method, members in groups.items():
        reps = group_replicates(entries(members))
        out[method] = (float(np.mean([r.summary["last_acc"] for r in members])),
                       None if reps is None else reps["last_acc"])
    return out


def verdict(shared: list, tuned: list, top: int = 5) -> dict:
    """The rank-order verdict (module docstring) between two leaderboards' runs."""
    a, b = _by_method(shared), _by_method(tuned)
    methods = sorted(m for m in set(a) & set(b) if not registry.get(m).reference)
    out = {"methods": methods, "top": top,
           "shared_order": sorted(methods, key=lambda m: -a[m][0]), "tuned_order": sorted(methods, key=lambda m: -b[m][0])}
    out["top_changed"] = out["shared_order"][:top] != out["tuned_order"][:top]
    out["rho"] = _spearman([a[m][0] for m in methods], [b[m][0] for m in methods]) if len(methods) > 1 else None
    have = [m for m in methods if a[m][1] is not None and b[m][1] is not None]
    out["rho_ci"] = None
    if len(have) == len(methods) > 1:
        ra = np.stack([a[m][1] for m in methods], axis=1)  # (B, n)
        rb = np.stack([b[m][1] for m in methods], axis=1)
        out["rho_ci"] = bootstrap.interval(np.array([_spearman(x, y) for x, y in zip(ra, rb)]))
    trades = []
    for m1, m2 in combinations(have, 2):
        ci_a = bootstrap.interval(a[m1][1] - a[m2][1])
        ci_b = bootstrap.interval(b[m1][1] - b[m2][1])
        if ci_a and ci_b and ((ci_a[0] > 0 and ci_b[1] < 0) or (ci_a[1] < 0 and ci_b[0] > 0)):
            if ci_a[0] < 0:  # m2 is ahead at the shared rate: name it first, its intervals m2 - m1
                m1, m2, ci_a, ci_b = m2, m1, (-ci_a[1], -ci_a[0]), (-ci_b[1], -ci_b[0])
            trades.append({"shared_ahead": m1, "tuned_ahead": m2, "shared_ci": ci_a, "tuned_ci": ci_b})
    out["trades"] = trades
    return out


def format_verdict(v: dict) -> str:
    rho = "–" if v["rho"] is None else f"{v['rho']:+.2f}"
    ci = (" (no interval: a row's predictions are missing, or fewer than two rows)" if v["rho_ci"] is None else
          f" [{v['rho_ci'][0]:+.2f}, {v['rho_ci'][1]:+.2f}] (95%, paired bootstrap over items)")
    lines = [f"rows in both leaderboards: {len(v['methods'])}",
             f"Spearman's rho of Last Acc, shared-rate against tuned: {rho}{ci}",
             f"top {v['top']} shared-rate: {', '.join(v['shared_order'][:v['top']])}",
             f"top {v['top']} tuned:       {', '.join(v['tuned_order'][:v['top']])}",
             f"the top rows' order {'changes' if v['top_changed'] else 'does not change'} (point estimates; "
             "what differs at 95% is the pairs below)"]
    if not v["trades"]:
        lines.append("rows that trade places at 95%: none")
    for t in v["trades"]:
        lines.append(f"trade places at 95%: {t['shared_ahead']} ahead of {t['tuned_ahead']} at the shared rate "
                     f"[{t['shared_ci'][0]:+.1f}, {t['shared_ci'][1]:+.1f}], behind it tuned "
                     f"[{t['tuned_ci'][0]:+.1f}, {t['tuned_ci'][1]:+.1f}]")
    return "\n".join(lines) + "\n"
