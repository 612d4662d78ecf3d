"""cluster-upcycle on the tiny Llama: the EMA dense teacher and its distillation, the accounting,
and end-to-end runs."""
from __future__ import annotations

import copy
import json
import math

import pytest
import torch
import torch.nn.functional as F

from cl_bench import registry
from cl_bench.record import io as results
from cl_bench.errors import UserError
from cl_bench.losses import distillation_kl
from cl_bench.method import Stage
from cl_bench.methods.cluster_upcycle import dense_routing
from cl_bench.models import moe
from cl_bench.models.loading import tiny_llama
from cl_bench.models.params import schedule_report
from helpers import flat_params, interrupted_run, only_run, run_cli, smoke_args
from cluster_upcycle_setup import D, GROUP, K, logits, make, start, task_batch


# ---- EMA teacher and distillation ----------------------------------------------------------

def test_ema_update_and_what_it_holds_across_tasks():
    method = make(ema_decay=0.9)
    model = method.model
    start(method, 0)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert set(method._ema) == trainable
    params = dict(model.named_parameters())
    for n in trainable:
        assert torch.equal(method._ema[n], params[n])  # starts at the initial weights
    before = {n: v.clone() for n, v in method._ema.items()}
    with torch.no_grad():
        for n in trainable:
            params[n].add_(1.0)
    method.after_step(0)
    for n in trainable:
        torch.testing.assert_close(method._ema[n], 0.9 * before[n] + 0.1 * params[n])
    assert method.param_report()["ema_teacher"] == 2 * GROUP
    method.after_task(Stage(0, [], "t0"))
    start(method, 1)  # the frozen group leaves; the new one joins at its initial weights
    params = dict(model.named_parameters())
    now = {n for n, p in model.named_parameters() if p.requires_grad}
    assert set(method._ema) == now and not now & trainable
    assert all(torch.equal(method._ema[n], params[n]) for n in now)
    report = method.param_report()
    assert report["ema_teacher"] == 2 * GROUP and report["total"] == report["deployed"] + 2 * GROUP

    # what trains in every task keeps its average across tasks, unless ema_reset
    for reset in (False, True):
        m = make(train_shared=True, ema_decay=0.5, ema_reset=reset)
        start(m, 0)
        q = dict(m.model.named_parameters())["model.layers.0.self_attn.q_proj.weight"]
        with torch.no_grad():
            q.add_(1.0)
        m.after_step(0)
        averaged = m._ema["model.layers.0.self_attn.q_proj.weight"].clone()
        m.after_task(Stage(0, [], "t0"))
        start(m, 1)
        kept = m._ema["model.layers.0.self_attn.q_proj.weight"]
        assert torch.equal(kept, q.detach() if reset else averaged)
        assert not torch.equal(averaged, q.detach())

    off = make(eesd_weight=0.0)
    start(off, 0)
    assert off._ema == {} and off.param_report()["ema_teacher"] == 0
    loss, parts = off.loss(task_batch(off), 0)
    assert set(parts) == {"lm", "lb"}


def test_dense_routing_sums_every_expert_by_its_probability():
    model, _, _ = tiny_llama(0)
    (layer,) = moe.upcycle_model(model, layers=[0], router_std=0.5)
    with torch.no_grad():
        layer.groups[0].gate.mul_(1.5)  # experts that are not their slices
    layer.eval()
    x = torch.randn(1, 5, D, generator=torch.Generator().manual_seed(0))
    flat = x.reshape(-1, D)
    probs = F.linear(flat, layer.router_weight(), layer.router_bias()).softmax(-1)  # (N, E)
    dense = layer.dense(flat)
    want = dense.clone()
    slices = moe.slice_experts(layer.dense, K)
    for e, (g, u, dn) in enumerate(layer.experts()):
        gs, us, ds = (s[e] for s in slices)
        expert = (F.silu(flat @ g.T) * (flat @ u.T)) @ dn.T
        dense_slice = (F.silu(flat @ gs.T) * (flat @ us.T)) @ ds.T
        want += probs[:, e:e + 1] * (expert - dense_slice)
    with torch.no_grad(), dense_routing(model):
        got = layer(x).reshape(-1, D)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert layer.k == 2  # restored


