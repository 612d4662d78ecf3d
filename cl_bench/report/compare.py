"""`cl-bench compare RUN_A RUN_B [...]`: paired differences between runs over the
same test items.

Each run after the first is compared with the first: for every summary, and for
every task's final score (after the last stage that evaluated it), the
difference (run - first) with its 95% paired-bootstrap interval and p-value
(cl_bench/metrics/bootstrap.py). `cl-bench site` draws its compare pages from here. The runs must share tasks, test items and
budget (training data, epochs, batch, lengths, replay budget, decoding budget
and model), precision (`auto` is bf16 on one machine and fp32 on another, and
the two score differently) and generator (eval.generator: hf or vllm); anything that differs is named and the comparison refused.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from tabulate import tabulate

from cl_bench.record import io as results
from cl_bench.report.figures.depth import decision_agreement
from cl_bench.errors import UserError
from cl_bench.report.general import LIMA, compare_general
from cl_bench.metrics.cl import SUMMARIES, SUMMARY
from cl_bench.metrics.intervals import SEED, ItemTable, point_summaries, replicates
from cl_bench.metrics import bootstrap
from cl_bench.record.schema import RunRecord

# Config fields that fix a run's budget: two runs compared must agree on all of them.
BUDGET_FIELDS = (
    ("model",), ("data", "order"), ("train", "batch_size"), ("train", "epochs"), ("train", "epochs_per_task"),
    ("train", "max_prompt_len"), ("train", "max_answer_len"), ("train", "truncation"),
    ("train", "truncation_head"), ("eval", "max_new_tokens_cap"), ("replay", "fraction"),
    ("replay", "per_task"), ("replay", "lima"), ("replay", "policy"),
)


def _get(d: dict, keys: tuple[str, ...]):
    for k in keys:
        d = (d or {}).get(k)
    return d


def differences(a: RunRecord, b: RunRecord, items: bool = True) -> list[str]:
    """What makes records `a` and `b` incomparable item by item: tasks, the test
    items or training subset of a task (unless `items` is False: runs of other
    seeds), or a budget field; [] when none."""
    if a.benchmark != b.benchmark:
        return [f"benchmark: {a.benchmark} vs {b.benchmark}"]
    if a.tasks != b.tasks:
        return [f"tasks: {','.join(a.tasks)} vs {','.join(b.tasks)}"]
    out = []
    for task in a.tasks if items else []:
        for split, what in (("test", "test items"), ("train", "training subset")):
            pa, pb = (_get(r.data, (task, split)) or {} for r in (a, b))
            if (pa.get("indices"), pa.get("sha256")) != (pb.get("indices"), pb.get("sha256")):
                na, nb = (len(p.get("indices") or ()) for p in (pa, pb))
                why = f"{na} vs {nb} items" if na != nb else f"seed {a.seed} vs {b.seed}, or other data"
                out.append(f"{task}: the {what} differ ({why})")
    if a.precision != b.precision:  # `auto` resolves per machine: bf16 where the CPU has it, else fp32
        out.append(f"precision: {a.precision} vs {b.precision} (set train.precision and eval.precision "
                   f"to the same value for both runs)")
    if a.generator != b.generator:  # vllm decodes in bf16 throughout, hf under autocast: other predictions
        out.append(f"generator: {a.generator} vs {b.generator} (set eval.generator to the same value for both runs)")
    for keys in BUDGET_FIELDS:
        va, vb = _get(a.config, keys), _get(b.config, keys)
        if va != vb:
            out.append(f"{'.'.join(keys)}: {va!r} vs {vb!r}")
    return out


def _table(run_dir: Path, record: RunRecord) -> ItemTable:
    predictions = results.read_jsonl(run_dir / results.PREDICTIONS_FILE)
    if not predictions:
        raise UserError(f"{run_dir}: no {results.PREDICTIONS_FILE}, so no item scores to compare; "
                        f"pass a run folder that has finished a stage")
    try:
        return ItemTable.from_run(record, predictions)
    except (KeyError, ValueError) as exc:
        raise UserError(f"{run_dir / results.PREDICTIONS_FILE}: does not match its run.json ({exc}); "
                        f"the run folder is damaged") from None


def _final_scores(table: ItemTable, resamples: int) -> tuple[np.ndarray, np.ndarray]:
    """Per task, the score after the last stage that evaluated it: (T,) points and
    (B, T) replicates over the same item draws as intervals.replicates."""
    R = table.matrices()[0][0]  # (S, T)
    Rr = table.matrices(bootstrap.draws([len(i) for i in table.items], resamples, SEED))[0]  # (B, S, T)
    last = [max((b for b in range(R.shape[0]) if np.isfinite(R[b, j])), default=None) for j in range(R.shape[1])]
    point = np.array([np.nan if b is None else R[b, j] for j, b in enumerate(last)])
    reps = np.stack([np.full(len(Rr), np.nan) if b is None else Rr[:, b, j] for j, b in enumerate(last)], axis=1)
    return point, reps


def compare(run_dirs: list[Path], resamples: int = bootstrap.RESAMPLES) -> dict[str, Any]:
    """{"baseline", "resamples", "comparisons": [{"run", "summaries": {name: {run,
    baseline, diff, ci, p}}, "tasks": {task: {...}}, "general"?, "decisions"?}]}: every run
    against the first, paired over items; "tasks" holds each task's final score;
    "general", the final ΔLima and ΔG where both runs measured the same items; "decisions", where both runs decide per layer and expert (expand or recycle), how
    often they decide alike (analysis.depth.decision_agreement)."""
    if len(run_dirs) < 2:
        raise UserError("compare needs at least two run folders: the baseline first, then the others")
    run_dirs = [Path(d) for d in run_dirs]
    records = [results.read_record(d) for d in run_dirs]
    for d, rec in zip(run_dirs[1:], records[1:]):
        problems = differences(records[0], rec)
        if problems:
            raise UserError(f"{d}: not comparable with {run_dirs[0]}: {'; '.join(problems)}")
    base_rec, base_table = records[0], _table(run_dirs[0], records[0])
    loaded = [(rec, _table(d, rec)) for d, rec in zip(run_dirs, records)]
    base_reps = replicates(base_table, resamples)
    base_point = point_summaries(base_table)
    base_final, base_final_reps = _final_scores(base_table, resamples)
    out = []
    for d, (rec, table) in zip(run_dirs[1:], loaded[1:]):
        reps = replicates(table, resamples)
        point = point_summaries(table)
        rows = {}
        for name in (s.key for s in SUMMARIES):
            a, b = point[name], base_point[name]
            if a is None or b is None:
                continue
            rows[name] = {"run": a, "baseline": b,
                          **bootstrap.paired_difference(reps[name], base_reps[name], a - b)}
        final, final_reps = _final_scores(table, resamples)
        tasks = {}
        for j, task in enumerate(rec.tasks):
            if np.isfinite(final[j]) and np.isfinite(base_final[j]):
                tasks[task] = {"run": float(final[j]), "baseline": float(base_final[j]),
                               **bootstrap.paired_difference(final_reps[:, j], base_final_reps[:, j],
                                                             float(final[j] - base_final[j]))}
        decisions = decision_agreement(rec.params, base_rec.params)
        general = compare_general(rec.general, base_rec.general, resamples)
        out.append({"run": str(d), "method": rec.method, "summaries": rows, "tasks": tasks,
                    **({"general": general} if general else {}), **({"decisions": decisions} if decisions else {})})
    return {"baseline": str(run_dirs[0]), "baseline_method": base_rec.method, "split": base_rec.split,
            "resamples": resamples,
            "seed": SEED, "level": bootstrap.LEVEL, "comparisons": out}


def format_comparison(result: dict[str, Any]) -> str:
    rows = []
    for comp in result["comparisons"]:
        named = [(SUMMARY[k].label, r) for k, r in comp["summaries"].items()]
        named += [(f"{task} (final)", r) for task, r in comp.get("tasks", {}).items()]
        named += [(f"{name} (final{', nats/token' if name == LIMA else ''})", r)
                  for name, r in comp.get("general", {}).items()]
        for name, r in named:
            ci = r["ci"]
            verdict = ("not distinguishable" if ci is None or ci[0] <= 0 <= ci[1]
                       else "higher" if r["diff"] > 0 else "lower")
            k = 3 if "nats" in name else 1  # a loss in nats moves in the second decimal
            rows.append([comp["run"], name, f"{r['run']:.{k}f}", f"{r['baseline']:.{k}f}",
                         f"{r['diff']:+.{k}f}", "–" if ci is None else f"[{ci[0]:+.{k}f}, {ci[1]:+.{k}f}]",
                         "–" if r["p"] is None else f"{r['p']:.3f}", verdict])
    head = ["run", "summary", "run", "baseline", "difference", "95% interval", "p", "at 95%"]
    text = (f"baseline: {result['baseline']} ({result['baseline_method']}); paired bootstrap over "
            f"{result.get('split', 'test')} items, "
            f"{result['resamples']} resamples\n" + tabulate(rows, head, tablefmt="github", disable_numparse=True))
    for comp in result["comparisons"]:
        if "decisions" in comp:
            text += f"\n{comp['run']}: {_format_agreement(comp['decisions'])}"
    return text


def _format_agreement(d: dict[str, Any]) -> str:
    kappa = "undefined (chance alone agrees everywhere)" if d["kappa"] is None else f"{d['kappa']:+.2f}"
    stages = ", ".join(f"stage {int(s) + 1} {x['agree']:.0%} of {x['n']}" for s, x in d["stages"].items())
    return (f"decisions agree with the baseline's in {d['agree']:.1%} of {d['n']} ({stages}); expand rate "
            f"{d['expand'][0]:.0%} vs {d['expand'][1]:.0%}; Cohen's kappa {kappa}")
