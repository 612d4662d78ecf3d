"""Loading and validating TRACE data: `<root>/<Task>/{train,eval,test}.json`,
each a JSON list of {"prompt": str, "answer": str} (docs/PROTOCOL.md, "Data").

Every problem with the files is a one-line UserError that names the file,
the record and the field, and says how to fix it."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from cl_bench.errors import UserError

from .tasks import TaskSpec, get_task, resolve_order

log = logging.getLogger(__name__)

ENV_VAR = "CL_BENCH_DATA"
# Tried in order, relative to the current directory, when neither --data-dir
# nor CL_BENCH_DATA is given.
CONVENTIONAL_DIRS = ("data/TRACE", "../shared/trace/LLM-CL-Benchmark_500")


def resolve_data_dir(cli_value: str | None) -> Path:
    """The TRACE root: `--data-dir`, else $CL_BENCH_DATA, else the first
    conventional folder that exists. Returned as an absolute path."""
    if cli_value is not None:
        return _existing_dir(Path(cli_value).expanduser(), f"--data-dir {cli_value}")
    env_value = os.environ.get(ENV_VAR)
    if env_value:
        return _existing_dir(Path(env_value).expanduser(), f"{ENV_VAR}={env_value}")
    tried = [Path(p).resolve() for p in CONVENTIONAL_DIRS]
    for path in tried:
        if path.is_dir():
            log.info("TRACE data: using %s", path)
            return path
    raise UserError(
        f"no TRACE data folder found; pass --data-dir or set {ENV_VAR} to the folder "
        f"holding C-STANCE/, FOMC/, ... (looked in: {', '.join(str(p) for p in tried)})"
    )


def _existing_dir(path: Path, source: str) -> Path:
    if not path.is_dir():
        what = "is not a folder" if path.exists() else "does not exist"
        raise UserError(
            f"{source}: {path} {what}; give the folder holding the task folders "
            f"(C-STANCE/, FOMC/, ...)"
        )
    return path.resolve()


@dataclass(frozen=True)
class Example:
    prompt: str
    answer: str
    index: int  # position in the source file


_JSON_TYPE = {dict: "object", list: "list", str: "string", int: "number",
              float: "number", bool: "boolean", type(None): "null"}


def _json_type(value: object) -> str:
    return _JSON_TYPE.get(type(value), type(value).__name__)


def load_split(data_dir: Path, task: str, split: str) -> list[Example]:
    """Read and validate `<data_dir>/<task>/<split>.json`."""
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        raise UserError(f"TRACE data folder {data_dir} does not exist; check --data-dir or {ENV_VAR}")
    task_dir = data_dir / task
    if not task_dir.is_dir():
        present = sorted(p.name for p in data_dir.iterdir() if p.is_dir())
        raise UserError(
            f"no folder for task {task!r} in {data_dir} (task folders present: "
            f"{', '.join(present) or 'none'}); point --data-dir at the TRACE root or add the task"
        )
    path = task_dir / f"{split}.json"
    if path.exists() and not path.is_file():
        raise UserError(f"{path}: is a folder, not a split file; replace it with the {split}.json file of {task}")
    if not path.is_file():
        present = sorted(p.name for p in task_dir.iterdir())
        raise UserError(
            f"missing split file {path} (files present: {', '.join(present) or 'none'}); "
            f"add {split}.json or choose another split"
        )

    try:
        records = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise UserError(f"{path}:{e.lineno}:{e.colno}: malformed JSON ({e.msg}); fix the JSON") from None
    except UnicodeDecodeError as e:
        raise UserError(f"{path}: byte {e.start} is not UTF-8; re-save the file as UTF-8") from None

    if not isinstance(records, list):
        raise UserError(
            f"{path}: top level is a JSON {_json_type(records)}, expected a list of "
            f'{{"prompt": ..., "answer": ...}} records; fix the file'
        )
    if not records:
        raise UserError(f"{path}: the list is empty; a split needs at least one record")

    examples = []
    for i, record in enumerate(records):
        if not isinstance(record, dict):
            raise UserError(
                f"{path}: record {i} is a JSON {_json_type(record)}, expected an object "
                f'with "prompt" and "answer" strings; fix record {i}'
            )
        for field in ("prompt", "answer"):
            if field not in record:
                raise UserError(
                    f'{path}: record {i} has no "{field}" field (fields: '
                    f'{", ".join(record) or "none"}); add "{field}" as a string'
                )
            if not isinstance(record[field], str):
                raise UserError(
                    f'{path}: record {i} field "{field}" is a JSON {_json_type(record[field])}, '
                    f"expected a string; fix record {i}"
                )
        examples.append(Example(prompt=record["prompt"], answer=record["answer"], index=i))
    return examples


def file_sha256(path: Path | str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


@dataclass
class TaskData:
    name: str
    spec: TaskSpec
    train: list[Example]
    test: list[Example]
    provenance: dict  # split files, their sha256, source sizes, selected indices


def _select(examples: list[Example], n: int | None, seed: int, task: str, split: str) -> list[Example]:
    """A seeded subset of n examples, returned in file order; all of them if
    n is None or n >= len(examples).

    The generator is keyed by (seed, task, split) through sha256, so a task's
    subset does not depend on which other tasks are loaded, and it is the same
    in every process (Python's hash() is salted per process). Taking the first n
    of one shuffle makes subsets nested: n=50 is a subset of n=100."""
    if n is None or n >= len(examples):
        return list(examples)
    key = hashlib.sha256(f"cl-bench/trace/{seed}/{task}/{split}".encode()).digest()
    order = list(range(len(examples)))
    random.Random(int.from_bytes(key[:8], "big")).shuffle(order)
    return [examples[i] for i in sorted(order[:n])]


def _check_count(name: str, n: int | None) -> None:
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
        raise UserError(f"{name}={n!r}: expected a positive integer, or None for the whole split")


def load_task(
    data_dir: Path,
    task: str,
    n_train: int | None,
    n_test: int | None,
    seed: int,
    test_split: str = "test",
) -> TaskData:
    """One task's train subset and test subset, with provenance for the run record."""
    spec = get_task(task)
    _check_count("n_train", n_train)
    _check_count("n_test", n_test)
    data_dir = Path(data_dir)

    provenance: dict = {"task": task, "data_dir": str(data_dir.resolve()), "seed": seed}
    subsets = {}
    for role, split, n in (("train", "train", n_train), ("test", test_split, n_test)):
        path = data_dir / task / f"{split}.json"
        source = load_split(data_dir, task, split)
        chosen = _select(source, n, seed, task, split)
        subsets[role] = chosen
        provenance[role] = {
            "split": split,
            "file": f"{task}/{split}.json",
            "sha256": file_sha256(path),
            "source_size": len(source),
            "requested": n,
            "size": len(chosen),
            "indices": [ex.index for ex in chosen],
        }
    if provenance["train"]["sha256"] == provenance["test"]["sha256"]:
        # MeetingBank in the 500 release: train.json is a copy of eval.json.
        log.warning(
            "%s: train.json and %s.json are byte-identical; scores on this split measure "
            "memorisation, not generalisation", task, test_split,
        )
    log.info(
        "%s: train %d/%d, %s %d/%d", task, len(subsets["train"]),
        provenance["train"]["source_size"], test_split, len(subsets["test"]),
        provenance["test"]["source_size"],
    )
    return TaskData(name=task, spec=spec, train=subsets["train"], test=subsets["test"],
                    provenance=provenance)


def load_benchmark(
    data_dir: Path,
    order: str | list[str],
    n_train: int | None,
    n_test: int | None,
    seed: int,
    n_train_per_task: Mapping[str, int] | None = None,
    n_test_per_task: Mapping[str, int] | None = None,
    test_split: str = "test",
) -> list[TaskData]:
    """Every task of `order` (see resolve_order), loaded in training order; the
    per-task mappings override n_train / n_test for the tasks they name; the
    scored items come from `test_split` ("eval" for model selection)."""
    train, test = n_train_per_task or {}, n_test_per_task or {}
    return [load_task(data_dir, task, train.get(task, n_train), test.get(task, n_test), seed, test_split)
            for task in resolve_order(order)]
