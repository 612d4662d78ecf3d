"""bilevel-cka on the tiny Llama (2 layers, width 64, FFN 128: K = 8 slices of h = 16):
the straight-through mask, the supernet, the clones' training, the CKA gradient, the
outer step, Expand / Recycle, and end-to-end runs."""
from __future__ import annotations

import copy
import json
import math
from types import SimpleNamespace

import pytest
import torch

from cl_bench import registry
from cl_bench.record import io as results
from cl_bench.config import ReplayConfig, RunConfig
from cl_bench.data.encode import collate
from cl_bench.errors import UserError
from cl_bench.method import MethodContext, Stage, prune_optimizer
from cl_bench.methods.bilevel_cka import BilevelCKAArgs, mask_schedule, reachable_mask_lr, straight_through_gumbel
from cl_bench.methods.bilevel_cka.search import LayerFeatures
from cl_bench.models import moe
from cl_bench.models.loading import tiny_llama
from cl_bench.models.params import params_command
from helpers import (answer_ce, final_weights, flat_params, interrupted_run, make_method, only_run, random_batch,
                     run_cli, smoke_args)

D, K, h = 64, 8, 16
PER_EXPERT = 3 * h * D + D + 1  # gate, up, down + router row and bias


def make(**args):
    """The method after task 0 on the tiny Llama, its experts and rows moved off
    their slices (a trained look), and the stage of task 1 begun. Seeded: the router
    rows of task 0's group come from the global generator."""
    method = make_method("bilevel-cka", context=MethodContext.for_shapes(3), **{"lr": 1e-2, **args})
    model = method.model
    method.before_task(Stage(0, [], "task 0"))
    with torch.no_grad():
        g = torch.Generator().manual_seed(1)
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn(p.shape, generator=g))
    method.after_task(Stage(0, [], "task 0"))
    return method, model


batch = random_batch  # two rows of 12 random ids, the second right-padded


def logits(model, b, method=None, pi=None):
    if pi is not None:
        method._task.set_masks(pi)
    with torch.no_grad():
        return model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits


def train(method, steps, stage, previous=None, log=None):
    """`steps` optimiser steps as the backend takes them: task loss, replay loss, step;
    the optimiser from optimizer_for_stage(stage, previous), as the sequencer asks
    for it. `log`: a list that gets each step's replay parts."""
    optimizer = method.optimizer_for_stage(stage, previous)
    for step in range(steps):
        optimizer.zero_grad()
        loss, _ = method.loss(batch(step), step)
        loss.backward()
        loss, parts = method.replay_loss(batch(100 + step), step)
        loss.backward()
        optimizer.step()
        if log is not None:
            log.append(parts)
    return optimizer, parts


def clone_params(method):
    return {f"{i}.{n}": p for i, net in method._task.nets.items() for n, p in net.clones.named_parameters()}


def mean_loss(model, batches):
    """Answer-token CE over `batches`, token-weighted, no gradient."""
    total = tokens = 0
    with torch.no_grad():
        for b in batches:
            n = int((b["labels"] != -100).sum())
            total += float(model(**b).loss) * n
            tokens += n
    return total / tokens


def pair_share(model, batches):
    """Per MoE layer of the (finalised) model: the share of the non-pad tokens of
    `batches` whose top-k holds two experts of one slot, from the layer's own router."""
    shares = []
    for layer in moe.moe_layers(model):
        pairs = tokens = 0
        for b in batches:
            seen = []
            handle = layer.register_forward_pre_hook(lambda module, args: seen.append(args[0]))
            with torch.no_grad():
                model(input_ids=b["input_ids"], attention_mask=b["attention_mask"])
            handle.remove()
            _, _, indices = layer.route(seen[0][b["attention_mask"].bool()])  # (n, k)
            slots = layer.slots()[indices].sort(dim=-1).values
            pairs += int((slots[:, 1:] == slots[:, :-1]).any(dim=-1).sum())
            tokens += indices.shape[0]
        shares.append(pairs / tokens)
    return shares


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
        method.loss(batch(0), step)
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
        method.loss(batch(0), 0)
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
    method.loss(batch(5), 1)
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
        loss, parts = method.loss(b, 0)
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
        method.loss(batch(0), 0)
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
    method.loss(batch(0), 0)
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
        method.loss(batch(0), 0)
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


