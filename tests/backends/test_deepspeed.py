"""The deepspeed backend on one rank, in this process (DeepSpeed's CPU accelerator,
gloo): the same numbers as the torch backend, added parameters trained, ZeRO-3
checkpoints and resume; and what needs no engine: refusals, config checks,
launch arguments, rank-0-only writing.

Tolerances (measured on the smoke profile: at most 4e-7 relative): logged losses
agree with the torch backend to rel 1e-5, the R matrix and every prediction exactly.
"""
from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cl_bench.run import checkpoint
from cl_bench.errors import UserError
from helpers import (assert_follows_fp32, assert_same_run, deepspeed_args, interrupted_ds_run, interrupted_run,
                     log_rows, only_run, one_line_error, run_cli, small_buckets, smoke_args)

ROOT = Path(__file__).resolve().parents[2]


# ---- no engine needed ---------------------------------------------------------------------

def test_methods_that_cannot_run_are_refused_before_loading(trace_dir, tmp_path, capsys, monkeypatch):
    """No method of the 17 refuses a ZeRO stage since bilevel-cka and cluster-upcycle
    joined ZeRO-3; a plugin may still (Method.zero_unsupported)."""
    from cl_bench import registry
    from cl_bench.methods.seqft import SeqFT

    class NoZero3(SeqFT):
        name = "no-zero3"
        zero_unsupported = {3: "it needs every weight whole in its loss, which ZeRO-3 partitions across the ranks"}

    monkeypatch.setitem(registry._METHODS, "no-zero3", NoZero3)
    out = tmp_path / "runs"
    assert run_cli(*smoke_args(trace_dir, out, "--method", "no-zero3", "--backend", "deepspeed", "--zero", "3")) == 2
    err = capsys.readouterr().err
    assert "method 'no-zero3' cannot run on the deepspeed backend with ZeRO-3: it needs every weight" in err
    assert "--backend torch" in err
    assert run_cli(*smoke_args(trace_dir, out, "--method", "bilevel-cka", "--method-arg", "outer_sample=shared",
                               "--backend", "deepspeed", "--zero", "3")) == 2
    err = capsys.readouterr().err
    assert "method_args.outer_sample=shared cannot run at ZeRO-3" in err and "Traceback" not in err
    assert not out.exists() or not any(out.iterdir())  # nothing written, no model loaded


def test_every_method_declares_its_backend_support(capsys):
    from cl_bench import registry

    assert run_cli("list", "--verbose") == 0
    shown = capsys.readouterr().out
    for name, cls in registry.available().items():
        assert set(cls.zero_unsupported) <= {2, 3}
        assert all(len(reason) > 40 for reason in cls.zero_unsupported.values()), name
    lines = shown.splitlines()
    for name in registry.available():  # every one since bilevel-cka and cluster-upcycle joined ZeRO-3
        at = next(i for i, line in enumerate(lines) if line.startswith(f"{name} "))
        assert lines[at + 1].strip() == "backends: torch, deepspeed ZeRO-2, deepspeed ZeRO-3", name


