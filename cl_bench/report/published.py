"""`cl-bench leaderboard --view published`: each run's scores also as other codebases
compute them, each column labelled with its source, so a row can be set beside a
published table.

One row per run (no pooling over seeds: published tables give single runs). The
cells are rescored from the run's stored predictions (predictions.jsonl) with the
"trace" scorer set (cl_bench/metrics/trace_scorers.py: TRACE's own evaluation
code, through the libraries it uses); only the cells the summaries need are
scored: the final row and the diagonal. Columns (SOURCES gives each tag's source):
  - OP [TRACE]: metrics.published.trace_op of the TRACE-scored matrix;
  - BWT [TreeLoRA]: metrics.published.treelora_bwt of the same matrix (TreeLoRA's
    collect_results reads TRACE's result files, so its cells are TRACE's);
  - BWT [TRACE]: metrics.published.trace_bwt of the same matrix, the paper's
    formula as the project's reference notes quote it (TRACE's code has none);
  - Last Acc, BWT [cl-bench]: the record's own summary, for comparison;
  - <task> [TRACE eval]: the final row's cells, TRACE-scored.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pandas as pd

from cl_bench.benchmark import DEFAULT as DEFAULT_BENCHMARK
from cl_bench.errors import UserError
from cl_bench.metrics import trace_scorers
from cl_bench.metrics.cl import SUMMARY
from cl_bench.metrics.published import trace_bwt, trace_op, treelora_bwt
from cl_bench.record.io import PREDICTIONS_FILE, read_jsonl, stage_number
from cl_bench.record.schema import RunRecord
from cl_bench.report.leaderboard.table import FORMATS, MISSING, render

log = logging.getLogger(__name__)

RUN_COLUMNS = ["Run", "Method", "Profile", "Precision", "Tasks"]
OWN = ("last_acc", "bwt")  # the record's own summaries, shown beside (metrics/cl.py's table)
SCORE_COLUMNS = ["OP [TRACE]", "BWT [TRACE]", "BWT [TreeLoRA]"] + [f"{SUMMARY[k].label} [cl-bench]" for k in OWN]
CELL_TAG = "[TRACE eval]"


def sources() -> list[str]:
    """One line per column tag: the definition and the file it comes from."""
    return [
        "[TRACE] OP = mean_j R[T-1][j], the final row's mean, and BWT = (1/T) sum_{i<=T} (R[T-1][i] - R[i][i]), "
        "the last task's zero term included (the TRACE paper, Wang et al., 2023, as the project's reference notes "
        "quote it: not checked against the paper's text here; TRACE's code computes neither), on the "
        "[TRACE eval] cells.",
        "[TreeLoRA] BWT = (1/T) sum_i min(R[T-1][i] - R[i][i], 0), gains clamped to 0 "
        "(ZinYY/TreeLoRA inference/collect_results.py), on the [TRACE eval] cells.",
        "[TRACE eval] each cell as BeyonderXX/TRACE metrics.py and evaluations/eval_*.py score it: rouge==1.0.1 "
        f"ROUGE-L, fuzzywuzzy fuzz.ratio ({trace_scorers.fuzz_backend()} backend), SARI as HF's metric, "
        "exact-match accuracy unstripped; from the run's predictions.jsonl.",
        "[cl-bench] the run record's summary: Last Acc (each task's last score, averaged: the final-row mean "
        "on a complete run) and BWT = (1/(T-1)) sum_{i<T-1} "
        "(R[T-1][i] - R[i][i]), cl-bench's scorers.",
    ]


def _metrics(run: RunRecord) -> dict[tuple[int, str], str]:
    """(stage, task) -> the metric cl-bench scored that cell with (the record's task_metrics)."""
    return {(m["stage"], m["task"]): m["metric"] for m in run.task_metrics if "metric" in m}


def trace_matrix(run: RunRecord, predictions: list[dict]) -> list[list[float | None]]:
    """R[b][j] rescored with the "trace" set from `predictions`, for the cells on the
    final row and the diagonal (None elsewhere and where the run has no predictions)."""
    tasks, n_stages = run.tasks, len(run.matrix)
    wanted = {(n_stages - 1, j) for j in range(len(tasks))} | {(j, j) for j in range(min(n_stages, len(tasks)))}
    groups: dict[tuple[int, int], list[dict]] = {}
    col = {name: j for j, name in enumerate(tasks)}
    for row in predictions:
        key = (row["stage"], col.get(row["task"], -1))
        if key in wanted:
            groups.setdefault(key, []).append(row)
    metrics = _metrics(run)
    R: list[list[float | None]] = [[None] * len(tasks) for _ in range(n_stages)]
    for (b, j), rows in sorted(groups.items()):
        metric = metrics.get((b, tasks[j]))
        if metric is None:
            raise UserError(f"{run.source}: task_metrics has no metric for stage {stage_number(b)} ('stage': {b} "
                            f"in the file), task {tasks[j]}; "
                            f"the record is incomplete")
        rows.sort(key=lambda r: r["index"])
        R[b][j] = trace_scorers.score(metric, [r["prediction"] for r in rows], [r["answer"] for r in rows],
                                      [r["prompt"] for r in rows])
    return R


def _row(run: RunRecord) -> dict:
    predictions = read_jsonl(Path(run.source).parent / PREDICTIONS_FILE) if run.source else []
    R = trace_matrix(run, predictions)
    summary = run.summary or {}
    row = {"Run": run.run_id, "Method": run.method, "Profile": run.profile, "Precision": run.precision,
           "Tasks": len(run.tasks), "OP [TRACE]": trace_op(R), "BWT [TRACE]": trace_bwt(R),
           "BWT [TreeLoRA]": treelora_bwt(R),
           **{f"{SUMMARY[k].label} [cl-bench]": summary.get(k) for k in OWN}}
    row.update({f"{task} {CELL_TAG}": R[-1][j] if R else None for j, task in enumerate(run.tasks)})
    return row


def build_table(runs: list[RunRecord]) -> pd.DataFrame:
    """One row per TRACE run, in the order given (leaderboard.load_runs: by path); runs of
    another benchmark are left out, with a line naming them: TRACE's scorers and
    published tables are TRACE's."""
    other = [run for run in runs if run.benchmark != DEFAULT_BENCHMARK]
    if other:
        log.warning("published view: %d run(s) of other benchmarks left out (TRACE's scorers score TRACE "
                    "runs only): %s", len(other), ", ".join(sorted({str(run.source or run.run_id) for run in other})))
    runs = [run for run in runs if run.benchmark == DEFAULT_BENCHMARK]
    rows = []
    for i, run in enumerate(runs, 1):
        log.info("published view: scoring %s with TRACE's scorers (%d/%d)", run.run_id, i, len(runs))
        rows.append(_row(run))
    cells = list(dict.fromkeys(k for r in rows for k in r if k.endswith(CELL_TAG)))
    return pd.DataFrame(rows, columns=RUN_COLUMNS + SCORE_COLUMNS + cells)


def format_table(df: pd.DataFrame, fmt: str = "md") -> str:
    """'md' or 'latex' (numbers to 2 decimals, as published tables give them, and
    the sources under the table) or 'csv' (raw numbers, no legend)."""
    if fmt == "csv":
        return df.to_csv(index=False, na_rep="")
    if fmt not in FORMATS:
        raise UserError(f"unknown leaderboard format {fmt!r}; choose one of {', '.join(FORMATS)}")
    numeric = [c for c in df.columns if c not in RUN_COLUMNS]
    rows = [[str(r[c]) for c in RUN_COLUMNS] + [MISSING if pd.isna(r[c]) else f"{r[c]:.2f}" for c in numeric]
            for r in df.to_dict("records")]
    table = render(rows, list(df.columns), fmt, ["left"] * 4 + ["right"] * (len(df.columns) - 4))
    legend = "\n".join(("- " if fmt == "md" else "% ") + line for line in sources())
    return f"{table}\n\n{legend}\n"
