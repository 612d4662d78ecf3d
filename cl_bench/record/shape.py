"""The shape of a run record's nested fields, beyond the JSON types that
RunRecord.from_json checks: lengths that follow `tasks` and `stages`, and
the entries the readers use (show, --resume, compare, the leaderboard, the
site). A record edited into any other shape fails here, when
it is read, with one line naming the file and the field, not later with a
traceback. The task names, the method and the stages are checked where they are
needed, against the recorded config (run --resume, cl_bench/run/prepare.py): a record
of a plugin not installed here still shows.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from cl_bench.record.schema import RunRecord, Where


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _pair(v: Any) -> bool:
    return isinstance(v, list) and len(v) == 2 and all(_number(x) for x in v)


def check(rec: RunRecord, where: Where) -> None:
    """Raise where.fail(...) at the first field out of shape."""
    tasks = rec.tasks
    n_stages = len(rec.stages) if rec.stages else len(rec.matrix)  # some hand-made records list no stages
    if not tasks or len(set(tasks)) != len(tasks):
        raise where.fail("field tasks must name each task once, at least one")
    for i, s in enumerate(rec.stages):
        if s.index != i or any(t not in tasks for t in s.tasks):
            raise where.fail(f"field stages[{i}] must have index {i} and tasks among the record's tasks")
    if rec.stages and not 0 <= rec.stages_done <= n_stages:
        raise where.fail(f"field stages_done={rec.stages_done} must be in [0, {n_stages}] (the stages)")
    _rows(where, "matrix", rec.matrix, n_stages, len(tasks), lambda v: v is None or _number(v), "a number or null")
    if rec.zero_shot is not None:
        _row(where, "zero_shot", rec.zero_shot, len(tasks), lambda v: v is None or _number(v), "a number or null")
    for name, m in (rec.majority or {}).items():
        if name not in tasks or not isinstance(m, dict) or not isinstance(m.get("answer"), str) \
                or not _number(m.get("score")):
            raise where.fail(f"field majority.{name} must be a task's {{answer: string, score: number}}")
    for i, m in enumerate(rec.task_metrics):
        if not (isinstance(m, dict) and _int(m.get("stage")) and -1 <= m["stage"] < n_stages
                and m.get("task") in tasks and _int(m.get("n")) and _int(m.get("max_new_tokens"))
                and _number(m.get("score"))):
            raise where.fail(f"field task_metrics[{i}] must hold stage (-1 to {n_stages - 1}), task (one of tasks), "
                             f"score, n and max_new_tokens")
    for key, v in (rec.summary or {}).items():
        if not (v is None or _number(v)):
            raise where.fail(f"field summary.{key} must be a number or null, found {type(v).__name__}")
    if rec.replay is not None and not _int(rec.replay.get("used", 0)):
        raise where.fail("field replay.used must be an integer")
    for kind, by_stage in (rec.probes or {}).items():
        if not isinstance(by_stage, dict) or not all(k.isdigit() for k in by_stage):
            raise where.fail(f"field probes.{kind} must be an object keyed by stage index")
    for i, r in enumerate(rec.resumes or []):
        if not (isinstance(r, dict) and _int(r.get("at_stage")) and isinstance(r.get("command", ""), str)
                and isinstance(r.get("backend", {}), dict)):
            raise where.fail(f"field resumes[{i}] must be an object with an integer at_stage, the command as a "
                             f"string and the backend as an object")
    if rec.failed_at is not None and not (_int(rec.failed_at.get("stage")) and _int(rec.failed_at.get("step"))):
        raise where.fail("field failed_at must be {stage: integer, step: integer}")
    for name, d in rec.data.items():
        if not isinstance(d, dict) or not all(isinstance(d.get(s), dict) for s in ("train", "test")):
            raise where.fail(f"field data.{name} must hold the train and test provenance objects")
    if not isinstance(rec.model.get("id", ""), str):
        raise where.fail("field model.id must be the model's name, a string")
    if rec.intervals is not None:
        _intervals(where, rec.intervals, n_stages, len(tasks))


def _rows(where: Where, name: str, rows: Any, n_rows: int, width: int, ok, what: str) -> None:
    """`rows`: n_rows lists (one per stage) of `width` values each passing `ok`."""
    if not isinstance(rows, list) or len(rows) != n_rows:
        raise where.fail(f"field {name} must have {n_rows} rows (one per stage)")
    for b, row in enumerate(rows):
        _row(where, f"{name}[{b}]", row, width, ok, what)


def _row(where: Where, name: str, row: Any, width: int, ok, what: str) -> None:
    if not isinstance(row, list) or len(row) != width:
        raise where.fail(f"field {name} must be a list of {width} values (one per task)")
    for j, v in enumerate(row):
        if not ok(v):
            raise where.fail(f"field {name}[{j}] must be {what}, found {type(v).__name__}")


def _intervals(where: Where, iv: dict, n_stages: int, width: int) -> None:
    """The keys of cl_bench.metrics.intervals.run_intervals that the readers use."""
    if not (_int(iv.get("resamples")) and _int(iv.get("seed"))):
        raise where.fail("field intervals must hold integer resamples and seed")
    n_items = iv.get("n_items")
    if not isinstance(n_items, list) or len(n_items) != width or not all(_int(n) for n in n_items):
        raise where.fail(f"field intervals.n_items must be {width} integers (one per task)")
    ci, share = (lambda v: v is None or _pair(v)), (lambda v: v is None or _number(v))
    _rows(where, "intervals.matrix_ci", iv.get("matrix_ci"), n_stages, width, ci, "[low, high] or null")
    _rows(where, "intervals.form_share", iv.get("form_share"), n_stages, width, share, "a number or null")
    for key, ok, what in (("zero_shot_ci", ci, "[low, high] or null"), ("zero_shot_form_share", share, "a number or null")):
        if iv.get(key) is not None:
            _row(where, f"intervals.{key}", iv[key], width, ok, what)
    for key, ok in (("summary", share), ("summary_ci", ci)):
        if not isinstance(iv.get(key, {}), dict) or not all(ok(v) for v in iv.get(key, {}).values()):
            raise where.fail(f"field intervals.{key} must map each summary to a number or null"
                             if key == "summary" else f"field intervals.{key} must map each summary to [low, high]")