def test_deepspeed_config_file_conflicts_name_the_key_and_the_fix(tmp_path):
    from cl_bench.backends.deepspeed_backend import ds_config
    from cl_bench.config import resolve

    def config_with(content: dict, **flags):
        path = tmp_path / "ds.json"
        path.write_text(json.dumps(content))
        return resolve("smoke", None, {"backend": "deepspeed", "deepspeed": {"config": str(path), **flags}})

    with pytest.raises(UserError, match=r"gradient_clipping=0.5 but the run gives 1.0 \(from train.grad_clip\)"):
        ds_config(config_with({"gradient_clipping": 0.5}), 1, False)
    with pytest.raises(UserError, match="remove the 'optimizer' section: the method builds its optimiser"):
        ds_config(config_with({"optimizer": {"type": "Adam"}}), 1, False)
    with pytest.raises(UserError, match="zero_optimization.stage=3 but deepspeed.zero=2"):
        ds_config(config_with({"zero_optimization": {"stage": 3}}), 1, False)
    for key in ("offload_optimizer", "offload_param"):  # mutation caught: the offload check dropped
        with pytest.raises(UserError, match=rf"zero_optimization.{key}.device='cpu': offload is not supported"):
            ds_config(config_with({"zero_optimization": {key: {"device": "cpu", "pin_memory": True}}}), 1, False)
        assert ds_config(config_with({"zero_optimization": {key: {"device": "none"}}}), 1, False)
    # settings that would change the numbers under a record that does not say so (mutation
    # caught: each refusal dropped, one at a time by its table entry)
    for content, shown in [({"torch_autocast": {"enabled": True, "dtype": "bfloat16"}}, 'torch_autocast={"enabled": true'),
                           ({"zero_optimization": {"cpu_offload": True}}, "zero_optimization.cpu_offload=true"),
                           ({"zero_optimization": {"cpu_offload_param": True}}, "cpu_offload_param=true"),
                           *(({"zero_optimization": {key: True}}, f"zero_optimization.{key}=true") for key in
                             ("zero_quantized_weights", "zero_quantized_nontrainable_weights",
                              "zero_quantized_gradients")),
                           ({"zero_optimization": {"zenflow": {"topk_ratio": 0.1}}}, "zero_optimization.zenflow="),
                           ({"zero_optimization": {"zenflow": {}}}, "zero_optimization.zenflow={}"),  # its defaults
                           ({"data_types": {"grad_accum_dtype": "fp32"}}, "data_types="),
                           # checked in DeepSpeed 0.19.8's source (the table's comment)
                           ({"gradient_allreduce_op": "Sum"}, 'gradient_allreduce_op="Sum": \'sum\' adds'),
                           ({"bf16": {"enabled": True, "bf16_master_weights_and_grads": True,
                                      "bf16_optimizer_states": True}}, "bf16.bf16_master_weights_and_grads=true"),
                           ({"bf16": {"bf16_optimizer_states": True}}, "bf16.bf16_optimizer_states=true"),
                           ({"bfloat16": {"enabled": True}}, 'bfloat16={"enabled": true}: the old name'),
                           ({"fp16": {"enabled": False, "auto_cast": True}}, "fp16.auto_cast=true"),
                           ({"fp16": {"enabled": False, "fp16_master_weights_and_grads": True}},
                            "fp16.fp16_master_weights_and_grads=true"),
                           ({"expert_parallel": {"enabled": True}}, 'expert_parallel={"enabled": true}: AutoEP'),
                           ({"tensor_parallel": {"autotp_size": 2}}, "tensor_parallel.autotp_size=2: AutoTP"),
                           ({"hybrid_engine": {"enabled": True}}, 'hybrid_engine={"enabled": true}'),
                           ({"autotuning": {"enabled": True}}, 'autotuning={"enabled": true}: the autotuner')]:
        with pytest.raises(UserError, match=re.escape(shown)):
            ds_config(config_with(content), 1, False)
    for bf16, comm in ((False, "bf16"), (True, "fp16")):
        with pytest.raises(UserError, match=f"communication_data_type='{comm}' reduces gradients in a precision"):
            ds_config(config_with({"communication_data_type": comm}), 1, bf16)
    # against the precision the run trains in, the file's bf16 section included (mutation
    # caught: the check before the file's bf16.enabled is read)
    assert ds_config(config_with({"bf16": {"enabled": True}, "communication_data_type": "bf16"}), 1, False)
    with pytest.raises(UserError, match="communication_data_type='bf16' reduces gradients in a precision"):
        ds_config(config_with({"bf16": {"enabled": False}, "communication_data_type": "bf16"}), 1, True)
    for content in ({"torch_autocast": {"enabled": False}}, {"zero_optimization": {"cpu_offload": False}},
                    {"communication_data_type": "fp32"}, {"gradient_allreduce_op": "mean"},
                    {"tensor_parallel": {"autotp_size": 1}}, {"autotuning": {"enabled": False}},
                    {"zero_optimization": {"zero_hpz_partition_size": 2}}):  # off, or no lower than the run's
        assert ds_config(config_with(content), 1, True)
    built = ds_config(config_with({"train_batch_size": "auto", "zero_optimization": {"overlap_comm": True}},
                                  zero="3"), 1, False)
    assert built["zero_optimization"] == {"overlap_comm": True, "stage": 3}
    assert (built["train_batch_size"], built["gradient_accumulation_steps"]) == (4, 2)  # smoke: 4 = 2 x 2


def test_paper_config_is_the_papers_setup():
    """configs/paper-deepspeed.yaml (bilevel-reference.md §6): 4 GPUs x micro 8 x
    accumulation 1 = 32, ZeRO-2, bf16, clip 1.0, lr 1.5e-5, epochs 8,5,5,5,5,5, 512/512."""
    from cl_bench.backends.deepspeed_backend import ds_config
    from cl_bench.config import resolve

    config = resolve("cpu", ROOT / "configs" / "paper-deepspeed.yaml", {})
    assert (config.profile, config.backend, config.seed) == ("paper", "deepspeed", 42)
    assert config.model == "meta-llama/Llama-3.2-1B-Instruct" and config.data.order == "paper6"
    t = config.train
    assert [t.epochs_for(n) for n in ("MeetingBank", "Py150", "NumGLUE-cm", "NumGLUE-ds", "20Minuten",
                                      "C-STANCE")] == [8, 5, 5, 5, 5, 5]
    assert (t.max_prompt_len, t.max_answer_len, t.grad_clip) == (512, 512, 1.0)
    assert config.method_args == {"lr": 1.5e-5}
    four = ds_config(config, 4, True)
    assert (four["train_micro_batch_size_per_gpu"], four["gradient_accumulation_steps"],
            four["train_batch_size"]) == (8, 1, 32)
    assert four["zero_optimization"]["stage"] == 2 and four["bf16"] == {"enabled": True}
    assert four["gradient_clipping"] == 1.0 and "offload_optimizer" in four["zero_optimization"]
    assert ds_config(config, 2, True)["gradient_accumulation_steps"] == 2  # still 32 a step


