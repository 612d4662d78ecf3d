"""EWC, MoFO and LwF: reference equivalences, their terms by hand, and CLI runs."""
from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from cl_bench import registry, results
from cl_bench.config import resolve
from cl_bench.data import IGNORE, Encoder, collate
from cl_bench.method import MethodContext, Stage, lm_loss
from cl_bench.models.loading import tiny_llama
from conftest import interrupted_run, make_trace, only_run, run_cli, smoke_args

TWO_TASKS = ("--order", "NumGLUE-cm,Py150")


# ---- helpers ------------------------------------------------------------------


def record(run_dir: Path) -> dict:
    return json.loads((run_dir / "run.json").read_text())


def metric(run_dir: Path, key: str, stage: int | None = None) -> list[float]:
    return [r[key] for r in results.read_jsonl(run_dir / "metrics.jsonl")
            if stage is None or r["stage"] == stage]


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return results.load_checkpoint(run_dir)["model"]


def task(*pairs: tuple[str, str]):
    return SimpleNamespace(name="t", train=[SimpleNamespace(prompt=p, answer=a) for p, a in pairs])


TASK_A = task(("Question:\n1 plus 2?\nAnswer:", "3"), ("Question:\n4 plus 4?\nAnswer:", "8"))
TASK_B = task(("<s> def f(x):<EOL>", "return x"), ("<s> y = 2<EOL>", "print(y)"))


def make(name: str, n_tasks: int = 3, **args):
    """A method on the tiny model with the smoke profile's config, set up."""
    model, tokenizer, _ = tiny_llama(0)
    config = resolve("smoke", None, {"method": name})
    ctx = MethodContext(config=config, device=torch.device("cpu"), tokenizer=tokenizer,
                        all_tasks=[TASK_A] * n_tasks, encoder=Encoder.from_config(tokenizer, config.train),
                        n_stages=n_tasks)
    cls = registry.get(name)
    method = cls(cls.parse_args(args), ctx)
    method.setup(model)
    return method


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


def batch_of(method, t) -> dict[str, torch.Tensor]:
    return collate([method.ctx.encoder.train_example(e.prompt, e.answer) for e in t.train], method.ctx.pad_id)


@pytest.fixture(scope="module")
def seqft_two_tasks(tmp_path_factory) -> Path:
    """One SeqFT run over two smoke tasks, kept checkpoint: the λ = 0 reference."""
    root = tmp_path_factory.mktemp("seqft")
    trace = make_trace(root / "trace")
    assert run_cli(*smoke_args(trace, root / "out", *TWO_TASKS, "--keep-checkpoint")) == 0
    return only_run(root / "out")


def assert_same_as_seqft(run_dir: Path, seqft: Path) -> None:
    assert metric(run_dir, "lm") == metric(seqft, "lm")  # exact, step for step
    assert len(set(metric(seqft, "lm"))) > 1  # it trained
    assert record(run_dir)["matrix"] == record(seqft)["matrix"]
    ours, theirs = final_weights(run_dir), final_weights(seqft)
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)


# ---- EWC ----------------------------------------------------------------------
def test_ewc_with_zero_lambda_is_seqft(seqft_two_tasks, tmp_path):
    """λ = 0: the Fisher pass and the (zero) penalty gradient change nothing."""
    trace = make_trace(tmp_path / "trace")
    out = tmp_path / "ewc"
    assert run_cli(*smoke_args(trace, out, *TWO_TASKS, "--keep-checkpoint", "--method", "ewc",
                               "--method-arg", "lambda_ewc=0")) == 0
    run_dir = only_run(out)
    assert_same_as_seqft(run_dir, seqft_two_tasks)
    assert metric(run_dir, "ewc") == [0.0] * len(metric(run_dir, "ewc"))


def test_ewc_penalty_is_zero_at_the_anchor_and_quadratic_away_from_it():
    m = make("ewc", lambda_ewc=3.0)
    name, p = next((n, p) for n, p in m.model.named_parameters() if p.dim() == 2)
    fisher = torch.zeros_like(p)
    fisher.view(-1)[:3] = 2.0  # F = 2 on three entries, 0 elsewhere
    m.fisher, m.anchor = {name: fisher}, {name: p.detach().clone()}
    assert m.penalty().item() == 0.0
    with torch.no_grad():
        p.view(-1)[:5] += 0.5  # two of the moved entries have F = 0
    # (λ/2)·Σ F δ² = 1.5 · 3 · 2 · 0.25
    assert m.penalty().item() == pytest.approx(2.25, rel=1e-6)
    with torch.no_grad():
        p.view(-1)[:5] += 0.5  # twice as far: four times the penalty
    assert m.penalty().item() == pytest.approx(9.0, rel=1e-6)


