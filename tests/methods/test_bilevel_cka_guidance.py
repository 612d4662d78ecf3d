"""bilevel-cka's guided mask initialisation (methods/bilevel_cka/guidance.py), the
reach of its search, and supernet=mix, on the tiny Llama (2 layers, K = 8 slots).
Each test names the mutation it catches."""
from __future__ import annotations

import contextlib
import json
import math

import pytest
import torch

from cl_bench.method import Stage
from cl_bench.methods import bilevel_cka
from cl_bench.methods.bilevel_cka import guidance, reachable_mask_lr
from cl_bench.methods.bilevel_cka.args import PAPER_REACH
from cl_bench.models import moe
from helpers import only_run, run_cli, smoke_args
from test_bilevel_cka import K, batch, logits, make, train

PRIOR = math.log(0.6 / 0.4)


class _Buffer:
    """A stand-in for the harness's replay buffer: what it stores so far."""

    def __init__(self, examples):
        self.stored = examples

    def examples(self):
        return list(self.stored)

    def chosen(self, task):
        return [f"{task.name}-kept"]


@pytest.fixture
def probe(monkeypatch):
    """Replay examples (strings) -> batches: "replay" gives two replay batches, a task's
    name the task's own batch; the method under test reads the buffer."""
    table = {"replay": [batch(1), batch(2)], "task": [batch(50)]}

    def batches(ctx, examples, n, key):
        return [b for e in examples for b in table[e.split("-")[0]]]

    monkeypatch.setattr(bilevel_cka, "replay_batches", batches)
    return table


def guided(**args):
    """The method after task 0 with a buffer holding replay examples, and task 1 begun."""
    method, model = make(**args)
    method.ctx.replay = _Buffer(["replay-a"])
    stage = Stage(1, [type("T", (), {"name": "task", "train": ["task-x"]})()], "task 1")
    method.before_task(stage)
    return method, model, stage


def expected_s(args: dict, batches) -> torch.Tensor:
    """s from a fresh copy of the same model state, computed by hand from the pieces."""
    method, model = make(**args)
    raw = guidance.expert_sensitivity(model, method._candidates, method._active, batches, contextlib.nullcontext)
    return guidance.scale_per_layer(raw)


def test_guided_init_is_the_prior_plus_the_replay_flatness_scaled_per_layer(probe):
    """alpha_e - alpha_r = log 1.5 + 4 (s - 0.5) + depth, s the replay loss's gradient
    norm per active expert min-max scaled within each layer. Mutations caught: the
    uniform prior instead (every gap log 1.5); the flatness taken from the task loss
    (the stage's own batches) instead of the replay loss; s without the per-layer
    scaling (a row that does not span [0, 1])."""
    method, _, _ = guided(depth_prior="fixed", kappa_depth=0.0)
    init = method._task.init
    gap = init[..., 1] - init[..., 0]
    s = expected_s({"depth_prior": "fixed", "kappa_depth": 0.0}, probe["replay"])
    torch.testing.assert_close(gap, PRIOR + 4 * (s - 0.5), rtol=0, atol=1e-6)
    assert float(gap.std()) > 0.5  # per-slot spread, not one value
    for row in s:  # each layer spans [0, 1]
        assert float(row.min()) == 0.0 and float(row.max()) == 1.0
    from_task = expected_s({"depth_prior": "fixed", "kappa_depth": 0.0}, probe["task"])
    assert not torch.allclose(s, from_task, atol=1e-3)  # the replay batches decide, not the task's
    recorded = method._task.guidance
    torch.testing.assert_close(torch.tensor(recorded["s"]), s, rtol=0, atol=1e-5)
    assert recorded["probe_rows"] == 4


def test_scaling_is_per_layer_and_flat_layers_are_neutral():
    """Mutation caught: one min-max over all layers (row 1 would span [0.5, 0.75])."""
    raw = torch.tensor([[0.0, 1.0, 2.0], [2.0, 2.5, 3.0], [4.0, 4.0, 4.0]])
    s = guidance.scale_per_layer(raw)
    torch.testing.assert_close(s, torch.tensor([[0.0, 0.5, 1.0], [0.0, 0.5, 1.0], [0.5, 0.5, 0.5]]))
    assert guidance.scale_over_layers([0.1, 0.3, 0.2]) == pytest.approx([0.0, 1.0, 0.5])
    assert guidance.scale_over_layers([0.2, 0.2]) == [0.0, 0.0]