def test_a_lost_rank_is_told_from_a_collective_called_wrongly(tmp_path):
    """Backend.lost_peer, which turns a killed rank into one line (cl_bench/cli.py), reads
    what the error says: gloo's words for a peer gone (as a killed rank's peer raised
    them, tests/backends/test_deepspeed_ranks.py) are a lost rank; a collective called
    wrongly (the real errors of a one-rank gloo group: sizes that differ, a rank that does
    not exist) keeps its traceback, and so does everything in one process. Mutation
    caught: lost_peer by where the error was raised (inside torch.distributed, as first
    written): the wrong calls counted as lost ranks."""
    import torch.distributed as dist
    from types import SimpleNamespace

    from cl_bench.backends.base import Backend
    from cl_bench.backends.deepspeed_backend import DeepSpeedBackend

    gone = [RuntimeError("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
                         "[127.0.0.1]:61641: Connection reset by peer. This is typically caused by a remote worker "
                         "hanging or bugs in the application."),
            RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:598] Connection closed by peer "
                         "[127.0.0.1]:29500"),
            RuntimeError("[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting "
                         "1800000ms for recv operation to complete")]
    made = not dist.is_initialized()
    if made:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    wrong = []
    try:
        for call in (lambda: dist.all_gather([torch.zeros(2)], torch.zeros(3)),
                     lambda: dist.broadcast(torch.zeros(2), src=3)):
            with pytest.raises(RuntimeError) as caught:
                call()
            wrong.append(caught.value)
    finally:
        if made:
            dist.destroy_process_group()
    ranks = SimpleNamespace(world_size=2)
    assert all(DeepSpeedBackend.lost_peer(ranks, e) for e in gone)
    assert not any(DeepSpeedBackend.lost_peer(ranks, e) for e in wrong), [str(e) for e in wrong]
    assert not any(DeepSpeedBackend.lost_peer(SimpleNamespace(world_size=1), e) for e in gone)
    assert not any(Backend.lost_peer(ranks, e) for e in gone)  # the torch backend: one process


def test_launch_arguments(trace_dir, tmp_path, capsys, monkeypatch):
    from cl_bench.cli import build_parser

    args = build_parser().parse_args(["--local_rank=1", "run", "--backend", "deepspeed", "--nproc", "2"])
    assert (args.local_rank, args.nproc, args.backend) == (1, 2, "deepspeed")  # `deepspeed script` adds it
    assert run_cli(*smoke_args(trace_dir, tmp_path, "--nproc", "2")) == 2
    assert "add --backend deepspeed" in capsys.readouterr().err
    # a torch run resumed with --nproc: --resume refuses --backend, so the line says to drop it
    # (mutation caught: the old line, "add --backend deepspeed" alone)
    run_dir = interrupted_run(monkeypatch, *smoke_args(trace_dir, tmp_path / "torch"), at_stage=1)
    capsys.readouterr()
    assert run_cli("run", "--resume", run_dir, "--nproc", "2") == 2
    assert one_line_error(capsys).endswith("--nproc 2 starts ranks of the deepspeed backend, and this run's backend "
                                           "is torch: drop --nproc, or for a new run add --backend deepspeed")
    monkeypatch.setenv("RANK", "0")  # as inside a launch of 3 ranks
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert run_cli(*smoke_args(trace_dir, tmp_path, "--backend", "deepspeed", "--nproc", "2")) == 2
    assert "inside a launch of 3 ranks" in capsys.readouterr().err


@pytest.mark.slow
def test_a_torch_run_never_imports_deepspeed(trace_dir, tmp_path):
    code = ("import sys; from cl_bench.cli import main; "
            f"assert main({smoke_args(trace_dir, tmp_path / 'runs', '--order', 'Py150')!r}) == 0; "
            "assert 'deepspeed' not in sys.modules, 'deepspeed imported'")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.slow
def test_only_rank_zero_writes_logs_and_shows_progress(trace_dir, tmp_path, monkeypatch, capsys):
    """Every rank runs the sequencer; one that is not rank 0 writes no file and prints
    no log line or progress bar (a torch backend posing as rank 1 of 2)."""
    from cl_bench.run import prepare
    from cl_bench.backends.torch_backend import TorchBackend

    class SecondRank(TorchBackend):
        def __init__(self, config):
            super().__init__(config, torch.device("cpu"))
            self.rank, self.world_size = 1, 2

        def on_main(self, fn):
            return None  # rank 0, elsewhere, does it

    monkeypatch.setattr(prepare, "create_backend", SecondRank)
    out = tmp_path / "runs"
    args = [a for a in smoke_args(trace_dir, out, "--run-id", "r") if a != "--no-progress"]
    assert run_cli(*args) == 0
    assert not out.exists() or not any(out.rglob("*"))  # not even the tokenisation cache
    captured = capsys.readouterr()
    assert "stage 1/3" not in captured.err + captured.out and "Last Acc" not in captured.out


