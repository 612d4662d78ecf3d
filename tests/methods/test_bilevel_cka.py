"""bilevel-cka on the tiny Llama (2 layers, width 64, FFN 128: K = 8 slices of h = 16):
the straight-through mask, the supernet, the clones' training, the CKA gradient and
the outer step (Expand / Recycle, the schedule and runs: test_bilevel_cka_decisions.py)."""
from __future__ import annotations

import copy
import math

import pytest
import torch

from cl_bench.data.encode import collate
from cl_bench.method import Stage
from cl_bench.methods.bilevel_cka import BilevelCKAArgs, mask_schedule, straight_through_gumbel
from cl_bench.methods.bilevel_cka.search import LayerFeatures
from helpers import answer_ce
from bilevel_cka_setup import K, batch, clone_params, logits, make, task_loss, train


# ---- pieces ----------------------------------------------------------------------------

def test_straight_through_mask_is_one_hot_forward_with_gradient_to_the_logits():
    alpha = torch.randn(2, K, 2, generator=torch.Generator().manual_seed(0)).requires_grad_()
    y = straight_through_gumbel(alpha, 1.0, torch.Generator().manual_seed(1))
    assert set(y.detach().unique().tolist()) <= {0.0, 1.0}
    assert torch.equal(y.detach().sum(-1), torch.ones(2, K))  # exactly one-hot
    (y[..., 1] * torch.arange(1.0, 2 * K + 1).reshape(2, K)).sum().backward()
    assert alpha.grad.abs().min() > 0
    # the hard sample does not depend on tau (only its gradient does)
    cold = straight_through_gumbel(alpha.detach(), 0.1, torch.Generator().manual_seed(1))
    assert torch.equal(cold, y.detach())
    # the expand side is drawn with probability sigmoid(alpha_e - alpha_r): 0.6 at the prior
    prior = torch.zeros(20000, 2)
    prior[:, 1] = math.log(0.6 / 0.4)
    share = straight_through_gumbel(prior, 5.0, torch.Generator().manual_seed(2))[:, 1].mean()
    assert float(share) == pytest.approx(0.6, abs=0.02)


@pytest.mark.parametrize("steps,every,updates", [(2, 1, 2), (8, 2, 4), (785, 10, 78), (20000, 10, 2000)])
def test_tau_reaches_its_floor_within_a_task(steps, every, updates):
    a = BilevelCKAArgs()
    n, u, rho = mask_schedule(steps, a)
    assert (n, u) == (every, updates)
    assert max(a.tau_final, a.tau0 * rho ** u) == pytest.approx(a.tau_final)
    if steps == 20000:
        assert rho == a.tau_decay  # enough updates: rho as given
    else:
        assert rho < a.tau_decay  # derived from the step count
    assert mask_schedule(8, BilevelCKAArgs(min_mask_updates=0))[:2] == (10, 0)  # N kept: no update
    assert mask_schedule(None, a) == (10, None, 0.995)


@pytest.mark.slow  # over ~1 s (pyproject.toml's marker)
def test_the_supernet_is_the_pre_task_model_with_masks_at_zero_while_clones_train():
    method, model = make(mask_every=1000)
    b = batch(7)
    before = logits(model, b)
    stage = Stage(1, [], "task 1")
    method.before_task(stage)
    ones, zeros = torch.ones(2, K), torch.zeros(2, K)
    torch.testing.assert_close(logits(model, b, method, zeros), before, rtol=0, atol=1e-6)
    for net in method._task.nets.values():  # clones start as copies of their experts, rows of their own
        experts = net.moe.experts()
        for c, e in enumerate(net.active.tolist()):
            clone = (net.clones.gate[c], net.clones.up[c], net.clones.down[c])
            assert all(torch.equal(w, old) for w, old in zip(clone, experts[e]))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {f"model.layers.{i}.mlp.clones.{p}" for i in range(2)
                         for p in ("gate", "up", "down", "router_weight", "router_bias")}

    old = {n: p.detach().clone() for n, p in model.named_parameters()}
    start = {n: p.detach().clone() for n, p in clone_params(method).items()}
    train(method, 4, stage)
    moved = {n for n, p in clone_params(method).items() if not torch.equal(p, start[n])}
    assert moved == set(start)  # every clone tensor (experts and rows) of both layers trained
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, old[n])}
    assert changed == trainable  # nothing else moved
    torch.testing.assert_close(logits(model, b, method, zeros), before, rtol=0, atol=1e-6)
    assert not torch.allclose(logits(model, b, method, ones), before, atol=1e-4)


