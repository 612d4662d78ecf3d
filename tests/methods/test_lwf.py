"""LwF: the λ = 0 reference equivalence, the KL term by hand, CLI runs, and the
mechanism tests of the teacher (each names the mutation of the method it catches;
tiny random Llama, hand-sized batches, a few steps each)."""
from __future__ import annotations

import pytest
import torch

from cl_bench.data.encode import IGNORE
from cl_bench.method import Stage
from helpers import (TASK_A, TASK_B, TWO_TASKS, answer_ce, assert_same_as_seqft, distinct_stages, encode, make,
                     make_method, make_trace, metric, only_run, record, run_cli, run_steps, smoke_args)

# The λ = 0 reference run, seqft_two_tasks: tests/methods/conftest.py.


@pytest.mark.slow
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
    batch = encode(m, TASK_A.train)
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
    from cl_bench.losses import distillation_kl

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


@pytest.mark.slow
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


# ---- mechanisms ----------------------------------------------------------------

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
    for stage in distinct_stages(3):
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
    for stage in distinct_stages(3):
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


def test_lwf_gradient_includes_lambda_times_the_kl_gradient():
    """Catches: the distillation term detached (`kl.detach()` in LwF.loss): it still
    adds to the loss's value, but sends no gradient, so LwF trains as SeqFT.

    At stage 1, after two steps (so the student has left the teacher and ∂KL ≠ 0),
    the gradient of the method's loss equals ∂CE + λ·∂KL, both computed here: CE by
    hand, and T²·KL(p_teacher ‖ p_student) in float64 from the two models' logits on
    the answer positions. λ·∂KL is a sizeable share of the whole gradient, far
    beyond the tolerance, so a loss without it fails."""
    lam = 2.0
    method = make_method("lwf", lr=1e-2, lambda_kl=lam)
    first, second = distinct_stages(2)
    method.before_task(first)
    optimizer = run_steps(method, first, encode(method, first.tasks[0].train[:4]), 2)
    method.after_task(first)
    method.before_task(second)
    batch = encode(method, second.tasks[0].train[:4])
    run_steps(method, second, batch, 2, optimizer)

    method.model.eval()  # no dropout: the loss is a function of the weights
    params = [p for p in method.model.parameters() if p.requires_grad]
    loss, parts = method.loss(batch, 2)
    got = torch.autograd.grad(loss, params)

    T = method.args.temperature
    answer = batch["labels"][:, 1:] != IGNORE
    student = method.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    with torch.no_grad():
        teacher = method.teacher(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    p = torch.softmax(teacher[:, :-1][answer].double() / T, -1)
    log_q = torch.log_softmax(student[:, :-1][answer].double() / T, -1)
    kl = T ** 2 * (p * (p.log() - log_q)).sum(-1).mean()
    assert parts["kl"] == pytest.approx(kl.item(), rel=1e-4) and kl.item() > 1e-3
    kl_grad = torch.autograd.grad(kl, params, retain_graph=True)
    ce_grad = torch.autograd.grad(answer_ce(method.model, batch), params)
    flat = lambda gs: torch.cat([g.reshape(-1).double() for g in gs])  # noqa: E731
    expected, distil = flat(ce_grad) + lam * flat(kl_grad), lam * flat(kl_grad)
    assert distil.norm() > 0.05 * expected.norm()  # the term matters
    torch.testing.assert_close(flat(got), expected, rtol=1e-4, atol=1e-4 * float(expected.abs().max()))