# ---- one rank, one engine per phase ---------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("schedule", [
    [],
    ["--set", "train.lr_schedule=cosine", "--set", "train.warmup_ratio=0.5", "--set", "train.batch_size=2"],
], ids=["constant", "cosine"])
def test_one_rank_zero2_matches_the_torch_backend(trace_dir, tmp_path, monkeypatch, schedule):
    """SeqFT on the smoke profile: the same loss trajectory (rel 1e-5), grad norms,
    matrix and predictions as the torch backend, with the Adam moments carried from
    stage to stage through a new engine each stage; the garbage collector runs at
    every step, so earlier engines are collected while a later one trains. With the
    harness's cosine schedule (4 steps a stage: lr x 0.5, 1, 1, 0.5), the engine
    steps at the lr the schedule sets."""
    import gc

    from cl_bench.backends.zero_engine import ZeroPhase

    sync = ZeroPhase.sync_hyperparameters
    monkeypatch.setattr(ZeroPhase, "sync_hyperparameters", lambda self: (gc.collect(), sync(self)))
    plain, ds = tmp_path / "torch", tmp_path / "ds"
    assert run_cli(*smoke_args(trace_dir, plain, *schedule)) == 0
    assert run_cli(*smoke_args(trace_dir, ds, *schedule, *deepspeed_args(tmp_path, 2))) == 0
    assert_same_run(only_run(plain), only_run(ds))
    record = json.loads((only_run(ds) / "run.json").read_text())
    assert record["backend"]["name"] == "deepspeed" and record["backend"]["world_size"] == 1
    assert record["backend"]["deepspeed_config"]["zero_optimization"]["stage"] == 2


@pytest.mark.slow
def test_shared_add_trains_its_routed_scale_as_the_torch_backend_does(trace_dir, tmp_path):
    """upcycle with shared=add: the layers' routed scale (one value each) trains under
    ZeRO-2 through three phases as on the torch backend: the same run and final weights.
    Mutation caught: the scale a 0-dim parameter (DeepSpeed's engine cannot broadcast
    one: the first phase fails)."""
    args = ["--method", "upcycle", "--method-arg", "shared=add", "--keep-checkpoint"]
    plain, ds = tmp_path / "torch", tmp_path / "ds"
    assert run_cli(*smoke_args(trace_dir, plain, *args)) == 0
    assert run_cli(*smoke_args(trace_dir, ds, *args, *deepspeed_args(tmp_path, 2))) == 0
    assert_same_run(only_run(plain), only_run(ds))
    weights = [checkpoint.load_checkpoint(only_run(d))["model"] for d in (plain, ds)]
    scales = [name for name in weights[0] if name.endswith("routed_scale")]
    assert scales and all(float(weights[0][name]) != 1.0 for name in scales)  # trained
    for name, value in weights[0].items():
        assert torch.allclose(weights[1][name], value, rtol=0, atol=1e-5), name


@pytest.mark.slow
def test_flagship_clones_left_without_a_gradient_are_skipped_as_on_torch(trace_dir, tmp_path):
    """bilevel-cka with most slots closed (mask_init=prior, p_expand 0.2): some steps leave
    a layer's clones without a .grad on one process (no token reached them but the outer
    step's forward, whose gradient goes to the mask logits only), and AdamW skips them;
    ZeRO-2 must skip them too (cl_bench/models/reach.py). The same run and final weights,
    exactly. Mutations caught: the outer forward counted as reaching the clones (the
    deployed clones of layer 0 off by 2.7e-4); checked by hand on a Zen 3 EPYC."""
    args = ["--method", "bilevel-cka", "--method-arg", "mask_init=prior", "--method-arg", "init_expand_prob=0.2",
            "--keep-checkpoint"]
    plain, ds = tmp_path / "torch", tmp_path / "ds"
    assert run_cli(*smoke_args(trace_dir, plain, *args)) == 0
    assert run_cli(*smoke_args(trace_dir, ds, *args, *deepspeed_args(tmp_path, 2))) == 0
    assert_same_run(only_run(plain), only_run(ds))
    weights = [checkpoint.load_checkpoint(only_run(d))["model"] for d in (plain, ds)]
    assert weights[0].keys() == weights[1].keys()
    for name, value in weights[0].items():
        assert torch.equal(weights[1][name], value), name


