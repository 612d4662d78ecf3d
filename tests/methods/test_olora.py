"""O-LoRA (olora) on the tiny Llama: a LoRA pair per task, the orthogonality penalty
by hand, a CLI run and resume; and the mechanism tests of the penalty (each names, in
its docstring, the mutation of the method it catches; the quantities it checks are
computed in the test from the model's parameters, not read back from the method)."""
from __future__ import annotations

import re

import pytest
import torch

from cl_bench.record import io as results
from cl_bench.run import checkpoint
from cl_bench.models.loading import tiny_llama
from helpers import (LORA_SIZE, answer_ce, batch_of, complete_record, distinct_stages, encode, interrupted_run,
                     make_method, make_task, only_run, run_cli, run_steps, smoke_args, stages, train_stage)


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


@pytest.mark.slow
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
    assert checkpoint.load_checkpoint(run_dir)["method"] == {"n_pairs": 2}
    assert run_cli("run", "--resume", run_dir, "--no-progress") == 0
    resumed = complete_record(run_dir)
    assert resumed["matrix"] == expected["matrix"]
    assert resumed["params"] == expected["params"]
    assert results.read_jsonl(run_dir / "metrics.jsonl") == logged  # same losses, step for step


# ---- mechanisms ----------------------------------------------------------------

def lora_pairs(model) -> dict[str, dict[str, dict[int, torch.Tensor]]]:
    """{module: {"A": {k: A_k}, "B": {k: B_k}}} read from the model's parameter names."""
    found: dict = {}
    for name, p in model.named_parameters():
        m = re.fullmatch(r"(.+)\.lora_([AB])\.(\d+)", name)
        if m:
            found.setdefault(m[1], {"A": {}, "B": {}})[m[2]][int(m[3])] = p
    return found


def orth_by_hand(model) -> torch.Tensor:
    """Σ_modules Σ_{k<t} Σ_ij |(A_k A_tᵀ)_ij| for the newest pair t, entry by entry."""
    total = torch.zeros(())
    for pair in lora_pairs(model).values():
        t = max(pair["A"])
        for k in range(t):
            total = total + (pair["A"][k] @ pair["A"][t].T).abs().sum()
    return total


def l2_by_hand(model) -> torch.Tensor:
    total = torch.zeros(())
    for pair in lora_pairs(model).values():
        t = max(pair["A"])
        total = total + pair["A"][t].pow(2).sum().sqrt() + pair["B"][t].pow(2).sum().sqrt()
    return total


@pytest.mark.parametrize("lambda2", [0.0, 0.3])
def test_olora_loss_is_lm_plus_weighted_orthogonality(lambda2):
    """Catches: the orthogonality term removed from OLoRA.loss()
    (total = lm + λ2·l2, without + λ1·orth).

    At task 2 (pairs 0 and 1 trained and frozen, pair 2 new), the returned loss
    equals lm + λ1·orth (+ λ2·l2), with lm the answer cross-entropy and orth
    Σ_{k<2} ‖A_k A_2ᵀ‖₁ both computed here from the model; λ1·orth is a large
    share of the loss, so leaving it out is far outside the tolerance."""
    lambda1 = 0.7
    method = make_method("olora", lr=1e-2, lambda1=lambda1, lambda2=lambda2)
    plan = distinct_stages(3)
    optimizer = None
    for stage in plan[:2]:
        method.before_task(stage)
        optimizer = run_steps(method, stage, encode(method, stage.tasks[0].train[:4]), 2, optimizer)
        method.after_task(stage)
    method.before_task(plan[2])
    # Train pair 2 a little, so B_2 ≠ 0 and l2 covers both factors.
    optimizer = run_steps(method, plan[2], encode(method, plan[2].tasks[0].train[:4]), 2, optimizer)

    method.model.eval()  # no dropout: the loss is a function of the weights
    batch = encode(method, plan[2].tasks[0].train[:4])
    total, parts = method.loss(batch, 0)
    with torch.no_grad():
        lm = answer_ce(method.model, batch)
        orth = orth_by_hand(method.model)
        l2 = l2_by_hand(method.model)
    assert orth.item() > 1.0 and lambda1 * orth.item() > 0.2 * lm.item()  # the term matters
    expected = lm + lambda1 * orth + lambda2 * l2
    assert total.item() == pytest.approx(expected.item(), rel=1e-5), \
        f"loss {total.item()} != lm {lm.item()} + {lambda1}·orth {orth.item()} + {lambda2}·l2 {l2.item()}"
    assert parts["lm"] == pytest.approx(lm.item(), rel=1e-5)
    assert parts["orth"] == pytest.approx(orth.item(), rel=1e-5)
    # The term is in the graph: the gradient reaching A_2 includes λ1·∂orth/∂A_2.
    method.model.zero_grad(set_to_none=True)
    total.backward()
    newest = [pair["A"][2] for pair in lora_pairs(method.model).values()]
    with_orth = [a.grad.clone() for a in newest]
    method.model.zero_grad(set_to_none=True)
    (answer_ce(method.model, batch) + lambda2 * l2_by_hand(method.model)).backward()
    orth_grads = torch.autograd.grad(lambda1 * orth_by_hand(method.model), newest)
    for g, lm_g, o_g in zip(with_orth, [a.grad for a in newest], orth_grads):
        torch.testing.assert_close(g, lm_g + o_g, rtol=1e-4, atol=1e-6)


