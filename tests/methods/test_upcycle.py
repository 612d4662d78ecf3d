"""upcycle and drop-upcycle on the tiny Llama (2 layers, width 64, FFN 128: K = 8
slices of h = 16): how each task's group starts, what trains, and end-to-end smoke
runs and resume. The MoE layer they build: tests/models/test_moe.py."""
from __future__ import annotations

import json

import pytest
import torch

from cl_bench.record import io as results
from cl_bench.models import moe
from cl_bench.models.loading import tiny_llama
from helpers import interrupted_run, make_method, only_run, run_cli, smoke_args, stages, train_stage

K, h, D = 8, 16, 64
GROUP = ("gate", "up", "down", "router_weight", "router_bias")


def pretrained_slices():
    """Per decoder layer, the K slices of the seed model's dense MLP, by hand: gate and
    up rows [i h, (i + 1) h), down's same columns."""
    model, _, _ = tiny_llama(0)
    return [(m.gate_proj.weight.reshape(K, h, D), m.up_proj.weight.reshape(K, h, D),
             m.down_proj.weight.reshape(D, K, h).permute(1, 0, 2))
            for m in (block.mlp for block in model.model.layers)]


def snapshot(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def moved(model, before):
    return {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}


def group_params(t):
    return {f"model.layers.{i}.mlp.groups.{t}.{p}" for i in range(2) for p in GROUP}


def test_each_new_group_starts_as_the_pretrained_dense_slices():
    """Task t >= 1's group: 8 slices of the frozen pretrained dense MLP, whatever the
    earlier groups learned. Mutation caught: new groups at t >= 1 drawn at random."""
    method = make_method("upcycle", lr=1e-3)
    slices = pretrained_slices()
    optimizer = None
    for stage in stages(3):
        method.before_task(stage)
        for layer, want in zip(moe.moe_layers(method.model), slices):
            assert len(layer.groups) == stage.index + 1
            new = layer.groups[-1]
            for got, w in zip((new.gate, new.up, new.down), want):
                assert torch.equal(got, w)
        optimizer = train_stage(method, stage, n_steps=2, optimizer=optimizer)  # before_task again: idempotent
        assert not torch.equal(moe.moe_layers(method.model)[0].groups[-1].gate, slices[0][0])  # it trained


def test_old_groups_stay_frozen_in_later_stages_and_after_a_resume():
    """In task t only group t (experts and router rows) moves; a method resumed from
    the state after task 1 (as resume.restore: load_state_dict, the weights, an
    optimiser over the saved parameter groups) trains as much, and only group 2, in
    task 2. Mutation caught: train_newest_group dropped from before_task and
    load_state_dict."""
    method = make_method("upcycle", lr=1e-3)
    plan = stages(3)
    optimizer = train_stage(method, plan[0], n_steps=2)
    method.before_task(plan[1])  # group 1 joins (train_stage's own before_task adds nothing)
    before = snapshot(method.model)
    optimizer = train_stage(method, plan[1], n_steps=2, optimizer=optimizer)
    assert moved(method.model, before) == group_params(1)
    trained = {n for n, p in method.model.named_parameters() if p.requires_grad}
    assert trained == group_params(1)

    resumed = make_method("upcycle", lr=1e-3, seed=1)  # other weights, to be overwritten
    resumed.load_state_dict(method.state_dict())
    resumed.model.load_state_dict(method.model.state_dict())
    assert {n for n, p in resumed.model.named_parameters() if p.requires_grad} == trained
    params = dict(resumed.model.named_parameters())
    names = {id(p): n for n, p in method.model.named_parameters()}
    restored = resumed.make_optimizer([{"params": [params[names[id(p)]] for p in g["params"]]}
                                       for g in optimizer.param_groups])
    restored.load_state_dict(optimizer.state_dict())
    resumed.before_task(plan[2])
    before = snapshot(resumed.model)
    train_stage(resumed, plan[2], n_steps=2, optimizer=restored)
    assert moved(resumed.model, before) == group_params(2)


@pytest.mark.parametrize("ratio", [0.25, 0.75])
def test_drop_upcycle_reinitialises_drop_ratio_of_each_new_expert(ratio):
    """drop-upcycle's groups (task 0's at setup, each later one) are the pretrained
    slices with floor(drop_ratio h) neurons per expert re-drawn (gate rows, up rows,
    down columns: one set). Mutation caught: the method ignoring drop_ratio (0.5)."""
    method = make_method("drop-upcycle", drop_ratio=ratio)
    slices = pretrained_slices()
    for stage in stages(2):
        method.before_task(stage)
        for layer, (gate0, up0, down0) in zip(moe.moe_layers(method.model), slices):
            new = layer.groups[-1]
            for i in range(K):
                rows = (new.gate[i] != gate0[i]).any(dim=1)  # (h,) neurons re-drawn
                assert int(rows.sum()) == int(ratio * h), (stage.index, i)
                assert torch.equal(rows, (new.up[i] != up0[i]).any(dim=1))
                assert torch.equal(rows, (new.down[i] != down0[i]).any(dim=0))


@pytest.mark.slow
@pytest.mark.parametrize("method", ["upcycle", "drop-upcycle"])
def test_smoke_run_grows_8_experts_per_layer_per_task(trace_dir, tmp_path, method):
    out = tmp_path / "runs"
    assert run_cli(*smoke_args(trace_dir, out, "--method", method)) == 0
    record = json.loads((only_run(out) / "run.json").read_text())
    assert record["status"] == "complete"
    assert [p["experts_per_layer"] for p in record["params"]] == [[8, 8], [16, 16], [24, 24]]
    for p in record["params"]:
        assert p["active_per_token"] < p["total"] and p["trainable"] < p["total"]
    rows = results.read_jsonl(only_run(out) / "metrics.jsonl")
    assert {"lm", "lb"} <= set(rows[0])


@pytest.mark.slow
def test_upcycle_resumes_to_the_same_run(trace_dir, tmp_path, monkeypatch):
    straight = tmp_path / "straight"
    assert run_cli(*smoke_args(trace_dir, straight, "--method", "upcycle")) == 0
    expected = json.loads((only_run(straight) / "run.json").read_text())

    broken = tmp_path / "broken"
    run_dir = interrupted_run(monkeypatch, *smoke_args(trace_dir, broken, "--method", "upcycle"), at_stage=2)
    assert run_cli("run", "--resume", run_dir, "--no-progress") == 0
    resumed = json.loads((run_dir / "run.json").read_text())
    assert resumed["status"] == "complete"
    assert resumed["matrix"] == expected["matrix"]
    assert resumed["params"] == expected["params"]
    rows = lambda d: [(r["lm"], r["lb"]) for r in results.read_jsonl(d / "metrics.jsonl")]
    assert rows(run_dir) == rows(only_run(straight))