@pytest.mark.slow
def test_bf16_trains_in_bf16_and_keeps_fp32_weights_between_phases(trace_dir, tmp_path):
    """deepspeed.bf16=true (on this CPU too): the engine computes in bf16 with fp32
    master weights; between phases the model is fp32 again and holds the masters, not
    their bf16 copies, so three stages lose no precision at their boundaries."""
    from cl_bench.config import resolve
    from cl_bench.run.checks import check_config
    from cl_bench.run.prepare import prepare
    from cl_bench.run.sequencer import execute

    config = resolve("smoke", None, {"method_args": {"lr": "1e-3"}, "backend": "deepspeed",
                                     "deepspeed": {"bf16": "true"}, "data": {"data_dir": str(trace_dir)},
                                     "output_dir": str(tmp_path / "bf16")})
    run = prepare(check_config(config), progress=False)
    record = execute(run)
    assert record.backend["bf16"] is True
    params = list(run.method.model.parameters())
    assert all(p.dtype == torch.float32 for p in params)
    assert any(bool((p != p.bfloat16().float()).any()) for p in params)  # not bf16 values
    plain = tmp_path / "torch"
    assert run_cli(*smoke_args(trace_dir, plain)) == 0
    lm = lambda d: [r["lm"] for r in log_rows(d)]
    assert lm(only_run(tmp_path / "bf16")) == pytest.approx(lm(only_run(plain)), rel=1e-2)


@pytest.mark.slow
@pytest.mark.parametrize("method, zero, args", [("ewc", 2, ["--method-arg", "lambda_ewc=1e6"]), ("ogd", 3, [])],
                         ids=["ewc-zero2", "ogd-zero3"])
def test_bf16_gradient_edits_reach_the_step(trace_dir, tmp_path, method, zero, args):
    """Under deepspeed.bf16 a method edits bf16 gradients between the backward and the
    step (ZeRO-2: views into the partition's buffer, edited in place; ZeRO-3: read and
    written back through the local API): EWC at λ 1e6, whose penalty's gradient
    dominates (grad_norm ~9800 at stage 2's second step against ~3 without), and OGD's
    projection follow the torch backend's fp32 run: losses within 2e-3, grad_norm within
    2e-2 relative (measured on an AVX2 CPU: 2.1e-4 and 3.5e-3). Mutations caught: the
    ZeRO-2 fragment a float copy of the bf16 gradient (the edit lost), ZeRO-3's
    write-back skipped."""
    one = tmp_path / "one"
    assert run_cli(*smoke_args(trace_dir, one, "--method", method, *args)) == 0
    bf16 = tmp_path / "bf16"
    assert run_cli(*smoke_args(trace_dir, bf16, "--method", method, *args, *deepspeed_args(tmp_path, zero),
                               "--set", "deepspeed.bf16=true")) == 0
    assert json.loads((only_run(bf16) / "run.json").read_text())["backend"]["bf16"] is True
    assert_follows_fp32(only_run(one), only_run(bf16))


def _expert_drift(model) -> list[list[float]]:
    """Per MoE layer and expert group: how far its experts moved from the dense
    slices they were copied from (0.0: never trained)."""
    from cl_bench.models.moe import moe_layers, slice_experts

    drift = []
    for layer in moe_layers(model):
        gate, _, _ = slice_experts(layer.dense, layer.n_per_group)
        drift.append([float((g.gate.detach() - gate[g.slots]).abs().max()) for g in layer.groups])
    return drift


@pytest.mark.slow
def test_zero3_trains_added_experts_checkpoints_and_resumes(trace_dir, tmp_path, monkeypatch):
    """Upcycling on ZeRO-3 (one rank, every weight partitioned): the expert group each
    stage adds is trained in that stage (a new engine takes it in); an interrupted run
    resumed from its gathered checkpoint gives the straight run's numbers; both equal
    the torch backend's."""
    from cl_bench.config import resolve
    from cl_bench.run.checks import check_config
    from cl_bench.run.prepare import prepare
    from cl_bench.run.sequencer import execute

    flags = ["--method", "upcycle", *deepspeed_args(tmp_path, 3)]
    straight = tmp_path / "straight"
    config = resolve("smoke", None, {"method": "upcycle", "method_args": {"lr": "1e-3"}, "backend": "deepspeed",
                                     "deepspeed": {"zero": "3", "config": str(small_buckets(tmp_path))},
                                     "data": {"data_dir": str(trace_dir)}, "output_dir": str(straight)})
    linear = torch.nn.functional.linear
    run = prepare(check_config(config), progress=False)
    execute(run)
    assert torch.nn.functional.linear is linear  # ZeRO-3's own F.linear does not outlive the engine
    from cl_bench.methods.upcycle import Upcycle

    def interrupt(self, batch, step):
        raise KeyboardInterrupt
    monkeypatch.setattr(Upcycle, "loss", interrupt)  # inside the phase: the engine exists
    assert run_cli(*smoke_args(trace_dir, tmp_path / "stopped", *flags)) == 130
    assert torch.nn.functional.linear is linear  # nor an engine stopped by an interrupt
    monkeypatch.undo()
    drift = _expert_drift(run.method.model)
    assert len(drift) == 2 and all(len(groups) == 3 for groups in drift)
    assert all(d > 1e-4 for groups in drift for d in groups), drift  # every stage's new group moved

    broken = tmp_path / "broken"
    run_dir = interrupted_ds_run(monkeypatch, *smoke_args(trace_dir, broken, *flags), at_stage=1)
    state = checkpoint.load_checkpoint(run_dir)  # full weights: ZeRO-3 partitions gathered for saving
    assert state["method"]["layout"] == [[8], [8]]
    assert all(t.numel() > 0 for t in state["model"].values())
    assert run_cli("run", "--resume", run_dir, "--no-progress") == 0
    assert_same_run(only_run(straight), run_dir)
    plain = tmp_path / "torch"
    assert run_cli(*smoke_args(trace_dir, plain, "--method", "upcycle")) == 0
    assert_same_run(only_run(plain), run_dir)


