"""CaRE on the tiny Llama: the model (what trains and what stays, the anchored shared adapter,
pseudo-labels, the stage records) and end-to-end runs."""
from __future__ import annotations

import json
import logging
import math

import pytest
import torch
import torch.nn.functional as F

from cl_bench import registry
from cl_bench.record import io as results
from cl_bench.data.encode import Encoder
from cl_bench.errors import UserError
from cl_bench.method import Stage
from cl_bench.methods.care.args import UNIFORM_CE_TOL
from cl_bench.methods.care.pseudo_labels import prompt_key
from cl_bench.models.loading import tiny_llama
from cl_bench.models.params import schedule_report
from helpers import assert_decodes_as_the_plain_loop, flat_params, interrupted_run, only_run, run_cli, smoke_args
from care_setup import D, G, TASKS, batch_of, grow, make, snapshot, stage, train


# ---- the model -----------------------------------------------------------------------

def test_setup_starts_as_the_base_model_and_triplets_are_as_the_code_makes_them():
    method, model = make()
    base, _, _ = tiny_llama(0)
    ids = torch.randint(3, 259, (2, 9))
    blocks = model.model.layers
    assert isinstance(blocks[0].post_attention_layernorm, torch.nn.Identity)  # moved into the wrapper
    for t in range(3):
        method.before_task(stage(t))
        with torch.no_grad():
            torch.testing.assert_close(model(input_ids=ids).logits, base(input_ids=ids).logits,
                                       rtol=0, atol=1e-6)  # every scale at 0
    layer = method.layers[0]
    assert [t.router.out_features for t in layer.triplets] == [1, 2, 3]
    assert layer.triplets[0].perceiver.out_features == G and layer.shared.down.out_features == 64
    assert layer.triplets[0].expert.down.out_features == 16
    assert layer.triplets[0].perceiver_norm.weight.abs().max() < 0.1  # the code's 0.02 gain init
    grow(method, 3)
    method.before_task(Stage(3, [], "task 3"))
    e = [t.expert for t in layer.triplets]
    for name, p in e[3].named_parameters():  # E_3 = mean(E_0, E_1): the most recent one left out
        torch.testing.assert_close(p, (e[0].get_parameter(name) + e[1].get_parameter(name)) / 2)
    assert not torch.equal(e[1].down.weight, e[0].down.weight)  # E_1 starts fresh


def test_adapters_routers_and_perceivers_start_trunc_normal_at_init_std():
    """Every new Linear: weights trunc-normal(init_std), biases 0 (not nn.Linear's
    Kaiming-uniform: std 1/sqrt(3 * 16) = 0.14 for an up-projection from width 16)."""
    for std in (0.02, 0.05):
        method, _ = make(init_std=std)
        method.before_task(stage(0))
        method.before_task(stage(1))  # E_1 starts fresh too (from E_2 on: a mean of earlier experts)
        groups = {"down": [], "up": [], "router and perceiver": []}
        biases = []
        for layer in method.layers:
            for adapter in (layer.shared, *(t.expert for t in layer.triplets)):
                groups["down"].append(adapter.down)
                groups["up"].append(adapter.up)
            groups["router and perceiver"] += [m for t in layer.triplets for m in (t.router, t.perceiver)]
        for name, linears in groups.items():
            w = torch.cat([m.weight.detach().flatten() for m in linears])  # >= 2,400 entries per group
            assert w.std().item() == pytest.approx(std, rel=0.05), name
            assert abs(w.mean().item()) < 0.1 * std and w.abs().max().item() < 6 * std, name
            biases += [m.bias for m in linears]
        assert all(torch.equal(b, torch.zeros_like(b)) for b in biases)
        gains = torch.cat([t.perceiver_norm.weight.detach() for layer in method.layers for t in layer.triplets])
        assert gains.std().item() == pytest.approx(std, rel=0.15)  # 256 entries


def test_residual_router_input_reads_z_a_not_the_experts():
    for router_input, moved in (("expert", True), ("residual", False)):
        method, model = make(router_input=router_input)
        grow(method, 2)
        model.eval()
        b = batch_of(method, TASKS[0])
        with torch.no_grad():
            before = method._forward(b, None)[1][0]["perceiver"]  # layer 0: its z_a has no adapter in it
            method.layers[0].triplets[1].expert.scale.mul_(3)
            after = method._forward(b, None)[1][0]["perceiver"]
        assert (not torch.allclose(before, after)) == moved, router_input


def test_pseudo_labels_cluster_the_tasks_prompts_and_label_rows_by_prompt():
    method, model = make()
    method.before_task(stage(0))
    sizes = method.param_report()["pseudo_label_sizes"]
    assert len(sizes) == G and sum(sizes) == 8
    b = batch_of(method, TASKS[0])
    labels = method._batch_labels(b)
    enc = Encoder.from_config(method.ctx.tokenizer, method.ctx.config.train)
    assert labels.tolist() == [method._labels[prompt_key(enc.prompt_ids(e.prompt))] for e in TASKS[0].train]
    # an unseen prompt gets the nearest centroid of its base-model features
    new = batch_of(method, TASKS[2], "test")
    got = method._batch_labels(new)
    feats = F.normalize(method._base_features(new["input_ids"], new["attention_mask"], new["labels"]), dim=-1)
    assert got.tolist() == torch.cdist(feats, method._centroids).argmin(1).tolist()


