"""`cl-bench perf` (cl_bench/tools/perf/): the harness times the method given by --method;
`upcycle-gap` measures the loss each upcycling variant adds."""
from __future__ import annotations

import json

import pytest
import torch

from helpers import make_trace, run_cli


def _harness(trace_dir, tmp_path, *extra) -> dict:
    out = tmp_path / f"harness{len(extra)}.json"
    assert run_cli("perf", "harness", "--model", "tiny-llama", "--n", "4", "--repeats", "1",
                   "--data-dir", trace_dir, "--task", "NumGLUE-cm", "--output", out, *extra) == 0
    return json.loads(out.read_text())


def test_harness_times_the_method_it_is_given(trace_dir, tmp_path):
    """Mutation caught: --method ignored (the baseline timed whatever was asked)."""
    full, lora = _harness(trace_dir, tmp_path), _harness(trace_dir, tmp_path, "--method", "lora")
    assert full["method"] == "seqft" and lora["method"] == "lora"
    assert 0 < lora["trainable_params"] < full["trainable_params"] / 10
    assert lora["median_ratio"] > 0 and len(lora["harness_s"]) == 1


def test_an_unknown_method_fails_in_one_line(trace_dir, tmp_path, capsys):
    assert run_cli("perf", "harness", "--model", "tiny-llama", "--method", "LoRA", "--data-dir", trace_dir) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "lora" in err


def test_upcycle_gap_command_measures_the_loss_each_variant_adds(trace_dir, tmp_path):
    out = tmp_path / "gap.json"
    assert run_cli("perf", "upcycle-gap", "--model", "tiny-llama", "--task", "NumGLUE-cm,Py150",
                   "--n", "4", "--data-dir", str(trace_dir), "--output", str(out)) == 0
    gap = json.loads(out.read_text())
    assert gap["tasks"] == ["NumGLUE-cm", "Py150"] and gap["command"].startswith("cl-bench perf")
    swap, paper = gap["change_pct"]["swap"], gap["change_pct"]["add s=1 (paper code)"]
    assert all(abs(v) < 1e-3 for v in swap.values()) and gap["within_2pct"]["swap"]
    assert all(abs(v) > 1e-3 for v in paper.values())


@pytest.mark.parametrize("what", ["step", "zero-shot"])
def test_a_measurement_against_another_method_needs_against(trace_dir, capsys, what):
    """No method's name is a default of the core: without --against, one line and exit 2.
    Mutation caught: a default for --against (the run would start and time something)."""
    assert run_cli("perf", what, "--model", "tiny-llama", "--data-dir", trace_dir) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "give --against METHOD" in err


def test_step_times_the_method_against_another_and_the_passes_it_needs(trace_dir, tmp_path):
    """bilevel-cka's stage-1 steps against upcycle's, on the same batches as its passes:
    an outer step where the schedule puts one (min_mask_updates=1 on 2 steps: N_eff 2)."""
    out = tmp_path / "step.json"
    assert run_cli("perf", "step", "--model", "tiny-llama", "--method", "bilevel-cka", "--against", "upcycle",
                   "--method-arg", "min_mask_updates=1", "--task", "Py150,NumGLUE-cm", "--n", "12", "--repeats", "1",
                   "--data-dir", str(trace_dir), "--output", str(out)) == 0
    rec = json.loads(out.read_text())
    assert rec["method"] == "bilevel-cka" and rec["against"] == "upcycle" and rec["outer_step"] == [False, True]
    assert set(rec["median_pass_s"]) == {"task forward and backward", "replay forward and backward",
                                         "reference forward of one row", "outer step",
                                         "optimiser step and clipping"}
    assert len(rec["step_over_needed"]) == len(rec["median_step_s"]["upcycle"]) == 2
    assert all(r > 0 for r in rec["step_over_against"])


def test_eval_profile_splits_one_pass_into_prefill_decode_and_the_rest(trace_dir, tmp_path):
    """Mutation caught: a step counted as a prefill (or the reverse): the calls
    would not be one prefill a batch and one step a decoded token."""
    out = tmp_path / "profile.json"
    assert run_cli("perf", "eval-profile", "--model", "tiny-llama", "--task", "NumGLUE-cm,Py150", "--n", "5",
                   "--repeats", "1", "--precision", "fp32",  # pinned: `auto` is bf16 on a CPU that has it
                   "--data-dir", str(trace_dir), "--output", str(out)) == 0
    rec = json.loads(out.read_text())
    assert rec["tasks"] == ["NumGLUE-cm", "Py150"] and rec["precision"] == "fp32" and rec["machine"]["cpu"]
    assert rec["prefill_calls"] == 2  # one batch of 5 (batch size 16) a task
    # at most budget - 1 steps a batch (24; 64 capped at 64), each of 1 to 5 rows
    assert 0 < rec["decode_steps"] <= 23 + 63
    assert rec["decode_steps"] <= rec["decode_rows"] <= 5 * rec["decode_steps"]
    assert abs(rec["prefill_s"] + rec["decode_s"] + rec["overhead_s"] - rec["pass_s"]) < 1e-9
    assert all(v > 0 for v in rec["bound_s"].values()) and rec["profiled_op_self_s"]["matmul_and_attention"] > 0