def test_expand_adds_one_expert_and_an_aligned_row_per_decision_and_recycle_none():
    method, model = make()
    stage = Stage(1, [], "task 1")
    method.before_task(stage)
    optimizer, _ = train(method, 2, stage)
    with torch.no_grad():
        method._task.logits.zero_()
        method._task.logits[0, [1, 4], 1] = 1.0  # layer 0: slots 1 and 4 expand; layer 1: all recycle
    clones = {i: {n: p.detach().clone() for n, p in net.clones.named_parameters()}
              for i, net in method._task.nets.items()}
    total = sum(p.numel() for p in model.parameters()) - sum(p.numel() for p in clone_params(method).values())
    old_experts = [e[0].detach().clone() for e in moe.moe_layers(model)[0].experts()]
    method.after_task(stage)

    report = method.param_report()
    assert report["decisions"] == [[0, 1, 0, 0, 1, 0, 0, 0], [0] * K]
    assert report["experts_added"] == 2 and report["expansion_rate"] == pytest.approx(2 / 16)
    assert report["experts_per_layer"] == moe.experts_per_layer(model) == [10, 8]
    assert report["total"] == total + 2 * PER_EXPERT  # growth = the decisions
    layer0, layer1 = moe.moe_layers(model)
    assert layer1.group_sizes() == [8]  # recycle: nothing kept
    new = layer0.groups[-1]
    assert new.slots.tolist() == [1, 4]
    for j, slot in enumerate([1, 4]):  # the trained clone and its trained row
        for name in ("gate", "up", "down", "router_weight", "router_bias"):
            torch.testing.assert_close(getattr(new, name)[j], clones[0][name][slot], rtol=0, atol=0)
    for e, gate in enumerate(old_experts):  # the old experts stay
        assert torch.equal(layer0.experts()[e][0], gate)
    # row e scores expert e: make each new row dominate and route
    x = torch.randn(5, D, generator=torch.Generator().manual_seed(0))
    for j, e in enumerate((8, 9)):
        with torch.no_grad():
            for g in layer0.groups:
                g.router_bias.zero_()
                g.router_weight.zero_()
            new.router_bias[j] = 30.0
        _, weights, indices = layer0.route(x)
        assert (indices[:, 0] == e).all()
        out = layer0.experts_forward(x, weights, indices)  # weight ~1 on expert e
        gate, up, down = (clones[0][name][[1, 4][j]] for name in ("gate", "up", "down"))
        want = (torch.nn.functional.silu(x @ gate.T) * (x @ up.T)) @ down.T  # the clone of slot 1 / 4
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
    # the expanded experts are now the active ones of their slots, and the next supernet clones them
    assert method._active[0] == [0, 8, 2, 3, 9, 5, 6, 7] and method._active[1] == list(range(K))
    live = {id(p) for p in model.parameters()}
    assert not all(id(p) in live for g in optimizer.param_groups for p in g["params"])  # the clones left
    prune_optimizer(optimizer, model)  # as the harness does after every stage
    assert all(id(p) in live for g in optimizer.param_groups for p in g["params"])  # clones pruned
    assert all(id(p) in live for p in optimizer.state)
    method.before_task(Stage(2, [], "task 2"))
    torch.testing.assert_close(method._task.nets[0].clones.gate[1], layer0.groups[-1].gate[0], rtol=0, atol=0)


@pytest.mark.slow  # over ~1 s (pyproject.toml's marker)
def test_the_finalised_model_is_the_searched_supernet_without_pairs_of_copies():
    """Issue #9. The deployed model must be the supernet at pi = the decisions, and
    top-k must not pick the old and the new copy of one slot (a clone whose row is a
    copy of its slot's: 100% of the tokens, logits 0.44 from the supernet's). Inner
    lr 1e-5, 8 steps a task, as measured; task 2 also routes task 1's copies."""
    method, model = make(lr=1e-5, mask_every=2)
    check = [batch(s) for s in range(4, 8)]  # the last 4 task micro-batches: the record's deploy check
    for t in (1, 2):
        stage = Stage(t, [], f"task {t}")
        method.before_task(stage)
        train(method, 8, stage)
        task = method._task
        expand = (task.logits[..., 1] - task.logits[..., 0]).detach().sigmoid() > 0.5
        assert expand.any()  # copies to pair up
        method._task.set_masks(expand.float())
        searched, searched_logits = mean_loss(model, check), logits(model, check[0])
        method.after_task(stage)
        shares = pair_share(model, check)
        # chance for top-2 of 16 experts, 8 slots of two: 8 / C(16, 2) = 6.7%
        assert max(shares) <= 0.25, (t, shares)
        deployed = mean_loss(model, check)
        assert abs(deployed - searched) <= 1e-5, (t, deployed, searched)
        torch.testing.assert_close(logits(model, check[0]), searched_logits, rtol=0, atol=1e-5)
        record = method.param_report()["deploy_check"]
        assert record["batches"] == 4 and record["loss_gap"] <= 1e-5
        assert record["deployed_loss"] == pytest.approx(deployed, abs=1e-5)
        assert record["pair_share"] == pytest.approx(shares, abs=1e-6)