def test_training_forces_the_current_router_and_logs_its_parts():
    method, model = make()
    grow(method, 3)  # task 2 begun
    b = batch_of(method, TASKS[2])
    model.train()
    _, records = method._forward(b, 2)
    assert all(r["selected"][:, 2].eq(1).all() and r["selected"].sum(1).eq(2).all() for r in records)
    loss, parts = method.loss(b, 0)
    assert set(parts) == {"lm", "perceiver", "perceiver_ce", "perceiver_kl", "task_id_acc"}
    assert loss.item() == pytest.approx(parts["lm"] + parts["perceiver"], rel=1e-5)
    loss.backward()
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {n for n, _ in model.named_parameters()
                         if ".mlp.shared." in n or ".mlp.triplets.2." in n}
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for n, p in model.named_parameters()
               if ".triplets.2.perceiver" in n)


def test_earlier_triplets_and_the_base_stay_frozen_in_a_later_task():
    method, model = make()
    method.before_task(stage(0))
    optimizer, _ = train(method, stage(0), 3)
    method.after_task(stage(0))
    method.before_task(stage(1))
    before = snapshot(model)
    optimizer, parts = train(method, stage(1), 3, optimizer)
    after = snapshot(model)
    moved = {n for n in before if not torch.equal(before[n], after[n])}
    assert all(".mlp.shared." in n or ".triplets.1." in n for n in moved)  # old triplets, LLM: exactly fixed
    assert any(".triplets.0." in n for n in before)
    for part in ("expert.scale", "expert.down.weight", "router.weight", "perceiver.weight", "perceiver_norm.weight"):
        assert {f"model.layers.{i}.mlp.triplets.1.{part}" for i in range(2)} & moved, part
    assert any(".mlp.shared." in n for n in moved) and "perceiver_kl" in parts


def test_the_shared_adapter_is_free_in_task_0_then_anchored():
    method, model = make(lr=1e-2)
    method.before_task(stage(0))
    optimizer = method.optimizer_for_stage(stage(0), None)
    b = batch_of(method, TASKS[0])

    def step(s):
        optimizer.zero_grad(set_to_none=True)
        method.loss(b, s)[0].backward()
        method.before_step(s)
        optimizer.step()
        stepped = [p.detach().clone() for p in method._shared_params()]
        method.after_step(s)
        return stepped

    for s in range(2):
        stepped = step(s)
    assert all(torch.equal(p, q) for p, q in zip(method._shared_params(), stepped))  # task 0: no pull
    method.after_task(stage(0))
    method.before_task(stage(1))
    anchor = [p.detach().clone() for p in method._shared_params()]
    optimizer = method.optimizer_for_stage(stage(1), optimizer)
    b = batch_of(method, TASKS[1])
    stepped = step(0)
    # Ebar - anchor = (1 - 0.999) * (the optimiser's Ebar - anchor)
    for p, q, a in zip(method._shared_params(), stepped, anchor):
        torch.testing.assert_close(p - a, 0.001 * (q - a), rtol=1e-3, atol=1e-7)  # fp32 rounding at |a| ~ 1
    assert all((q - a).abs().max() > 5e-3 for q, a in zip(stepped, anchor))  # a full step each, pulled to 1e-5
    method.after_task(stage(1))
    rec = method.param_report()
    assert 0 < rec["shared_drift"] < 1e-3 and rec["shared_drift_since_task0"] == rec["shared_drift"]


def test_stage_records_task_id_accuracy_oracle_gap_and_drift():
    method, model = make(n_tasks=2)
    method.before_task(stage(0))
    optimizer, _ = train(method, stage(0), 2)
    method.after_task(stage(0))
    rec = method.param_report()
    assert rec["task_id_acc"] == [1.0, 1.0] and rec["oracle_gap"] == 0.0  # one triplet: nothing to miss
    assert rec["shared_drift"] > 0 and rec["shared_drift_since_task0"] is None
    assert rec["experts_per_layer"] == [1, 1]
    method.before_task(stage(1))
    train(method, stage(1), 2, optimizer)
    method.after_task(stage(1))
    rec = method.param_report()
    assert set(rec["task_id_acc_by_task"]) == set(rec["answer_ce"]) == set(rec["answer_ce_oracle"]) == {"math", "code"}
    assert all(0 <= a <= 1 for a in rec["task_id_acc"]) and len(rec["task_id_acc"]) == 2
    gaps = [rec["answer_ce"][k] - rec["answer_ce_oracle"][k] for k in rec["answer_ce"]]
    assert rec["oracle_gap"] == pytest.approx(sum(gaps) / 2, abs=1e-5)
    assert rec["shared_drift_since_task0"] is not None and rec["experts_per_layer"] == [2, 2]
    assert sum(rec["pseudo_label_sizes"]) == 8


