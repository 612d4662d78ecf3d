"""The long-sequence benchmark (issue 54) on a tiny folder in O-LoRA's release
layout: its prompts, its carved eval split, its scoring, its profiles, and runs on
it that name their tasks or stop in one line."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from cl_bench import config as cfg
from cl_bench import registry
from cl_bench.errors import UserError
from cl_bench.metrics import scorers
from cl_bench.profiles import PROFILES
from cl_bench.record.io import read_record
from helpers import only_run, run_cli


def test_list_shows_trace_and_long_sequence(capsys):
    assert run_cli("list", "--benchmarks") == 0
    assert {"trace", "long-sequence"} <= {line.split()[0] for line in capsys.readouterr().out.splitlines()}


def test_a_misspelt_name_suggests_it():
    with pytest.raises(UserError, match="did you mean 'long-sequence'"):
        registry.get_benchmark("long-sequense")


def test_another_benchmark_has_none_of_traces_task_fields():
    """Mutation caught: general.lima left out of OWN (long-sequence's cpu would probe
    Lima, which its folder lacks)."""
    c = cfg.resolve("cpu", None, {"data": {"benchmark": "long-sequence"}})
    assert c.data.order == "order4-10" and c.data.n_test == 200 and c.data.n_test_per_task == {}
    assert c.general.lima == 0 and c.eval.max_new_tokens_cap == 8
    assert c.train.lr_by_family == PROFILES["cpu"]["train"]["lr_by_family"]  # shared fields stay
    paper = cfg.resolve("paper", None, {"data": {"benchmark": "long-sequence"}})
    assert paper.train.epochs_per_task == {}


def release(root: Path, nested: bool = True) -> Path:
    """CB and COPA in O-LoRA's release layout (CB under its family folder NLI/ when `nested`)."""
    cb = root / ("NLI/CB" if nested else "CB")
    copa = root / "COPA"
    for folder, labels, item in (
            (cb, ["entailment", "contradiction", "neutral"],
             lambda i: {"label": ["entailment", "contradiction"][i % 2], "sentence": f"sentence 1: s{i}\nsentence 2: t"}),
            (copa, ["A", "B"], lambda i: {"label": "AB"[i % 2], "sentence": f"Which is the cause of {i}?\nA: x\nB: y"})):
        folder.mkdir(parents=True)
        (folder / "labels.json").write_text(json.dumps(labels))
        (folder / "train.json").write_text(json.dumps([item(i) for i in range(40)]))
        (folder / "test.json").write_text(json.dumps([item(i) for i in range(100, 110)]))
    return root


def test_long_sequence_prompts_are_the_releases(tmp_path):
    bench = registry.get_benchmark("long-sequence")
    root = release(tmp_path / "CL_Benchmark")
    cb = bench.load_split(root, "CB", "test")[0]
    assert cb.prompt == ('Task:NLI\nDataset:CB\nWhat is the logical relationship between the "sentence 1" and the '
                         '"sentence 2"? Choose one from the option.\nOption: entailment, contradiction, neutral \n'
                         'sentence 1: s100\nsentence 2: t\nAnswer:')
    assert cb.answer == "entailment"
    copa = bench.load_split(root, "COPA", "test")[1]
    assert copa.prompt == "Task:COPA\nDataset:COPA\nWhich is the cause of 101?\nA: x\nB: y\nAnswer:"


def test_long_sequence_eval_is_carved_from_train_the_same_for_every_seed(tmp_path):
    """Mutation caught: eval items left in train (the carve's test flipped or dropped)."""
    bench = registry.get_benchmark("long-sequence")
    root = release(tmp_path / "flat", nested=False)
    train = {e.index for e in bench.load_split(root, "CB", "train")}
    held = {e.index for e in bench.load_split(root, "CB", "eval")}
    assert len(held) == 4 and len(train) == 36 and not train & held
    a = bench.load_task(root, "CB", None, None, seed=1, test_split="eval")
    b = bench.load_task(root, "CB", None, None, seed=2, test_split="eval")
    assert [e.index for e in a.test] == [e.index for e in b.test] == sorted(held)
    assert a.provenance["test"]["file"] == "CB/train.json" and a.provenance["test"]["split"] == "eval"


def test_exact_match_scores_as_the_release():
    """O-LoRA's normalisation: case, punctuation and spacing do not count. Mutation
    caught: punctuation kept ('Science or Technology.' then scores 0)."""
    assert scorers.exact_match(["science  or technology.", "Bad", "World"],
                               ["Science or Technology", "Good", "World"]) == pytest.approx(200 / 3)


def test_an_order_naming_a_missing_task_stops_in_one_line(tmp_path, capsys):
    """Mutation caught: prepare not checking the order's folders before it claims the
    run folder (the same line comes later, and leaves an empty run folder)."""
    root = release(tmp_path / "CL_Benchmark")
    out = tmp_path / "out"
    assert run_cli("run", "--profile", "smoke", "--benchmark", "long-sequence", "--data-dir", root,
                   "--order", "CB,MNLI,yelp", "--output-dir", out) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no folder for MNLI, yelp" in err[0] and "CB, COPA" in err[0]
    assert not out.exists() or not any(out.iterdir())  # stopped before a run folder was claimed


def test_long_sequence_smoke_names_the_tasks_it_used_and_shows_its_forms(tmp_path, capsys):
    """`show` of the run has the answer-form table (a share for each scored cell) and BWT's
    format and content parts. Mutation caught: long-sequence declaring no answer_forms
    (no table, no split)."""
    root = release(tmp_path / "CL_Benchmark")
    out = tmp_path / "out"
    assert run_cli("run", "--profile", "smoke", "--benchmark", "long-sequence", "--data-dir", root,
                   "--order", "CB,COPA", "--output-dir", out, "--no-progress") == 0
    record = read_record(only_run(out))
    assert record.benchmark == "long-sequence" and record.tasks == ["CB", "COPA"]
    assert record.config["data"]["benchmark"] == "long-sequence"
    assert {t["metric"] for t in record.task_metrics} == {"exact_match"}
    has = lambda rows: [[v is not None for v in row] for row in rows]  # noqa: E731
    assert has(record.intervals["form_share"]) == has(record.matrix) == [[True, False], [True, True]]
    capsys.readouterr()
    assert run_cli("show", only_run(out)) == 0
    shown = capsys.readouterr().out
    assert "answer form (share of predictions" in shown and "BWT format" in shown and "BWT content" in shown
    # A record stored before its benchmark declared forms (the shares all null) shows them
    # now, from its predictions; the stored cells stay what they were.
    from cl_bench.metrics.intervals import record_intervals

    run = only_run(out)
    raw = json.loads((run / "run.json").read_text())
    stored = raw["intervals"]
    raw["intervals"] = {**stored, "form_share": [[None, None], [None, None]], "zero_shot_form_share": [None, None]}
    (run / "run.json").write_text(json.dumps(raw))
    again = record_intervals(read_record(run), run)
    assert again["form_share"] == stored["form_share"]
    assert json.loads(json.dumps(again["matrix_ci"])) == stored["matrix_ci"]
    # (mutation caught: record_intervals returning the stored intervals whatever they lack)
