"""Benchmarks as plugins (issue 54): the registry and its entry-point group, the
profiles a benchmark owns, your own task folder (`--benchmark DIR`, `cl-bench data
check`); the long-sequence benchmark: test_long_sequence.py."""
from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from cl_bench import config as cfg
from cl_bench import registry
from cl_bench.benchmark import METRICS
from cl_bench.errors import UserError
from cl_bench.metrics import scorers
from cl_bench.profiles import PROFILES
from cl_bench.record.io import read_record
from helpers import only_run, run_cli


def test_list_shows_trace(capsys):
    assert run_cli("list", "--benchmarks") == 0
    assert "trace" in {line.split()[0] for line in capsys.readouterr().out.splitlines()}


def test_benchmark_metrics_are_the_scorers():
    assert set(METRICS) == set(scorers.METRICS)


def test_an_outside_benchmark_registers_through_the_entry_point_group(tmp_path, monkeypatch):
    """Mutation caught: BENCHMARK_GROUP changed, or discovery not reading it (the plugin is not found)."""
    assert registry.BENCHMARK_GROUP == "cl_bench.benchmarks"
    (tmp_path / "clb_bench_plugin.py").write_text(textwrap.dedent("""
        from cl_bench.benchmark import Benchmark, TaskSpec

        OUTSIDE = Benchmark(name="outside-bench", title="Outside", description="an outside benchmark",
                            tasks={"A": TaskSpec("A", "accuracy", 4, "a task", "en")},
                            orders={"one": ["A"]}, default_order="one")
    """))
    info = tmp_path / "clb_bench_plugin-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: clb-bench-plugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[cl_bench.benchmarks]\noutside-bench = clb_bench_plugin:OUTSIDE\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(registry, "_BENCHMARKS_DISCOVERED", False)
    assert registry.get_benchmark("outside-bench").resolve_order(None) == ["A"]
    assert "outside-bench" in registry.benchmarks()


def test_unknown_benchmark_suggests():
    with pytest.raises(UserError, match="did you mean 'trace'"):
        registry.get_benchmark("trase")


# ---- profiles ----------------------------------------------------------------


@pytest.mark.parametrize("profile", sorted(PROFILES))
def test_trace_profiles_resolve_as_written(profile):
    """TRACE's runs keep every profile field as profiles.py writes it. Mutation caught:
    split_own dropping the own fields (TRACE's cpu without its order and per-task counts)."""
    written = cfg.build(cfg.merge({"profile": profile}, PROFILES[profile]), "test").to_dict()
    assert cfg.resolve(profile, None, {}).to_dict() == written


def test_a_record_without_benchmark_reads_as_trace(tmp_path):
    run = Path(__file__).resolve().parents[2] / "results"
    record_file = next(run.rglob("run.json"))
    data = json.loads(record_file.read_text())
    data.pop("benchmark")
    (tmp_path / "run.json").write_text(json.dumps(data))
    assert read_record(tmp_path).benchmark == "trace"


# ---- your own tasks ------------------------------------------------------------


def own_folder(root: Path) -> Path:
    """Two tasks: Add (JSON, labels) and Echo (JSONL, with an eval split)."""
    (root / "Add").mkdir(parents=True)
    (root / "Echo").mkdir()
    add = [{"prompt": f"{a} plus {a}? Answer:", "answer": str(2 * a)} for a in range(12)]
    (root / "Add" / "train.json").write_text(json.dumps(add))
    (root / "Add" / "test.json").write_text(json.dumps(add[:5]))
    echo = [{"prompt": f"Say {w}:", "answer": w} for w in "red green blue cyan gray pink teal".split()]
    for split in ("train", "eval", "test"):
        (root / "Echo" / f"{split}.jsonl").write_text("\n".join(json.dumps(r) for r in echo) + "\n")
    (root / "benchmark.yaml").write_text(textwrap.dedent("""
        name: toy
        description: two toy tasks
        tasks:
          Add: {metric: accuracy, max_new_tokens: 4, labels: ["0", "2"], answer_form: label}
          Echo: {metric: rouge_l, max_new_tokens: 6}
        orders:
          backwards: [Echo, Add]
    """))
    return root