def test_the_clones_train_with_the_optimiser_the_sequencer_carries_over():
    """The sequencer hands stage t-1's optimiser to optimizer_for_stage. One built
    before the clones existed (the published code's) holds none of them: they
    would never step, and the knowledge gain would measure untrained copies.
    Mutations caught: the clones left out of the carried optimiser (held), no step
    (every clone stepped). The gain's move is only required to be non-zero: over 4
    steps it came out between 1.3e-4 and 1.2e-3 from run to run while `make` left
    task 0's router rows to the unseeded global generator (seeded now). That the
    sequencer asks for a new optimiser each stage at all is tested through it:
    test_smoke_run_with_the_mask_off_expands_every_clone_trained_in_its_stage."""
    method, model = make(mask_every=2)
    previous = method.optimizer_for_stage(Stage(0, [], "task 0"), None)  # stage 0's: no clone yet
    stage = Stage(1, [], "task 1")
    method.before_task(stage)
    clones = clone_params(method)
    start = {n: p.detach().clone() for n, p in clones.items()}

    def gain():  # L_recycle - L_expand on a fixed task batch
        method._task.set_masks(torch.zeros(2, K))
        recycle = mean_loss(model, [batch(50)])
        method._task.set_masks(torch.ones(2, K))
        return recycle - mean_loss(model, [batch(50)])

    before, log = gain(), []
    optimizer, _ = train(method, 4, stage, previous, log)
    held = {id(p) for g in optimizer.param_groups for p in g["params"]}
    assert all(id(p) in held for p in clones.values()), "clones missing from the stage's optimiser"
    assert {n for n, p in clones.items() if not torch.equal(p, start[n])} == set(start)  # every clone stepped
    assert gain() != before  # Expand's loss moved: the clones learned
    gains = [parts["mask_gain"] for parts in log if "mask_gain" in parts]
    assert len(gains) == 2 and len(set(gains)) == 2


def _outer_updates(profile: str, args: BilevelCKAArgs) -> dict[str, int]:
    """Outer updates per paper6 task of bilevel-cka on `profile`, from the stage's
    step count as the sequencer batches it (no data loaded)."""
    from cl_bench.benchmarks.trace.tasks import ORDERS
    from cl_bench.config import resolve

    config = resolve(profile, None, {})
    ctx = MethodContext(config, torch.device("cpu"), None)
    out = {}
    for i, name in enumerate(ORDERS["paper6"]):
        task = SimpleNamespace(name=name, train=[None] * config.data.n_train_for(name))
        out[name] = mask_schedule(ctx.stage_steps(Stage(i, [task], name)), args)[1]
    return out


def test_cpu_long_gives_the_search_35_to_70_outer_updates_a_task():
    """Issue 15: the search needs 35-70 outer updates a task to decide. `cpu`'s 12-32
    steps a task cannot give that even with an update every step; `cpu-long` (3 epochs)
    with min_mask_updates=35 gives 36-48, each able to reach Recycle. Mutations caught:
    cpu-long without its epochs (12-32), min_mask_updates ignored (4 a task)."""
    g0 = math.log(0.6 / 0.4)
    assert set(_outer_updates("cpu", BilevelCKAArgs()).values()) == {4}
    assert max(_outer_updates("cpu", BilevelCKAArgs(min_mask_updates=35)).values()) < 35  # one a step at most
    long = _outer_updates("cpu-long", BilevelCKAArgs(min_mask_updates=35))
    assert long == {"MeetingBank": 36, "Py150": 48, "NumGLUE-cm": 48, "NumGLUE-ds": 48, "20Minuten": 36,
                    "C-STANCE": 48}
    assert all(2 * u * reachable_mask_lr(u, g0, 0.01, BilevelCKAArgs().mask_reach) >= 2 * g0 - 1e-9 for u in long.values())


