"""Your own tasks without code: a folder with one subfolder per task and a
benchmark.yaml beside them (`--benchmark DIR`; `cl-bench data check DIR`).

    DIR/benchmark.yaml
    DIR/<Task>/train.json   test.json   eval.json (optional)   # or .jsonl
        each a JSON list of {"prompt": ..., "answer": ...} (.jsonl: one object a line)

benchmark.yaml names each task's metric and generation budget:

    name: my-tasks                 # optional; default: the folder's name
    description: two toy tasks     # optional
    tasks:                         # in their default order
      Sentiment: {metric: accuracy, max_new_tokens: 4, labels: [good, bad], answer_form: label}
      Summary: {metric: rouge_l, max_new_tokens: 128, language: de, answer_form: text}
      Quiz: {metric: accuracy, max_new_tokens: 2, answer_form: {option: ABCD}}
    orders:                        # optional named orders
      short: [Sentiment]

A task's fields: metric (cl_bench/benchmark.py, METRICS), max_new_tokens, and
optionally language (default en), labels, description (docs/benchmarks.md), and
answer_form, the shape of its answers (cl_bench/metrics/answer_form.py), which gives
its runs form shares and BWT's split into format and content: `label` (one of its
labels, compared as its metric compares answers: needs labels, and metric accuracy or
exact_match), `number`, `text`, `{option: LETTERS}` (one of those letters alone) or
`{option_first: LETTERS}` (one of them first, then nothing or a line break). A task
without it has no form share.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from cl_bench.benchmark import METRICS, SPLITS, SUFFIXES, Benchmark, TaskSpec, read_json_records, record_faults
from cl_bench.errors import UserError, did_you_mean
from cl_bench.metrics import answer_form
from cl_bench.metrics.scorers import ANSWER_KEYS

SPEC_FILE = "benchmark.yaml"
FIELDS = ("name", "description", "tasks", "orders")
TASK_FIELDS = ("metric", "max_new_tokens", "language", "labels", "description", "answer_form")
REQUIRED_SPLITS = ("train", "test")
# answer_form's spellings: a form's name, or {name: LETTERS} for the forms that take option letters
PLAIN_FORMS = {"number": answer_form.number, "text": answer_form.text}
OPTION_FORMS = {"option": answer_form.option, "option_first": answer_form.option_first}
FORM_SPELLINGS = ("label", *PLAIN_FORMS, *(f"{{{name}: LETTERS}}" for name in OPTION_FORMS))


class _FormFault(ValueError):
    """What is wrong with a task's answer_form, and the fix."""


def _is_labels(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(x, str) for x in value)


def _answer_form(fields: dict[str, Any]) -> answer_form.Rule | None:
    """The rule a task's `answer_form` spells (None where it has none); a fault raises _FormFault.
    A `label` form whose labels or metric are faulty gets no rule: theirs are the faults."""
    form = fields.get("answer_form")
    if form is None:
        return None
    if form == "label":
        labels, metric = fields.get("labels"), fields.get("metric")
        if not labels:
            raise _FormFault("label needs the task's labels, the answers it chooses from: add e.g. labels: [yes, no]")
        if metric not in METRICS or not _is_labels(labels):
            return None
        if metric not in ANSWER_KEYS:
            raise _FormFault(f"label compares a prediction with the labels as the metric compares it with the answer, "
                             f"and metric {metric} compares no whole answer; use metric "
                             f"{' or '.join(ANSWER_KEYS)}, or another answer_form")
        return answer_form.label(labels, metric)
    if isinstance(form, str) and form in PLAIN_FORMS:
        return PLAIN_FORMS[form]
    if isinstance(form, str) and form in OPTION_FORMS:
        raise _FormFault(f"{form} needs its option letters: write answer_form: {{{form}: ABCD}}")
    if isinstance(form, dict) and len(form) == 1 and next(iter(form)) in OPTION_FORMS:
        (name, letters), = form.items()
        if not isinstance(letters, str) or not letters.isalnum():
            raise _FormFault(f"{name} needs its option letters as one string of letters or digits, "
                             f"e.g. answer_form: {{{name}: ABCD}}")
        return OPTION_FORMS[name](letters)
    raise _FormFault(f"{form!r} is not an answer form; "
                     f"{did_you_mean(str(form), ('label', *PLAIN_FORMS, *OPTION_FORMS))}"
                     f"give one of: {', '.join(FORM_SPELLINGS)}")


