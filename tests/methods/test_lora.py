"""The LoRA family on the tiny Llama: what lora, olora (O-LoRA) and ogd share (the
adapter helper they compose, its arguments), and lora itself. olora: test_olora.py,
ogd: test_ogd.py.

The tiny model has 2 layers of width 64 with 2 KV heads of 16, so q_proj is
64 -> 64 and v_proj 64 -> 32; one rank-8 LoRA on both adds, per layer,
8·(64+64) + 8·(64+32) = 1792 parameters, 3584 in all (helpers.LORA_SIZE).
"""
from __future__ import annotations

import pytest
import torch

from cl_bench.run import checkpoint
from cl_bench.errors import UserError
from cl_bench.models.loading import tiny_llama
from helpers import LORA_SIZE, complete_record, make_method, only_run, run_cli, smoke_args, stages, train_stage


# ---- the family: composed, not inherited --------------------------------------

@pytest.mark.parametrize("name, own", [("lora", []), ("olora", ["lambda1", "lambda2"]),
                                       ("ogd", ["max_per_task", "max_basis"])])
def test_lora_family_composes_the_adapter_helper_and_keeps_its_arguments(name, own):
    from cl_bench import registry
    from cl_bench.method import Method, MethodArgs
    from cl_bench.models.lora_adapters import LoRAAdapterArgs

    cls = registry.get(name)
    assert cls.__mro__[1:] == (Method, object)  # no method inherits another
    assert cls.Args.__mro__[1:] == (LoRAAdapterArgs, MethodArgs, object)
    assert cls.lr_family == "adapter"
    table = cls.arg_table()
    assert [n for n, _, _ in table] == ["lr", "weight_decay", "beta1", "beta2", "r", "alpha", "dropout",
                                        "target_modules", *own]
    assert dict((n, d) for n, _, d in table if n in ("lr", "r", "alpha", "dropout", "target_modules")) == \
        {"lr": 1e-4, "r": 8, "alpha": 32, "dropout": 0.1, "target_modules": ["q_proj", "v_proj"]}


# ---- lora ------------------------------------------------------------------

def test_lora_trains_only_the_adapter(tmp_path):
    method = make_method("lora", lr=1e-2)
    before = {k: v.clone() for k, v in method.model.state_dict().items()}
    trainable = {n for n, p in method.model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A.default." in n or ".lora_B.default." in n for n in trainable)
    assert method.param_report()["trainable"] == LORA_SIZE
    train_stage(method, stages(1)[0])
    after = method.model.state_dict()
    pristine = tiny_llama(0)[0].state_dict()
    for key, value in after.items():
        if ".lora_" in key:
            assert not torch.equal(value, before[key]), f"{key} did not train"
        else:
            assert torch.equal(value, pristine[key.replace(".base_layer", "")]), f"{key} moved"


@pytest.mark.slow
def test_lora_smoke_run_leaves_the_base_bit_identical(trace_dir, tmp_path):
    out = tmp_path / "runs"
    assert run_cli(*smoke_args(trace_dir, out, "--method", "lora", "--keep-checkpoint")) == 0
    run_dir = only_run(out)
    record = complete_record(run_dir)
    assert record["method_args"]["r"] == 8 and record["method_args"]["target_modules"] == ["q_proj", "v_proj"]
    report = record["params"][-1]
    assert report["trainable"] == LORA_SIZE and report["deployed"] == report["total"] - LORA_SIZE
    final = checkpoint.load_checkpoint(run_dir)["model"]
    pristine = tiny_llama(record["seed"])[0].state_dict()
    base = {k.replace(".base_layer", ""): v for k, v in final.items() if ".lora_" not in k}
    assert base.keys() == pristine.keys()
    for key, value in base.items():
        assert torch.equal(value, pristine[key]), f"{key} moved"
    lora_b = [v for k, v in final.items() if ".lora_B." in k]
    assert len(lora_b) == 4 and all(v.abs().sum() > 0 for v in lora_b)  # B starts at zero


@pytest.mark.parametrize("name", ["lora", "olora", "ogd"])
def test_unknown_target_module_is_a_user_error(name):
    with pytest.raises(UserError, match="target_modules"):
        make_method(name, target_modules=["qkv_proj"])


def test_lora_adapter_and_its_moments_carry_into_the_next_stage():
    """Catches: the adapter re-initialised at a stage boundary (e.g. peft's
    `reset_lora_parameters` in before_task), so each stage starts from scratch
    instead of continuing LoRA-SeqFT's one adapter.

    After stage 0 trains (B moves off zero), the adapter at the start of stage 1
    (after before_task and optimizer_for_stage, as the harness calls them) equals
    its end-of-stage-0 values, and the optimiser keeps its AdamW moments (the
    trainable set is unchanged, so it is the same optimiser)."""
    method = make_method("lora", lr=1e-2)
    first, second = stages(2)
    optimizer = train_stage(method, first)
    adapter = {n: p for n, p in method.model.named_parameters() if p.requires_grad}
    end = {n: p.detach().clone() for n, p in adapter.items()}
    moments = {n: optimizer.state[p]["exp_avg"].clone() for n, p in adapter.items()}
    assert all(v.abs().sum() > 0 for n, v in end.items() if ".lora_B." in n)  # B trained off zero

    method.before_task(second)
    assert optimizer is method.optimizer_for_stage(second, optimizer)
    now = {n: p for n, p in method.model.named_parameters() if p.requires_grad}
    assert now.keys() == end.keys()
    changed = [n for n in end if not torch.equal(now[n].detach(), end[n])]
    assert not changed, f"{len(changed)} adapter tensors differ from the end of stage 0, e.g. {changed[0]}"
    for n, p in now.items():
        assert optimizer.state[p]["step"] == 3 and torch.equal(optimizer.state[p]["exp_avg"], moments[n])