def test_recycle_is_reachable_on_a_short_task():
    """Adam moves a logit by at most ~mask_lr per update, so the expand - recycle gap
    moves at most 2 U mask_lr: with U = 4 and 0.01 that is 0.08 from the prior's
    0.405, and Recycle is out of reach. mask_lr_eff makes the reach 2 g0."""
    a, g0 = BilevelCKAArgs(), math.log(0.6 / 0.4)
    for steps, updates, lr in ((8, 4, g0 / 4), (12, 4, g0 / 4), (32, 4, g0 / 4), (785, 78, 0.01)):
        assert mask_schedule(steps, a)[1] == updates
        assert reachable_mask_lr(updates, g0, a.mask_lr, a.mask_reach) == pytest.approx(lr)
        assert 2 * updates * reachable_mask_lr(updates, g0, a.mask_lr, a.mask_reach) >= 2 * g0 - 1e-9
    assert reachable_mask_lr(None, g0, a.mask_lr, a.mask_reach) == a.mask_lr  # steps unknown: as given

    # an outer loss that pushes every slot to Recycle gets there in a task of 8 steps
    method, model = make(r_target=0.0, beta=100.0, gamma=0.0)
    method.ctx.stage_steps = lambda stage: 8
    stage = Stage(1, [], "task 1")
    method.before_task(stage)
    train(method, 8, stage)
    method.after_task(stage)
    report = method.param_report()
    s = report["mask_schedule"]
    assert (s["steps"], s["mask_every"], s["updates"]) == (8, 2, 4)
    assert s["mask_lr"] == 0.01 and s["mask_lr_eff"] == pytest.approx(g0 / 4)
    assert s["init_gap"] == pytest.approx(g0, abs=1e-6) and s["reach"] >= 2 * s["init_gap"] - 1e-6
    assert report["expansion_rate"] == 0.0, report["expand_prob"]

    # no outer update at all: refused before training, naming the arguments
    refused, _ = make(min_mask_updates=0)
    refused.ctx.stage_steps = lambda stage: 8
    tasks = [SimpleNamespace(name=f"t{i}", train=[]) for i in range(2)]
    for call in (lambda: refused.plan(tasks), lambda: refused.before_task(Stage(1, [], "task 1"))):
        with pytest.raises(UserError, match=r"mask_every=10 with method_args.min_mask_updates=0.*"
                                            r"min_mask_updates >= 1.*mask_every <= 8"):
            call()


def test_mask_off_expands_every_slot():
    method, model = make(mask="off")
    stage = Stage(1, [], "task 1")
    method.before_task(stage)
    assert method._task.logits is None
    train(method, 2, stage)
    method.after_task(stage)
    report = method.param_report()
    assert report["expansion_rate"] == 1.0 and report["experts_per_layer"] == [16, 16]
    assert report["experts_added"] == 16 and report["expand_prob"] is None


def test_only_candidate_layers_get_a_supernet():
    method, model = make(mask="off", candidate_layers=[1])
    stage = Stage(1, [], "task 1")
    method.before_task(stage)
    assert {n for n, p in model.named_parameters() if p.requires_grad} == {
        f"model.layers.1.mlp.clones.{p}" for p in ("gate", "up", "down", "router_weight", "router_bias")}
    train(method, 1, stage)
    method.after_task(stage)
    assert moe.experts_per_layer(model) == [8, 16] and method.param_report()["decisions"] == [[1] * K]


def test_arguments_and_settings_are_checked():
    cls = registry.get("bilevel-cka")
    with pytest.raises(UserError, match="mask='maybe'"):
        cls.parse_args({"mask": "maybe"})
    with pytest.raises(UserError, match="tau_final"):
        cls.parse_args({"tau_final": 10.0})
    ctx = MethodContext(RunConfig(replay=ReplayConfig(policy="epoch")), torch.device("cpu"), None)
    with pytest.raises(UserError, match="replay.policy=interleave"):
        cls(cls.parse_args({}), ctx)
    method = cls(cls.parse_args({"candidate_layers": [0, 5]}), None)
    with pytest.raises(UserError, match="candidate_layers"):
        method.setup(tiny_llama(0)[0])


def test_params_command_reports_the_upper_bound_on_llama_3_2_1b():
    rows = params_command("llama-3.2-1b", "bilevel-cka", 6)
    upcycle = params_command("llama-3.2-1b", "upcycle", 6)
    assert [r["total"] for r in rows] == [r["total"] for r in upcycle]  # every decision Expand
    assert [r["experts_per_layer"] for r in rows] == [[8 * (t + 1)] * 16 for t in range(6)]
    assert all(r["bound"].startswith("upper") for r in rows)
    assert rows[1]["trainable"] == upcycle[1]["trainable"]  # clones + rows = one group + rows


