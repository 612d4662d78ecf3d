"""The general-ability numbers of a record as text (`cl-bench show`) and as site rows,
as paired differences between runs (`cl-bench compare`), and per leaderboard row:
the Lima probe's ΔLima (lima.py) and lm-eval's ΔG (lm_eval_tasks.py)."""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

from cl_bench.eval.general import lima as lima_probe
from cl_bench.eval.general import lm_eval_tasks
from cl_bench.metrics import bootstrap

LIMA, DELTA_G = "ΔLima", "ΔG"  # the leaderboard's column stems: "<stem> mean", "<stem> std", "<stem> lo", "<stem> hi"
STATS = ("mean", "std", "lo", "hi")
DIGITS = {LIMA: 3, DELTA_G: 1}  # a loss in nats moves in the second decimal; ΔG is in points (0-100)


def _ci(ci, k: int = 3) -> str:
    return "" if ci is None else f" [{ci[0]:+.{k}f}, {ci[1]:+.{k}f}]"


def _point_name(point: str, stage_labels: list[str]) -> str:
    return "zero-shot" if point == lima_probe.ZERO_SHOT else f"after {int(point) + 1}: {stage_labels[int(point)]}"


def lima_rows(general: dict | None, stage_labels: list[str]) -> list[dict[str, str]]:
    """One row per probed point: {"point", "nll", "delta", "seconds"} as text; [] without the probe."""
    lima = (general or {}).get("lima") or {}
    points, delta = lima.get("points") or {}, lima.get("delta") or {}
    rows = []
    for point in sorted(points, key=int):
        d = delta.get(point)
        rows.append({"point": _point_name(point, stage_labels), "nll": f"{points[point]['mean']:.3f}",
                     "delta": "–" if d is None else f"{d['value']:+.3f}{_ci(d['ci'])}",
                     "seconds": f"{points[point]['seconds']:.1f}"})
    return rows


def lima_note(general: dict | None) -> str | None:
    """What the probe measured, in one line; None without the probe."""
    lima = (general or {}).get("lima")
    if not lima:
        return None
    n = len(next(iter(lima["points"].values()))["items"])
    return (f"Lima probe: {n} held-out Lima {lima['split']}-split items, mean answer NLL per token (nats; lower "
            f"is better), ΔLima = after stage - zero-shot with its 95% paired interval over items; a proxy (loss on "
            f"general instruction data), not TRACE's GPT-4 judgement")


def task_rows(general: dict | None, stage_labels: list[str]) -> tuple[list[str], list[dict[str, Any]]]:
    """lm-eval's tasks: (task names, one row per scored point {"point", "cells": per task 'score ± stderr
    [ci]', "delta": ΔG [ci]}); ([], []) without general.tasks."""
    block = (general or {}).get("lm_eval") or {}
    points, delta = block.get("points") or {}, block.get("delta_g") or {}
    if not points:
        return [], []
    names = list(next(iter(points.values()))["tasks"])
    rows = []
    for point in sorted(points, key=int):
        cells = []
        for name in names:
            t = points[point]["tasks"][name]
            err = "" if t["stderr"] is None else f" ± {t['stderr']:.1f}"
            ci = "" if t["ci"] is None else f" [{t['ci'][0]:.1f}, {t['ci'][1]:.1f}]"
            cells.append(f"{t['score']:.1f}{err}{ci}")
        d = delta.get(point)
        rows.append({"point": _point_name(point, stage_labels), "cells": cells,
                     "delta": "–" if d is None else f"{d['value']:+.1f}{_ci(d['ci'], 1)}"})
    return names, rows


def format_general(general: dict | None, stage_labels: list[str]) -> str | None:
    """The lines `cl-bench show` prints under the matrix; None where the run has nothing."""
    out = []
    note = lima_note(general)
    if note is not None:
        out += [note] + [f"  {r['point']:<28} {r['nll']}  ΔLima {r['delta']}" for r in lima_rows(general, stage_labels)]
    names, rows = task_rows(general, stage_labels)
    if rows:
        block = general["lm_eval"]
        out.append(f"general tasks (lm-eval {block['version']}, limit {block['limit']}; score 0-100 ± lm-eval's "
                   f"stderr [95% bootstrap over items]); ΔG = mean over tasks of (score - zero-shot score), TRACE's")
        out += [f"  {r['point']:<28} " + " | ".join(f"{n} {c}" for n, c in zip(names, r["cells"]))
                + f"  ΔG {r['delta']}" for r in rows]
    return "\n".join(out) or None


