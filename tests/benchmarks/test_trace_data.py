"""TRACE task specs, orders and the data loader, on tiny fixture folders in
the TRACE layout (the real 500 release: test_trace_real_data.py)."""

import hashlib
import json
import logging
import os
import subprocess
import sys

import pytest

from cl_bench.benchmarks.trace import (
    CL_TASKS,
    METRICS,
    ORDERS,
    TASKS,
    Example,
    TaskSpec,
    file_sha256,
    load_benchmark,
    load_split,
    load_task,
    resolve_data_dir,
    resolve_order,
)
from cl_bench.errors import UserError


def records(n, tag="x"):
    return [{"prompt": f"{tag} prompt {i}", "answer": f"{tag} answer {i}"} for i in range(n)]


def write_split(root, task, split, content):
    """content: a Python object (dumped as JSON) or a str (written as is)."""
    folder = root / task
    folder.mkdir(parents=True, exist_ok=True)
    text = content if isinstance(content, str) else json.dumps(content, indent=1)
    (folder / f"{split}.json").write_text(text, encoding="utf-8")
    return folder / f"{split}.json"


@pytest.fixture
def root(tmp_path):
    """A TRACE-layout folder: FOMC, C-STANCE and NumGLUE-ds, each with the same
    40 train / 10 eval / 10 test records."""
    root = tmp_path / "TRACE"
    for task in ("FOMC", "C-STANCE", "NumGLUE-ds"):
        write_split(root, task, "train", records(40, "train"))
        write_split(root, task, "eval", records(10, "eval"))
        write_split(root, task, "test", records(10, "test"))
    return root


def error_of(fn, *args, **kwargs) -> str:
    with pytest.raises(UserError) as info:
        fn(*args, **kwargs)
    message = str(info.value)
    assert "\n" not in message, "messages are one line"
    return message


# --- task specs and orders ---------------------------------------------------


def test_tasks_cover_trace_and_lima():
    assert set(TASKS) == set(CL_TASKS) | {"Lima"}
    for name, spec in TASKS.items():
        assert spec.name == name
        assert spec.metric in METRICS
        assert spec.max_new_tokens >= 1
        assert "\n" not in spec.description
    assert TASKS["Py150"].extra_metrics == ("codebleu",)
    assert {TASKS[t].metric for t in ("C-STANCE", "FOMC", "NumGLUE-cm", "NumGLUE-ds")} == {"accuracy"}
    assert TASKS["ScienceQA"].metric == "first_char_accuracy"
    assert TASKS["MeetingBank"].metric == "rouge_l"
    assert TASKS["Py150"].metric == "edit_similarity"
    assert TASKS["20Minuten"].metric == "sari"
    assert "not a scored" in TASKS["Lima"].description
    assert "copy of eval" in TASKS["MeetingBank"].description


def test_taskspec_rejects_unknown_metric():
    with pytest.raises(ValueError, match="bleu"):
        TaskSpec(name="X", metric="bleu", max_new_tokens=4, description="d", language="en")


def test_named_orders():
    assert resolve_order("paper6") == [
        "MeetingBank", "Py150", "NumGLUE-cm", "NumGLUE-ds", "20Minuten", "C-STANCE"]
    assert resolve_order("trace8") == [
        "C-STANCE", "FOMC", "MeetingBank", "Py150", "ScienceQA", "NumGLUE-cm", "NumGLUE-ds",
        "20Minuten"]
    # A copy: callers may not mutate the registry.
    resolve_order("paper6").append("FOMC")
    assert len(ORDERS["paper6"]) == 6


def test_custom_orders():
    assert resolve_order(["FOMC", "C-STANCE"]) == ["FOMC", "C-STANCE"]
    assert resolve_order("FOMC,C-STANCE") == ["FOMC", "C-STANCE"]
    assert resolve_order(" FOMC , C-STANCE ") == ["FOMC", "C-STANCE"]
    assert resolve_order("FOMC") == ["FOMC"]


