"""What the calibrated profiles rest on: precision, per-task sizes, the learning
rate of a method family, the zero-shot row and next-task scores (FWT), the
majority-class levels and the intervals a run records."""
from __future__ import annotations

import json

import pytest
import torch

from cl_bench import registry
from cl_bench.run import precision
from cl_bench.record import io as results
from cl_bench.config import build, resolve
from cl_bench.profiles import PROFILES
from helpers import only_run, run_cli, smoke_args


def test_auto_precision_follows_the_device():
    cpu = torch.device("cpu")
    assert precision.resolve("fp32", cpu) == "fp32" and precision.resolve("bf16", cpu) == "bf16"
    assert precision.resolve("auto", cpu) == ("bf16" if precision.native_bf16(cpu) else "fp32")


@pytest.mark.parametrize("choice, says", [("auto", "auto -> fp32"), ("bf16", "emulated")])
def test_a_cpu_without_native_bf16_is_warned_once(monkeypatch, caplog, choice, says):
    """auto falls back to fp32 there (slower, not comparable with bf16 records); an
    explicit bf16 is emulated and far slower: both are said, once, in the log."""
    monkeypatch.setattr(precision, "native_bf16", lambda device: False)
    monkeypatch.setattr(precision, "_WARNED", set())
    cpu = torch.device("cpu")
    with caplog.at_level("WARNING", logger="cl_bench.run.precision"):
        for _ in range(3):
            precision.resolve(choice, cpu)
        precision.resolve("fp32", cpu)
    assert [r.getMessage() for r in caplog.records if says in r.getMessage()] != []
    assert len(caplog.records) == 1
    monkeypatch.setattr(precision, "native_bf16", lambda device: True)
    monkeypatch.setattr(precision, "_WARNED", set())
    caplog.clear()
    precision.resolve(choice, cpu)  # a CPU that has it: nothing to say
    assert caplog.records == []


@pytest.mark.slow
def test_bf16_training_stays_near_fp32(trace_dir, tmp_path):
    """bf16 autocast changes the losses (it is engaged) by less than 2% a step on the
    tiny model over 8 steps, and the record says which precision ran."""
    losses = {}
    for p in ("fp32", "bf16"):
        out = tmp_path / p
        assert run_cli(*smoke_args(trace_dir, out, "--order", "NumGLUE-cm", "--set", "train.epochs=4",
                                   "--set", f"train.precision={p}", "--set", f"eval.precision={p}")) == 0
        run_dir = only_run(out)
        losses[p] = [r["lm"] for r in results.read_jsonl(run_dir / "metrics.jsonl")]
        record = json.loads((run_dir / "run.json").read_text())
        assert record["backend"]["precision"] == {"train": p, "eval": p}
    assert len(losses["fp32"]) == 8 and losses["fp32"] != losses["bf16"]
    for a, b in zip(losses["fp32"], losses["bf16"]):
        assert abs(a - b) / a < 0.02
    assert losses["bf16"][-1] < losses["bf16"][0]  # and it learns


def test_profile_lr_by_family_unless_the_method_argument_is_given():
    config = build({"train": {"lr_by_family": {"full": 3e-4, "adapter": 2e-3}}}, "test")
    assert registry.get("seqft").parse_args(registry.get("seqft").args_for(config)).lr == 3e-4
    assert registry.get("lora").parse_args(registry.get("lora").args_for(config)).lr == 2e-3
    config.method_args = {"lr": 1e-6}
    assert registry.get("seqft").parse_args(registry.get("seqft").args_for(config)).lr == 1e-6
    none = build({}, "test")  # no family table: the method's own default
    assert registry.get("lora").parse_args(registry.get("lora").args_for(none)).lr == 1e-4


def test_cpu_profile_sets_every_family_and_the_zero_shot_row():
    cpu = resolve("cpu", None, {})
    assert set(cpu.train.lr_by_family) == {"full", "adapter", "expert"}
    assert cpu.eval.zero_shot and cpu.eval.next_task
    assert cpu.train.precision == "auto" and cpu.eval.precision == "auto"
    assert set(PROFILES["cpu"]["data"]["n_test_per_task"]) <= set(cpu.data.n_test_per_task)
    # the Lima probe: on where it costs about 5% of a run (docs/protocol.md), off in smoke
    assert cpu.general.lima == resolve("cpu-long", None, {}).general.lima == resolve("paper", None, {}).general.lima == 64
    assert resolve("smoke", None, {}).general.lima == 0