def test_olora_training_lowers_orthogonality_against_lambda1_zero():
    """Catches: the orthogonality term removed from OLoRA.loss() (or detached,
    so it adds to the value but sends no gradient).

    Two runs from the same seed on the same batches, λ1 = 0.5 and λ1 = 0:
    they are identical through task 0 (no earlier pair) and start task 1 at
    the same ‖A_0 A_1ᵀ‖₁; after task 1's steps, the λ1 > 0 run's orth
    (computed here from the model) is clearly below the λ1 = 0 run's.
    Without the term both runs are the same and the orths are equal."""
    first, second = distinct_stages(2)
    orth_start, orth_end = {}, {}
    for lambda1 in (0.5, 0.0):
        method = make_method("olora", lr=1e-3, lambda1=lambda1)
        torch.manual_seed(1)  # the same pair inits and dropout masks in both runs
        method.before_task(first)
        optimizer = run_steps(method, first, encode(method, first.tasks[0].train[:4]), 3)
        method.after_task(first)
        method.before_task(second)
        with torch.no_grad():
            orth_start[lambda1] = orth_by_hand(method.model).item()
        run_steps(method, second, encode(method, second.tasks[0].train[:4]), 8, optimizer)
        with torch.no_grad():
            orth_end[lambda1] = orth_by_hand(method.model).item()
    assert orth_start[0.5] == orth_start[0.0] > 0
    assert orth_end[0.5] < orth_start[0.5]
    assert orth_end[0.5] < 0.9 * orth_end[0.0], \
        f"orth after task 1: λ1=0.5 -> {orth_end[0.5]}, λ1=0 -> {orth_end[0.0]}"


def test_olora_lambda2_shrinks_the_new_pair_against_lambda2_zero():
    """Catches: O-LoRA's L2 term left out of the gradient (dropped from the loss,
    or detached), which its default λ2 = 0 never exercises.

    Two runs from the same seed on the same batches, λ2 = 1 and λ2 = 0 (λ1 = 0, so
    only the L2 term differs): after task 1's steps, ‖A_1‖_F + ‖B_1‖_F summed over
    the modules (computed here from the model) is clearly smaller with λ2 = 1."""
    first, second = distinct_stages(2)
    l2_end = {}
    for lambda2 in (1.0, 0.0):
        method = make_method("olora", lr=1e-2, lambda1=0.0, lambda2=lambda2)
        torch.manual_seed(1)  # the same pair inits and dropout masks in both runs
        method.before_task(first)
        optimizer = run_steps(method, first, encode(method, first.tasks[0].train[:4]), 2)
        method.after_task(first)
        method.before_task(second)
        run_steps(method, second, encode(method, second.tasks[0].train[:4]), 6, optimizer)
        with torch.no_grad():
            l2_end[lambda2] = l2_by_hand(method.model).item()
    assert l2_end[1.0] < 0.95 * l2_end[0.0], l2_end
