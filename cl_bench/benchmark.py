"""The benchmark contract: what a benchmark declares and how the harness loads it.

A Benchmark names its tasks (TaskSpec: metric, generation budget, language, label
set where there is one), its named orders, the profile fields that are its own
(`profiles`, see cl_bench/profiles.py's OWN) and where its data folder is; it
reads one split of one task from that folder (`read_split`). Everything else,
orders, seeded subsets and the provenance a run records, is the same for every
benchmark and lives here.

The default `read_split` is the plain layout TRACE uses and a user's own folder
(cl_bench/benchmarks/folder.py) too: `<data_dir>/<task>/<split>.json`, a JSON list
of {"prompt", "answer"} (or `<split>.jsonl`, one object a line). A benchmark in
another layout overrides it (cl_bench/benchmarks/long_sequence.py). Built-in
benchmarks register on import (`registry.register_benchmark`); outside packages
add theirs through the entry-point group `cl_bench.benchmarks`.

Every problem with a data file is a one-line UserError that names the file, the
record and the field, and says how to fix it; `record_faults` lists them all at
once (`cl-bench data check`).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping

from cl_bench.errors import UserError, did_you_mean

log = logging.getLogger(__name__)

# Scorer names implemented in cl_bench.metrics.scorers (a test keeps them equal).
METRICS = ("accuracy", "exact_match", "first_char_accuracy", "rouge_l", "edit_similarity", "sari")
SPLITS = ("train", "eval", "test")  # the scored split is `test`, or `eval` for model selection
SUFFIXES = (".json", ".jsonl")
DEFAULT = "trace"  # a run's benchmark where its config names none, and a record's written before records named it


@dataclass(frozen=True)
class TaskSpec:
    """One task. `metric` is the score reported for it (0-100); `extra_metrics`
    are logged beside it but never enter the R matrix; `labels`: the answers a
    label task chooses from (empty for generation tasks)."""

    name: str
    metric: str
    max_new_tokens: int  # generation budget; greedy decoding stops earlier at EOS
    description: str  # one line
    language: str
    extra_metrics: tuple[str, ...] = ()
    labels: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.metric not in METRICS:
            raise ValueError(f"task {self.name}: metric {self.metric!r} not in {list(METRICS)}")
        if self.max_new_tokens < 1:
            raise ValueError(f"task {self.name}: max_new_tokens must be >= 1")


@dataclass(frozen=True)
class Example:
    prompt: str
    answer: str
    index: int  # position in the source file


@dataclass
class TaskData:
    name: str
    spec: TaskSpec
    train: list[Example]
    test: list[Example]
    provenance: dict  # split files, their sha256, source sizes, selected indices


_JSON_TYPE = {dict: "object", list: "list", str: "string", int: "number",
              float: "number", bool: "boolean", type(None): "null"}


def _json_type(value: object) -> str:
    return _JSON_TYPE.get(type(value), type(value).__name__)


def read_json_records(path: Path) -> list:
    """A split file's records: a JSON list (`.json`) or one JSON value a line
    (`.jsonl`); a file that cannot be read so is a UserError naming where."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"{path}: byte {e.start} is not UTF-8; re-save the file as UTF-8") from None
    lines = list(enumerate(text.splitlines(), 1)) if path.suffix == ".jsonl" else [(0, text)]
    values = []
    for n, line in lines:
        if not line.strip() and n:
            continue
        try:
            values.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise UserError(f"{path}:{n or e.lineno}:{e.colno}: malformed JSON ({e.msg}); fix the JSON") from None
    if path.suffix == ".jsonl":
        return values
    records = values[0]
    if not isinstance(records, list):
        raise UserError(f"{path}: top level is a JSON {_json_type(records)}, expected a list of records "
                        f"(JSON objects); fix the file")
    return records


