"""LoRA-family methods on the tiny Llama: lora, olora (O-LoRA) and ogd.

The tiny model has 2 layers of width 64 with 2 KV heads of 16, so q_proj is
64 -> 64 and v_proj 64 -> 32; one rank-8 LoRA on both adds, per layer,
8·(64+64) + 8·(64+32) = 1792 parameters, 3584 in all.
"""
from __future__ import annotations

import io
import json
import logging
from pathlib import Path

import pytest
import torch

from cl_bench import results
from cl_bench.data import collate
from cl_bench.errors import UserError
from cl_bench.method import Stage
from cl_bench.models.loading import tiny_llama
from helpers import make_method, make_task
from conftest import interrupted_run, only_run, run_cli, smoke_args

LORA_SIZE = 2 * (8 * (64 + 64) + 8 * (64 + 32))  # 3584


def batch_of(method, task) -> dict[str, torch.Tensor]:
    rows = [method.ctx.encoder.train_example(e.prompt, e.answer) for e in task.train[:4]]
    return collate(rows, method.ctx.pad_id)


def train_stage(method, stage: Stage, n_steps: int = 3, optimizer=None):
    """The backend's hook order on one fixed batch; returns the optimiser."""
    method.before_task(stage)
    optimizer = method.optimizer_for_stage(stage, optimizer)
    batch = batch_of(method, stage.tasks[0])
    for step in range(n_steps):
        optimizer.zero_grad(set_to_none=True)
        loss, _ = method.loss(batch, step)
        loss.backward()
        method.before_step(step)
        optimizer.step()
        method.after_step(step)
    method.after_task(stage)
    return optimizer


def stages(n: int) -> list[Stage]:
    return [Stage(i, [make_task(f"task{i}")], f"task{i}") for i in range(n)]




def complete_record(run_dir: Path) -> dict:
    record = json.loads((run_dir / "run.json").read_text())
    assert record["status"] == "complete"
    assert [[v is not None for v in row] for row in record["matrix"]] == \
        [[j <= b for j in range(3)] for b in range(3)]
    assert record["summary"] is not None and len(record["params"]) == 3
    return record


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


def test_lora_smoke_run_leaves_the_base_bit_identical(trace_dir, tmp_path):
    out = tmp_path / "runs"
    assert run_cli(*smoke_args(trace_dir, out, "--method", "lora", "--keep-checkpoint")) == 0
    run_dir = only_run(out)
    record = complete_record(run_dir)
    assert record["method_args"]["r"] == 8 and record["method_args"]["target_modules"] == ["q_proj", "v_proj"]
    report = record["params"][-1]
    assert report["trainable"] == LORA_SIZE and report["deployed"] == report["total"] - LORA_SIZE
    final = results.load_checkpoint(run_dir)["model"]
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


# ---- olora -----------------------------------------------------------------

def pairs(method) -> list[tuple[torch.Tensor, ...]]:
    """Per pair k: every module's (A_k, B_k), cloned."""
    return [tuple(t.detach().clone() for layer in method.layers for t in (layer.lora_A[k], layer.lora_B[k]))
            for k in range(method.n_pairs)]


def test_olora_adds_a_pair_per_task_and_freezes_the_old_ones():
    method = make_method("olora", lr=1e-2)
    base_total = method.param_report()["total"]
    plan = stages(3)
    optimizer = None
    for t, stage in enumerate(plan):
        snapshot = pairs(method)
        optimizer = train_stage(method, stage, optimizer=optimizer)
        assert method.n_pairs == t + 1
        report = method.param_report()
        assert report["total"] == base_total + (t + 1) * LORA_SIZE
        assert report["trainable"] == LORA_SIZE and report["deployed"] == base_total
        trainable = {n for n, p in method.model.named_parameters() if p.requires_grad}
        assert trainable == {n for n, _ in method.model.named_parameters()
                             if n.endswith((f"lora_A.{t}", f"lora_B.{t}"))}
        now = pairs(method)
        for k in range(t):  # every earlier pair bit-identical through task t
            assert all(torch.equal(a, b) for a, b in zip(snapshot[k], now[k])), f"pair {k} moved in task {t}"
        new_b = now[t][1::2]
        assert all(b.abs().sum() > 0 for b in new_b), f"pair {t} did not train"
    pristine = tiny_llama(0)[0].state_dict()
    for key, value in method.model.state_dict().items():
        if ".lora_" not in key:
            assert torch.equal(value, pristine[key.replace(".base.", ".")]), f"{key} moved"