@pytest.mark.slow
@pytest.mark.parametrize("args", [[], ["--method-arg", "train_shared=true"]], ids=["default", "train-shared"])
def test_zero3_flagship_outer_gradient_stays_out_of_the_reduction(trace_dir, tmp_path, args):
    """bilevel-cka on ZeRO-3 with DeepSpeed's default buckets (one rank): its outer step
    takes the mask logits' gradient through the MoE layers, ZeRO-3's leaf modules,
    inside `ctx.grads.apart()` (ZeroPhase.apart), so their reduction hooks run once a
    step and the run is the torch backend's. Without apart() the experts are queued
    twice in one bucket and DeepSpeed asserts (checked: the mutation fails this test;
    so does putting the hooks not back after it); with tiny buckets (the two-rank
    test's) the duplicate flushes unseen in between. train_shared=true: the CKA
    reference runs the pre-task snapshot of the shared weights in their place
    (models/modes.substituted; torch.func.functional_call there fails at ZeRO-3:
    checked)."""
    ds, plain = tmp_path / "ds", tmp_path / "torch"
    flagship = ["--method", "bilevel-cka", "--set", "eval.batch_size=3", *args]
    assert run_cli(*smoke_args(trace_dir, ds, *flagship, "--backend", "deepspeed", "--zero", "3")) == 0
    assert run_cli(*smoke_args(trace_dir, plain, *flagship)) == 0
    assert any("replay_mask_loss" in row for row in log_rows(only_run(ds)))  # the outer step ran
    assert_same_run(only_run(plain), only_run(ds))


class _TorchLikeBuilder:
    """Stands in for DeepSpeed's CPU op builder: its load() waits on torch's lock file as
    torch's cpp_extension does, for at most `patience` seconds (torch waits forever)."""

    name = "deepspeed_shm_comm"

    def __init__(self, patience: float = 0.0):
        self.patience, self.loads = patience, []

    def load(self, verbose=False):
        import time

        waited = time.monotonic()
        while (self.folder / "lock").exists():
            assert time.monotonic() - waited < self.patience, "torch's lock file stayed: the run would hang"
            time.sleep(0.05)
        self.loads.append(time.monotonic())


def _builder_in(tmp_path, monkeypatch, patience: float = 0.0) -> _TorchLikeBuilder:
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    builder = _TorchLikeBuilder(patience)
    builder.folder = tmp_path / builder.name
    builder.folder.mkdir()
    return builder


def test_a_killed_builds_lock_file_does_not_hang_the_next_run(tmp_path, monkeypatch, caplog):
    """Mutation caught: _build_cpu_comm_op not removing torch's lock file (the next
    DeepSpeed run on the machine would wait on it forever)."""
    from cl_bench.backends.deepspeed_backend import _build_cpu_comm_op

    builder = _builder_in(tmp_path, monkeypatch)
    (builder.folder / "lock").touch()  # left by a build killed midway
    with caplog.at_level("WARNING"):
        _build_cpu_comm_op(builder)
    assert len(builder.loads) == 1 and not (builder.folder / "lock").exists()
    assert "interrupted build" in caplog.text


def test_a_live_build_is_waited_for_not_broken(tmp_path, monkeypatch, caplog):
    """Another process holds the build lock and torch's lock file (a rank building the op
    while this one starts): this one waits for it, removes nothing and loads after it.
    Mutation caught: the flock not taken (the live build's lock file would be removed)."""
    import time

    from cl_bench.backends.deepspeed_backend import BUILD_LOCK, _build_cpu_comm_op

    builder = _builder_in(tmp_path, monkeypatch, patience=30)
    ready = builder.folder / "building"
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, os, sys, time\n"
        f"f = open({str(builder.folder / BUILD_LOCK)!r}, 'a'); fcntl.flock(f, fcntl.LOCK_EX)\n"
        f"open({str(builder.folder / 'lock')!r}, 'w').close(); open({str(ready)!r}, 'w').close()\n"
        f"time.sleep(1.5); os.remove({str(builder.folder / 'lock')!r})\n")])
    try:
        while not ready.exists():
            assert holder.poll() is None, "the holder process died"
            time.sleep(0.05)
        with caplog.at_level("INFO"):
            _build_cpu_comm_op(builder)
    finally:
        holder.wait(timeout=30)
    assert len(builder.loads) == 1 and "waiting for another process's build" in caplog.text
    assert "interrupted build" not in caplog.text


