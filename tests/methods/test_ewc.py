"""EWC: the λ = 0 reference equivalence, its penalty and Fisher by hand, and CLI runs."""
from __future__ import annotations

import pytest
import torch

from cl_bench.data.encode import IGNORE, collate
from cl_bench.method import Stage, lm_loss
from helpers import (TASK_A, TASK_B, TWO_TASKS, assert_same_as_seqft, encode, interrupted_run, make, make_trace,
                     metric, only_run, record, run_cli, smoke_args, task)

# The λ = 0 reference run, seqft_two_tasks: tests/methods/conftest.py.


def answer_nll_by_hand(model, row: dict[str, list[int]]) -> torch.Tensor:
    """−log p(answer + EOS | prompt) of one unpadded row: the sum over its answer tokens."""
    ids = torch.tensor([row["input_ids"]])
    logp = model(input_ids=ids).logits[0].float().log_softmax(-1)  # (T, V)
    return -sum(logp[k - 1, tok] for k, (tok, lab) in enumerate(zip(row["input_ids"], row["labels"]))
                if lab != IGNORE)


def squared_grads(model, loss: torch.Tensor) -> dict[str, torch.Tensor]:
    named = list(model.named_parameters())
    return {n: g.square() for (n, _), g in zip(named, torch.autograd.grad(loss, [p for _, p in named]))}


def assert_near(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal up to fp32 rounding: 1e-4 relative, entries near 0 against the tensor's scale."""
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-6 * float(expected.abs().max()))


@pytest.mark.slow
def test_ewc_with_zero_lambda_is_seqft(seqft_two_tasks, tmp_path):
    """λ = 0: the Fisher pass and the (zero) penalty gradient change nothing."""
    trace = make_trace(tmp_path / "trace")
    out = tmp_path / "ewc"
    assert run_cli(*smoke_args(trace, out, *TWO_TASKS, "--keep-checkpoint", "--method", "ewc",
                               "--method-arg", "lambda_ewc=0")) == 0
    run_dir = only_run(out)
    assert_same_as_seqft(run_dir, seqft_two_tasks)
    assert metric(run_dir, "ewc") == [0.0] * len(metric(run_dir, "ewc"))


def penalty_by_hand(m) -> torch.Tensor:
    """(λ/2) Σ F (θ − θ*)² over the whole parameters, differentiable."""
    params = dict(m.model.named_parameters())
    return 0.5 * m.args.lambda_ewc * sum((f * (params[n] - m.anchor[n]).square()).sum() for n, f in m.fisher.items())


def test_ewc_penalty_is_zero_at_the_anchor_and_quadratic_away_from_it():
    m = make("ewc", lambda_ewc=3.0)
    name, p = next((n, p) for n, p in m.model.named_parameters() if p.dim() == 2)
    fisher = torch.zeros_like(p)
    fisher.view(-1)[:3] = 2.0  # F = 2 on three entries, 0 elsewhere
    m.fisher, m.anchor = {name: fisher}, {name: p.detach().clone()}
    assert m.penalty_value().item() == 0.0
    with torch.no_grad():
        p.view(-1)[:5] += 0.5  # two of the moved entries have F = 0
    # (λ/2)·Σ F δ² = 1.5 · 3 · 2 · 0.25
    assert m.penalty_value().item() == pytest.approx(2.25, rel=1e-6)
    with torch.no_grad():
        p.view(-1)[:5] += 0.5  # twice as far: four times the penalty
    assert m.penalty_value().item() == pytest.approx(9.0, rel=1e-6)


def test_ewc_adds_exactly_the_penalty_gradient_before_the_step():
    m = make("ewc", lambda_ewc=5.0)
    params = dict(m.model.named_parameters())
    gen = torch.Generator().manual_seed(0)
    m.fisher = {n: torch.rand(p.shape, generator=gen) for n, p in params.items()}
    m.anchor = {n: p.detach() + 0.1 * torch.randn(p.shape, generator=gen) for n, p in params.items()}
    batch = encode(m, TASK_A.train)
    loss, parts = m.loss(batch, 0)
    assert set(parts) == {"lm", "ewc"} and parts["ewc"] > 0
    assert loss.item() == pytest.approx(parts["lm"] + parts["ewc"], rel=1e-6)
    loss.backward()
    lm_grads = {n: p.grad.clone() for n, p in params.items()}
    expected = torch.autograd.grad(penalty_by_hand(m), list(params.values()))
    m.before_step(0)
    for (n, p), g in zip(params.items(), expected):
        torch.testing.assert_close(p.grad, lm_grads[n] + g)


