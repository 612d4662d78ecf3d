"""Intervals, answer form and the format/content split of one run, from its
record and predictions (cl_bench/metrics: bootstrap.py, answer_form.py, cl.py).

Everything here is recomputed from predictions.jsonl, so old records get
intervals too; the sequencer also stores the result in the record when a run
completes (`run.json: intervals`). The draws depend only on the number of test
items per task, the resamples and the seed, so two runs over the same items
are resampled alike and can be compared item by item (cl_bench/report/compare.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from cl_bench.record import io as results
from cl_bench.metrics import bootstrap
from cl_bench.metrics.answer_form import rules_of, well_formed
from cl_bench.metrics.cl import SUMMARIES, bwt_split, summarise
from cl_bench.record.schema import RunRecord

SEED = 0  # the bootstrap's own seed: fixed, so every run of the same items shares its draws


@dataclass
class ItemTable:
    """Per-item scores and answer-form flags of one run, by (stage, task index);
    stage -1 is the zero-shot row. Items are in test-set order (their `index`)."""

    tasks: list[str]
    n_stages: int
    items: list[list[int]]  # per task: the test items' indices in the data set
    scores: dict[tuple[int, int], np.ndarray]
    forms: dict[tuple[int, int], np.ndarray]

    @classmethod
    def from_run(cls, record: RunRecord, predictions: list[dict]) -> "ItemTable":
        tasks = record.tasks
        col = {name: j for j, name in enumerate(tasks)}
        groups: dict[tuple[int, int], list[dict]] = {}
        for row in predictions:
            groups.setdefault((row["stage"], col[row["task"]]), []).append(row)
        items: list[list[int] | None] = [None] * len(tasks)
        scores, forms = {}, {}
        # the benchmark's to declare (none: no form shares), found as the run found it: its
        # data.benchmark (a task folder's path; the name a folder benchmark records is registered
        # nowhere), else the record's name for it
        rules = _rules(record)
        for (b, j), rows in groups.items():
            rows.sort(key=lambda r: r["index"])
            order = [r["index"] for r in rows]
            if items[j] is None:
                items[j] = order
            elif items[j] != order:
                raise ValueError(f"task {tasks[j]}: stage {results.stage_number(b)} ('stage': {b} in "
                                 f"predictions.jsonl) scored other test items than an earlier stage")
            scores[b, j] = np.array([r["score"] for r in rows], float)
            if tasks[j] in rules:
                forms[b, j] = np.array(well_formed(tasks[j], [r["prediction"] for r in rows],
                                                   [r["prompt"] for r in rows], rules), float)
        return cls(tasks, len(record.matrix), [i or [] for i in items], scores, forms)

    def matrices(self, idx: list[np.ndarray] | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray,
                                                                      np.ndarray]:
        """(R, F, R0, F0): score and form-share matrices (S, T) and zero-shot rows (T,);
        with `idx`, (B, ...) replicates over those item draws instead."""
        shape = (self.n_stages + 1, len(self.tasks))  # row 0: zero-shot
        if idx is None:
            idx = [np.arange(len(i))[None, :] for i in self.items]
        shift = lambda cells: {(b + 1, j): v for (b, j), v in cells.items()}  # noqa: E731
        R = bootstrap.resample_cells(shift(self.scores), idx, shape)
        F = bootstrap.resample_cells(shift(self.forms), idx, shape)
        return R[:, 1:], F[:, 1:], R[:, 0], F[:, 0]


def _summaries(R: np.ndarray, F: np.ndarray, R0: np.ndarray) -> dict[str, float | None]:
    zero = None if np.isnan(R0).all() else R0.tolist()
    out = summarise(R.tolist(), zero)
    split = bwt_split(R.tolist(), F.tolist())
    return {**out, "bwt_format": split["format"], "bwt_content": split["content"]}


def point_summaries(table: ItemTable) -> dict[str, float | None]:
    """Every summary on the run's own items (what the record's summary holds, plus
    BWT's format and content parts)."""
    R, F, R0, _ = (a[0] for a in table.matrices())
    return _summaries(R, F, R0)


def replicates(table: ItemTable, resamples: int, seed: int = SEED) -> dict[str, np.ndarray]:
    """Every summary on each of `resamples` paired item resamples: name -> (B,)."""
    idx = bootstrap.draws([len(i) for i in table.items], resamples, seed)
    R, F, R0, _ = table.matrices(idx)
    rows = [_summaries(R[r], F[r], R0[r]) for r in range(resamples)]
    return {k: np.array([np.nan if row[k] is None else row[k] for row in rows]) for k in (s.key for s in SUMMARIES)}


def _nan_to_none(a: np.ndarray) -> list:
    return [[None if np.isnan(v) else float(v) for v in row] for row in np.atleast_2d(a)]


def run_intervals(record: RunRecord, predictions: list[dict], resamples: int = bootstrap.RESAMPLES,
                  seed: int = SEED) -> dict[str, Any]:
    """The run's point estimates with 95% intervals: every cell of R and of the
    zero-shot row, every summary, the answer-form share of every cell, and BWT's
    format and content parts."""
    table = ItemTable.from_run(record, predictions)
    _, F, _, F0 = (a[0] for a in table.matrices())
    point = point_summaries(table)
    idx = bootstrap.draws([len(i) for i in table.items], resamples, seed)
    Rr, _, R0r, _ = table.matrices(idx)
    reps = replicates(table, resamples, seed)

    def cell_ci(reps_: np.ndarray) -> list:
        return [[bootstrap.interval(reps_[:, b, j]) if not np.isnan(reps_[:, b, j]).all() else None
                 for j in range(reps_.shape[2])] for b in range(reps_.shape[1])]

    return {
        "resamples": resamples, "seed": seed, "level": bootstrap.LEVEL,
        "n_items": [len(i) for i in table.items],
        "matrix_ci": cell_ci(Rr),
        "zero_shot_ci": cell_ci(R0r[:, None, :])[0],
        "summary": point,
        "summary_ci": {k: bootstrap.interval(v) for k, v in reps.items()},
        "form_share": _nan_to_none(F),
        "zero_shot_form_share": _nan_to_none(F0)[0],
    }


def _rules(record: RunRecord):
    return rules_of(((record.config or {}).get("data") or {}).get("benchmark"), record.benchmark)


def _forms_added_since(record: RunRecord) -> bool:
    """Whether the record's stored intervals have no answer-form share although its
    benchmark now declares a rule for one of its tasks (a rule added after the run)."""
    stored = record.intervals or {}
    if "form_share" not in stored:  # intervals from before answer forms: shown as they were
        return False
    shares = [v for row in stored["form_share"] or [] for v in row] + list(stored.get("zero_shot_form_share") or [])
    return all(v is None for v in shares) and any(t in _rules(record) for t in record.tasks)


def record_intervals(record: RunRecord, run_dir) -> dict[str, Any] | None:
    """The record's stored intervals, else computed from the run's predictions (a
    record made before intervals existed, a run still going, or one whose benchmark
    declared its answer forms after it ran: the stored cells are the same, the form
    shares new); None when the run has no predictions yet."""
    if record.intervals and not _forms_added_since(record):
        return record.intervals
    predictions = results.read_jsonl(Path(run_dir) / results.PREDICTIONS_FILE)
    return run_intervals(record, predictions) if predictions else record.intervals