@pytest.mark.parametrize("args", [{"train_shared": True}, {"shared": "add"}])
def test_the_cka_reference_is_the_pre_task_model_when_more_than_the_clones_trains(args):
    """With attention etc. (train_shared) or the routed scale (shared=add) training, masks
    at 0 are no longer the old model: the reference puts back their pre-task values."""
    method, model = make(**args)
    b = batch(3)
    before = method._features.of(b)[1]  # layer 1's output, non-pad tokens
    stage = Stage(1, [], "task 1")
    method.before_task(stage)
    assert method._task.snapshot
    train(method, 3, stage)
    method._task.set_masks(torch.zeros(2, K))
    assert not torch.allclose(method._features.of(b)[1], before, atol=1e-4)  # masks at 0 alone: moved
    torch.testing.assert_close(method._features.reference(method._task, b)[1], before,
                               rtol=0, atol=1e-5)


def rows_batch(rows):
    """A micro-batch of token rows as the harness's collator makes it (right-padded to 8)."""
    return collate([{"input_ids": r, "labels": r} for r in rows], pad_id=0)


ROWS = [torch.randint(3, 259, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (12, 9, 5)]


def forwards(model):
    """A counter of forwards through the model's first decoder layer."""
    calls = [0]
    model.model.layers[0].register_forward_pre_hook(lambda module, args: calls.__setitem__(0, calls[0] + 1))
    return calls


def test_the_cka_reference_is_each_rows_own_forward_through_the_pre_task_model_once_a_task():
    """Cached per row for the task, keyed by the precision and the row's tokens: the
    same as a fresh forward of the pre-task model on that row alone, whatever shares
    its batch or pads it, under fp32 and bf16 alike; a cached row costs no forward."""
    method, model = make(train_shared=True)  # attention etc. train too: the live model moves away
    old = copy.deepcopy(model)
    alone = LayerFeatures(old, method._cka_layers, 1024)

    def fresh(row, dtype=None):  # the row alone, unpadded (padding alone moves the rounding)
        ids = torch.tensor([row])
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype is not None):
            return alone.of({"input_ids": ids, "attention_mask": torch.ones_like(ids)})[1]

    stage = Stage(1, [], "task 1")
    method.before_task(stage)
    train(method, 3, stage)
    task, features = method._task, method._features
    calls, cached = forwards(model), len(task.reference)  # the training steps' replay rows
    a = features.reference(task, rows_batch([ROWS[0], ROWS[1]]))[1]  # width 16
    assert calls[0] == 2 and len(task.reference) == cached + 2  # one forward per row, alone
    b = features.reference(task, rows_batch([ROWS[1], ROWS[2], ROWS[0]]))[1]  # other neighbours, order, width
    assert calls[0] == 3  # only the new row ran
    n0, n1 = len(ROWS[0]), len(ROWS[1])
    for got, row in ((a[:n0], 0), (a[n0:], 1), (b[:n1], 1), (b[n1:n1 + len(ROWS[2])], 2), (b[-n0:], 0)):
        assert torch.equal(got, fresh(ROWS[row])), row
    with torch.autocast("cpu", dtype=torch.bfloat16):
        c = features.reference(task, rows_batch([ROWS[0]]))[1]
    assert calls[0] == 4 and torch.equal(c, fresh(ROWS[0], torch.bfloat16))  # its own key: not the fp32 features
    assert not torch.equal(c, a[:n0])
    features.reference(task, rows_batch([ROWS[2], ROWS[0]]))
    assert calls[0] == 4
    assert not torch.allclose(features.of(rows_batch([ROWS[0]]))[1], fresh(ROWS[0]), atol=1e-4)  # model moved


def test_a_replay_step_runs_the_reference_only_for_rows_new_to_the_task_and_its_gradient_is_unchanged():
    method, model = make(mask_every=1000)  # no outer step: one forward a step for the replay batch
    method.before_task(Stage(1, [], "task 1"))
    calls = forwards(model)
    replay = rows_batch(ROWS)

    def grads(step):
        model.zero_grad()
        task_loss(method, batch(0), step)
        loss, parts = method.replay_loss(replay, step)
        loss.backward()
        return parts, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    grads(0)
    assert calls[0] == 1 + 1 + 3  # task forward, the reference of each row, the replay forward
    before = calls[0]
    warm = grads(1)
    assert calls[0] - before == 2  # task and replay forwards: the reference comes from the cache
    method._task.reference.clear()
    cold = grads(1)  # the same step (the same masks), every row's reference computed afresh
    assert warm[0] == cold[0] and warm[1].keys() == cold[1].keys()
    assert all(torch.equal(warm[1][n], cold[1][n]) for n in warm[1])
    assert method._task.reference  # finalise's CKA reuses it under its own key


