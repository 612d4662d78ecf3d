"""Branch-Train-MiX on the tiny Llama: what each phase trains, and end-to-end runs."""
from __future__ import annotations

import json

import pytest
import torch

from cl_bench.record import io as results
from cl_bench.method import MethodContext, Stage, trainable_groups
from cl_bench.models import moe
from cl_bench.models.loading import tiny_llama
from helpers import interrupted_run, make_method, only_run, run_cli, smoke_args


def _step(model):
    """One SGD step on a random batch through whatever is trainable."""
    ids = torch.randint(3, 259, (2, 10), generator=torch.Generator().manual_seed(0))
    params = [p for p in model.parameters() if p.requires_grad]
    model(input_ids=ids, labels=ids).loss.backward()
    with torch.no_grad():
        for p in params:
            p -= 0.5 * p.grad
            p.grad = None


def _snapshot(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_branch_then_mix_train_what_they_should():
    method = make_method("btx", context=MethodContext.for_shapes(3))
    model = method.model
    for t in range(2):
        stage = Stage(t, [], f"task {t}")
        method.before_task(stage)
        branch, mix = method.phases(stage)
        assert (branch.name, branch.replay, mix.name, mix.replay) == ("branch", False, "mix", True)

        method.before_phase(stage, branch)
        trainable = {n for n, p in model.named_parameters() if p.requires_grad}
        assert trainable and all(".mlp.ffn." in n for n in trainable)
        before = _snapshot(model)
        _step(model)
        after = _snapshot(model)
        changed = {n for n in before if not torch.equal(before[n], after[n])}
        assert changed == trainable  # the branch moved, nothing else
        ffn = model.model.layers[0].mlp.ffn
        trained_gate = ffn.gate_proj.weight.detach().clone()

        method.before_phase(stage, mix)
        assert moe.experts_per_layer(model) == [8 * (t + 1)] * 2
        layer = moe.moe_layers(model)[0]
        # the new group holds the trained branch's slices
        torch.testing.assert_close(layer.groups[-1].gate, trained_gate.reshape(8, 16, 64))
        trainable = {n for n, p in model.named_parameters() if p.requires_grad}
        assert trainable == {f"model.layers.{i}.mlp.groups.{g}.{p}" for i in range(2) for g in range(t + 1)
                             for p in ("router_weight", "router_bias")}
        assert method.make_optimizer(trainable_groups(method.model)).param_groups[0]["lr"] == method.args.router_lr


def test_every_branch_starts_from_the_pretrained_mlp_which_no_mix_changes():
    """BTX branches from the seed: task t's branch is a fresh copy of the pretrained
    dense MLP, and after each mix the layer's dense MLP (the shared path) is still the
    pretrained one, while the new group holds the trained branch. Mutation caught: the
    trained branch written into the seed MLP (branches chain)."""
    seed = {n: p.detach().clone() for n, p in tiny_llama(0)[0].model.layers.named_parameters()
            if ".mlp." in n}  # layers.{i}.mlp.{gate,up,down}_proj.weight
    method = make_method("btx", context=MethodContext.for_shapes(3))
    model = method.model
    for t in range(2):
        stage = Stage(t, [], f"task {t}")
        method.before_task(stage)
        branch, mix = method.phases(stage)
        method.before_phase(stage, branch)
        for i, block in enumerate(model.model.layers):
            for name, p in block.mlp.ffn.named_parameters():
                assert torch.equal(p, seed[f"{i}.mlp.{name}"]), (t, i, name)
        _step(model)
        trained = model.model.layers[0].mlp.ffn.gate_proj.weight.detach().clone()
        assert not torch.equal(trained, seed["0.mlp.gate_proj.weight"])
        method.before_phase(stage, mix)
        for i, layer in enumerate(moe.moe_layers(model)):
            for name, p in layer.dense.named_parameters():
                assert torch.equal(p, seed[f"{i}.mlp.{name}"]), (t, i, name)
        torch.testing.assert_close(moe.moe_layers(model)[0].groups[-1].gate, trained.reshape(8, 16, 64),
                                   rtol=0, atol=0)


def test_params_schedule_grows_by_one_group_per_task():
    from cl_bench.models.params import schedule_report

    rows = schedule_report("tiny-llama", "btm", 3)  # the alias
    assert [r["experts_per_layer"] for r in rows] == [[8, 8], [16, 16], [24, 24]]
    assert rows[-1]["trainable"] == 2 * 24 * 65  # the mix phase: every router row and bias


@pytest.mark.slow
def test_smoke_run_and_resume(trace_dir, tmp_path, monkeypatch):
    straight = tmp_path / "straight"
    assert run_cli(*smoke_args(trace_dir, straight, "--method", "btx")) == 0
    record = json.loads((only_run(straight) / "run.json").read_text())
    assert record["status"] == "complete" and record["uses_replay"]
    assert [p["experts_per_layer"] for p in record["params"]] == [[8, 8], [16, 16], [24, 24]]
    assert record["replay"]["used"] > 0
    rows = results.read_jsonl(only_run(straight) / "metrics.jsonl")
    assert [r["phase"] for r in rows if r["stage"] == 1][:1] == ["branch"]
    assert {"lb", "replay_lm"} <= set(next(r for r in rows if r["stage"] == 1 and r["phase"] == "mix"))

    broken = tmp_path / "broken"
    run_dir = interrupted_run(monkeypatch, *smoke_args(trace_dir, broken, "--method", "btx"), at_stage=2)
    assert run_cli("run", "--resume", run_dir, "--no-progress") == 0
    resumed = json.loads((run_dir / "run.json").read_text())
    assert resumed["matrix"] == record["matrix"] and resumed["params"] == record["params"]