def test_a_stage_whose_perceivers_stay_uniform_warns_and_a_trained_one_does_not(caplog):
    """perceiver_ce_end within UNIFORM_CE_TOL * ln G of ln G: a warning in the stage record
    and the log. Untrained perceivers (weight 0: no gradient) stay there; trained ones
    leave (pooling z_a, which is not 0 at the start as E_0(z_a) is, and a large lr:
    10 steps take the CE from 2.08 to 1.68)."""
    uniform = math.log(G)
    for weight, args, steps, warns in ((0.0, {"lr": 1e-2}, 3, True),
                                       (1.0, {"lr": 3e-2, "router_input": "residual"}, 10, False)):
        method, _ = make(n_tasks=1, perceiver_weight=weight, diag_examples=0, **args)
        method.before_task(stage(0))
        _, parts = train(method, stage(0), steps)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="cl_bench.methods.care"):
            method.after_task(stage(0))
        rec = method.param_report()
        assert rec["perceiver_ce_end"] == pytest.approx(parts["perceiver_ce"], abs=1e-6)  # <= 10 steps: the last
        assert rec["perceiver_uniform"] is warns
        if warns:
            assert abs(rec["perceiver_ce_end"] - uniform) <= UNIFORM_CE_TOL * uniform
            (message,) = rec["warnings"]
            assert "ln G" in message and "stage 0" in message
            assert [r.getMessage() for r in caplog.records] == [f"care: {message}"]
        else:
            assert rec["perceiver_ce_end"] < (1 - UNIFORM_CE_TOL) * uniform
            assert rec["warnings"] == [] and not caplog.records


def test_bad_arguments_fail_with_the_field_named():
    cls = registry.get("care")
    with pytest.raises(UserError, match="router_input"):
        cls.parse_args({"router_input": "cls"})
    with pytest.raises(UserError, match="top_k"):
        cls.parse_args({"top_k": 0})


def test_params_schedule_adds_one_triplet_per_task():
    rows = schedule_report("tiny-llama", "care", 3)
    assert [r["experts_per_layer"] for r in rows] == [[1, 1], [2, 2], [3, 3]]
    expert = D + (D * 16 + 16) + (16 * D + D) + D  # norm, down, up, scale
    shared = D + (D * 64 + 64) + (64 * D + D) + D
    perceiver = D + D * G + G

    def triplet(i):
        return expert + D * (i + 1) + (i + 1) + perceiver

    assert [r["total"] - rows[0]["total"] for r in rows] == [0, 2 * triplet(1), 2 * (triplet(1) + triplet(2))]
    assert [r["trainable"] for r in rows] == [2 * (shared + triplet(i)) for i in range(3)]
    # Llama-3.2-1B on the meta device: about 1.5M per task (16 layers, d 2048)
    big = schedule_report("llama-3.2-1b", "care", 2)
    d = 2048
    one = (d + d * 16 + 16 + 16 * d + d + d) + 2 * d + 2 + (d + d * G + G)
    assert big[1]["total"] - big[0]["total"] == 16 * one


# ---- end to end ---------------------------------------------------------------------

@pytest.mark.slow
def test_smoke_run_and_resume(trace_dir, tmp_path, monkeypatch):
    straight = tmp_path / "straight"
    assert run_cli(*smoke_args(trace_dir, straight, "--method", "care")) == 0
    record = json.loads((only_run(straight) / "run.json").read_text())
    assert record["status"] == "complete" and not record["uses_replay"]
    assert [p["experts_per_layer"] for p in record["params"]] == [[1, 1], [2, 2], [3, 3]]
    last = flat_params(record)[-1]
    assert len(last["task_id_acc"]) == 2 and set(last["answer_ce"]) == set(record["tasks"])
    assert last["shared_drift_since_task0"] is not None
    rows = results.read_jsonl(only_run(straight) / "metrics.jsonl")
    assert {"lm", "perceiver_ce", "perceiver_kl", "task_id_acc"} <= set(rows[-1])

    broken = tmp_path / "broken"
    run_dir = interrupted_run(monkeypatch, *smoke_args(trace_dir, broken, "--method", "care"), at_stage=2)
    assert run_cli("run", "--resume", run_dir, "--no-progress") == 0
    resumed = json.loads((run_dir / "run.json").read_text())
    assert resumed["matrix"] == record["matrix"] and resumed["params"] == record["params"]


def test_rows_that_stop_leave_the_batch_with_their_routing():
    """A row that reaches EOS leaves the decoding batch with its routing weights
    (keep_rows); the others decode as in the plain loop."""
    method, model = make()
    grow(method, 3)
    model.eval()
    enc = Encoder.from_config(method.ctx.tokenizer, method.ctx.config.train)
    prompts = [enc.prompt_ids(TASKS[j % 3].test[j // 3].prompt) for j in range(6)]
    assert_decodes_as_the_plain_loop(model, prompts, 8, 0, 4)