@pytest.mark.slow
def test_zero_shot_row_next_task_scores_sizes_majority_and_intervals(trace_dir, tmp_path, capsys):
    out = tmp_path / "runs"
    assert run_cli(*smoke_args(trace_dir, out, "--set", "eval.zero_shot=true", "--set", "eval.next_task=true",
                               "--set", "data.n_test_per_task={Py150: 6}",
                               "--set", "data.n_train_per_task={NumGLUE-cm: 12}")) == 0
    run_dir = only_run(out)
    record = json.loads((run_dir / "run.json").read_text())
    assert len(record["zero_shot"]) == 3 and None not in record["zero_shot"]
    # lower triangle plus the next task: R[b][j] for j <= b + 1
    for b, row in enumerate(record["matrix"]):
        assert [v is not None for v in row] == [j <= b + 1 for j in range(3)]
    assert record["summary"]["fwt"] is not None
    assert len(record["data"]["Py150"]["test"]["indices"]) == 6
    assert len(record["data"]["NumGLUE-cm"]["train"]["indices"]) == 12
    predictions = results.read_jsonl(run_dir / "predictions.jsonl")
    assert sum(p["stage"] == results.ZERO_SHOT_STAGE for p in predictions) == 4 + 6 + 4
    # NumGLUE-cm is a label task (exact match): always answering the most frequent
    # training answer scores this on the test items
    answers = [e["answer"] for e in json.loads((trace_dir / "NumGLUE-cm" / "test.json").read_text())]
    majority = record["majority"]["NumGLUE-cm"]
    test_idx = record["data"]["NumGLUE-cm"]["test"]["indices"]
    assert majority["score"] == pytest.approx(100 * sum(answers[i] == majority["answer"] for i in test_idx) / 4)
    assert set(record["majority"]) == {"NumGLUE-cm"}  # Py150 and 20Minuten are generation tasks
    iv = record["intervals"]
    assert iv["n_items"] == [4, 6, 4] and iv["resamples"] == 1000
    assert iv["summary"]["last_acc"] == pytest.approx(record["summary"]["last_acc"])
    lo, hi = iv["summary_ci"]["last_acc"]
    assert lo <= record["summary"]["last_acc"] <= hi
    shown = capsys.readouterr().out
    assert "zero-shot" in shown and "answer form" in shown and "BWT format" in shown


@pytest.mark.parametrize("setting, message", [
    ("train.epochs_per_task={Py15O: 2}", "'Py15O' is not a TRACE task; did you mean 'Py150'?"),
    ("train.epochs_per_task={Py150: abc}", "train.epochs_per_task.Py150='abc' is not a valid int"),
    ("train.epochs_per_task={Py150: -3}", "train.epochs_per_task.Py150=-3 must be a whole number >= 1"),
    ("data.n_test_per_task={FOMK: 4}", "data.n_test_per_task: 'FOMK' is not a TRACE task; did you mean 'FOMC'?"),
    ("data.test_split=train", "data.test_split='train' must be 'test' or 'eval'"),
    ("train.precision=fp16", "train.precision='fp16' must be one of auto, fp32, bf16"),
    ("train.lr_by_family={full: -1}", "train.lr_by_family.full=-1.0 must be a positive number"),
    ("general.lima=4", "which does not exist; add TRACE's Lima folder there, or set general.lima=0"),
])
def test_bad_per_task_and_precision_settings_fail_in_one_line(trace_dir, tmp_path, capsys, setting, message):
    assert run_cli(*smoke_args(trace_dir, tmp_path / "runs", "--set", setting)) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err
    assert not (tmp_path / "runs").exists() or not list((tmp_path / "runs").glob("*/run.json"))


def test_lr_by_family_names_a_family_and_a_flag_merges_as_a_file_does():
    """A misspelt family was taken and ignored (the lr stayed the method's default); a
    `--set` mapping replaced the profile's whole table where the same line in a config
    file merges into it. Mutations caught: the family check dropped; the flag's mapping
    left a string until after the merge."""
    from cl_bench.config import set_dotted
    from cl_bench.config_fields import LR_FAMILIES
    from cl_bench.errors import UserError

    assert {cls.lr_family for cls in map(registry.get, registry.available())} - {None} <= set(LR_FAMILIES)
    with pytest.raises(UserError, match="'fulll' is not a method family; did you mean 'full'"):
        resolve("cpu", None, {"train": {"lr_by_family": {"fulll": 1e-3}}})
    raw: dict = {}
    set_dotted(raw, "train.lr_by_family", "{full: 1e-4}")
    flag = resolve("cpu", None, raw).train.lr_by_family
    assert flag == {**resolve("cpu", None, {}).train.lr_by_family, "full": 1e-4}


def test_a_count_below_one_is_refused_before_the_run_folder(tmp_path, capsys):
    """--n-train 0 failed at data loading: after the run folder (a lock only) was made,
    the error printed twice. Mutation caught: the config-time check dropped."""
    out = tmp_path / "runs"
    for flag in ("--n-train", "--n-test"):
        assert run_cli("run", "--profile", "smoke", "--output-dir", out, flag, "0") == 2
        err = capsys.readouterr().err
        assert f"data.{flag[2:].replace('-', '_')}=0 must be at least 1" in err and err.count("error:") == 1
    assert not out.exists()