@pytest.mark.parametrize("drift,depth", [([0.3, 0.1], [1.0, 0.0]), ([0.1, 0.3], [0.0, 1.0])])
def test_depth_prior_cka_adds_the_measured_drift_not_a_fixed_layer_list(probe, drift, depth):
    """depth_prior=cka: + kappa_depth * (drift scaled over layers) on every slot of a
    layer; fixed: + kappa_depth on the last third (here layer 1). Mutation caught: the
    fixed list used under depth_prior=cka (the first case, whose drift is largest in
    layer 0, would get layer 1's bias)."""
    gaps = {}
    for prior in ("cka", "fixed"):
        method, model = make(depth_prior=prior, kappa_flat=0.0, kappa_depth=2.0)
        method.ctx.replay = _Buffer(["replay-a"])
        method._drift = (drift, "given")
        method.before_task(Stage(1, [], "task 1"))
        init = method._task.init
        gaps[prior] = (init[..., 1] - init[..., 0])[:, 0]
    torch.testing.assert_close(gaps["cka"], PRIOR + 2.0 * torch.tensor(depth), rtol=0, atol=1e-6)
    torch.testing.assert_close(gaps["fixed"], PRIOR + 2.0 * torch.tensor([0.0, 1.0]), rtol=0, atol=1e-6)


def test_the_recorded_start_is_the_tensor_the_search_started_from(probe):
    """The record's init gap is alpha at the start of the search, and "changed" counts
    the final decisions that differ from its sign. Mutation caught: a record computed
    from the logits after the search (they moved), or from a second computation of the
    init that is not the one the optimiser got."""
    method, model, stage = guided()
    start = method._task.logits.detach().clone()
    optimizer = method._task.optimizer
    seen = optimizer.param_groups[0]["params"][0]
    assert seen is method._task.logits
    train(method, 4, stage)
    assert not torch.equal(method._task.logits.detach(), start)  # the search moved it
    method.after_task(stage)
    report = method.param_report()
    init = report["init"]
    torch.testing.assert_close(torch.tensor(init["gap"]), start[..., 1] - start[..., 0], rtol=0, atol=1e-6)
    init_sign = (start[..., 1] > start[..., 0]).int()
    assert init["decisions"] == init_sign.tolist()
    changed = int((init_sign != torch.tensor(report["decisions"])).sum())
    assert init["changed"] == changed


def test_the_reach_lets_a_disagreeing_slot_cross_and_keeps_the_spread_on_cpu_and_cpu_long():
    """The schedule's reach, under constant-sign gradients (Adam then moves each logit
    by its lr an update; the real outer loss's dynamics are what a run's init.changed
    records): Adam on a guided init (s evenly spaced in each layer, depth 0 / 1) for the
    updates a paper6 task gets on `cpu` (4) and `cpu-long` (36, 48), at mask_lr_eff:
    (a) a slot whose own gradient opposes its init crosses 0.5 when |gap| < R - one
    update; (b) a push common to every slot, in either direction, leaves at least 60%
    of the decisions at their init's sign and the decisions mixed. Mutations caught:
    the reach uncapped (g0 / U: the common push flips every slot on `cpu`); mask_lr
    kept at 0.01 on `cpu` (reach 0.08: no slot crosses)."""
    s = torch.linspace(0, 1, K).repeat(2, 1)
    init = guidance.guided_logits(2, K, 0.6, s, [0.0, 1.0], 4.0, 1.0)
    gap0 = init[..., 1] - init[..., 0]
    g0 = float(gap0.abs().max())
    for updates in (4, 36, 48):
        lr = reachable_mask_lr(updates, g0, 0.01, PAPER_REACH)
        assert 2 * updates * lr == pytest.approx(max(PAPER_REACH, 0.02 * updates))

        def run(grad_of):
            alpha = torch.nn.Parameter(init.clone())
            opt = torch.optim.Adam([alpha], lr=lr)
            for _ in range(updates):
                alpha.grad = grad_of(alpha)
                opt.step()
            return (alpha[..., 1] - alpha[..., 0]).detach()

        def against_init(alpha):  # each slot's own term opposes its init
            g = torch.zeros_like(alpha)
            g[..., 1] = torch.sign(gap0)
            g[..., 0] = -torch.sign(gap0)
            return g
        crossed = (run(against_init) > 0) != (gap0 > 0)
        near = gap0.abs() < 2 * updates * lr - 2 * lr
        assert near.any() and bool(crossed[near].all()), (updates, gap0[near])
        for direction in (1.0, -1.0):
            def common(alpha, d=direction):
                g = torch.zeros_like(alpha)
                g[..., 1], g[..., 0] = d, -d
                return g
            final = run(common) > 0
            kept = float((final == (gap0 > 0)).float().mean())
            assert kept >= 0.6 and 0 < int(final.sum()) < final.numel(), (updates, direction, kept)


