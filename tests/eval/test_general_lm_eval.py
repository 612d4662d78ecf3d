"""General tasks through lm-evaluation-harness (cl_bench/eval/general/lm_eval_tasks.py): ΔG,
the offline refusal before training, and two made-up local tasks (tests/data/general: a
multiple-choice and a generation one) run through lm-eval's own code inside a smoke run.
The tests that need lm-eval skip where the optional extra `cl-bench[general]` is absent."""
from __future__ import annotations

import builtins
from pathlib import Path

import pytest

from cl_bench.record import io as results
from cl_bench.config import resolve
from cl_bench.errors import UserError
from cl_bench.eval.general import lm_eval_tasks
from cl_bench.report.general import compare_general
from helpers import only_run, run_cli, smoke_args

DATA = Path(__file__).parents[1] / "data" / "general"
TASKS = f"general.tasks=[{DATA / 'tiny_mc.yaml'},{DATA / 'tiny_gen.yaml'}]"


@pytest.fixture(scope="module")
def index():
    """lm-eval's task index, built once for this module: TaskManager() reads every YAML under
    lm_eval/tasks (about 20 s on CI, most of these tests' time), the same index each time."""
    pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    return TaskManager()


@pytest.fixture
def one_index(index, monkeypatch):
    """GeneralTasks.prepare's TaskManager() returns the module's index (it imports the name
    inside the function, so the patched one), TaskManager(include_defaults=False) a real one
    without the built-in tasks; the rest of prepare runs as it is. The list: each call's
    include_defaults."""
    import lm_eval.tasks

    real, calls = lm_eval.tasks.TaskManager, []

    def manager(include_defaults=True):
        calls.append(include_defaults)
        return index if include_defaults else real(include_defaults=False)

    monkeypatch.setattr(lm_eval.tasks, "TaskManager", manager)
    return calls


def task(scores: list[float], items: list[str] | None = None) -> dict:
    return {"metric": "acc", "score": sum(scores) / len(scores), "stderr": None, "ci": None, "n": len(scores),
            "items": items or [f"t/{i}" for i in range(len(scores))], "item_scores": scores}


def points() -> dict:
    return {"-1": {"tasks": {"A": task([0, 100, 100, 0]), "B": task([0, 0])}},  # 50, 0
            "0": {"tasks": {"A": task([100, 100, 100, 0]), "B": task([100, 0])}},  # 75, 50
            "1": {"tasks": {"A": task([100, 100, 100, 100]), "B": task([0, 0])}}}  # 100, 0


def test_delta_g_is_the_mean_change_from_zero_shot():
    d = lm_eval_tasks.delta_g(points())
    assert d["0"]["value"] == pytest.approx(((75 - 50) + (50 - 0)) / 2)  # 37.5
    assert d["0"]["tasks"] == {"A": 25.0, "B": 50.0}
    # after stage 1: against zero-shot (50 + 0) / 2 = 25; against the previous stage it would be -12.5
    assert d["1"]["value"] == pytest.approx(25.0)
    lo, hi = d["1"]["ci"]
    assert lo <= 25.0 <= hi


def test_delta_g_refuses_other_items_at_a_later_point():
    p = points()
    p["1"]["tasks"]["B"] = task([0, 0], items=["t/0", "t/5"])
    with pytest.raises(ValueError, match="other items"):
        lm_eval_tasks.delta_g(p)


def test_compare_pairs_delta_g_between_runs():
    a = {"lm_eval": {"points": points()}}
    b = {"lm_eval": {"points": {**points(), "1": points()["0"]}}}  # b ends where a's stage 0 was: ΔG 37.5
    for g in (a, b):
        g["lm_eval"]["delta_g"] = lm_eval_tasks.delta_g(g["lm_eval"]["points"])
    row = compare_general(a, b)["ΔG"]
    assert (row["run"], row["baseline"], row["diff"]) == pytest.approx((25.0, 37.5, -12.5))
    assert row["ci"][0] <= -12.5 <= row["ci"][1]


def test_stages_are_zero_shot_and_last_unless_every_stage():
    ends = lm_eval_tasks.GeneralTasks([], [], [], None, False, 4)
    assert [p for p in ("-1", "0", "1", "2") if ends.due(p, 3)] == ["-1", "2"]
    every = lm_eval_tasks.GeneralTasks([], [], [], None, True, 4)
    assert [p for p in ("-1", "0", "1", "2") if every.due(p, 3)] == ["-1", "0", "1", "2"]


