"""`cl-bench score`: predictions made elsewhere (or a run's predictions.jsonl), read
from JSONL and scored with the task's own metric (cl_bench/metrics/scorers.py)."""
from __future__ import annotations

from pathlib import Path

from cl_bench import registry
from cl_bench.errors import UserError
from cl_bench.metrics import scorers
from cl_bench.record.io import ZERO_SHOT_STAGE, json_lines, stage_index, stage_number


def score_file(path: Path, task: str, stage: int | None, benchmark: str | None = None) -> dict:
    """{"task", "metric", "score", "n"} of the predictions in `path` for `task` of
    `benchmark` (None: the default) at `stage`, numbered as `show` numbers it: 1..T, 0 the
    zero-shot row (record/io.stage_number)."""
    spec = registry.get_benchmark(benchmark).get_task(task)
    rows = read_predictions(path, task, stage)
    preds = [r["prediction"].strip() for r in rows]
    score = scorers.score(spec.metric, preds, [r["answer"] for r in rows], [r["prompt"] for r in rows])
    return {"task": spec.name, "metric": spec.metric, "score": score, "n": len(rows)}


def read_predictions(path: Path, task: str, stage: int | None) -> list[dict]:
    """Lines of {"prompt", "prediction", "answer"}; lines that carry "task"/"stage"
    fields (cl-bench's own predictions.jsonl) are filtered to --task/--stage. `stage`
    is the user's number (1..T, 0 zero-shot); the file's `stage` is its 0-based index."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise UserError(f"{path}: cannot read predictions ({exc.strerror}); check the path") from None
    except UnicodeDecodeError as exc:
        raise UserError(f"{path}: not UTF-8 text (byte {exc.start}); write the predictions as UTF-8 JSONL") from None
    rows = []
    for n, row in json_lines(path, text, "each line must be one JSON object"):
        if not isinstance(row, dict):
            raise UserError(f"{path}:{n}: a line must be a JSON object with prompt, prediction, answer")
        for key in ("prompt", "prediction", "answer"):
            if not isinstance(row.get(key), str):
                found = type(row[key]).__name__ if key in row else "nothing"
                raise UserError(f"{path}:{n}: field '{key}' must be a string, found {found}; "
                                f"fix that line")
        if "task" in row and row["task"] != task:
            continue
        if stage is not None and row.get("stage") != stage_index(stage):
            continue
        rows.append(row)
    if not rows:
        raise UserError(f"{path}: no predictions for task {task}"
                        + (f" at stage {stage}" if stage is not None else "")
                        + "; check --task and --stage")
    stages = sorted({r["stage"] for r in rows if isinstance(r.get("stage"), int)})
    if stage is None and len(stages) > 1:  # pooling stages would score no cell of the matrix
        raise UserError(f"{path}: task {task} has predictions of stages "
                        f"{', '.join(str(stage_number(b)) for b in stages)}"
                        + (" (0: zero-shot)" if ZERO_SHOT_STAGE in stages else "") + "; pass --stage to score one")
    return rows