def test_unknown_task_suggests_and_lists():
    message = error_of(resolve_order, ["FOMC", "NumGLUE-dx"])
    assert "'NumGLUE-dx'" in message
    assert "did you mean 'NumGLUE-ds'" in message
    assert all(t in message for t in CL_TASKS)


def test_case_only_mismatch_is_an_error_with_the_right_spelling():
    message = error_of(resolve_order, "fomc,C-STANCE")
    assert "did you mean 'FOMC'" in message and "case-sensitive" in message


def test_unknown_order_name_suggests_order():
    message = error_of(resolve_order, "paper7")
    assert "did you mean 'paper6'" in message
    assert "trace8" in message


def test_duplicates_and_empty_entries_rejected():
    assert "more than once" in error_of(resolve_order, ["FOMC", "C-STANCE", "FOMC"])
    assert "more than once" in error_of(resolve_order, "FOMC,FOMC")
    assert "empty" in error_of(resolve_order, "FOMC,,C-STANCE")
    assert "empty" in error_of(resolve_order, [])


def test_lima_is_not_an_order_task():
    assert "replay-only" in error_of(resolve_order, ["FOMC", "Lima"])


# --- data dir resolution -----------------------------------------------------


def test_cli_value_beats_env(tmp_path, monkeypatch):
    (tmp_path / "cli").mkdir()
    (tmp_path / "env").mkdir()
    monkeypatch.setenv("CL_BENCH_DATA", str(tmp_path / "env"))
    assert resolve_data_dir(str(tmp_path / "cli")) == (tmp_path / "cli").resolve()
    assert resolve_data_dir(None) == (tmp_path / "env").resolve()


def test_env_beats_conventional_places(tmp_path, monkeypatch):
    work = tmp_path / "work"
    (work / "data" / "TRACE").mkdir(parents=True)
    (tmp_path / "env").mkdir()
    monkeypatch.chdir(work)
    monkeypatch.setenv("CL_BENCH_DATA", str(tmp_path / "env"))
    assert resolve_data_dir(None) == (tmp_path / "env").resolve()
    monkeypatch.delenv("CL_BENCH_DATA")
    assert resolve_data_dir(None) == (work / "data" / "TRACE").resolve()


def test_conventional_shared_copy(tmp_path, monkeypatch):
    shared = tmp_path / "shared" / "trace" / "LLM-CL-Benchmark_500"
    shared.mkdir(parents=True)
    (tmp_path / "main").mkdir()
    monkeypatch.chdir(tmp_path / "main")
    monkeypatch.delenv("CL_BENCH_DATA", raising=False)
    assert resolve_data_dir(None) == shared.resolve()


def test_missing_given_paths_are_named(tmp_path, monkeypatch):
    missing = tmp_path / "nope"
    message = error_of(resolve_data_dir, str(missing))
    assert str(missing) in message and "--data-dir" in message
    monkeypatch.setenv("CL_BENCH_DATA", str(missing))
    message = error_of(resolve_data_dir, None)
    assert str(missing) in message and "CL_BENCH_DATA" in message
    (tmp_path / "file").write_text("")
    assert "not a folder" in error_of(resolve_data_dir, str(tmp_path / "file"))


def test_nothing_found_says_what_to_do(tmp_path, monkeypatch):
    (tmp_path / "a" / "b").mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "a" / "b")
    monkeypatch.delenv("CL_BENCH_DATA", raising=False)
    message = error_of(resolve_data_dir, None)
    assert "--data-dir" in message and "CL_BENCH_DATA" in message
    assert str(tmp_path / "a" / "b" / "data" / "TRACE") in message
    assert str(tmp_path / "a" / "shared" / "trace" / "LLM-CL-Benchmark_500") in message


# --- load_split validation ---------------------------------------------------


def test_load_split_reads_records_with_indices(root):
    examples = load_split(root, "FOMC", "test")
    assert len(examples) == 10
    assert examples[3] == Example(prompt="test prompt 3", answer="test answer 3", index=3)