@pytest.mark.slow
@pytest.mark.parametrize("zero", [2, 3])
def test_a_non_finite_gradient_stops_the_run_without_clipping(trace_dir, tmp_path, monkeypatch, zero):
    """train.grad_clip=0, and an infinite gradient at the first step: ZeRO (fp32) takes it
    for an overflow and skips the step, where the torch backend's AdamW writes NaN weights
    and the next loss stops the run as diverged; the deepspeed backend stops it as
    diverged too (grad_norm inf; exit 2, the record failed). Mutation caught: the overflow
    not reported (the deepspeed run completes, its first step silently skipped)."""
    from cl_bench import registry

    seqft = registry.get("seqft")

    def poisoned(self, step):  # an infinite gradient on this rank's part of the first weight
        if step == 0:
            first = [p for p in self.model.parameters() if p.requires_grad][:1]
            fragments = self.ctx.grads.fragments(first)
            for f in fragments:
                f.grad.fill_(float("inf"))
            self.ctx.grads.write(fragments)

    monkeypatch.setattr(seqft, "before_step", poisoned)
    for name, backend in (("torch", []), ("deepspeed", deepspeed_args(tmp_path, zero))):
        assert run_cli(*smoke_args(trace_dir, tmp_path / name, "--set", "train.grad_clip=0", *backend)) == 2, name
        record = json.loads((only_run(tmp_path / name) / "run.json").read_text())
        assert record["status"] == "failed" and "the run diverged" in record["error"], (name, record.get("error"))


@pytest.mark.slow
def test_a_train_precision_the_engine_does_not_follow_is_said(trace_dir, tmp_path, caplog):
    """The deepspeed backend trains in what deepspeed.bf16 says; train.precision=bf16
    (or auto on a device with native bf16) under deepspeed.bf16=false (pinned: left
    null, a CUDA device would give bf16) trains fp32, and a warning says so and how to
    get bf16; the record says fp32. Mutation caught: the warning removed."""
    out = tmp_path / "ds"
    with caplog.at_level(logging.WARNING):
        assert run_cli(*smoke_args(trace_dir, out, "--set", "train.precision=bf16", "--set", "eval.precision=fp32",
                                   "--set", "deepspeed.bf16=false", *deepspeed_args(tmp_path, 2))) == 0
    said = [r.getMessage() for r in caplog.records if "deepspeed backend trains in what deepspeed.bf16" in r.getMessage()]
    assert len(said) == 1 and "train.precision=bf16" in said[0] and "deepspeed.bf16=true" in said[0], said
    assert json.loads((only_run(out) / "run.json").read_text())["backend"]["precision"]["train"] == "fp32"


@pytest.mark.slow
def test_phases_free_what_they_drop_and_walk_only_what_the_run_made(trace_dir, tmp_path, monkeypatch):
    """btx at ZeRO-3 (its branches replaced by the merged experts between phases):
    - every module a phase ran that the model no longer holds is freed by the run's
      end, and the model too once the run returns (it sits in reference cycles).
      DeepSpeed kept them (zero_engine._forget_released_modules). Mutations caught:
      the coordinator's memo not emptied, the engine's module left on
      FWD_MODULE_STACK (36 modules, 147,456 weights kept either way); the freeze
      below made after the model loads (the model outlives the run);
    - every ZeRO-3 phase starts (DeepSpeed's defragment) and ends (ZeroPhase.close)
      with a full garbage collection; what the process held before data and model
      loaded is set aside from the collector (deepspeed_backend._freeze_what_lives),
      so each walks fewer objects than a quarter of that (measured: 42,700-48,500
      against 585,000 set aside). Mutation caught: the freeze removed (each walks
      them all);
    - its phases start no process: DeepSpeed's CPU accelerator ran numactl at every
      ZeRO-3 gradient reduction to count its devices, unless LOCAL_SIZE is set, as its
      own launcher sets it (deepspeed_backend._count_local_ranks). Mutation caught:
      LOCAL_SIZE left unset (100 processes in its 6 phases)."""
    import gc
    import subprocess
    import weakref

    from cl_bench.backends.zero_engine import ZeroPhase

    walked = []
    collect = gc.collect
    monkeypatch.setattr(gc, "collect", lambda *a: walked.append((len(gc.get_objects()), gc.get_freeze_count()))
                        or collect(*a))
    ran, models = {}, []
    close = ZeroPhase.close

    def noting(phase):
        in_phases.append(len(started) - phase.started)
        for m in phase.model.modules():
            ran.setdefault(id(m), weakref.ref(m))
        models[:] = [weakref.ref(phase.model)]
        close(phase)

    monkeypatch.setattr(ZeroPhase, "close", noting)
    init = ZeroPhase.__init__

    def starting(phase, *args, **kwargs):
        phase.started = len(started)
        init(phase, *args, **kwargs)

    monkeypatch.setattr(ZeroPhase, "__init__", starting)
    started, in_phases = [], []

    class Popen(subprocess.Popen):
        def __init__(self, args, *rest, **kwargs):
            started.append(args)
            super().__init__(args, *rest, **kwargs)

    monkeypatch.setattr(subprocess, "Popen", Popen)
    monkeypatch.delenv("LOCAL_SIZE", raising=False)  # as a process of its own starts
    assert run_cli(*smoke_args(trace_dir, tmp_path / "ds", "--method", "btx", *deepspeed_args(tmp_path, 3))) == 0
    assert len(walked) >= 7 and all(objects < frozen / 4 for objects, frozen in walked[1:]), walked  # after the freeze's
    kept = {id(m) for m in models[0]().modules()}
    dropped = [r for i, r in ran.items() if i not in kept]
    assert dropped and not [r() for r in dropped if r() is not None]
    collect()
    assert models[0]() is None
    assert len(in_phases) == 6 and not any(in_phases), (in_phases, started)  # processes each phase started