def test_prior_and_random_keep_their_reach_rule():
    """The uniform-init ablation reruns as before: g0 = log 1.5 < R / 2, so mask_lr_eff
    = max(mask_lr, g0 / U) unchanged. Mutation caught: the cap applied below g0."""
    for updates in (2, 4, 78):
        assert reachable_mask_lr(updates, PRIOR, 0.01, PAPER_REACH) == pytest.approx(max(0.01, PRIOR / updates))


# ---- supernet=mix --------------------------------------------------------------------------

def test_mix_supernet_is_the_pair_form_and_expand_deploys_it():
    """supernet=mix: at pi = 0 the layer before the task; at pi = 1 every assignment to an
    active expert goes to its clone, on the old row, which is what Expand deploys (the
    clone's weights in the expert's place, no expert added); pi gets gradient. Mutations
    caught: the clone added beside its expert (experts per layer would grow); the share
    not passed to the old expert (pi = 0 would differ from the pre-task model)."""
    method, model = make(supernet="mix", mask_init="prior")
    b = batch(3)
    with torch.no_grad():
        before = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
    stage = Stage(1, [], "task 1")
    method.before_task(stage)
    train(method, 3, stage)
    K_ = method.args.experts_per_task
    torch.testing.assert_close(logits(model, b, method, torch.zeros(2, K_)), before, rtol=1e-5, atol=1e-5)
    pi = torch.ones(2, K_, requires_grad=True)
    method._task.set_masks(pi)
    out = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], labels=b["labels"])
    (grad,) = torch.autograd.grad(out.loss, [pi])
    assert float(grad.abs().sum()) > 0
    searched = logits(model, b, method, torch.ones(2, K_))
    with torch.no_grad():
        method._task.logits.zero_()
        method._task.logits[..., 1] = 1.0  # every slot expands
    method.after_task(stage)
    report = method.param_report()
    assert report["experts_added"] == 0 and report["experts_replaced"] == 2 * K_
    assert moe.experts_per_layer(model) == [8, 8]
    torch.testing.assert_close(logits(model, b), searched, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_smoke_run_measures_the_drift_and_feeds_it_to_the_next_task(trace_dir, tmp_path):
    """Through the sequencer: task 1's depth comes from task 0's own replay items, task
    2's from the drift measured across task 1 on the buffer; the record holds the init,
    its inputs and the decisions it kept. Mutation caught: no drift carried to the next
    task (task 2's depth source would be "none")."""
    out = tmp_path / "guided"
    assert run_cli(*smoke_args(trace_dir, out, "--method", "bilevel-cka")) == 0
    record = json.loads((only_run(out) / "run.json").read_text())
    rows = [{**p, **p.get("diagnostics", {})} for p in record["params"]][1:]
    sources = [r["init"]["guidance"]["depth_source"] for r in rows]
    assert sources[0].startswith("task 0's replay items") and sources[1].startswith("replay items of tasks 0..0")
    for r in rows:
        init = r["init"]
        assert r["mask_init"] == "guided" and init["slots"] == 2 * K
        assert init["changed"] == sum(a != b for x, y in zip(init["decisions"], r["decisions"]) for a, b in zip(x, y))
        assert len(init["guidance"]["drift"]) == 2 and init["guidance"]["probe_rows"] >= 1
        assert max(map(max, init["guidance"]["s"])) == 1.0


# ---- the measurements themselves -------------------------------------------------------------

def measuring(**args):
    """make(), with a context that measures (not shapes-only) and a buffer of replay examples."""
    method, model = make(**args)
    method.ctx.shapes_only = False
    method.ctx.replay = _Buffer(["replay-a"])
    return method, model


@pytest.mark.parametrize("expand", [False, True])
def test_the_drift_is_one_minus_cka_across_the_task_per_layer(probe, expand):
    """After a task: 1 - CKA per candidate layer between the outputs before and after
    it on the replay batches: 0 where every slot recycled (the layer is as before),
    and the hand computation on a copy of the pre-task model where every slot
    expanded. Mutations caught: the drift taken after against after (always 0); the
    "before" side read from the trained model."""
    import copy

    from cl_bench.eval.probes.cka import linear_cka
    from cl_bench.methods.bilevel_cka.search import LayerFeatures

    method, model = measuring()
    before_model = copy.deepcopy(model)
    stage = Stage(1, [], "task 1")
    method.before_task(stage)
    train(method, 3, stage)
    with torch.no_grad():
        method._task.logits.zero_()
        method._task.logits[..., 1] = 1.0 if expand else -1.0
    method.after_task(stage)
    measured, source = method._drift
    assert source == "replay items of tasks 0..0, before and after task 1"
    if not expand:
        assert measured == pytest.approx([0.0, 0.0], abs=1e-5)
        return
    layers = method._candidates
    outputs = [guidance.layer_outputs(m, LayerFeatures(m, layers, 1024), probe["replay"], contextlib.nullcontext)
               for m in (before_model, model)]
    want = [1 - float(linear_cka(outputs[1][l], outputs[0][l])) for l in layers]
    assert measured == pytest.approx(want, abs=1e-5) and max(want) > 1e-4


def test_flatness_maps_each_slot_to_its_active_expert_across_groups(probe):
    """At task 2, after task 1 expanded slots 1 and 4 of layer 0, those slots' active
    experts live in group 1, the others in group 0: each slot's score is the norm of
    its own expert's gradient from one plain backward through the model. Mutation
    caught: the slot read as an index into group 0."""
    method, model = make(depth_prior="fixed")
    stage = Stage(1, [], "task 1")
    method.before_task(stage)
    train(method, 2, stage)
    with torch.no_grad():
        method._task.logits.zero_()
        method._task.logits[0, [1, 4], 1] = 1.0
    method.after_task(stage)
    assert method._active[0] == [0, 8, 2, 3, 9, 5, 6, 7]
    raw = guidance.expert_sensitivity(model, method._candidates, method._active, probe["replay"],
                                      contextlib.nullcontext)
    layer = moe.moe_layers(model)[0]
    params = [w for g in layer.groups for w in (g.gate, g.up, g.down)]
    for p in params:
        p.requires_grad_(True)
    loss = sum(model(**b).loss for b in probe["replay"]) / len(probe["replay"])
    grads = dict(zip(map(id, params), torch.autograd.grad(loss, params)))
    for k, e in enumerate(method._active[0]):
        g, j = guidance.expert_owners(layer)[e]
        parts = [grads[id(w)][j] for w in (g.gate, g.up, g.down)]
        want = math.sqrt(sum(float(x.pow(2).sum()) for x in parts)) / math.sqrt(sum(x.numel() for x in parts))
        assert float(raw[0, k]) == pytest.approx(want, rel=1e-4)


def test_the_drift_and_the_probe_size_travel_as_set(probe, monkeypatch):
    """The measured drift is in the state a stage checkpoint keeps, and a checkpoint
    without it (written before the guided init) is refused on resume; probe_batches
    reaches the probe and mask_reach the schedule. Mutations caught: the drift left
    out of state_dict; probe_batches or mask_reach ignored."""
    from cl_bench.errors import UserError

    method, model = measuring(probe_batches=7, mask_reach=0.8)
    method._drift = ([0.1, 0.2], "given")
    state = method.state_dict()
    fresh, _ = measuring()
    fresh.load_state_dict(state)
    assert fresh._drift == ([0.1, 0.2], "given")
    del state["drift"]
    with pytest.raises(UserError, match="before the guided mask init"):
        fresh.load_state_dict(state)
    sizes = []
    real = bilevel_cka.replay_batches
    monkeypatch.setattr(bilevel_cka, "replay_batches", lambda ctx, ex, n, key: sizes.append(n) or real(ctx, ex, n, key))
    method.ctx.stage_steps = lambda stage: 8
    method.before_task(Stage(1, [], "task 1"))
    assert sizes == [7]
    assert 2 * 4 * method._task.mask_lr == pytest.approx(0.8)  # 8 steps: 4 updates, reach 0.8