def test_eval_speed_times_the_decoder_against_the_plain_loop(trace_dir, tmp_path):
    out = tmp_path / "speed.json"
    assert run_cli("perf", "eval-speed", "--model", "tiny-llama", "--task", "NumGLUE-cm", "--n", "3",
                   "--repeats", "2", "--data-dir", str(trace_dir), "--output", str(out)) == 0
    rec = json.loads(out.read_text())
    assert rec["predictions"] == rec["identical_predictions"] == 3
    assert len(rec["seconds"]["new"]) == len(rec["seconds"]["plain"]) == 2 and rec["speedup"] > 0
    assert rec["baseline"] == "plain" and rec["machine"]["logical_cores"] > 0
    assert all(len(v) == 2 and min(v) > 0 for v in rec["cpu_seconds"].values()) and rec["cpu_speedup"] > 0
    assert len(rec["machine"]["loadavg"]["start"]) == len(rec["machine"]["loadavg"]["end"]) == 3


def test_eval_speed_against_the_growing_cache_reserves_on_the_new_side_only(trace_dir, tmp_path, monkeypatch):
    """Mutation caught: the growing-cache baseline decoding with the reserved buffers too
    (both sides the same decoder)."""
    from cl_bench.eval import generation

    reserved = []
    real = generation.reserve
    monkeypatch.setattr(generation, "reserve", lambda cache, extra: reserved.append(extra) or real(cache, extra))
    out = tmp_path / "speed.json"
    assert run_cli("perf", "eval-speed", "--model", "tiny-llama", "--task", "NumGLUE-cm", "--n", "3",
                   "--repeats", "2", "--baseline", "growing-cache", "--data-dir", str(trace_dir),
                   "--output", str(out)) == 0
    rec = json.loads(out.read_text())
    assert rec["baseline"] == "growing-cache" and set(rec["seconds"]) == {"new", "growing-cache"}
    assert rec["predictions"] == rec["identical_predictions"] == 3
    assert len(reserved) == 2  # one batch of 3, decoded by the new side in each of the 2 repeats


def test_train_step_reports_tokens_flops_and_no_mfu_without_a_listed_device(tmp_path):
    """On the CPU: the steps of one stage timed, the first left out; MFU null (no peak);
    too few examples for two steps refused in one line."""
    trace = make_trace(tmp_path / "trace", n_train=24)
    out = tmp_path / "step.json"
    assert run_cli("perf", "train-step", "--model", "tiny-llama", "--task", "NumGLUE-cm", "--n", "24",
                   "--data-dir", str(trace), "--output", str(out)) == 0
    rec = json.loads(out.read_text())
    assert rec["device"] == "cpu" and rec["mfu"] is None and rec["peak_tflops"] is None
    assert rec["steps"] == 3 and len(rec["step_s"]) == 2  # 24 examples, batches of 8 (the cpu profile)
    assert rec["tokens_per_step"] > 0 and rec["tflops"] > 0
    assert run_cli("perf", "train-step", "--model", "tiny-llama", "--task", "NumGLUE-cm", "--n", "12",
                   "--data-dir", str(trace)) == 2


def test_peak_is_matched_on_the_device_name(monkeypatch):
    """Mutation caught: "H100" tried before "H100 PCIe" (a PCIe card's MFU against the SXM peak)."""
    from cl_bench.tools.perf import device

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d: "NVIDIA H100 PCIe")
    assert device.peak_tflops(torch.device("cuda"), "bf16") == ("NVIDIA H100 PCIe", 756.0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d: "NVIDIA H100 80GB HBM3")
    assert device.peak_tflops(torch.device("cuda"), "bf16")[1] == 989.4
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d: "Some Card")
    assert device.peak_tflops(torch.device("cuda"), "fp32")[1] is None