def test_missing_data_dir(tmp_path):
    assert str(tmp_path / "nope") in error_of(load_split, tmp_path / "nope", "FOMC", "test")


def test_missing_task_folder_lists_present_ones(root):
    message = error_of(load_split, root, "ScienceQA", "test")
    assert "'ScienceQA'" in message and str(root) in message
    assert "C-STANCE, FOMC, NumGLUE-ds" in message


def test_missing_split_file_lists_present_files(root):
    (root / "FOMC" / "eval.json").unlink()
    message = error_of(load_split, root, "FOMC", "eval")
    assert str(root / "FOMC" / "eval.json") in message
    assert "test.json, train.json" in message


def test_malformed_json_gives_line_and_column(root):
    path = write_split(root, "FOMC", "test", '[\n  {"prompt": "a", "answer": "b"},\n  {"prompt": }\n]')
    message = error_of(load_split, root, "FOMC", "test")
    assert f"{path}:3:14:" in message and "fix the JSON" in message


def test_not_utf8(root):
    (root / "FOMC" / "test.json").write_bytes(b'[{"prompt": "\xff", "answer": "b"}]')
    assert "UTF-8" in error_of(load_split, root, "FOMC", "test")


@pytest.mark.parametrize(
    "content, expected",
    [
        ({"prompt": "a", "answer": "b"}, ["top level is a JSON object", "expected a list"]),
        ([], ["empty"]),
        ([{"prompt": "a", "answer": "b"}, "just text"], ["record 2", "JSON string", "expected an object"]),
        ([{"prompt": "a", "answer": "b"}, {"prompt": "a"}], ["record 2", 'no "answer" field', "fields: prompt"]),
        ([{"answer": "b", "id": 3}], ["record 1", 'no "prompt" field', "fields: answer, id"]),
        ([{"prompt": "a", "answer": "b"}] * 2 + [{"prompt": "a", "answer": 3}],
         ["record 3", 'field "answer"', "JSON number", "expected a string"]),
        ([{"prompt": None, "answer": "b"}], ["record 1", 'field "prompt"', "JSON null"]),
        ([{"prompt": ["a"], "answer": "b"}], ["record 1", 'field "prompt"', "JSON list"]),
    ],
    ids=["top-object", "empty", "record-not-object", "no-answer", "no-prompt",
         "answer-number", "prompt-null", "prompt-list"],
)
def test_invalid_records(root, content, expected):
    path = write_split(root, "FOMC", "test", content)
    message = error_of(load_split, root, "FOMC", "test")
    assert str(path) in message
    for part in expected:
        assert part in message


def test_empty_strings_are_valid(root):
    # Lima's eval/test answers are empty strings in the real release.
    write_split(root, "FOMC", "test", [{"prompt": "", "answer": ""}])
    assert load_split(root, "FOMC", "test") == [Example("", "", 0)]


def test_file_sha256(root):
    path = root / "FOMC" / "train.json"
    assert file_sha256(path) == hashlib.sha256(path.read_bytes()).hexdigest()


# --- subsets and provenance --------------------------------------------------


def test_none_or_large_n_takes_all_in_file_order(root):
    for n in (None, 40, 1000):
        data = load_task(root, "FOMC", n_train=n, n_test=n, seed=0)
        assert [ex.index for ex in data.train] == list(range(40))
        assert [ex.index for ex in data.test] == list(range(10))


