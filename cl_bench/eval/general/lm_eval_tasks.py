"""General benchmarks through lm-evaluation-harness on the in-memory model (`general.tasks`).

TRACE's General Ability Delta (Wang et al., 2023, §4), over the general tasks i:

    ΔG_t = mean_i (R^G_{t,i} - R^G_{0,i})

with R^G_{0,i} the score of task i before any training (the zero-shot point) and
R^G_{t,i} after stage t, each 0-100. It is always taken against the zero-shot
point, never against the previous stage.

Each task is an lm-eval task name (MMLU, GSM8K, BBH... as lm-eval registers them)
or the path of a local task YAML (`dataset_path: json` with `data_files`, a
relative path read from the YAML's folder). lm-eval's HFLM wraps the model being
trained and its tokenizer; `simple_evaluate` runs the task through lm-eval's own
code (prompts, few-shot, filters, metrics) with `log_samples`, and the record
keeps, per task, lm-eval's score (the first metric of the task's metric list) and
its stderr, the item scores, and a 95% percentile bootstrap interval over the
items (cl_bench/metrics/bootstrap.py). A group (mmlu) is scored as the mean over
all its items. The same draws of item indices serve every point, so ΔG's interval
(and compare's, between runs over the same items) is paired over items.

Offline: cl-bench runs these tasks with the Hugging Face hub switched off
(`offline()`), so nothing is fetched at run time; every task is built once while
the run is prepared, and a task whose data is neither local nor in the datasets
cache stops the run there, before any training, in one line.

The lm-eval package is an optional extra (`pip install 'cl-bench[general]'`),
imported only when `general.tasks` is set.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
from torch import nn

from cl_bench.errors import UserError, did_you_mean
from cl_bench.metrics import bootstrap
from cl_bench.models.modes import eval_mode

log = logging.getLogger(__name__)

ZERO_SHOT = "-1"
SEED = 0  # the bootstrap's own seed, as cl_bench/metrics/intervals.py's
INSTALL = "pip install 'cl-bench[general]'"
LOCAL_DATA = ("give it as a local task YAML with dataset_path: json and data_files (README, "
              "\"General ability\"), or load it once where a hub is reachable so it sits in the datasets cache")


@contextlib.contextmanager
def offline() -> Iterator[None]:
    """The Hugging Face hub switched off for the block (datasets and huggingface_hub read their
    switches at import, so the module constants are set, and restored afterwards)."""
    import datasets.config
    import huggingface_hub.constants

    saved = (datasets.config.HF_HUB_OFFLINE, datasets.config.HF_DATASETS_OFFLINE,
             huggingface_hub.constants.HF_HUB_OFFLINE)
    datasets.config.HF_HUB_OFFLINE = datasets.config.HF_DATASETS_OFFLINE = True
    huggingface_hub.constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        (datasets.config.HF_HUB_OFFLINE, datasets.config.HF_DATASETS_OFFLINE,
         huggingface_hub.constants.HF_HUB_OFFLINE) = saved


def _import_lm_eval():
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        raise UserError(f"general.tasks needs lm-evaluation-harness, which is not installed: {INSTALL}") from None
    return lm_eval


def _task_spec(entry: str, index: Callable[[], Any]) -> tuple[str, Any]:
    """(task name, what simple_evaluate takes) for a configured entry: a YAML path or a task name
    (looked up in `index()`, lm-eval's whole task index, built only for a name)."""
    from lm_eval.tasks._yaml_loader import load_yaml

    if entry.endswith((".yaml", ".yml")):
        path = Path(entry).expanduser()
        if not path.is_file():
            raise UserError(f"general.tasks: {entry} does not exist; give the path of a task YAML or an lm-eval "
                            f"task name")
        spec = load_yaml(str(path), resolve_func=True)
        files = (spec.get("dataset_kwargs") or {}).get("data_files")
        if isinstance(files, dict):  # relative to the YAML's folder, not to where cl-bench runs
            spec["dataset_kwargs"]["data_files"] = {
                split: str((path.parent / f).resolve()) if not Path(f).is_absolute() else f
                for split, f in files.items()}
        if "task" not in spec:
            raise UserError(f"general.tasks: {entry} has no 'task' field; name the task in the YAML")
        return spec["task"], spec
    manager = index()
    if not manager.match_tasks([entry]):
        raise UserError(f"general.tasks: '{entry}' is not an lm-eval task; "
                        f"{did_you_mean(entry, manager.all_tasks)}list them with `lm-eval ls tasks`")
    return entry, entry


@dataclass
class GeneralTasks:
    """The run's lm-eval tasks, checked and built once (prepare), evaluated at the due points."""

    entries: list[str]  # as configured
    names: list[str]  # lm-eval task names, the record's keys
    specs: list[Any]  # what simple_evaluate takes
    limit: int | None
    every_stage: bool
    batch_size: int
    manager: Any = field(repr=False, default=None)

    @classmethod
    def prepare(cls, entries: list[str], limit: int | None, every_stage: bool, batch_size: int) -> GeneralTasks:
        """Import lm-eval, resolve every task and build it offline: a task whose data is not local
        fails here, before any model loads, naming the task."""
        _import_lm_eval()
        from lm_eval.tasks import TaskManager

        whole = functools.cache(TaskManager)
        names, specs = zip(*(_task_spec(e, whole) for e in entries))
        # lm-eval builds a task YAML (not a group) from its own fields; its index of the built-in
        # tasks (every YAML under lm_eval/tasks read: 15 s of a 2-core EPYC) serves names and groups only
        standalone = all(isinstance(s, dict) and "group" not in s for s in specs)
        manager = TaskManager(include_defaults=False) if standalone else whole()
        with offline():
            for entry, spec in zip(entries, specs):
                try:
                    manager.load([spec])
                except Exception as exc:  # lm-eval and datasets raise many kinds; each is named in the line
                    reason = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
                    raise UserError(f"general.tasks: '{entry}' cannot be built offline ({reason}); "
                                    f"{LOCAL_DATA}") from None
        return cls(list(entries), list(names), list(specs), limit, every_stage, batch_size, manager)

    def due(self, point: str, n_stages: int) -> bool:
        """The zero-shot point and the last stage; every stage with general.every_stage."""
        return self.every_stage or point in (ZERO_SHOT, str(n_stages - 1))

    def measure(self, model: nn.Module, tokenizer) -> dict[str, Any]:
        """Every task on `model` now: {name: {"metric", "score", "stderr", "ci", "n", "items",
        "item_scores"}} (scores 0-100), and "seconds"."""
        from lm_eval import simple_evaluate
        from lm_eval.models.huggingface import HFLM

        t0 = time.perf_counter()
        with offline(), eval_mode(model):
            lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=self.batch_size)
            out = simple_evaluate(model=lm, tasks=list(self.specs), limit=self.limit, log_samples=True,
                                  task_manager=self.manager, bootstrap_iters=bootstrap.RESAMPLES,
                                  random_seed=0, numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=0)
        tasks = {name: _task_result(out, name) for name in self.names}
        return {"tasks": tasks, "seconds": round(time.perf_counter() - t0, 2)}

    def record(self, general: dict | None, point: str, model: nn.Module, tokenizer) -> dict:
        """`general` (the record's field) with this point measured and ΔG updated."""
        import lm_eval

        general = dict(general or {})
        block = dict(general.get("lm_eval") or {"version": lm_eval.__version__, "tasks": self.entries,
                                                "limit": self.limit, "points": {}})
        block["points"] = {**block["points"], point: self.measure(model, tokenizer)}
        block["delta_g"] = delta_g(block["points"])
        general["lm_eval"] = block
        return general


