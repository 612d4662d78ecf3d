"""The general-ability numbers of a record as text (`cl-bench show`), as paired
differences between runs (`cl-bench compare`), and per leaderboard row."""
from __future__ import annotations

from typing import Any

import numpy as np

from cl_bench.general import lima as lima_probe
from cl_bench.metrics import bootstrap


def _ci(ci) -> str:
    return "" if ci is None else f" [{ci[0]:+.3f}, {ci[1]:+.3f}]"


def lima_rows(general: dict | None, stage_labels: list[str]) -> list[dict[str, str]]:
    """One row per probed point: {"point", "nll", "delta", "seconds"} as text; [] without the probe."""
    lima = (general or {}).get("lima") or {}
    points, delta = lima.get("points") or {}, lima.get("delta") or {}
    rows = []
    for point in sorted(points, key=int):
        d = delta.get(point)
        rows.append({"point": "zero-shot" if point == lima_probe.ZERO_SHOT
                     else f"after {int(point) + 1}: {stage_labels[int(point)]}",
                     "nll": f"{points[point]['mean']:.3f}",
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


def format_general(general: dict | None, stage_labels: list[str]) -> str | None:
    """The lines `cl-bench show` prints under the matrix; None where the run has nothing."""
    note = lima_note(general)
    if note is None:
        return None
    return "\n".join([note] + [f"  {r['point']:<28} {r['nll']}  ΔLima {r['delta']}"
                               for r in lima_rows(general, stage_labels)])


def compare_general(run: dict | None, base: dict | None, resamples: int = bootstrap.RESAMPLES) -> dict[str, Any]:
    """Paired differences (run - baseline) of the final ΔLima, where both runs probed the same items
    and share the last probed stage; {} otherwise."""
    a, b = (((g or {}).get("lima")) for g in (run, base))
    if not a or not b or not a.get("delta") or not b.get("delta"):
        return {}
    last = max(a["delta"], key=int)
    if last not in b["delta"] or a["points"][last]["items"] != b["points"][last]["items"]:
        return {}
    va, ra = lima_probe.delta_replicates(a["points"], last, resamples)
    vb, rb = lima_probe.delta_replicates(b["points"], last, resamples)
    return {"ΔLima": {"run": va, "baseline": vb, **bootstrap.paired_difference(ra, rb, va - vb)}}


LIMA = "ΔLima"  # the leaderboard's column stem: "ΔLima mean", "ΔLima std", "ΔLima lo", "ΔLima hi"
LIMA_STATS = ("mean", "std", "lo", "hi")


def lima_cell(mean, std, lo, hi) -> str:
    """'+0.123 ± 0.010 [+0.100, +0.150]' (nats per token; the std only over several runs); '–' when absent."""
    if mean is None or mean != mean:
        return "–"
    text = f"{mean:+.3f}" if std is None or std != std else f"{mean:+.3f} ± {std:.3f}"
    return text if lo is None or lo != lo else f"{text} [{lo:+.3f}, {hi:+.3f}]"


def lima_group(records: list) -> dict[str, float | None]:
    """A leaderboard row's final ΔLima over its runs (seeds): mean, sample std (NaN for one run) and
    the 95% interval over items and seeds (bootstrap.pooled); all None where a run lacks it."""
    finals = [lima_probe.final_delta(r.general) for r in records]
    if not finals or any(f is None for f in finals):
        return {"mean": None, "std": None, "lo": None, "hi": None}
    values = np.array([f["value"] for f in finals])
    reps = [lima_probe.delta_replicates(r.general["lima"]["points"], str(f["stage"]))[1]
            for r, f in sorted(zip(records, finals), key=lambda rf: rf[0].seed or 0)]
    pooled = reps[0] if len(reps) == 1 else bootstrap.pooled(reps, bootstrap.RESAMPLES, seed=0)
    lo, hi = bootstrap.interval(pooled)
    return {"mean": float(values.mean()), "std": float(values.std(ddof=1)) if len(values) > 1 else float("nan"),
            "lo": lo, "hi": hi}