def test_orthogonality_penalty_matches_a_hand_computation():
    from cl_bench.methods.olora import orthogonality_penalty

    a0 = torch.tensor([[1.0, 0.0, 0.0], [0.0, 2.0, 0.0]])
    a1 = torch.tensor([[0.0, 0.0, 3.0], [1.0, 1.0, 0.0]])
    at = torch.tensor([[1.0, -1.0, 1.0], [0.0, 0.0, 2.0]])
    # a0 @ atᵀ = [[1, 0], [-2, 0]] -> 3;  a1 @ atᵀ = [[3, 6], [0, 0]] -> 9
    assert orthogonality_penalty([a0], at).item() == 3.0
    assert orthogonality_penalty([a0, a1], at).item() == 12.0
    assert orthogonality_penalty([], at).item() == 0.0


def test_olora_penalty_is_zero_at_task_0_and_uses_earlier_pairs_only():
    method = make_method("olora")
    method.before_task(stages(1)[0])
    _, parts = method.loss(batch_of(method, make_task("t")), 0)
    assert parts["orth"] == 0.0 and parts["lm"] > 0
    method.before_task(stages(2)[1])
    method.before_task(stages(3)[2])
    orth, l2 = method.penalties()
    by_hand = sum((layer.lora_A[k] @ layer.lora_A[2].T).abs().sum()
                  for layer in method.layers for k in range(2))
    with_self = by_hand + sum((layer.lora_A[2] @ layer.lora_A[2].T).abs().sum() for layer in method.layers)
    assert orth.item() == pytest.approx(by_hand.item(), rel=1e-6)
    assert orth.item() < 0.9 * with_self.item()
    # B_t is zero at the start, so the l2 term is Σ ‖A_t‖_F alone (not squared)
    assert l2.item() == pytest.approx(sum(layer.lora_A[2].norm().item() for layer in method.layers), rel=1e-6)
    _, parts = method.loss(batch_of(method, make_task("t")), 0)
    assert parts["orth"] == pytest.approx(orth.item(), rel=1e-6)


def test_olora_penalty_falls_when_optimised():
    method = make_method("olora")
    method.before_task(stages(1)[0])
    method.before_task(stages(2)[1])
    new = [layer.lora_A[1] for layer in method.layers]
    optimizer = torch.optim.SGD(new, lr=1e-2)
    values = []
    for _ in range(10):
        optimizer.zero_grad()
        orth, _ = method.penalties()
        values.append(orth.item())
        orth.backward()
        optimizer.step()
    assert values[0] > 0 and values[-1] < 0.5 * values[0]
    assert all(b <= a for a, b in zip(values, values[1:]))


def test_olora_smoke_run_and_resume(trace_dir, tmp_path, monkeypatch):
    straight = tmp_path / "straight"
    assert run_cli(*smoke_args(trace_dir, straight, "--method", "olora")) == 0
    expected = complete_record(only_run(straight))
    totals = [p["total"] for p in expected["params"]]
    assert [b - a for a, b in zip(totals, totals[1:])] == [LORA_SIZE, LORA_SIZE]
    logged = results.read_jsonl(only_run(straight) / "metrics.jsonl")
    assert {"lm", "orth", "l2"} <= set(logged[0])
    assert all(r["orth"] == 0 for r in logged if r["stage"] == 0)
    assert all(r["orth"] > 0 for r in logged if r["stage"] > 0)

    broken = tmp_path / "broken"
    run_dir = interrupted_run(monkeypatch, *smoke_args(trace_dir, broken, "--method", "olora"), at_stage=2)
    assert results.load_checkpoint(run_dir)["method"] == {"n_pairs": 2}
    assert run_cli("run", "--resume", run_dir, "--no-progress") == 0
    resumed = complete_record(run_dir)
    assert resumed["matrix"] == expected["matrix"]
    assert resumed["params"] == expected["params"]
    assert results.read_jsonl(run_dir / "metrics.jsonl") == logged  # same losses, step for step