def _spec_faults(path: Path) -> tuple[dict[str, Any], list[str]]:
    """benchmark.yaml's mapping (what of it could be read) and one line per fault in it."""
    if not path.is_file():
        return {}, [f"{path}: missing; write it, naming each task's metric and max_new_tokens "
                    f"(docs/benchmarks.md, 'Your own tasks')"]
    try:
        spec = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except UnicodeDecodeError as e:
        return {}, [f"{path}: byte {e.start} is not UTF-8; re-save the file as UTF-8"]
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        return {}, [f"{path}: invalid YAML{at}; fix the syntax"]
    if not isinstance(spec, dict):
        return {}, [f"{path}: the top level must be a mapping with 'tasks'; see docs/benchmarks.md"]
    faults = [f"{path}: unknown field '{key}'; {did_you_mean(str(key), FIELDS)}valid fields: {', '.join(FIELDS)}"
              for key in spec if key not in FIELDS]
    tasks = spec.get("tasks")
    if not isinstance(tasks, dict) or not tasks:
        return spec, faults + [f"{path}: field 'tasks' must map each task folder's name to its metric and "
                               f"max_new_tokens, e.g. 'tasks: {{MyTask: {{metric: accuracy, max_new_tokens: 8}}}}'"]
    for name, fields in tasks.items():
        where = f"{path}: task {name}"
        if not isinstance(fields, dict):
            faults.append(f"{where}: give a mapping with metric and max_new_tokens")
            continue
        faults += [f"{where}: unknown field '{key}'; {did_you_mean(str(key), TASK_FIELDS)}valid fields: "
                   f"{', '.join(TASK_FIELDS)}" for key in fields if key not in TASK_FIELDS]
        metric = fields.get("metric")
        if metric not in METRICS:
            faults.append(f"{where}: metric {metric!r} is not a metric; {did_you_mean(str(metric), METRICS)}"
                          f"choose one of {', '.join(METRICS)}")
        budget = fields.get("max_new_tokens")
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
            faults.append(f"{where}: max_new_tokens={budget!r} must be a whole number >= 1 (the generation "
                          f"budget in tokens), e.g. max_new_tokens: 16")
        if not _is_labels(fields.get("labels", [])):
            faults.append(f"{where}: labels must be a list of strings, e.g. labels: [yes, no]")
        try:
            _answer_form(fields)
        except _FormFault as e:
            faults.append(f"{where}: answer_form {e}")
    orders = spec.get("orders", {})
    if not isinstance(orders, dict) or not all(isinstance(o, list) for o in orders.values()):
        return spec, faults + [f"{path}: field 'orders' must map order names to lists of task names"]
    faults += [f"{path}: order {name} names {task!r}, not a task of this file; {did_you_mean(str(task), tasks)}"
               f"name tasks from: {', '.join(map(str, tasks))}"
               for name, order in orders.items() for task in order if task not in tasks]
    return spec, faults


def _benchmark(folder: Path, spec: dict[str, Any]) -> Benchmark:
    tasks = {str(name): TaskSpec(name=str(name), metric=f["metric"], max_new_tokens=f["max_new_tokens"],
                                 description=str(f.get("description", name)), language=str(f.get("language", "en")),
                                 labels=tuple(f.get("labels", ())))
             for name, f in spec["tasks"].items()}
    orders = {"all": list(tasks), **{str(k): [str(t) for t in v] for k, v in spec.get("orders", {}).items()}}
    forms = {str(name): _answer_form(f) for name, f in spec["tasks"].items()}
    name = str(spec.get("name") or folder.resolve().name)
    return Benchmark(name=name, title=name, description=str(spec.get("description") or f"the tasks of {folder}"),
                     tasks=tasks, orders=orders, default_order="all", default_dirs=(str(folder.resolve()),),
                     reference=str(folder / SPEC_FILE),
                     answer_forms={task: rule for task, rule in forms.items() if rule is not None})


def from_folder(folder: Path) -> Benchmark:
    """The benchmark `folder`'s benchmark.yaml declares; its first fault is a UserError."""
    spec, faults = _spec_faults(folder / SPEC_FILE)
    if faults:
        raise UserError(f"{faults[0]} (`cl-bench data check {folder}` lists every fault)")
    return _benchmark(folder, spec)


def check(folder: Path) -> list[str]:
    """Every fault of a task folder, one line each: benchmark.yaml's, then each task's
    (a missing train or test split, a file that is not UTF-8 or not JSON, a record
    without its prompt or answer), each naming the file, the item and the fix."""
    if not folder.is_dir():
        return [f"{folder}: not a folder; give the folder holding benchmark.yaml and one subfolder per task"]
    spec, faults = _spec_faults(folder / SPEC_FILE)
    tasks = spec.get("tasks") if isinstance(spec.get("tasks"), dict) else {}
    for task in tasks:
        task_dir = folder / str(task)
        if not task_dir.is_dir():
            faults.append(f"{task_dir}: missing; benchmark.yaml names task {task}: add its folder with "
                          f"train.json and test.json, or remove it from benchmark.yaml")
            continue
        for split in SPLITS:
            files = [task_dir / f"{split}{suffix}" for suffix in SUFFIXES if (task_dir / f"{split}{suffix}").is_file()]
            if not files and split in REQUIRED_SPLITS:
                faults.append(f"{task_dir}: no {split} split; add {split}.json (a JSON list of "
                              f'{{"prompt": ..., "answer": ...}}) or {split}.jsonl')
            for path in files:
                try:
                    faults += record_faults(path, read_json_records(path))
                except UserError as exc:
                    faults.append(str(exc))
    return faults