def test_gen_throughput_runs_each_generator_installed_and_names_those_not_run(trace_dir, tmp_path):
    out = tmp_path / "gen.json"
    assert run_cli("perf", "gen-throughput", "--model", "tiny-llama", "--task", "NumGLUE-cm", "--n", "3",
                   "--max-new-tokens", "4", "--repeats", "1", "--data-dir", str(trace_dir), "--output", str(out)) == 0
    rec = json.loads(out.read_text())
    assert list(rec["generators"]) == ["hf"] and "vllm" in rec["not_run"]
    hf = rec["generators"]["hf"]
    assert hf["identical_to_hf"] == 3 and hf["tokens_per_s"] > 0 and len(hf["seconds"]) == 1


def test_loss_path_times_both_paths_on_the_same_batches(trace_dir, tmp_path, monkeypatch):
    """Each method's stage with logits at the answer positions against every position:
    both sides' steps timed, their losses equal to float rounding (the same batches and
    weights), the peak memory and the machine named, the command line inside. Mutation
    caught: both sides run the same path (the old side without all_positions()); --before
    not giving the old side AdamW's per-parameter loop."""
    from cl_bench import losses
    from cl_bench.method import Method

    entered, real = [], losses.all_positions

    def counted():
        entered.append(1)
        return real()

    monkeypatch.setattr(losses, "all_positions", counted)
    fused = []
    real_make = Method.make_optimizer

    def noted(self, groups):
        optimizer = real_make(self, groups)
        fused.append(bool(optimizer.defaults["fused"]))
        return optimizer

    monkeypatch.setattr(Method, "make_optimizer", noted)
    out = tmp_path / "loss-path.json"
    assert run_cli("perf", "loss-path", "--model", "tiny-llama", "--methods", "seqft,upcycle", "--task",
                   "Py150,NumGLUE-cm", "--n", "8", "--repeats", "1", "--before", "--data-dir", str(trace_dir),
                   "--output", str(out)) == 0
    rec = json.loads(out.read_text())
    assert rec["command"].startswith("cl-bench perf loss-path") and rec["machine"]["cpu"]
    assert 0 < rec["answer_share"] < 1 and rec["steps"] == 1
    for name in ("seqft", "upcycle"):
        m = rec["methods"][name]
        assert set(m["median_step_s"]) == {"old", "new"} and m["speed_up"] > 0 and m["cpu_speed_up"] > 0
        assert m["lm_max_rel_diff"] < 1e-4  # bf16: the head over other rows may round otherwise
        assert set(m["peak_memory_mib"]) == {"old", "new"}
    assert len(entered) == 2  # one old side a method and repeat
    assert rec["old"] == "every position, AdamW's per-parameter loop"
    assert False in fused and True in fused  # --before: the old side's optimiser is the loop, the new side's fused


def test_step_options_times_the_optimisers_and_the_frozen_cast_on_one_step(trace_dir, tmp_path):
    """The optimiser step three ways over the method's trainable parameters, and (bf16,
    pinned: auto would let the CPU decide) the task pass with the frozen linear weights
    cast once: only a method with frozen linears gets that side, counting the frozen
    linear weights but not the tied embedding or what trains; the cast leaves the loss
    exactly as autocast makes it; the fused kernel drifts from the loop by rounding only.
    Mutations caught: a trainable weight counted as frozen, the cast side given to a
    method that freezes nothing. (tiny-llama's head is not tied to its embedding, so the
    tied weight's exclusion is not exercised here.)"""
    from cl_bench.models.loading import load

    out = tmp_path / "options.json"
    assert run_cli("perf", "step-options", "--model", "tiny-llama", "--methods", "seqft,lora", "--task",
                   "Py150,NumGLUE-cm", "--n", "8", "--repeats", "1", "--precision", "bf16",
                   "--data-dir", str(trace_dir), "--output", str(out)) == 0
    rec = json.loads(out.read_text())
    assert rec["command"].startswith("cl-bench perf step-options") and rec["precision"] == "bf16"
    seqft, lora = rec["methods"]["seqft"], rec["methods"]["lora"]
    for m in (seqft, lora):
        assert set(m["optimiser_step"]) == {"loop", "foreach", "fused"}
        assert m["fused_max_rel_drift_3_steps"] < 1e-5 and m["step_as_run"]["cpu_s"] > 0
        assert m["profiled_step"]["top_ops"] and m["profiled_step"]["op_self_s"]["matmul_and_attention"] > 0
    assert seqft["frozen_linear_params"] == 0 and "cast_once_over_autocast" not in seqft
    model = load("tiny-llama", 1234, progress=False).model
    tied = model.get_input_embeddings().weight
    linears = sum(m.weight.numel() for m in model.modules()
                  if isinstance(m, torch.nn.Linear) and m.weight is not tied)
    assert lora["frozen_linear_params"] == linears
    assert lora["cast_once_losses_equal"] is True and set(lora["task_pass"]) == {"autocast", "cast once"}