# ---- ogd -------------------------------------------------------------------

def flat_grad(method) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in method.adapter]).clone()


def test_ogd_projects_the_gradient_off_the_basis():
    method = make_method("ogd", lr=1e-2)
    first, second = stages(2)
    optimizer = train_stage(method, first)  # after_task stores task0's gradients
    basis = method.basis
    assert basis.dtype == torch.float32 and basis.shape == (8, LORA_SIZE)
    assert torch.allclose(basis @ basis.T, torch.eye(len(basis)), atol=1e-5)  # orthonormal

    method.before_task(second)
    method.optimizer_for_stage(second, optimizer)
    loss, _ = method.loss(batch_of(method, make_task("other", 6)), 0)
    loss.backward()
    raw = flat_grad(method)
    method.before_step(0)
    applied = flat_grad(method)
    assert (basis @ raw).norm() > 1e-2 * raw.norm()  # there was something to remove
    assert (basis @ applied).abs().max() < 1e-5 * raw.norm()
    assert torch.allclose(applied, raw - basis.T @ (basis @ raw), atol=1e-6)


def test_ogd_basis_is_capped_and_drops_dependent_directions(caplog):
    from cl_bench.methods.ogd import extend_basis

    e = torch.eye(4)
    basis, dropped = extend_basis(torch.zeros(0, 4), torch.stack([e[0], e[1], e[0] + 2 * e[1]]), cap=10)
    assert basis.shape == (2, 4) and dropped == 0  # the third is in the span of the first two
    basis, dropped = extend_basis(basis, torch.stack([e[0] + e[2], e[3], e[2] - e[3]]), cap=3)
    assert basis.shape == (3, 4) and dropped == 1
    assert torch.allclose(basis @ basis.T, torch.eye(3), atol=1e-6)

    method = make_method("ogd", lr=1e-2, max_per_task=3, max_basis=5)
    first, second = stages(2)
    optimizer = train_stage(method, first)
    assert len(method.basis) == 3  # 8 examples, 3 kept
    with caplog.at_level(logging.WARNING, logger="cl_bench.methods.ogd"):
        train_stage(method, second, optimizer=optimizer)
    assert len(method.basis) == 5 and "max_basis=5" in caplog.text
    assert torch.allclose(method.basis @ method.basis.T, torch.eye(5), atol=1e-5)


def test_ogd_basis_survives_state_dict():
    method = make_method("ogd", lr=1e-2)
    train_stage(method, stages(1)[0])
    buffer = io.BytesIO()
    torch.save(method.state_dict(), buffer)  # as the checkpoint does
    buffer.seek(0)
    fresh = make_method("ogd", lr=1e-2)
    assert len(fresh.basis) == 0
    fresh.load_state_dict(torch.load(buffer, weights_only=False))
    assert torch.equal(fresh.basis, method.basis) and fresh.basis.dtype == torch.float32
    fresh.model.load_state_dict(method.model.state_dict())
    for m in (method, fresh):
        m.model.eval()  # no dropout: both compute the same gradient
        m.model.zero_grad(set_to_none=True)
        m.loss(batch_of(m, make_task("other", 6)), 0)[0].backward()
        m.before_step(0)
    assert torch.equal(flat_grad(fresh), flat_grad(method))


def test_ogd_smoke_run(trace_dir, tmp_path):
    out = tmp_path / "runs"
    assert run_cli(*smoke_args(trace_dir, out, "--method", "ogd")) == 0
    record = complete_record(only_run(out))
    # basis_vectors: a key of the row (record v1) or of its "diagnostics" (v2, cl_bench/record.py)
    assert [p.get("diagnostics", p)["basis_vectors"] for p in record["params"]] == [8, 16, 24]  # 8 per task
    assert [p["trainable"] for p in record["params"]] == [LORA_SIZE] * 3
    assert record["method_args"]["max_per_task"] == 200