def _leaves(out: dict, name: str) -> list[str]:
    """The leaf tasks of `name` (itself when it is not a group)."""
    groups = out.get("group_subtasks") or {}
    if name not in groups or not groups[name]:
        return [name]
    return [leaf for sub in groups[name] for leaf in _leaves(out, sub)]


def _task_result(out: dict, name: str) -> dict[str, Any]:
    """One task's numbers from simple_evaluate's output: its first metric, lm-eval's value and
    stderr (x100), the items as "leaf/doc_id" and their scores (x100), and the bootstrap interval."""
    res = out["results"][name]
    metric_key = next(k for k in res if "," in k and "_stderr," not in k)  # e.g. "acc,none"
    metric, filt = metric_key.split(",", 1)
    stderr = res.get(f"{metric}_stderr,{filt}")
    items, scores = [], []
    for leaf in _leaves(out, name):
        for sample in sorted((s for s in out["samples"][leaf] if s.get("filter", filt) == filt),
                             key=lambda s: s["doc_id"]):
            items.append(f"{leaf}/{sample['doc_id']}")
            value = sample.get(metric)
            scores.append(100 * float(value) if isinstance(value, (int, float, np.floating)) else None)
    numeric = all(s is not None for s in scores) and scores
    ci = None
    if numeric:
        idx = bootstrap.draws([len(scores)], bootstrap.RESAMPLES, SEED)[0]  # (R, n)
        ci = bootstrap.interval(np.asarray(scores)[idx].mean(axis=1))
    score = float(np.mean(scores)) if numeric else 100 * float(res[metric_key])
    return {"metric": metric, "score": round(score, 4), "lm_eval_score": round(100 * float(res[metric_key]), 4),
            "stderr": None if stderr is None or isinstance(stderr, str) or not math.isfinite(stderr)
            else round(100 * float(stderr), 4),
            "ci": None if ci is None else [round(v, 4) for v in ci], "n": len(items), "items": items,
            "item_scores": scores if numeric else None}