def test_teacher_is_the_ema_model_run_densely():
    method = make()
    model = method.model
    start(method, 0)
    b = task_batch(method)
    params = dict(model.named_parameters())
    with torch.no_grad():  # the student moves away from its EMA
        for n in method._ema:
            params[n].add_(0.05 * torch.randn(params[n].shape, generator=torch.Generator().manual_seed(1)))
    reference = copy.deepcopy(model)
    with torch.no_grad():
        for n, v in method._ema.items():
            dict(reference.named_parameters())[n].copy_(v)
        for layer in moe.moe_layers(reference):
            layer.k = layer.n_experts
    model.train()
    teacher = method.teacher_logits(b)
    assert not any(isinstance(v, torch.Tensor) and v.grad_fn is not None  # nothing stored on a layer
                   for layer in moe.moe_layers(model) for v in vars(layer).values())
    assert all(layer.k == 2 for layer in moe.moe_layers(model))
    torch.testing.assert_close(teacher, logits(reference, b), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(teacher, logits(model, b), atol=1e-4)


def test_eesd_is_the_distillation_kl_teacher_to_student_on_answer_tokens():
    g = torch.Generator().manual_seed(0)
    student = torch.randn(2, 6, 11, generator=g, requires_grad=True)
    teacher = torch.randn(2, 6, 11, generator=g)
    labels = torch.full((2, 6), -100)
    labels[0, 3:5] = 1  # answer tokens at 3, 4: predicted at positions 2, 3
    labels[1, 5] = 2  # predicted at position 4
    pos = [(0, 2), (0, 3), (1, 4)]
    s = torch.stack([student[i, j] for i, j in pos])
    t = torch.stack([teacher[i, j] for i, j in pos])
    want = F.kl_div(s.log_softmax(-1), t.log_softmax(-1), log_target=True, reduction="batchmean")
    got = distillation_kl(student, teacher, labels, 1.0)
    torch.testing.assert_close(got, want)
    pt = t.softmax(-1)
    by_hand = (pt * (pt.log() - s.log_softmax(-1))).sum(-1).mean()
    torch.testing.assert_close(got, by_hand)
    T = 2.0
    want_t = T ** 2 * F.kl_div((s / T).log_softmax(-1), (t / T).log_softmax(-1), log_target=True,
                               reduction="batchmean")
    torch.testing.assert_close(distillation_kl(student, teacher, labels, T), want_t)
    assert distillation_kl(student, student.detach(), labels, 1.0).abs().item() < 1e-6
    got.backward()
    assert student.grad[0, 0].abs().sum() == 0 and student.grad[0, 2].abs().sum() > 0
    assert distillation_kl(student, teacher, torch.full((2, 6), -100), 1.0).item() == 0


def test_loss_adds_weighted_eesd_to_lm_and_balancing():
    method = make(eesd_weight=0.5)
    start(method, 0)
    b = task_batch(method)
    method.model.train()
    loss, parts = method.loss(b, 0)
    assert set(parts) == {"lm", "lb", "eesd"} and parts["eesd"] > 0  # dense teacher != sparse student
    assert loss.item() == pytest.approx(parts["lm"] + parts["lb"] + 0.5 * parts["eesd"], rel=1e-5)
    loss.backward()
    grads = {n for n, p in method.model.named_parameters() if p.grad is not None}
    assert grads == {n for n, p in method.model.named_parameters() if p.requires_grad}


# ---- accounting and runs ----------------------------------------------------------------------

def test_params_schedule_counts_groups_and_the_ema_teacher():
    rows = schedule_report("tiny-llama", "cluster-upcycle", 3)
    assert [r["experts_per_layer"] for r in rows] == [[8, 8], [16, 16], [24, 24]]
    for r in rows:
        assert r["trainable"] == 2 * GROUP
        assert r["ema_teacher"] == 2 * GROUP  # the trainable group's copy
        assert r["total"] == r["deployed"] + r["ema_teacher"]
    off = schedule_report("tiny-llama", "cluster-upcycle", 2, {"eesd_weight": 0})
    assert off[-1]["ema_teacher"] == 0 and off[-1]["total"] == off[-1]["deployed"]


def test_arguments_are_checked():
    cls = registry.get("cluster-upcycle")
    for bad in ({"tau": 0}, {"tau": 1.5}, {"rank_cap": -1}, {"ema_decay": 1.0}, {"eesd_temperature": 0},
                {"calib_tokens": 0}, {"ridge": -1}, {"max_drift": 0}):
        with pytest.raises(UserError):
            cls.parse_args(bad)
    assert cls.parse_args({"rank_cap": "null"}).rank_cap is None
    assert cls.parse_args({"rank_cap": "52"}).rank_cap == 52
    assert cls.parse_args({"max_drift": "null"}).max_drift is None


@pytest.mark.slow
def test_smoke_run_and_resume(trace_dir, tmp_path, monkeypatch):
    straight = tmp_path / "straight"
    assert run_cli(*smoke_args(trace_dir, straight, "--method", "cluster-upcycle")) == 0
    record = json.loads((only_run(straight) / "run.json").read_text())
    assert record["status"] == "complete"
    assert record["method_args"]["tau"] == 0.99 and record["method_args"]["shared"] == "swap"
    params = flat_params(record)
    assert [p["experts_per_layer"] for p in params] == [[8, 8], [16, 16], [24, 24]]
    for p in params:
        init = p["cluster_init"]
        assert math.isfinite(init["lm_rel_change"]) and math.isfinite(init["lm_end"])
        assert len(init["layers"]) == 2 and "end_routing" in init["layers"][0]
    rows = results.read_jsonl(only_run(straight) / "metrics.jsonl")
    assert rows and all({"lm", "lb", "eesd"} <= set(r) for r in rows)

    broken = tmp_path / "broken"
    run_dir = interrupted_run(monkeypatch, *smoke_args(trace_dir, broken, "--method", "cluster-upcycle"),
                              at_stage=2)
    assert run_cli("run", "--resume", run_dir, "--no-progress") == 0
    resumed = json.loads((run_dir / "run.json").read_text())
    assert resumed["matrix"] == record["matrix"] and resumed["params"] == record["params"]
    assert results.read_jsonl(run_dir / "metrics.jsonl") == rows



def test_the_ema_follows_the_weights_the_optimiser_steps_not_the_working_copy():
    """Under ZeRO in bf16 the working copy is a bf16 cast of the fp32 master: the EMA
    reads the master (StepGradients.fragments' weights), here p + 1, and takes what
    `assemble` makes whole. Mutation caught: the EMA read from `p` (the working copy)."""
    from cl_bench.methods.cluster_upcycle.teacher import ema_step
    from cl_bench.step_gradients import Fragment, StepGradients

    class Masters(StepGradients):
        def fragments(self, params, grad=True):
            return [Fragment(p, 0, p.numel(), None, p.detach().reshape(-1) + 1) for p in params]

    params = [torch.nn.Parameter(torch.randn(3, 4, generator=torch.Generator().manual_seed(i))) for i in range(2)]
    emas = [torch.zeros(3, 4) for _ in params]
    ema_step(list(zip(emas, params)), 0.9, Masters())
    for value, p in zip(emas, params):
        torch.testing.assert_close(value, 0.1 * (p.detach() + 1))