def test_ewc_fisher_is_per_example_nonnegative_and_accumulates():
    m = make("ewc", gamma=0.5, fisher_examples=2)
    stage0, stage1, last = Stage(0, [TASK_A], "a"), Stage(1, [TASK_B], "b"), Stage(2, [TASK_A], "c")
    params = dict(m.model.named_parameters())

    # F_new is the mean of per-example squared gradients, not the square of the mean.
    enc = m.ctx.encoder
    by_hand = {n: torch.zeros_like(p) for n, p in params.items()}
    for e in TASK_A.train:
        for n, g2 in squared_grads(m.model, answer_nll_by_hand(m.model, enc.train_example(e.prompt, e.answer))).items():
            by_hand[n] += g2 / 2
    m.after_task(stage0)
    f0 = {n: f.clone() for n, f in m.fisher.items()}
    assert f0.keys() == params.keys()
    for n in params:
        torch.testing.assert_close(f0[n], by_hand[n])
        assert (f0[n] >= 0).all() and f0[n].dtype == torch.float32
        assert torch.equal(m.anchor[n], params[n].detach())
    assert sum(bool((f > 0).any()) for f in f0.values()) > len(f0) // 2

    with torch.no_grad():  # as if task 1 trained
        for p in params.values():
            p.add_(0.01)
    fresh = m.fisher_of(stage1)
    m.after_task(stage1)
    for n in params:
        torch.testing.assert_close(m.fisher[n], 0.5 * f0[n] + fresh[n])
        assert torch.equal(m.anchor[n], params[n].detach())
    assert any(not torch.equal(fresh[n], f0[n]) for n in params)

    before = {n: f.clone() for n, f in m.fisher.items()}
    m.after_task(last)  # nothing left to protect: F stays
    assert all(torch.equal(before[n], m.fisher[n]) for n in params)


def test_ewc_fisher_is_the_squared_gradient_of_the_answers_log_likelihood():
    """F_new of one example = (∂/∂θ Σ_k −log p(y_k))², summed over its L answer tokens:
    L² times the square of the per-token mean's gradient (the old F, whose weight on an
    example shrank as 1/L²); a Fisher batch takes the mean of its examples' sums."""
    m = make("ewc")
    enc = m.ctx.encoder
    prompt = "Question:\n3 plus 4?\nAnswer:"
    short, long = (task((prompt, answer)) for answer in ("7", "7" * 7))
    rows = [enc.train_example(prompt, t.train[0].answer) for t in (short, long)]
    lengths = [sum(lab != IGNORE for lab in r["labels"]) for r in rows]
    assert lengths == [2, 8]  # byte tokens + EOS
    for t, row, L in zip((short, long), rows, lengths):
        fisher = m.fisher_of(Stage(0, [t], "t"))
        by_hand = squared_grads(m.model, answer_nll_by_hand(m.model, row))
        mean = squared_grads(m.model, lm_loss(m.model, collate([row], m.ctx.tokenizer.pad_token_id)))
        assert fisher.keys() == by_hand.keys()
        for n in by_hand:
            assert_near(fisher[n], by_hand[n])
            assert_near(fisher[n], L ** 2 * mean[n])
    # Both in one Fisher batch (right padding): (∂ (ℓ_short + ℓ_long)/2)².
    m.args.fisher_batch_size = 2
    both = task((prompt, "7"), (prompt, "7" * 7))
    fisher = m.fisher_of(Stage(0, [both], "t"))
    half = (answer_nll_by_hand(m.model, rows[0]) + answer_nll_by_hand(m.model, rows[1])) / 2
    for n, g2 in squared_grads(m.model, half).items():
        assert_near(fisher[n], g2)


@pytest.mark.slow
def test_ewc_runs_and_resumes_to_the_same_matrix(trace_dir, tmp_path, monkeypatch):
    straight = tmp_path / "straight"
    assert run_cli(*smoke_args(trace_dir, straight, "--method", "ewc")) == 0
    expected_dir = only_run(straight)
    expected = record(expected_dir)
    assert expected["status"] == "complete" and expected["method_args"]["lambda_ewc"] == 1e4
    assert metric(expected_dir, "ewc", 0) == [0.0, 0.0]
    for stage in (1, 2):  # each stage starts at its anchor, then moves away from it
        assert [v > 0 for v in metric(expected_dir, "ewc", stage)] == [False, True]

    broken = tmp_path / "broken"
    run_dir = interrupted_run(monkeypatch, *smoke_args(trace_dir, broken, "--method", "ewc"), at_stage=2)
    assert record(run_dir)["stages_done"] == 2
    assert run_cli("run", "--resume", run_dir, "--no-progress") == 0
    resumed = record(run_dir)
    assert resumed["status"] == "complete"
    assert resumed["matrix"] == expected["matrix"]
    # The resumed stage saw the saved F and θ*: same penalty and losses, step for step.
    assert metric(run_dir, "ewc") == metric(expected_dir, "ewc")
    assert metric(run_dir, "lm") == metric(expected_dir, "lm")