def test_ewc_adds_exactly_the_penalty_gradient_before_the_step():
    m = make("ewc", lambda_ewc=5.0)
    params = dict(m.model.named_parameters())
    gen = torch.Generator().manual_seed(0)
    m.fisher = {n: torch.rand(p.shape, generator=gen) for n, p in params.items()}
    m.anchor = {n: p.detach() + 0.1 * torch.randn(p.shape, generator=gen) for n, p in params.items()}
    batch = batch_of(m, TASK_A)
    loss, parts = m.loss(batch, 0)
    assert set(parts) == {"lm", "ewc"} and parts["ewc"] > 0
    assert loss.item() == pytest.approx(parts["lm"] + parts["ewc"], rel=1e-6)
    loss.backward()
    lm_grads = {n: p.grad.clone() for n, p in params.items()}
    expected = torch.autograd.grad(m.penalty(), list(params.values()))
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


def test_ewc_runs_and_resumes_to_the_same_matrix(trace_dir, tmp_path, monkeypatch):
    straight = tmp_path / "straight"
    assert run_cli(*smoke_args(trace_dir, straight, "--method", "ewc")) == 0
    expected_dir = only_run(straight)
    expected = record(expected_dir)
    assert expected["status"] == "complete" and expected["method_args"]["lambda_ewc"] == 1e6
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


# ---- MoFO ---------------------------------------------------------------------
def mofo_optimizer(params, **kw):
    from cl_bench.methods.mofo import MomentumFilteredAdam

    return MomentumFilteredAdam(params, **kw)


def fresh_params(seed: int = 0) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    shapes = [(7, 13), (3, 5, 4), (11,)]
    return [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]


def set_grads(params, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)


def test_mofo_moves_exactly_floor_alpha_entries_of_each_matrix():
    params = fresh_params()
    opt = mofo_optimizer(params, lr=1e-2, alpha=0.15)
    for step in range(3):
        before = [p.detach().clone() for p in params]
        set_grads(params, seed=step)
        opt.step()
        moved = [int((p.detach() != b).sum()) for p, b in zip(params, before)]
        assert moved == [math.floor(0.15 * 91), math.floor(0.15 * 60), 11]
        for p in params:  # moments updated everywhere, not only where weights moved
            assert (opt.state[p]["exp_avg"] != 0).all() and (opt.state[p]["exp_avg_sq"] != 0).all()
    # After one step m = (1 − β1)·g, so the moved entries are those of largest |g|.
    params = fresh_params()
    opt = mofo_optimizer(params, lr=1e-2, alpha=0.15)
    before = params[0].detach().clone()
    set_grads(params, seed=7)
    top = params[0].grad.abs().flatten().topk(13).indices
    opt.step()
    moved = (params[0].detach() != before).flatten().nonzero().flatten()
    assert sorted(moved.tolist()) == sorted(top.tolist())


def test_mofo_ties_at_the_threshold_move_no_more_than_the_fraction():
    params = fresh_params()
    opt = mofo_optimizer(params, lr=1e-2, alpha=0.15)
    before = [p.detach().clone() for p in params]
    for p in params:
        p.grad = torch.ones_like(p)  # every |m| ties
    opt.step()
    assert [int((p.detach() != b).sum()) for p, b in zip(params, before)] == [13, 9, 11]


def test_mofo_with_alpha_one_is_adam_exactly():
    ours, ref = fresh_params(), fresh_params()
    opt = mofo_optimizer(ours, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, alpha=1.0)
    adam = torch.optim.Adam(ref, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, foreach=False)
    for step in range(5):
        set_grads(ours, step)
        set_grads(ref, step)
        opt.step()
        adam.step()
        for a, b in zip(ours, ref):
            assert torch.equal(a, b)
            assert torch.equal(opt.state[a]["exp_avg_sq"], adam.state[b]["exp_avg_sq"])
    assert not torch.equal(ours[0], fresh_params()[0])


def test_mofo_state_round_trips_through_state_dict(tmp_path):
    params = fresh_params()
    opt = mofo_optimizer(params, lr=1e-2, alpha=0.3)
    for step in range(2):
        set_grads(params, step)
        opt.step()
    torch.save(opt.state_dict(), tmp_path / "opt.pt")
    twin = [torch.nn.Parameter(p.detach().clone()) for p in params]
    restored = mofo_optimizer(twin, lr=1.0, alpha=0.9)  # hyperparameters come back too
    restored.load_state_dict(torch.load(tmp_path / "opt.pt", weights_only=False))
    assert restored.param_groups[0]["alpha"] == 0.3 and restored.param_groups[0]["lr"] == 1e-2
    set_grads(params, 9)
    set_grads(twin, 9)
    opt.step()
    restored.step()
    for a, b in zip(params, twin):
        assert torch.equal(a, b)
        assert restored.state[b]["step"] == 3


