"""The cost of two runs' stages, from their records' timing (`cl-bench analyze
RUN --against OTHER`).

Two runs of one task order and profile: training seconds per optimiser
step per stage (set-up of the stage included, so a method's per-task search
shows) and peak resident memory, with the ratios run / other and their median
over the stages compared; written as cost-vs-<other run id>.json. Two runs made
under different machine load (threads, other jobs) differ by that load as well:
`--calibrate-stage B` names a stage both runs compute identically (bilevel-cka's
first task is plain upcycling, the same work as upcycle's) and also gives every
step ratio divided by stage B's, which cancels the load factor.

The flags number stages as `show` does (from 1); `from_stage`, `calibrate_stage` and
each row's `stage` here and in the JSON are the files' 0-based positions (record/io).
"""
from __future__ import annotations

import statistics
from pathlib import Path

from cl_bench.errors import UserError
from cl_bench.record.io import RUN_FILE, read_finished, stage_number


def cost(run_dir: Path, other_dir: Path, from_stage: int = 0, calibrate_stage: int | None = None) -> dict:
    """The stage costs of `run_dir` against `other_dir` (module docstring), over
    the stages from `from_stage` that both finished."""
    run, other = read_finished(run_dir), read_finished(other_dir)
    for key in ("tasks", "profile"):
        if getattr(run, key) != getattr(other, key):
            raise UserError(f"{Path(other_dir) / RUN_FILE}: field {key} is {getattr(other, key)!r}, but "
                            f"{Path(run_dir) / RUN_FILE} has {getattr(run, key)!r}; compare runs of one profile "
                            f"and task order")
    timing = [{s.stage: s for s in r.timing.stages} for r in (run, other)]
    per_step = [{b: s.train_s / s.steps for b, s in t.items()} for t in timing]
    both = set(timing[0]) & set(timing[1])
    stages = sorted(b for b in both if b >= from_stage)
    if not stages:
        raise UserError(f"--from-stage {stage_number(from_stage)}: no stage from it on finished in both "
                        f"{run_dir} and {other_dir}")
    if calibrate_stage is not None and calibrate_stage not in both:
        raise UserError(f"--calibrate-stage {stage_number(calibrate_stage)}: not a stage both {run_dir} and "
                        f"{other_dir} finished (those are {', '.join(str(stage_number(b)) for b in sorted(both))})")
    ratio = {b: per_step[0][b] / per_step[1][b] for b in both}
    load = None if calibrate_stage is None else ratio[calibrate_stage]
    rows = [{"stage": b, "task": run.stages[b].label, "s_per_step": per_step[0][b],
             "other_s_per_step": per_step[1][b], "step_ratio": ratio[b],
             **({} if load is None else {"calibrated_step_ratio": ratio[b] / load}),
             "peak_rss_mb": timing[0][b].peak_rss_mb, "other_peak_rss_mb": timing[1][b].peak_rss_mb}
            for b in stages]
    peak = [max(r[k] for r in rows) if all(r[k] for r in rows) else None
            for k in ("peak_rss_mb", "other_peak_rss_mb")]
    out = {"run": run.run_id, "other": other.run_id, "from_stage": from_stage, "stages": rows,
           "median_step_ratio": statistics.median(r["step_ratio"] for r in rows),
           "peak_rss_mb": peak[0], "other_peak_rss_mb": peak[1],
           "peak_rss_ratio": peak[0] / peak[1] if all(peak) else None,
           "note": "peak_rss_mb: the process's peak resident memory by the end of each stage"}
    if load is not None:
        out.update(calibrate_stage=calibrate_stage, load_ratio=load,
                   median_calibrated_step_ratio=statistics.median(r["calibrated_step_ratio"] for r in rows))
    return out