@pytest.mark.parametrize("zero", [2, 3])
def test_a_loaded_optimiser_state_is_held_as_between_phases(zero):
    """zero_engine.load_held (DeepSpeedBackend.load_optimizer, --resume): a checkpoint's
    Adam moments stay in host memory, here where the parameters sit on the meta device,
    and at ZeRO-3 rank 2 of 3 keeps only its padded piece of each (7 values: 3 a rank,
    its own the 7th and two zeros); the step and the hyperparameters load as torch
    loads them. Mutation caught: load_held calling load_state_dict alone (the moments
    on the meta device, whole)."""
    from cl_bench.backends.zero_engine import Piece, load_held

    made = [torch.nn.Parameter(torch.zeros(7)), torch.nn.Parameter(torch.zeros(2, 3))]
    adam = torch.optim.AdamW(made, lr=0.5)
    for p in made:
        p.grad = torch.arange(1.0, p.numel() + 1).reshape(p.shape)
    adam.step()
    saved = adam.state_dict()
    params = [torch.nn.Parameter(torch.empty(p.shape, device="meta")) for p in made]
    loaded = torch.optim.AdamW(params, lr=1.0)
    load_held(loaded, saved, zero, rank=2, ranks=3)
    assert loaded.param_groups[0]["lr"] == 0.5
    for p, q in zip(made, params):
        assert torch.equal(loaded.state[q]["step"], adam.state[p]["step"])
        for key in ("exp_avg", "exp_avg_sq"):
            held, whole = loaded.state[q][key], adam.state[p][key]
            if zero == 2:
                assert held.device.type == "cpu" and torch.equal(held, whole), key
                continue
            size = -(-p.numel() // 3)
            assert isinstance(held, Piece) and (held.shape, held.rank, held.ranks) == (p.shape, 2, 3), key
            mine = whole.reshape(-1)[2 * size:]
            assert torch.equal(held.value, torch.cat([mine, torch.zeros(size - mine.numel())])), key


def test_a_model_with_a_0_dim_parameter_is_refused_as_the_run_starts(trace_dir, tmp_path, monkeypatch, capsys):
    """A --model with a 0-dim parameter (a learned scalar, as some hub models hold) is
    refused in one line before anything trains (Backend.check_model, from prepare), not
    by a traceback at the first phase. Mutation caught: the check not called (the
    phase's RuntimeError, exit 1)."""
    from cl_bench.run import prepare

    real = prepare.load

    def with_a_scalar(*args, **kwargs):
        loaded = real(*args, **kwargs)
        loaded.model.model.norm.temperature = torch.nn.Parameter(torch.tensor(1.0))
        return loaded

    monkeypatch.setattr(prepare, "load", with_a_scalar)
    capsys.readouterr()
    assert run_cli(*smoke_args(trace_dir, tmp_path / "runs", *deepspeed_args(tmp_path, 2))) == 2
    assert re.fullmatch(r"error: tiny-llama: parameter 'model.norm.temperature' is 0-dim: the deepspeed backend "
                        r"cannot hold it \(.*\); run it with --backend torch", one_line_error(capsys))


@pytest.mark.parametrize("zero", [2, 3])
def test_a_phase_refuses_a_0_dim_parameter_by_name(zero):
    """DeepSpeed (0.19.8) fails on a 0-dim parameter with a traceback from deep in its
    engine ("self.dim() cannot be 0 to view Float as Byte"), and zero_engine._per_value
    could not tell its Adam moments from its 0-dim step: a phase refuses it first, naming
    it. Mutation caught: the check removed (the phase goes on to DeepSpeed, here None:
    a TypeError)."""
    from cl_bench.backends.zero_engine import ZeroPhase

    model = torch.nn.Module()
    model.proj = torch.nn.Linear(2, 2)
    model.proj.temperature = torch.nn.Parameter(torch.tensor(0.5))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    with pytest.raises(RuntimeError, match=r"parameter 'proj.temperature' is 0-dim: .* give it shape \(1,\)"):
        ZeroPhase(None, model, optimizer, None, {}, zero, bf16=False)