def test_mofo_runs_end_to_end(trace_dir, tmp_path):
    out = tmp_path / "runs"
    assert run_cli(*smoke_args(trace_dir, out, "--method", "mofo")) == 0
    rec = record(only_run(out))
    assert rec["status"] == "complete"
    assert rec["method_args"]["alpha"] == 0.15 and rec["method_args"]["beta2"] == 0.999
    assert all(v is not None for b, row in enumerate(rec["matrix"]) for v in row[:b + 1])


# ---- LwF ----------------------------------------------------------------------
def test_lwf_with_zero_lambda_is_seqft(seqft_two_tasks, tmp_path):
    trace = make_trace(tmp_path / "trace")
    out = tmp_path / "lwf"
    assert run_cli(*smoke_args(trace, out, *TWO_TASKS, "--keep-checkpoint", "--method", "lwf",
                               "--method-arg", "lambda_kl=0")) == 0
    run_dir = only_run(out)
    assert_same_as_seqft(run_dir, seqft_two_tasks)
    assert metric(run_dir, "kl", 0) == [0.0, 0.0]
    assert metric(run_dir, "kl", 1)[0] == 0.0  # teacher = student before the first step
    assert metric(run_dir, "kl", 1)[1] > 0  # the teacher really ran


def test_lwf_kl_is_zero_for_the_teacher_itself_and_grows_after_a_step():
    m = make("lwf")
    batch = batch_of(m, TASK_A)
    m.before_task(Stage(0, [TASK_A], "a"))
    assert m.teacher is None and m.loss(batch, 0)[1]["kl"] == 0.0
    m.before_task(Stage(1, [TASK_B], "b"))  # teacher = the model as it is now
    teacher = {n: p.detach().clone() for n, p in m.teacher.named_parameters()}
    loss, parts = m.loss(batch, 0)
    assert set(parts) == {"lm", "kl"} and parts["kl"] == 0.0
    sgd = torch.optim.SGD(m.model.parameters(), lr=0.5)
    loss.backward()
    sgd.step()
    sgd.zero_grad()
    loss, parts = m.loss(batch, 1)
    assert parts["kl"] > 0
    assert loss.item() == pytest.approx(parts["lm"] + parts["kl"], rel=1e-6)  # λ = 1
    loss.backward()  # the teacher is frozen: no gradient, unchanged weights
    for n, p in m.teacher.named_parameters():
        assert p.grad is None and torch.equal(p, teacher[n])


def test_lwf_kl_counts_only_answer_positions():
    gen = torch.Generator().manual_seed(0)
    B, L, V, T = 2, 6, 5, 2.0
    student = torch.randn(B, L, V, generator=gen)
    teacher = torch.randn(B, L, V, generator=gen)
    # Row 0: prompt 0..2, answer 3..4, padding 5. Row 1: prompt 0..3, answer 4..5.
    labels = torch.full((B, L), IGNORE)
    labels[0, 3:5] = 1
    labels[1, 4:] = 2
    from cl_bench.distillation import distillation_kl

    value = distillation_kl(student, teacher, labels, T)
    # By hand: positions (0,2), (0,3), (1,3), (1,4) predict answer tokens.
    p = torch.softmax(teacher / T, -1)
    q = torch.softmax(student / T, -1)
    kl = (p * (p.log() - q.log())).sum(-1)  # (B, L)
    expected = T ** 2 * (kl[0, 2] + kl[0, 3] + kl[1, 3] + kl[1, 4]) / 4
    assert value.item() == pytest.approx(expected.item(), rel=1e-5)
    # Prompt positions, the last answer token's position (it predicts padding) and padding:
    for b, i in [(0, 0), (0, 1), (0, 4), (0, 5), (1, 0), (1, 2), (1, 5)]:
        changed = teacher.clone()
        changed[b, i] += 3 * torch.randn(V, generator=gen)
        assert distillation_kl(student, changed, labels, T).item() == value.item()
    changed = teacher.clone()
    changed[1, 3] += 3 * torch.randn(V, generator=gen)
    assert distillation_kl(student, changed, labels, T).item() != value.item()
    assert distillation_kl(teacher, teacher, labels, T).item() == 0.0


def test_lwf_runs_end_to_end(trace_dir, tmp_path):
    out = tmp_path / "runs"
    assert run_cli(*smoke_args(trace_dir, out, "--method", "lwf")) == 0
    run_dir = only_run(out)
    rec = record(run_dir)
    assert rec["status"] == "complete"
    assert rec["method_args"]["lambda_kl"] == 1.0 and rec["method_args"]["temperature"] == 2.0
    assert metric(run_dir, "kl", 0) == [0.0, 0.0]
    assert metric(run_dir, "kl", 2)[-1] > 0
    # From task 1 on the frozen teacher is held beside the model.
    assert rec["params"][1]["total"] == 2 * rec["params"][0]["total"]
