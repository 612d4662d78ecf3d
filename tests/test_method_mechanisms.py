"""Mechanism tests: each one fails when the mechanism it names is removed.

"A test that passes with the mechanism removed is not a test of it." Every test
here names, in its docstring, the mutation of the method code it catches; the
quantities it checks (losses, penalties, gradients, weights) are computed in
the test, from the model's parameters, not read back from the method.

Tiny random Llama (2 layers, width 64), hand-sized batches, a few steps each.
"""
from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

from cl_bench.data import IGNORE, collate
from cl_bench.method import Stage
from cl_bench.models.modes import eval_mode
from helpers import make_method, make_task

# ---- helpers (make_task, make_method: tests/helpers.py) ------------------------


def encode(method, examples) -> dict[str, torch.Tensor]:
    encoder = method.ctx.encoder
    return collate([encoder.train_example(e.prompt, e.answer) for e in examples], method.ctx.pad_id)


def stages(n: int) -> list[Stage]:
    # Different examples per task, so each task's gradients are its own.
    return [Stage(i, [make_task(f"task{i}", n=6, offset=10 * i)], f"task{i}") for i in range(n)]


def answer_ce(model, batch) -> torch.Tensor:
    """Causal-LM cross-entropy by hand: mean over the positions whose next label is not IGNORE."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                   use_cache=False).logits  # (B, L, V)
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), batch["labels"][:, 1:].flatten(),
                           ignore_index=IGNORE)


def run_steps(method, stage: Stage, batch, n_steps: int, optimizer=None, on_step=None):
    """The backend's per-step hook order on one fixed batch (no before/after_task)."""
    optimizer = method.optimizer_for_stage(stage, optimizer)
    for step in range(n_steps):
        optimizer.zero_grad(set_to_none=True)
        loss, parts = method.loss(batch, step)
        loss.backward()
        method.before_step(step)
        if on_step is not None:
            on_step(step, loss, parts)
        optimizer.step()
        method.after_step(step)
    return optimizer


# ---- O-LoRA --------------------------------------------------------------------

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
    plan = stages(3)
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
    first, second = stages(2)
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


# ---- OGD -----------------------------------------------------------------------

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
    for stage in stages(2):
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
    first, second = stages(2)
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


# ---- LwF -----------------------------------------------------------------------

def weights(module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def test_lwf_teacher_is_refreshed_at_every_stage():
    """Catches: LwF keeping the teacher made for task 1 and never refreshing it
    (e.g. `if self.teacher is not None: return` in before_task).

    Over three stages: at the start of stages 1 and 2 the teacher's weights
    equal the model's as they were at the end of the previous stage (a copy,
    not the live model), and stay so while the stage trains; the model really
    moved in stage 1, so the stage-1 teacher would not match stage 2's."""
    method = make_method("lwf", lr=1e-3)
    optimizer = None
    end_of: dict[int, dict[str, torch.Tensor]] = {}
    for stage in stages(3):
        method.before_task(stage)
        if stage.index == 0:
            assert method.teacher is None
        else:
            teacher = weights(method.teacher)
            previous = end_of[stage.index - 1]
            assert teacher.keys() == previous.keys()
            stale = [k for k in previous if not torch.equal(teacher[k], previous[k])]
            assert not stale, f"stage {stage.index}: teacher differs from the end of stage " \
                              f"{stage.index - 1} in {len(stale)} tensors, e.g. {stale[0]}"
            live = {p.data_ptr() for p in method.model.parameters()}
            assert not any(p.data_ptr() in live for p in method.teacher.parameters())
            if stage.index >= 2:  # the previous stage moved the model
                assert any(not torch.equal(end_of[stage.index - 1][k], end_of[stage.index - 2][k])
                           for k in previous)
        optimizer = run_steps(method, stage, encode(method, stage.tasks[0].train[:4]), 3, optimizer)
        method.after_task(stage)
        end_of[stage.index] = weights(method.model)
        if stage.index > 0:  # frozen through the stage
            assert all(torch.equal(v, end_of[stage.index - 1][k]) for k, v in weights(method.teacher).items())


def test_lwf_kl_is_zero_at_the_first_step_of_every_stage():
    """Catches: LwF keeping the teacher made for task 1 and never refreshing it
    (at stage 2 the teacher is then the end of stage 0, the student the end of
    stage 1, and the first KL is large).

    The logged T²·KL at step 0 of stages 1 and 2 is 0 (teacher = student at a
    stage's start) and > 0 once the stage has taken a step; a KL computed here
    from the teacher's and the student's logits agrees with the logged one."""
    method = make_method("lwf", lr=1e-3)
    optimizer = None
    kls: dict[int, list[float]] = {}
    for stage in stages(3):
        method.before_task(stage)
        batch = encode(method, stage.tasks[0].train[:4])
        record = kls.setdefault(stage.index, [])

        def log(step, loss, parts, batch=batch, record=record):
            record.append(parts["kl"])
            if method.teacher is not None:
                with torch.no_grad():  # the KL by hand, answer positions only
                    student = method.model(input_ids=batch["input_ids"],
                                           attention_mask=batch["attention_mask"]).logits
                    teacher = method.teacher(input_ids=batch["input_ids"],
                                             attention_mask=batch["attention_mask"]).logits
                T = method.args.temperature
                answer = batch["labels"][:, 1:] != IGNORE
                p = torch.softmax(teacher[:, :-1][answer].double() / T, -1)
                q = torch.log_softmax(student[:, :-1][answer].double() / T, -1)
                by_hand = T ** 2 * (p * (p.log() - q)).sum(-1).mean()
                assert parts["kl"] == pytest.approx(by_hand.item(), rel=1e-4, abs=1e-6)

        method.model.eval()  # no dropout anywhere: the student's logits are a function of its weights
        optimizer = run_steps(method, stage, batch, 3, optimizer, on_step=log)
        method.after_task(stage)
    assert kls[0] == [0.0, 0.0, 0.0]  # no teacher in task 0
    for s in (1, 2):
        assert kls[s][0] == pytest.approx(0.0, abs=1e-6), f"stage {s}: first-step KL {kls[s][0]} != 0"
        assert kls[s][1] > 1e-4, f"stage {s}: the teacher did not run ({kls[s]})"
