"""Answer-form rules are the benchmark's to declare (Benchmark.answer_forms; issue 54):
TRACE declares its eight (benchmarks/trace/tasks.py), long-sequence a label rule for
each of its fifteen, another benchmark has none unless it declares them, and the core
names no TRACE task.

Mutations caught: rules_of ignoring the record's benchmark (TRACE's rules for every
record: a benchmark without rules would get form shares); a benchmark's rules
replaced by TRACE's where the benchmark declares its own (its undeclared task would
get one); a TRACE task name written back into the core's answer_form.py or
intervals.py; answer_forms naming a task the benchmark lacks left unchecked; `show`'s
form table and analyze's forms.png drawn for a benchmark without forms (all dashes)."""
from __future__ import annotations

from pathlib import Path

import pytest

from cl_bench import registry
from cl_bench.benchmark import Benchmark, TaskSpec
from cl_bench.benchmarks.trace.tasks import ANSWER_FORMS, TASKS
from cl_bench.benchmarks.long_sequence import LABELS, LONG_SEQUENCE, _labels
from cl_bench.metrics.answer_form import label, option, rules_of
from cl_bench.metrics.intervals import run_intervals
from cl_bench.record.schema import RunRecord
from cl_bench.report.figures import plots
from cl_bench.report.text import format_matrix
from helpers import RECORD_TASKS, make_record

ROOT = Path(__file__).resolve().parents[2]
SCORES = {(0, 0): [100, 100, 0, 100], (0, 1): [100, 0, 0, 0],
          (1, 0): [0, 100, 0, 0], (1, 1): [100, 100, 100, 0]}


def intervals(benchmark: str | None) -> dict:
    record, preds = make_record(SCORES)
    if benchmark is not None:
        record["benchmark"] = benchmark
    return run_intervals(RunRecord.from_json(record), preds, resamples=20)


def test_trace_keeps_its_rules_and_old_records_read_as_trace():
    assert rules_of("trace") is ANSWER_FORMS
    old, trace = intervals(None), intervals("trace")
    # stage 1's wrong answers "x" have neither form (NumGLUE-cm: a number, C-STANCE: a letter)
    assert old["form_share"] == trace["form_share"] == [[1.0, 1.0], [0.25, 0.75]]
    assert old["summary"]["bwt_format"] == trace["summary"]["bwt_format"] is not None


def test_a_benchmark_without_rules_has_no_form_shares(tmp_path, monkeypatch):
    """TRACE's task names, no rules declared."""
    bare = Benchmark(name="no-forms", title="NoForms", description="test",
                     tasks={t: TaskSpec(t, "accuracy", 4, t, "en") for t in RECORD_TASKS},
                     orders={"all": list(RECORD_TASKS)}, default_order="all")
    monkeypatch.setitem(registry._BENCHMARKS, "no-forms", bare)
    iv = intervals("no-forms")
    assert rules_of("no-forms") == {}
    assert iv["form_share"] == [[None, None], [None, None]]
    assert iv["summary"]["bwt_format"] is None and iv["summary"]["bwt_content"] is None
    assert iv["summary"]["bwt"] == intervals("trace")["summary"]["bwt"]  # the scores are the scores
    assert rules_of("not-installed-here") == {}
    record = RunRecord.from_json({**make_record(SCORES)[0], "benchmark": "no-forms"})
    assert "answer form" not in format_matrix(record, iv)  # no table of dashes
    assert plots.forms(record, tmp_path / "forms.png", iv) is None and not (tmp_path / "forms.png").exists()


def test_a_benchmark_declares_its_own_rules(monkeypatch):
    """Same task names as TRACE's, one rule declared (C-STANCE: the letter A alone)."""
    own = Benchmark(name="forms-test", title="FormsTest", description="test",
                    tasks={t: TaskSpec(t, "accuracy", 4, t, "en") for t in RECORD_TASKS},
                    orders={"all": list(RECORD_TASKS)}, default_order="all",
                    answer_forms={"C-STANCE": option("A")})
    monkeypatch.setitem(registry._BENCHMARKS, "forms-test", own)
    iv = intervals("forms-test")
    # NumGLUE-cm: no rule declared; C-STANCE: "A" right, "B" (stage 0's wrong) and "x" not
    assert iv["form_share"] == [[None, 0.25], [None, 0.75]]


def test_answer_forms_name_tasks_of_the_benchmark():
    with pytest.raises(ValueError, match="answer_forms names tasks it does not have: Nope"):
        Benchmark(name="bad", title="Bad", description="", tasks={"A": TaskSpec("A", "accuracy", 4, "a", "en")},
                  orders={"all": ["A"]}, default_order="all", answer_forms={"Nope": option("A")})


def test_the_core_names_no_trace_task():
    for path in ("cl_bench/metrics/answer_form.py", "cl_bench/metrics/intervals.py"):
        text = (ROOT / path).read_text(encoding="utf-8")
        assert [t for t in TASKS if f'"{t}"' in text] == [], path


def test_a_label_is_one_of_the_labels_as_the_metric_compares_answers():
    """Mutations caught: the prediction compared as it is under exact_match (the label in
    other case and punctuation fails); containment instead of equality ('' and 'science',
    part of a label, pass); the metric's key ignored (accuracy's 'Entailment' passes); the
    empty check dropped ('' passes where a label normalises to nothing, as '-' does)."""
    nli = label(["entailment", "Science or Technology", "-"], "exact_match")
    assert nli("entailment", "p") and nli("Entailment.", "p") and nli("science  OR technology!", "p")
    assert not nli("maybe", "p") and not nli("science", "p") and not nli("", "p")
    as_is = label(["entailment"], "accuracy")
    assert as_is("entailment", "p") and not as_is("Entailment", "p")
    with pytest.raises(ValueError, match="rouge_l"):
        label(["a"], "rouge_l")


def test_long_sequence_has_a_label_rule_for_every_task():
    """Each of the fifteen tasks accepts its own labels (in any case) and not a non-label;
    LABELS are what the loader reads from labels.json (the copy here, where present).
    Mutations caught: answer_forms over order4-10 only (five tasks without a rule);
    every rule built over one task's labels (CB's)."""
    rules = rules_of("long-sequence")
    assert set(rules) == set(LONG_SEQUENCE.tasks)
    for task, labels in LABELS.items():
        assert all(rules[task](x, "p") and rules[task](x.upper(), "p") for x in labels), task
        assert not rules[task]("maybe", "p"), task
    copy = Path(LONG_SEQUENCE.default_dirs[1])
    for folder in sorted(copy.glob("*/labels.json")) if copy.is_dir() else []:
        assert tuple(_labels(folder)) == LABELS[folder.parent.name], folder