def test_deepspeed_is_refused_in_one_line():
    with pytest.raises(UserError, match="refused with backend deepspeed"):
        resolve("smoke", None, {"backend": "deepspeed", "general": {"tasks": ["boolq"]}})


def test_without_lm_eval_the_extra_is_named(monkeypatch):
    real = builtins.__import__

    def no_lm_eval(name, *args, **kwargs):
        if name == "lm_eval" or name.startswith("lm_eval."):
            raise ImportError(name)
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_lm_eval)
    with pytest.raises(UserError, match=r"pip install 'cl-bench\[general\]'"):
        lm_eval_tasks.GeneralTasks.prepare(["boolq"], None, False, 4)


def test_built_in_tasks_are_indexed_only_for_a_name(one_index, tmp_path):
    # catches: the built-in index (about 38 s) read for local task YAMLs; or not read for a name
    local = [str(DATA / "tiny_mc.yaml"), str(DATA / "tiny_gen.yaml")]
    tasks = lm_eval_tasks.GeneralTasks.prepare(local, 4, False, 4)
    assert one_index == [False] and tasks.names == ["clb_tiny_mc", "clb_tiny_gen"]
    one_index.clear()
    with pytest.raises(UserError, match="'boolq' cannot be built offline"):  # found by name, its data on a hub
        lm_eval_tasks.GeneralTasks.prepare([local[0], "boolq"], 4, False, 4)
    assert one_index == [True]


@pytest.mark.slow
def test_a_hub_task_offline_fails_before_training(trace_dir, tmp_path, capsys, one_index):
    out = tmp_path / "runs"
    assert run_cli(*smoke_args(trace_dir, out, "--set", "general.tasks=[piqa]")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "'piqa' cannot be built offline" in err[0] and "local task YAML" in err[0]
    assert not out.exists()  # refused before the run folder, the model and any training
    hub_yaml = tmp_path / "hub.yaml"  # a local YAML whose data lives on a hub
    hub_yaml.write_text("task: from_hub\ndataset_path: someone/some_dataset\noutput_type: multiple_choice\n"
                        "test_split: test\ndoc_to_text: '{{q}}'\ndoc_to_choice: ['a', 'b']\ndoc_to_target: 0\n")
    assert run_cli(*smoke_args(trace_dir, out, "--set", f"general.tasks=[{hub_yaml}]")) == 2
    assert "cannot be built offline" in capsys.readouterr().err
    assert run_cli(*smoke_args(trace_dir, out, "--set", "general.tasks=[boolqq]")) == 2
    assert "did you mean 'boolq'" in capsys.readouterr().err


@pytest.mark.slow
def test_local_tasks_run_through_lm_eval_inside_a_smoke_run(trace_dir, tmp_path, capsys, one_index):
    out = tmp_path / "runs"
    assert run_cli(*smoke_args(trace_dir, out, "--set", TASKS, "--set", "general.limit=4")) == 0
    record = results.read_record(only_run(out))
    block = record.general["lm_eval"]
    assert set(block["points"]) == {"-1", "2"}  # zero-shot and the last stage
    for point in block["points"].values():
        mc, gen = point["tasks"]["clb_tiny_mc"], point["tasks"]["clb_tiny_gen"]
        assert (mc["metric"], gen["metric"]) == ("acc", "exact_match")
        assert mc["n"] == gen["n"] == 4 and mc["items"] == [f"clb_tiny_mc/{i}" for i in range(4)]
        assert mc["score"] == pytest.approx(mc["lm_eval_score"]) == pytest.approx(sum(mc["item_scores"]) / 4)
        assert mc["stderr"] is not None and mc["ci"] is not None
    zero, last = block["points"]["-1"]["tasks"], block["points"]["2"]["tasks"]
    hand = sum(last[n]["score"] - zero[n]["score"] for n in zero) / 2
    assert block["delta_g"]["2"]["value"] == pytest.approx(hand, abs=1e-3)
    capsys.readouterr()
    assert run_cli("show", only_run(out)) == 0
    assert "clb_tiny_mc" in capsys.readouterr().out