def _paired(now: dict, zero: dict, name: str, point: str) -> None:
    if now["items"] != zero["items"]:
        raise ValueError(f"general task {name}: point {point} scored other items than zero-shot; "
                         f"ΔG is paired over the same items")


def delta_g_replicates(points: dict[str, dict], point: str,
                       resamples: int = bootstrap.RESAMPLES) -> tuple[float, dict[str, float], np.ndarray | None]:
    """ΔG at `point` against the zero-shot point (TRACE's formula), per task R_t,i - R_0,i, and the
    (R,) paired bootstrap replicates of ΔG: one draw of items per task (bootstrap.draws over the
    tasks' item counts), applied to both points; None where a task has no item scores."""
    zero, now = points[ZERO_SHOT]["tasks"], points[point]["tasks"]
    names = list(zero)
    for name in names:
        _paired(now[name], zero[name], name, point)
    per_task = {name: now[name]["score"] - zero[name]["score"] for name in names}
    value = float(np.mean(list(per_task.values())))
    if any(p[name]["item_scores"] is None for p in (zero, now) for name in names):
        return value, per_task, None
    idx = bootstrap.draws([len(zero[name]["items"]) for name in names], resamples, SEED)  # per task (R, n_i)
    reps = [np.asarray(now[name]["item_scores"])[i].mean(axis=1) - np.asarray(zero[name]["item_scores"])[i].mean(axis=1)
            for name, i in zip(names, idx)]  # per task (R,)
    return value, per_task, np.mean(reps, axis=0)


def delta_g(points: dict[str, dict]) -> dict[str, dict]:
    """Per stage point t: {"value": ΔG_t, "ci", "tasks": {name: R_t,i - R_0,i}}; {} without a zero-shot point."""
    if ZERO_SHOT not in points:
        return {}
    out = {}
    for point in sorted((p for p in points if p != ZERO_SHOT), key=int):
        value, per_task, reps = delta_g_replicates(points, point)
        ci = None if reps is None else bootstrap.interval(reps)
        out[point] = {"value": round(value, 4), "ci": None if ci is None else [round(v, 4) for v in ci],
                      "tasks": {k: round(v, 4) for k, v in per_task.items()}}
    return out