def test_the_cka_term_carries_gradient_to_the_clones():
    grads = {}
    for lam in (1.0, 0.0):
        method, model = make(mask="off", lambda_replay=0.0, lambda_cka=lam)  # off: every slot is a clone
        method.before_task(Stage(1, [], "task 1"))
        with torch.no_grad():
            for p in clone_params(method).values():
                p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(3)))
        task_loss(method, batch(0), 0)
        loss, parts = method.replay_loss(batch(1), 0)
        assert 0 < parts["cka"] < 1 and parts["cka_loss"] == pytest.approx(1 - parts["cka"])
        loss.backward()
        if lam:
            grads = {n: p.grad for n, p in clone_params(method).items()}
        else:  # lambda_cka=0 and lambda_replay=0: the replay batch trains nothing
            assert all(not p.grad.any() for p in clone_params(method).values())
    # CKA is on layer 1's output: the clones of both layers feed it
    for name in ("0.gate", "0.down", "1.up", "1.router_weight"):
        assert grads[name] is not None and grads[name].abs().sum() > 0, name


def test_outer_step_updates_the_mask_logits_and_tau():
    method, model = make(mask_every=2)
    stage = Stage(1, [], "task 1")
    method.before_task(stage)
    task = method._task
    start = task.logits.detach().clone()
    torch.testing.assert_close(start[..., 1] - start[..., 0], torch.full((2, K), math.log(1.5)))
    _, parts = train(method, 1, stage)
    assert "mask_loss" not in parts and torch.equal(task.logits, start)  # step 0: not yet
    for p in model.parameters():
        p.grad = None
    task_loss(method, batch(5), 1)
    _, parts = method.replay_loss(batch(6), 1)
    assert all(p.grad is None for p in model.parameters())  # the outer step leaves the model's gradients alone
    assert {"mask_loss", "mask_replay", "mask_gain", "mask_balance", "mask_rate", "tau"} <= set(parts)
    assert parts["mask_loss"] == pytest.approx(parts["mask_replay"] - 0.35 * parts["mask_gain"]
                                               + 0.4 * parts["mask_balance"], rel=1e-5)
    assert not torch.equal(task.logits, start) and task.logits.grad is None
    assert task.updates == 1 and parts["tau"] == pytest.approx(5.0 * 0.995)


def trainable_params(model):
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def test_the_task_loss_is_the_answer_ce_plus_the_balancing_term():
    """L_task = CE + lb (docs/methods/bilevel-cka.md, "Inner step"), lb the Switch terms
    of the masked forward: the returned loss is the CE by hand plus lb, lb > 0 and in
    proportion to lb_coef (0 turns it off). Mutation caught: the loss without lb."""
    b, out = batch(2), {}
    for coef in (0.0, 0.01, 0.02):
        method, model = make(lb_coef=coef)
        method.before_task(Stage(1, [], "task 1"))
        loss, parts = task_loss(method, b, 0)
        with torch.no_grad():
            ce = answer_ce(model, b)  # the same step: the same masks
        assert parts["lm"] == pytest.approx(float(ce), rel=1e-6)
        assert loss.item() == pytest.approx(float(ce) + parts["lb"], rel=1e-6)
        out[coef] = parts["lb"]
    assert out[0.0] == 0 and out[0.01] > 1e-3
    assert out[0.02] == pytest.approx(2 * out[0.01], rel=1e-5)


def test_the_cka_gradient_scales_with_lambda_cka():
    """With lambda_replay = 0 the replay loss is lambda_cka * L_CKA: its value and its
    gradient on every clone tensor are in proportion to lambda_cka (0.2 vs 0.6: x3).
    Mutation caught: lambda_cka ignored (a fixed 0.15)."""
    out = {}
    for lam in (0.2, 0.6):
        method, model = make(mask="off", lambda_replay=0.0, lambda_cka=lam)
        method.before_task(Stage(1, [], "task 1"))
        g = torch.Generator().manual_seed(3)
        with torch.no_grad():  # clones off their experts, so CKA < 1 and its gradient is not ~0
            for p in trainable_params(model).values():
                p.add_(0.05 * torch.randn(p.shape, generator=g))
        task_loss(method, batch(0), 0)
        loss, parts = method.replay_loss(batch(1), 0)
        assert 0 < parts["cka_loss"] < 1
        assert loss.item() == pytest.approx(lam * parts["cka_loss"], rel=1e-6)
        loss.backward()
        out[lam] = {n: p.grad.clone() for n, p in trainable_params(model).items()}
    assert out[0.2].keys() == out[0.6].keys() and out[0.2]
    for n, grad in out[0.2].items():
        assert grad.abs().sum() > 0, n
        torch.testing.assert_close(out[0.6][n], 3 * grad, rtol=1e-4, atol=1e-5 * float(grad.abs().max()))


