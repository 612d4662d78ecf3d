"""OGD on the tiny Llama: the gradient projected off the stored basis, the basis cap,
its state dict, a CLI run; and the mechanism tests of the stored gradients (each
names, in its docstring, the mutation of the method it catches; the quantities it
checks are computed in the test from the model's parameters, not read back from
the method)."""
from __future__ import annotations

import io
import logging

import pytest
import torch

from cl_bench.models.modes import eval_mode
from helpers import (LORA_SIZE, answer_ce, batch_of, complete_record, distinct_stages, encode, make_method,
                     make_task, only_run, run_cli, run_steps, smoke_args, stages, train_stage)


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


@pytest.mark.slow
def test_ogd_smoke_run(trace_dir, tmp_path):
    out = tmp_path / "runs"
    assert run_cli(*smoke_args(trace_dir, out, "--method", "ogd")) == 0
    record = complete_record(only_run(out))
    # basis_vectors: a key of the row (record v1) or of its "diagnostics" (v2, cl_bench/record/schema.py)
    assert [p.get("diagnostics", p)["basis_vectors"] for p in record["params"]] == [8, 16, 24]  # 8 per task
    assert [p["trainable"] for p in record["params"]] == [LORA_SIZE] * 3
    assert record["method_args"]["max_per_task"] == 200


# ---- mechanisms ----------------------------------------------------------------

def adapter_of(method) -> list[torch.nn.Parameter]:
    """The LoRA parameters in the model's own order (the basis's coordinates)."""
    params = [p for n, p in method.model.named_parameters() if ".lora_" in n]
    assert len(params) == len(method.adapter) and all(a is b for a, b in zip(params, method.adapter))
    return params


def example_gradients(method, examples) -> torch.Tensor:
    """(m, n): per-example gradients of the answer CE w.r.t. the adapter, dropout off,
    at the model's current weights, computed by hand."""
    params = adapter_of(method)
    rows = []
    with eval_mode(method.model):
        for ex in examples:
            grads = torch.autograd.grad(answer_ce(method.model, encode(method, [ex])), params)
            rows.append(torch.cat([g.reshape(-1) for g in grads]).float())
    return torch.stack(rows)


def residual_off(basis: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """g minus its least-squares projection onto the row span of `basis` (no orthonormality assumed)."""
    coef = torch.linalg.lstsq(basis.T.double(), g.T.double()).solution  # (k, m)
    return (g.T.double() - basis.T.double() @ coef).T


def test_ogd_stores_the_tasks_own_example_gradients():
    """Catches: OGD's stored gradients replaced by random vectors (e.g.
    `grads = torch.randn_like(grads)` in after_task / task_gradients).

    After each task, every per-example gradient of that task's training
    examples, computed here at the weights the task ended with (dropout off),
    lies in the span of the stored basis: its projection residual is ~0.
    A basis of 6 random directions per task in 3584 leaves almost all of it."""
    method = make_method("ogd", lr=1e-2)
    optimizer = None
    expected_rows = 0
    for stage in distinct_stages(2):
        method.before_task(stage)
        optimizer = run_steps(method, stage, encode(method, stage.tasks[0].train[:4]), 3, optimizer)
        method.after_task(stage)
        grads = example_gradients(method, stage.tasks[0].train)  # at the end-of-task weights
        expected_rows += len(grads)
        assert method.basis.shape == (expected_rows, grads.shape[1])
        residual = residual_off(method.basis, grads)
        ratio = residual.norm(dim=1) / grads.norm(dim=1).double()
        assert grads.norm(dim=1).min() > 0
        assert ratio.max() < 1e-3, f"{stage.label}: stored basis misses its gradients, residual/‖g‖ {ratio.tolist()}"


def test_ogd_update_is_orthogonal_to_earlier_task_gradients():
    """Catches: OGD's stored gradients replaced by random vectors (the
    projection then removes directions unrelated to task 0).

    Task 0's per-example gradients G are computed here at the end of task 0.
    At every step of task 1, the gradient OGD hands to the optimiser (after
    before_step) has ⟨update, g⟩ ≈ 0 for every g in G, while the raw gradient
    of the same step does not; the update is the raw gradient with exactly its
    component in span(G) removed."""
    method = make_method("ogd", lr=1e-2)
    first, second = distinct_stages(2)
    method.before_task(first)
    optimizer = run_steps(method, first, encode(method, first.tasks[0].train[:4]), 3)
    method.after_task(first)
    earlier = example_gradients(method, first.tasks[0].train)  # (6, n)
    unit = earlier / earlier.norm(dim=1, keepdim=True)
    q, _ = torch.linalg.qr(earlier.double().T)  # (n, 6): an orthonormal basis of span(G), made here

    params = adapter_of(method)
    seen = []

    def check(step, loss, parts):
        applied = torch.cat([p.grad.reshape(-1) for p in params]).float()
        raw = torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, params)]).float()
        raw_cos = (unit @ raw) / raw.norm()
        cos = (unit @ applied) / applied.norm()
        assert raw_cos.abs().max() > 1e-2, "nothing to remove: the check would be vacuous"
        assert cos.abs().max() < 1e-4, f"step {step}: update not ⊥ task 0's gradients, cos {cos.tolist()}"
        off = raw.double() - q @ (q.T @ raw.double())
        torch.testing.assert_close(applied.double(), off, rtol=0, atol=1e-5 * raw.norm().item())
        seen.append(step)

    method.before_task(second)
    batch = encode(method, second.tasks[0].train[:4])
    optimizer = method.optimizer_for_stage(second, optimizer)
    for step in range(3):
        optimizer.zero_grad(set_to_none=True)
        method.model.eval()  # one forward for both gradients, so no dropout mask to match
        loss, parts = method.loss(batch, step)
        loss.backward(retain_graph=True)  # `check` differentiates it once more: the raw gradient
        method.before_step(step)
        check(step, loss, parts)
        optimizer.step()
        method.after_step(step)
    assert seen == [0, 1, 2]