# ---- end to end ---------------------------------------------------------------------

@pytest.mark.slow
def test_smoke_run_records_decisions_and_resumes_to_the_same_run(trace_dir, tmp_path, monkeypatch):
    straight = tmp_path / "straight"
    assert run_cli(*smoke_args(trace_dir, straight, "--method", "bilevel-cka")) == 0
    record = json.loads((only_run(straight) / "run.json").read_text())
    assert record["status"] == "complete" and record["uses_replay"] and record["replay"]["used"] > 0
    params = flat_params(record)
    assert params[0]["expansion_rate"] is None and params[0]["experts_per_layer"] == [8, 8]
    for prev, p in zip(params, params[1:]):
        assert len(p["decisions"]) == 2 and all(len(row) == K for row in p["decisions"])
        assert p["experts_added"] == sum(map(sum, p["decisions"]))
        assert p["expansion_rate"] == pytest.approx(p["experts_added"] / 16)
        assert p["total"] - prev["total"] == p["experts_added"] * PER_EXPERT
        assert len(p["cka_before"]) == len(p["cka_after"]) == len(p["cka_final"]) == 1
        s = p["mask_schedule"]  # smoke: 2 steps a task -> an outer step each, tau down to 0.1
        assert (s["steps"], s["mask_every"], s["updates"]) == (2, 1, 2)
        assert s["tau_end"] == pytest.approx(0.1)
        # 2 updates: raised so the gap can move by min(2 g0, the paper's reach)
        assert s["mask_lr_eff"] == pytest.approx(min(s["init_gap"], s["mask_reach"] / 2) / 2)
        d = p["deploy_check"]  # the deployed model is the searched one, without pairs of copies
        assert d["batches"] == 4 and d["loss_gap"] <= 1e-5 and max(d["pair_share"]) <= 0.25, d
    rows = results.read_jsonl(only_run(straight) / "metrics.jsonl")
    later = [r for r in rows if r["stage"] >= 1]
    assert all({"lm", "lb", "expand", "replay_lm", "replay_cka", "replay_cka_1", "replay_mask_loss",
                "replay_mask_gain", "replay_mask_balance", "replay_tau"} <= set(r) for r in later)

    broken = tmp_path / "broken"
    run_dir = interrupted_run(monkeypatch, *smoke_args(trace_dir, broken, "--method", "bilevel-cka"),
                              at_stage=2)
    assert run_cli("run", "--resume", run_dir, "--no-progress") == 0
    resumed = json.loads((run_dir / "run.json").read_text())
    assert resumed["status"] == "complete"
    assert resumed["matrix"] == record["matrix"] and resumed["params"] == record["params"]
    assert results.read_jsonl(run_dir / "metrics.jsonl") == rows


@pytest.mark.slow
def test_smoke_run_with_the_mask_off_expands_every_clone_trained_in_its_stage(trace_dir, tmp_path):
    """Through the sequencer: with every slot expanded, group t of each layer is stage
    t's trained clones of group t - 1 (the active experts), frozen afterwards, so
    each group differs from the one it was cloned from, in most experts (a clone the
    router sends no token in smoke's 2 steps gets no gradient).
    Mutation caught: the sequencer keeping stage 0's optimiser for every stage (the
    clones never step: group 2 == group 1 == group 0)."""
    out = tmp_path / "off"
    assert run_cli(*smoke_args(trace_dir, out, "--method", "bilevel-cka", "--method-arg", "mask=off",
                               "--keep-checkpoint")) == 0
    record = json.loads((only_run(out) / "run.json").read_text())
    assert [p["expansion_rate"] for p in record["params"]] == [None, 1.0, 1.0]
    assert [p["experts_per_layer"] for p in record["params"]] == [[8, 8], [16, 16], [24, 24]]
    weights = final_weights(only_run(out))
    for i in range(2):
        for t in (1, 2):
            for name in ("gate", "up", "down"):
                new, old = (weights[f"model.layers.{i}.mlp.groups.{g}.{name}"] for g in (t, t - 1))
                moved = (new - old).flatten(1).abs().amax(dim=1)  # (K,) per expert
                assert int((moved > 0).sum()) >= K // 2, (i, t, name, moved)