def test_your_own_folder_runs_end_to_end_on_smoke(tmp_path, capsys):
    """Add declares `answer_form: label`, Echo no form: `show` has Add's form shares, and
    none of Echo's, whether it reads the record's intervals or computes them from the
    predictions. Mutations caught: the run loading TRACE whatever data.benchmark says
    (the smoke profile's NumGLUE-cm is not in the folder); the record not naming the
    folder's benchmark; benchmark.yaml's answer_form not given to the benchmark, or
    rules_of looking up only the record's name for it ('toy', registered nowhere): no
    form shares."""
    folder = own_folder(tmp_path / "mine")
    out = tmp_path / "out"
    assert run_cli("run", "--profile", "smoke", "--benchmark", folder, "--order", "backwards", "--output-dir", out,
                   "--no-progress", "--method-arg", "lr=1e-3") == 0
    run_dir = only_run(out)
    record = read_record(run_dir)
    assert record.status == "complete" and record.benchmark == "toy" and record.tasks == ["Echo", "Add"]
    assert record.data["Echo"]["train"]["file"] == "Echo/train.jsonl" and record.data["Add"]["test"]["size"] == 4
    assert all(v is not None for v in record.matrix[-1])
    assert [row[0] for row in record.intervals["form_share"]] == [None, None]  # Echo: no form
    assert record.intervals["form_share"][-1][1] is not None  # Add, after both stages
    stored = json.loads((run_dir / "run.json").read_text())
    for intervals in (stored, {**stored, "intervals": None}):  # stored, then from predictions.jsonl
        (run_dir / "run.json").write_text(json.dumps(intervals))
        capsys.readouterr()
        assert run_cli("show", run_dir) == 0
        assert "answer form (share of predictions" in capsys.readouterr().out


def fault_lines(capsys, folder) -> list[str]:
    assert run_cli("data", "check", folder) == 2
    out = capsys.readouterr()
    assert "Traceback" not in out.out + out.err
    return out.out.strip().splitlines()


def test_data_check_is_silent_on_a_good_folder(tmp_path, capsys):
    assert run_cli("data", "check", own_folder(tmp_path / "mine")) == 0
    assert "no faults" in capsys.readouterr().out


def test_data_check_gives_one_line_per_fault(tmp_path, capsys):
    """A missing answer, a task without a test split, an unknown metric, a non-UTF-8 file:
    one line each, naming the file, the item and the fix. Mutations caught: the check
    stopping at the first fault (one line), test not a required split (three)."""
    folder = own_folder(tmp_path / "mine")
    (folder / "Add" / "train.json").write_text(json.dumps([{"prompt": "p"}, {"prompt": "q", "answer": "a"}]))
    (folder / "Echo" / "test.jsonl").unlink()
    (folder / "Echo" / "eval.jsonl").write_bytes(b'{"prompt": "caf\xe9", "answer": "x"}\n')
    spec = folder / "benchmark.yaml"
    spec.write_text(spec.read_text().replace("metric: rouge_l", "metric: rouge-l"))
    lines = fault_lines(capsys, folder)
    assert len(lines) == 4, lines
    metric, answer, utf8, test = lines  # benchmark.yaml's first, then each task's splits in order
    assert "benchmark.yaml" in metric and "rouge-l" in metric and "did you mean 'rouge_l'" in metric
    assert "Add/train.json" in answer and "record 1" in answer and 'add "answer"' in answer
    assert "Echo" in test and "no test split" in test and "add test.json" in test
    assert "Echo/eval.jsonl" in utf8 and "not UTF-8" in utf8 and "re-save" in utf8


@pytest.mark.parametrize("task, fields, says", [
    ("Add", '{metric: accuracy, max_new_tokens: 4, labels: ["0", "2"], answer_form: lable}',
     ["'lable' is not an answer form", "did you mean 'label'", "{option: LETTERS}"]),
    ("Add", "{metric: accuracy, max_new_tokens: 4, answer_form: label}",
     ["label needs the task's labels", "labels: ["]),
    ("Echo", "{metric: rouge_l, max_new_tokens: 6, labels: [red], answer_form: label}",
     ["metric rouge_l compares no whole answer", "use metric accuracy or exact_match"]),
    ("Add", "{metric: accuracy, max_new_tokens: 4, answer_form: option}",
     ["option needs its option letters", "answer_form: {option: ABCD}"]),
    ("Add", "{metric: accuracy, max_new_tokens: 4, answer_form: {option_first: ''}}",
     ["option_first needs its option letters", "answer_form: {option_first: ABCD}"]),
])
def test_data_check_gives_one_line_per_answer_form_fault(tmp_path, capsys, task, fields, says):
    """An unknown form, label without labels or with a metric that compares no whole
    answer, an option form without letters: one line naming the file, the task, the
    field and the fix; exit 2, no traceback. Mutations caught: the check not reading
    answer_form, or dropping label's labels check, or an option form's letters check,
    or accepting an option form without letters (exit 0 each); label's metric check
    dropped (a ValueError building the rule)."""
    folder = own_folder(tmp_path / "mine")
    spec = folder / "benchmark.yaml"
    lines = spec.read_text().splitlines()
    spec.write_text("\n".join(f"  {task}: {fields}" if line.strip().startswith(f"{task}:") else line
                              for line in lines))
    [line] = fault_lines(capsys, folder)
    assert f"benchmark.yaml: task {task}: answer_form " in line and all(s in line for s in says), line


def test_a_bad_yaml_stops_a_run_in_one_line(tmp_path, capsys):
    folder = own_folder(tmp_path / "mine")
    (folder / "benchmark.yaml").write_text("tasks: {Add: {metric: bleu, max_new_tokens: 4}}\n")
    assert run_cli("run", "--profile", "smoke", "--benchmark", folder, "--output-dir", tmp_path / "out") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "bleu" in err[0] and "data check" in err[0]