def test_subset_is_seeded_sorted_and_recorded(root):
    data = load_task(root, "FOMC", n_train=8, n_test=3, seed=7)
    indices = [ex.index for ex in data.train]
    assert len(indices) == 8 and indices == sorted(indices) and indices != list(range(8))
    assert data.train == [ex for ex in load_split(root, "FOMC", "train") if ex.index in indices]

    again = load_task(root, "FOMC", n_train=8, n_test=3, seed=7)
    assert again.train == data.train and again.test == data.test
    other_seed = load_task(root, "FOMC", n_train=8, n_test=3, seed=8)
    assert [ex.index for ex in other_seed.train] != indices

    p = data.provenance
    assert p["task"] == "FOMC" and p["seed"] == 7 and p["data_dir"] == str(root.resolve())
    assert p["train"] == {
        "split": "train", "file": "FOMC/train.json",
        "sha256": file_sha256(root / "FOMC" / "train.json"),
        "source_size": 40, "requested": 8, "size": 8, "indices": indices,
    }
    assert p["test"]["split"] == "test" and p["test"]["source_size"] == 10
    assert p["test"]["indices"] == [ex.index for ex in data.test]
    json.dumps(p)  # goes into the run record as is


def test_subsets_are_nested(root):
    small = load_task(root, "FOMC", n_train=5, n_test=None, seed=3)
    large = load_task(root, "FOMC", n_train=20, n_test=None, seed=3)
    assert set(small.provenance["train"]["indices"]) < set(large.provenance["train"]["indices"])


def test_subset_keyed_by_task_and_split(root):
    # FOMC and NumGLUE-ds hold identical files here, but draw different subsets.
    fomc = load_task(root, "FOMC", n_train=8, n_test=None, seed=1)
    ds = load_task(root, "NumGLUE-ds", n_train=8, n_test=None, seed=1)
    assert fomc.provenance["train"]["indices"] != ds.provenance["train"]["indices"]
    # And train vs eval of one task (eval is used as a test split) differ too.
    write_split(root, "FOMC", "eval", records(40, "eval"))
    as_eval = load_task(root, "FOMC", n_train=8, n_test=8, seed=1, test_split="eval")
    assert as_eval.provenance["test"]["split"] == "eval"
    assert as_eval.provenance["test"]["indices"] != as_eval.provenance["train"]["indices"]


def test_adding_a_task_does_not_change_another(root):
    alone = load_benchmark(root, ["FOMC"], n_train=8, n_test=4, seed=5)
    together = load_benchmark(root, ["C-STANCE", "NumGLUE-ds", "FOMC"], n_train=8, n_test=4, seed=5)
    assert [t.name for t in together] == ["C-STANCE", "NumGLUE-ds", "FOMC"]
    assert together[2].train == alone[0].train and together[2].test == alone[0].test


def test_subset_is_the_same_in_another_process(root):
    code = (
        "import sys, json; from cl_bench.benchmarks.trace import load_task; "
        "d = load_task(sys.argv[1], 'FOMC', 8, 4, seed=11); "
        "print(json.dumps([d.provenance['train']['indices'], d.provenance['test']['indices']]))"
    )
    here = load_task(root, "FOMC", 8, 4, seed=11)
    expected = [here.provenance["train"]["indices"], here.provenance["test"]["indices"]]
    for hash_seed in ("1", "2"):
        out = subprocess.run(
            [sys.executable, "-c", code, str(root)], check=True, capture_output=True, text=True,
            env={**os.environ, "PYTHONHASHSEED": hash_seed},
        ).stdout
        assert json.loads(out) == expected


@pytest.mark.parametrize("n", [0, -1, 2.5, True])
def test_bad_counts_rejected(root, n):
    assert "n_train" in error_of(load_task, root, "FOMC", n_train=n, n_test=None, seed=0)


def test_unknown_task_in_load_task(root):
    message = error_of(load_task, root, "Fomc", n_train=None, n_test=None, seed=0)
    assert "did you mean 'FOMC'" in message


def test_identical_train_and_test_files_warn(root, caplog):
    write_split(root, "FOMC", "eval", records(40, "train"))  # same bytes as train.json
    with caplog.at_level(logging.WARNING):
        load_task(root, "FOMC", None, None, seed=0, test_split="eval")
    assert "byte-identical" in caplog.text


def test_load_benchmark_validates_order_first(root):
    assert "did you mean" in error_of(load_benchmark, root, "paper7", 8, 4, 0)