def record_faults(path: Path, records: list, fields: tuple[str, ...] = ("prompt", "answer")) -> list[str]:
    """One line per fault of the records of `path`: not an object, a field missing
    or not a string; an empty list is a fault too."""
    if not records:
        return [f"{path}: the list is empty; a split needs at least one record"]
    faults, quoted = [], " and ".join(f'"{name}"' for name in fields)
    for i, record in enumerate(records, 1):  # counted from 1, as editors and `score` count lines
        if not isinstance(record, dict):
            faults.append(f"{path}: record {i} is a JSON {_json_type(record)}, expected an object "
                          f"with {quoted} strings; fix record {i}")
            continue
        for name in fields:
            if name not in record:
                faults.append(f'{path}: record {i} has no "{name}" field (fields: '
                              f'{", ".join(record) or "none"}); add "{name}" as a string')
            elif not isinstance(record[name], str):
                faults.append(f'{path}: record {i} field "{name}" is a JSON {_json_type(record[name])}, '
                              f"expected a string; fix record {i}")
    return faults


def read_checked(path: Path, fields: tuple[str, ...] = ("prompt", "answer")) -> list[dict]:
    """The records of `path`, each an object with string `fields`; the first fault raises."""
    records = read_json_records(path)
    faults = record_faults(path, records, fields)
    if faults:
        raise UserError(faults[0])
    return records