@pytest.mark.parametrize("noise", [0.0, 30.0])
def test_the_knowledge_gain_moves_every_mask_towards_the_lower_loss(noise):
    """beta = 0 and gamma large, so L_out ~ -gamma G, G = sg(L_recycle - L_expand) mean(pi):
    d(-gamma G)/d(alpha_e - alpha_r) has the sign of L_expand - L_recycle in every slot
    (through mean(pi), also where this step's pi is 0 and L_replay gives ~nothing), and
    Adam's first step moves each logit by mask_lr (0.01) against its gradient's sign:
    the gap rises by 0.02 everywhere when expanding lowers the loss, falls by 0.02
    when it raises it (noise = 30: clones far off their experts). Mutations caught: no
    gradient from the gain, the gain's sign flipped."""
    method, model = make(mask_every=1, gamma=1e4, beta=0.0)
    stage = Stage(1, [], "task 1")
    method.before_task(stage)
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for p in trainable_params(model).values():  # the clones and their rows
            p.add_(noise * p.detach().std() * torch.randn(p.shape, generator=g))
    task_loss(method, batch(0), 0)
    _, parts = method.replay_loss(batch(1), 0)  # step 0 with N = 1: an outer step
    assert parts["mask_rate"] > 0 and parts["mask_gain"] != 0
    sign = 1.0 if parts["mask_gain"] > 0 else -1.0  # mask_gain = (L_recycle - L_expand) * rate
    assert sign == (1.0 if noise == 0 else -1.0)  # both directions are exercised
    method.after_task(stage)
    gaps = torch.logit(torch.tensor(method.param_report()["expand_prob"], dtype=torch.float64))  # (L_c, K)
    torch.testing.assert_close(gaps, torch.full((2, K), math.log(1.5) + sign * 0.02, dtype=torch.float64),
                               rtol=0, atol=1e-4)


def test_mask_init_random_draws_the_logits_instead_of_the_prior():
    """mask_init=random: every logit ~ N(0, 0.1^2), so the gap alpha_e - alpha_r ~
    N(0, 0.02) per slot (std 0.14, mean 0) where the prior gives log(0.6 / 0.4) = 0.405
    everywhere. Read from the record of a task finalised before any step (the
    decisions are the initialisation). Mutation caught: the prior for both."""
    gaps = {}
    for init in ("prior", "random"):
        method, _ = make(mask_init=init)
        stage = Stage(1, [], "task 1")
        method.before_task(stage)
        method.after_task(stage)
        gaps[init] = torch.logit(torch.tensor(method.param_report()["expand_prob"], dtype=torch.float64))
    torch.testing.assert_close(gaps["prior"], torch.full((2, K), math.log(1.5), dtype=torch.float64),
                               rtol=0, atol=1e-5)
    random = gaps["random"]
    assert 0.07 < float(random.std()) < 0.25 and abs(float(random.mean())) < 0.1, random
    assert len(set(random.flatten().tolist())) == 2 * K  # a draw per slot


def test_outer_sample_shared_runs_one_replay_forward_for_the_outer_and_the_inner_loss():
    """outer_sample=shared: on an outer step one replay forward (the outer sample's) serves
    the outer loss and the inner one; the mask logits still take their Adam step, the
    model's gradient is the inner loss's at that sample, and alpha's stray gradient goes."""
    counts, steps = {}, {}
    for mode in ("own", "shared"):
        method, model = make(mask_every=1, outer_sample=mode)
        method.before_task(Stage(1, [], "task 1"))
        task = method._task
        calls, start = forwards(model), task.logits.detach().clone()
        task_loss(method, batch(0), 0)
        loss, parts = method.replay_loss(batch(1), 0)
        counts[mode] = calls[0]
        loss.backward()
        method.before_step(0)
        assert task.updates == 1 and not torch.equal(task.logits, start) and task.logits.grad is None
        assert {"mask_loss", "mask_replay", "cka", "lm"} <= set(parts)
        grads = [p.grad for p in clone_params(method).values()]
        assert all(g is not None and torch.isfinite(g).all() for g in grads) and any(g.any() for g in grads)
        steps[mode] = parts
    # own: task, outer replay, L_expand, L_recycle, 2 reference rows, inner replay; shared: no outer replay
    assert counts["own"] == 7 and counts["shared"] == 6
    assert steps["shared"]["mask_replay"] == pytest.approx(steps["shared"]["lm"])  # one forward, one loss