def _final(delta: dict) -> str | None:
    return max(delta, key=int) if delta else None


def compare_general(run: dict | None, base: dict | None, resamples: int = bootstrap.RESAMPLES) -> dict[str, Any]:
    """Paired differences (run - baseline) of the final ΔLima and the final ΔG, each where both runs
    measured the same items at the same last point; {} where neither."""
    out = {}
    a, b = (((g or {}).get("lima")) or {} for g in (run, base))
    last = _final(a.get("delta"))
    if last is not None and last in (b.get("delta") or {}) and a["points"][last]["items"] == b["points"][last]["items"]:
        va, ra = lima_probe.delta_replicates(a["points"], last, resamples)
        vb, rb = lima_probe.delta_replicates(b["points"], last, resamples)
        out[LIMA] = {"run": va, "baseline": vb, **bootstrap.paired_difference(ra, rb, va - vb)}
    a, b = (((g or {}).get("lm_eval")) or {} for g in (run, base))
    last = _final(a.get("delta_g"))
    if last is not None and last in (b.get("delta_g") or {}) and _same_items(a["points"][last], b["points"][last]):
        va, _, ra = lm_eval_tasks.delta_g_replicates(a["points"], last, resamples)
        vb, _, rb = lm_eval_tasks.delta_g_replicates(b["points"], last, resamples)
        out[DELTA_G] = ({"run": va, "baseline": vb, **bootstrap.paired_difference(ra, rb, va - vb)}
                        if ra is not None and rb is not None else {"run": va, "baseline": vb, "diff": va - vb,
                                                                   "ci": None, "p": None})
    return out


def _same_items(a: dict, b: dict) -> bool:
    return list(a["tasks"]) == list(b["tasks"]) and all(a["tasks"][n]["items"] == b["tasks"][n]["items"]
                                                        for n in a["tasks"])


def cell(stem: str, mean, std, lo, hi) -> str:
    """'+0.123 ± 0.010 [+0.100, +0.150]' (the std only over several runs); '–' when absent."""
    if mean is None or mean != mean:
        return "–"
    k = DIGITS[stem]
    text = f"{mean:+.{k}f}" if std is None or std != std else f"{mean:+.{k}f} ± {std:.{k}f}"
    return text if lo is None or lo != lo else f"{text} [{lo:+.{k}f}, {hi:+.{k}f}]"


def _lima_final(record) -> tuple[float, np.ndarray] | None:
    final = lima_probe.final_delta(record.general)
    return None if final is None else lima_probe.delta_replicates(record.general["lima"]["points"],
                                                                  str(final["stage"]))


def _delta_g_final(record) -> tuple[float, np.ndarray | None] | None:
    block = (record.general or {}).get("lm_eval") or {}
    last = _final(block.get("delta_g"))
    if last is None:
        return None
    value, _, reps = lm_eval_tasks.delta_g_replicates(block["points"], last)
    return value, reps


FINALS: dict[str, Callable] = {LIMA: _lima_final, DELTA_G: _delta_g_final}


def group_stats(stem: str, records: list) -> dict[str, float | None]:
    """A leaderboard row's final ΔLima or ΔG over its runs (seeds): mean, sample std (NaN for one run)
    and the 95% interval over items and seeds (bootstrap.pooled); all None where a run lacks it."""
    finals = [FINALS[stem](r) for r in sorted(records, key=lambda r: r.seed or 0)]
    if not finals or any(f is None for f in finals):
        return dict.fromkeys(STATS)
    values = np.array([v for v, _ in finals])
    reps = [r for _, r in finals]
    lo = hi = None
    if all(r is not None for r in reps):
        pooled = reps[0] if len(reps) == 1 else bootstrap.pooled(reps, bootstrap.RESAMPLES, seed=0)
        lo, hi = bootstrap.interval(pooled)
    return {"mean": float(values.mean()), "std": float(values.std(ddof=1)) if len(values) > 1 else float("nan"),
            "lo": lo, "hi": hi}