def file_sha256(path: Path | str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _check_count(name: str, n: int | None) -> None:
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
        raise UserError(f"{name}={n!r}: expected a positive integer, or None for the whole split")


def seeded_order(n: int, key: str) -> list[int]:
    """range(n) in the order of one shuffle seeded through sha256 of `key`: the same in
    every process (Python's hash() is salted per process)."""
    order = list(range(n))
    random.Random(int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big")).shuffle(order)
    return order


@dataclass
class Benchmark:
    """A task sequence the harness runs. Instances register (registry.register_benchmark)."""

    name: str  # registry key, lower-case: `--benchmark NAME`
    title: str  # how messages name it: "TRACE"
    description: str  # one line, for `cl-bench list --benchmarks`
    tasks: dict[str, TaskSpec]  # every task the data folder may hold
    orders: dict[str, list[str]]  # named orders
    default_order: str  # the order a run without data.order trains
    cl_tasks: tuple[str, ...] = ()  # the tasks an order may contain (empty: all of `tasks`)
    profiles: dict[str, dict] = field(default_factory=dict)  # per profile, the fields that are its own
    env_var: str | None = None  # the data folder's environment variable, if it has one
    default_dirs: tuple[str, ...] = ()  # tried in order, relative to the working directory
    reference: str = ""  # where its tasks and orders come from
    # per task, the rule of its answer form (cl_bench/metrics/answer_form.py: option, number, text, ...):
    # the format/content split of BWT and the form shares; a task without one has none
    answer_forms: dict[str, Callable[[str, str], bool]] = field(default_factory=dict)
    # tasks whose eval split is a copy of their train split: scores on it measure memorisation, so a
    # tuning grid (cl_bench/tools/tuning/grid.py) never tunes on them
    eval_is_train: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        self.cl_tasks = tuple(self.cl_tasks or self.tasks)
        for what, names in (("answer_forms", self.answer_forms), ("eval_is_train", self.eval_is_train)):
            unknown = sorted(set(names) - set(self.tasks))
            if unknown:
                raise ValueError(f"benchmark {self.name}: {what} names tasks it does not have: {', '.join(unknown)}")

    # ---- what a benchmark may override ----

    def read_split(self, data_dir: Path, task: str, split: str) -> tuple[list[Example], Path]:
        """The examples of `split` of `task`, and the file they came from."""
        path = self.split_file(data_dir, task, split)
        records = read_checked(path)
        return [Example(prompt=r["prompt"], answer=r["answer"], index=i) for i, r in enumerate(records)], path

    def task_dir(self, data_dir: Path, task: str) -> Path:
        return Path(data_dir) / task

    def split_file(self, data_dir: Path, task: str, split: str) -> Path:
        """`<task>/<split>.json` or `.jsonl`, with a one-line error where it is missing."""
        data_dir = Path(data_dir)
        if not data_dir.is_dir():
            raise UserError(f"{self.title} data folder {data_dir} does not exist; check --data-dir"
                            + (f" or {self.env_var}" if self.env_var else ""))
        task_dir = self.task_dir(data_dir, task)
        if not task_dir.is_dir():
            present = sorted(p.name for p in data_dir.iterdir() if p.is_dir())
            raise UserError(f"no folder for task {task!r} in {data_dir} (task folders present: "
                            f"{', '.join(present) or 'none'}); point --data-dir at the {self.title} root "
                            f"or add the task")
        for suffix in SUFFIXES:
            path = task_dir / f"{split}{suffix}"
            if path.exists() and not path.is_file():
                raise UserError(f"{path}: is a folder, not a split file; replace it with the {split}.json "
                                f"file of {task}")
            if path.is_file():
                return path
        present = sorted(p.name for p in task_dir.iterdir())
        raise UserError(f"missing split file {task_dir / (split + '.json')} (files present: "
                        f"{', '.join(present) or 'none'}); add {split}.json or choose another split")

    # ---- tasks and orders ----

    def get_task(self, name: str) -> TaskSpec:
        """The TaskSpec called `name` (exact spelling), or a UserError with suggestions."""
        if name in self.tasks:
            return self.tasks[name]
        raise UserError(f"unknown {self.title} task {name!r}; {did_you_mean(name, self.tasks)}"
                        f"valid tasks: {', '.join(self.tasks)}")

    def resolve_order(self, order: str | list[str] | None) -> list[str]:
        """Task names in training order. `order` is a named order, a list of task names,
        a comma-separated string of them ("FOMC,C-STANCE"), or None (the default order).
        Names match exactly."""
        valid = self.cl_tasks
        if order is None:
            order = self.default_order
        if isinstance(order, str):
            if order in self.orders:
                return list(self.orders[order])
            names = [part.strip() for part in order.split(",")]
            # A single unknown word is more likely a misspelt order than a task.
            if len(names) == 1 and names[0] not in valid:
                hint = did_you_mean(names[0], list(self.orders) + list(valid))
                raise UserError(f"unknown task order {order!r}; {hint}named orders: {', '.join(self.orders)}; "
                                f"or give task names separated by commas from: {', '.join(valid)}")
        else:
            names = list(order)
        if not names or any(n == "" for n in names):
            raise UserError(f"task order {order!r} has an empty entry; give task names from: {', '.join(valid)}")
        for name in names:
            if not isinstance(name, str):
                raise UserError(f"task order {order!r}: entry {name!r} is a {type(name).__name__}, "
                                f"expected a task name from: {', '.join(valid)}")
            if name in self.tasks and name not in valid:
                raise UserError(f"task order {order!r}: {name} is replay-only data, not a continual-learning "
                                f"task; remove it (valid tasks: {', '.join(valid)})")
            if name not in valid:
                raise UserError(f"task order {order!r}: unknown task {name!r}; {did_you_mean(name, valid)}"
                                f"valid tasks: {', '.join(valid)}")
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise UserError(f"task order {order!r} lists {', '.join(dupes)} more than once; "
                            f"each task may appear once")
        return names

    # ---- the data folder ----

    def resolve_data_dir(self, cli_value: str | None) -> Path:
        """The data folder: `--data-dir`, else the environment variable, else the first
        default folder that exists. Returned as an absolute path."""
        if cli_value is not None:
            return self._existing_dir(Path(cli_value).expanduser(), f"--data-dir {cli_value}")
        env_value = os.environ.get(self.env_var) if self.env_var else None
        if env_value:
            return self._existing_dir(Path(env_value).expanduser(), f"{self.env_var}={env_value}")
        tried = [Path(p).resolve() for p in self.default_dirs]
        for path in tried:
            if path.is_dir():
                log.info("%s data: using %s", self.title, path)
                return path
        raise UserError(f"no {self.title} data folder found; pass --data-dir"
                        + (f" or set {self.env_var}" if self.env_var else "")
                        + f" to the folder holding {self._folders_hint()} (looked in: "
                          f"{', '.join(str(p) for p in tried) or 'nowhere'})")

    def _folders_hint(self) -> str:
        return ", ".join(f"{t}/" for t in list(self.cl_tasks)[:2]) + ", ..."

    def _existing_dir(self, path: Path, source: str) -> Path:
        if not path.is_dir():
            what = "is not a folder" if path.exists() else "does not exist"
            raise UserError(f"{source}: {path} {what}; give the folder holding the task folders "
                            f"({self._folders_hint()})")
        return path.resolve()

    # ---- loading ----

    def load_split(self, data_dir: Path, task: str, split: str) -> list[Example]:
        return self.read_split(Path(data_dir), task, split)[0]

    def select(self, examples: list[Example], n: int | None, seed: int, task: str, split: str) -> list[Example]:
        """A seeded subset of n examples, returned in file order; all of them if n is None
        or n >= len(examples). Keyed by (benchmark, seed, task, split), so a task's subset
        does not depend on which other tasks are loaded; taking the first n of one
        shuffle makes subsets nested: n=50 is a subset of n=100."""
        if n is None or n >= len(examples):
            return list(examples)
        order = seeded_order(len(examples), f"cl-bench/{self.name}/{seed}/{task}/{split}")
        return [examples[i] for i in sorted(order[:n])]

    def load_task(self, data_dir: Path, task: str, n_train: int | None, n_test: int | None, seed: int,
                  test_split: str = "test") -> TaskData:
        """One task's train subset and test subset, with provenance for the run record."""
        spec = self.get_task(task)
        _check_count("n_train", n_train)
        _check_count("n_test", n_test)
        data_dir = Path(data_dir)
        provenance: dict = {"task": task, "data_dir": str(data_dir.resolve()), "seed": seed}
        subsets = {}
        for role, split, n in (("train", "train", n_train), ("test", test_split, n_test)):
            source, path = self.read_split(data_dir, task, split)
            chosen = self.select(source, n, seed, task, split)
            subsets[role] = chosen
            provenance[role] = {"split": split, "file": path.relative_to(data_dir).as_posix(),
                                "sha256": file_sha256(path), "source_size": len(source), "requested": n,
                                "size": len(chosen), "indices": [ex.index for ex in chosen]}
        train, test = provenance["train"], provenance["test"]
        if train["file"] != test["file"] and train["sha256"] == test["sha256"]:
            # TRACE's MeetingBank in the 500 release: train.json is a copy of eval.json.
            log.warning("%s: %s and %s are byte-identical; scores on this split measure memorisation, "
                        "not generalisation", task, train["file"], test["file"])
        log.info("%s: train %d/%d, %s %d/%d", task, len(subsets["train"]), train["source_size"], test_split,
                 len(subsets["test"]), test["source_size"])
        return TaskData(name=task, spec=spec, train=subsets["train"], test=subsets["test"], provenance=provenance)

    def load_tasks(self, data_dir: Path, order: str | list[str] | None, n_train: int | None, n_test: int | None,
                   seed: int, n_train_per_task: Mapping[str, int] | None = None,
                   n_test_per_task: Mapping[str, int] | None = None, test_split: str = "test") -> list[TaskData]:
        """Every task of `order` (see resolve_order), loaded in training order; the per-task
        mappings override n_train / n_test for the tasks they name; the scored items come
        from `test_split` ("eval" for model selection)."""
        train, test = n_train_per_task or {}, n_test_per_task or {}
        return [self.load_task(data_dir, task, train.get(task, n_train), test.get(task, n_test), seed, test_split)
                for task in self.present_order(data_dir, order)]

    def present_order(self, data_dir: Path, order: str | list[str] | None) -> list[str]:
        """resolve_order's tasks, each with its folder in `data_dir`: an order naming
        tasks the folder lacks stops here, naming them all, before anything loads."""
        names = self.resolve_order(order)
        missing = [t for t in names if Path(data_dir).is_dir() and not self.task_dir(data_dir, t).is_dir()]
        if missing:
            present = [t for t in self.cl_tasks if self.task_dir(data_dir, t).is_dir()]
            raise UserError(f"{data_dir}: no folder for {', '.join(missing)}, which the order names; give "
                            f"--order with tasks present ({', '.join(present) or 'none'}), or point --data-dir "
                            f"at a folder holding them all")
        return names
