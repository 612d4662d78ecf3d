"""The upcycled MoE layer on the tiny Llama (width 64, FFN 128: K = 8 slices of h = 16).
End-to-end runs of upcycle and drop-upcycle: tests/methods/test_upcycle.py."""
from __future__ import annotations

import copy

import pytest
import torch

from cl_bench.models import moe
from cl_bench.models.loading import tiny_llama

D, H, K, h = 64, 128, 8, 16


@pytest.fixture(autouse=True)
def seeded():
    """Every test starts from the same global RNG (router rows are drawn from it), so
    its data does not depend on the tests run before it in the process (order, xdist:
    a gradient check failed at atol 1e-6 after tests/models/test_modes.py moved the
    RNG; with this it passes at seeds 0-7)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        yield


@pytest.fixture
def dense():
    model, _, _ = tiny_llama(0)
    return model.model.layers[0].mlp  # LlamaMLP: gate/up (128, 64), down (64, 128)


def tokens(n=24, seed=0) -> torch.Tensor:
    return torch.randn(n, D, generator=torch.Generator().manual_seed(seed))  # (N, d)


def random_experts(seed):
    """A distinct random group, so experts of different groups compute different things."""
    def init(dense_mlp, n_per_group):
        g = torch.Generator().manual_seed(seed)
        return (torch.randn(K, h, D, generator=g) * 0.1, torch.randn(K, h, D, generator=g) * 0.1,
                torch.randn(K, D, h, generator=g) * 0.1)
    return init


def swiglu(x, gate, up, down):
    return (torch.nn.functional.silu(x @ gate.T) * (x @ up.T)) @ down.T


def test_a_group_of_slices_with_weight_one_is_the_dense_mlp(dense):
    layer = moe.UpcycledMoE(copy.deepcopy(dense), k=K)
    layer.add_group()
    x1 = tokens().requires_grad_()
    x2 = x1.detach().clone().requires_grad_()
    everyone = torch.arange(K).expand(len(x1), K)  # every token to all 8 slices, weight 1
    out = layer.experts_forward(x1, torch.ones(len(x1), K), everyone)
    ref = dense(x2)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)

    grad = torch.randn_like(ref)
    dense.requires_grad_(True)
    out.backward(grad)
    ref.backward(grad)
    torch.testing.assert_close(x1.grad, x2.grad, rtol=1e-5, atol=1e-6)
    g = layer.groups[0]
    torch.testing.assert_close(g.gate.grad, dense.gate_proj.weight.grad.reshape(K, h, D), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(g.up.grad, dense.up_proj.weight.grad.reshape(K, h, D), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(g.down.grad, dense.down_proj.weight.grad.reshape(D, K, h).permute(1, 0, 2),
                               rtol=1e-5, atol=1e-6)


def test_dispatch_matches_running_every_expert_on_every_token(dense):
    layer = moe.UpcycledMoE(dense, k=2)
    for seed in range(3):  # 24 experts in 3 distinct groups
        layer.add_group(random_experts(seed))
    x1 = tokens(40).requires_grad_()
    x2 = x1.detach().clone().requires_grad_()
    _, weights, indices = layer.route(x1.detach())
    weights = weights.detach().requires_grad_()  # (N, k): a leaf, so its gradient is compared too
    out = layer.experts_forward(x1, weights, indices)

    # naive reference: each expert on all tokens, masked by its routing weight
    ref = torch.zeros_like(x2)
    for e, (gate, up, down) in enumerate(layer.experts()):
        w = (weights * (indices == e)).sum(dim=1, keepdim=True)  # (N, 1), 0 unless routed to e
        ref = ref + w * swiglu(x2, gate, up, down)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)

    grad = torch.randn_like(out)
    params = [p for g in layer.groups for p in (g.gate, g.up, g.down)]
    got = torch.autograd.grad(out, [x1, weights, *params], grad)
    want = torch.autograd.grad(ref, [x2, weights, *params], grad)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_dense_routing_runs_every_expert_as_the_dispatch_would(dense):
    """k = E (every expert on every token, here over 3 distinct groups and an extra
    one): the one-product-a-group path gives the naive sum and its gradients.
    Mutations caught: the weights left out; down's columns taken without the
    transpose (expert j's neurons meet another expert's down rows); the k = E branch
    removed (the dispatch runs)."""
    layer = moe.UpcycledMoE(copy.deepcopy(dense), k=4 * K)
    for seed in range(4):
        layer.add_group(random_experts(seed), router_std=1.0)
    extra = layer.groups.pop(3)  # routed after the layer's own 24
    x1 = tokens(40).requires_grad_()
    x2 = x1.detach().clone().requires_grad_()
    _, weights, indices = layer.route(x1.detach(), extra, torch.ones(K))
    assert indices.shape == (40, 4 * K)
    weights = weights.detach().requires_grad_()
    calls = []
    layer.dispatch = lambda *a: calls.append(a)  # experts_forward must not dispatch at k = E
    out = layer.experts_forward(x1, weights, indices, extra)
    del layer.dispatch
    assert not calls
    ref = torch.zeros_like(x2)
    for e, (gate, up, down) in enumerate(layer.experts(extra)):
        w = (weights * (indices == e)).sum(dim=1, keepdim=True)
        ref = ref + w * swiglu(x2, gate, up, down)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(layer.dispatch(x1, weights, indices, extra), ref, rtol=1e-5, atol=1e-6)
    grad = torch.randn_like(out)
    params = [p for g in [*layer.groups, extra] for p in (g.gate, g.up, g.down)]
    got = torch.autograd.grad(out, [x1, weights, *params], grad)
    want = torch.autograd.grad(ref, [x2, weights, *params], grad)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # the whole layer at k = E: the swapped dense path plus every expert at its probability
    layer.groups.append(extra)
    y = layer(x1.detach().unsqueeze(0))
    probs, _, _ = layer.route(x1.detach())
    naive = layer.swapped_dense(x1.detach(), probs, torch.arange(4 * K).expand(40, -1))
    for e, (gate, up, down) in enumerate(layer.experts()):
        naive = naive + probs[:, e:e + 1] * swiglu(x1.detach(), gate, up, down)
    torch.testing.assert_close(y[0], naive, rtol=1e-5, atol=1e-6)


def test_topk_weights_are_renormalised(dense):
    layer = moe.UpcycledMoE(dense, k=2)
    layer.add_group()
    layer.add_group()
    probs, weights, indices = layer.route(tokens())
    assert probs.dtype == torch.float32 and probs.shape == (24, 16)
    torch.testing.assert_close(probs.sum(-1), torch.ones(24))
    torch.testing.assert_close(weights.sum(-1), torch.ones(24))
    top = probs.gather(1, indices)
    torch.testing.assert_close(weights, top / top.sum(-1, keepdim=True))
    assert (weights[:, 0] >= weights[:, 1]).all()


def test_load_balancing_loss_on_a_fixed_routing(dense):
    layer = moe.UpcycledMoE(dense, k=2, lb_coef=0.01)
    layer.add_group(router_std=0.0)  # zero rows: the biases alone route
    layer.groups[0].router_bias.data = torch.tensor([0.4, 0.3] + [0.05] * 6).log()
    layer.train()
    with moe.balancing_losses() as lb:
        layer(tokens().unsqueeze(0))
    # every token: P = (0.4, 0.3, 0.05, ...), top-2 = experts 0 and 1, so f = (0.5, 0.5, 0, ...)
    # loss = 0.01 * 8 * (0.5 * 0.4 + 0.5 * 0.3) = 0.028
    assert len(lb.terms) == 1
    torch.testing.assert_close(lb.total(), torch.tensor(0.028))

    layer.groups[0].router_bias.data = torch.zeros(8)  # uniform P = 1/8, f sums to 1: loss = coef
    with moe.balancing_losses() as lb:
        layer(tokens().unsqueeze(0))
        layer(tokens().unsqueeze(0))  # every training forward inside the block adds its term
    torch.testing.assert_close(lb.total(), torch.tensor(0.02))
    layer.eval()
    with moe.balancing_losses() as lb:
        layer(tokens().unsqueeze(0))
    assert lb.terms == [] and lb.total().item() == 0.0  # only training forwards add one
    off = moe.UpcycledMoE(dense, lb_coef=0.0)
    off.add_group()
    off.train()
    with moe.balancing_losses() as lb:
        off(tokens().unsqueeze(0))
    assert lb.terms == []


def test_the_balancing_loss_is_collected_by_its_block_never_stored_on_a_module():
    """No MoE forward leaves a tensor with a graph on any module (the loss used to be
    kept as layer.aux_loss); terms of forwards outside a block go nowhere, those of a
    nested block go to the nested one only."""
    model, _, _ = tiny_llama(0)
    moe.upcycle_model(model)
    model.train()
    ids = torch.randint(3, 259, (2, 8), generator=torch.Generator().manual_seed(0))

    def stored_graphs():
        return [(name, key) for name, m in model.named_modules() for key, v in vars(m).items()
                if isinstance(v, torch.Tensor) and v.grad_fn is not None]

    model(input_ids=ids)  # outside any block
    assert stored_graphs() == []
    with moe.balancing_losses() as outer:
        model(input_ids=ids)
        assert stored_graphs() == []
        with moe.balancing_losses() as inner:
            model(input_ids=ids)
        model(input_ids=ids)
    model(input_ids=ids)  # after the block: not collected
    assert stored_graphs() == []
    assert len(inner.terms) == 2 and len(outer.terms) == 4  # 2 MoE layers per forward
    torch.testing.assert_close(outer.total(), 2 * inner.total())
    assert inner.total().grad_fn is not None  # differentiable: it trains the routers
    assert moe.balancing.active() is None  # the block closed
    with pytest.raises(RuntimeError), moe.balancing_losses():  # closed on error too
        raise RuntimeError
    assert moe.balancing.active() is None
    copy.deepcopy(model)  # no graph held anywhere


def test_extra_gated_experts_route_as_a_layer_that_holds_them(dense):
    """route/forward with an `extra` group and gates: gate 1 everywhere is the layer with
    the group appended (balancing over E + n), gate 0 is the layer without it."""
    torch.manual_seed(0)
    layer = moe.UpcycledMoE(copy.deepcopy(dense), k=2)
    layer.add_group(random_experts(0), router_std=1.0)
    grown = copy.deepcopy(layer)
    grown.add_group(random_experts(1), router_std=1.0)
    extra = grown.groups[1]
    x = tokens(30).unsqueeze(0)
    layer.train()
    grown.train()
    with moe.balancing_losses() as gated, torch.no_grad():
        y_on = layer(x, extra, torch.ones(K))
        y_off = layer(x, extra, torch.zeros(K))
    with moe.balancing_losses() as plain, torch.no_grad():
        y_grown = grown(x)
        y_alone = layer(x)
    torch.testing.assert_close(y_on, y_grown, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(y_off, y_alone, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gated.terms[0], plain.terms[0], rtol=1e-5, atol=1e-7)  # 16 live experts
    probs, _, indices = layer.route(x[0], extra, torch.zeros(K))
    assert (indices < K).all() and (probs[:, K:] == 0).all()  # a gate 0: never chosen
    half = torch.tensor([1.0, 0.0] * (K // 2))
    probs, _, _ = layer.route(x[0], extra, half)
    assert (probs[:, K + 1::2] == 0).all() and (probs[:, K::2] > 0).all()


def test_router_row_i_scores_expert_i_after_adding_groups(dense):
    layer = moe.UpcycledMoE(dense, k=2)
    for seed in range(3):
        layer.add_group(random_experts(seed))
    experts = layer.experts()
    assert len(experts) == 24
    torch.testing.assert_close(layer.router_weight()[8:16], layer.groups[1].router_weight)
    x = tokens(6)
    for e in range(24):
        for g in layer.groups:
            g.router_weight.data.zero_()
            g.router_bias.data.zero_()
        g, i = layer.groups[e // K], e % K
        g.router_bias.data[i] = 30.0  # row e dominates: p_e ~ 1
        _, weights, indices = layer.route(x)
        assert (indices[:, 0] == e).all()
        out = layer.experts_forward(x, weights, indices)
        # the expert row e scores is the e-th expert, i.e. slot i of group e // K
        torch.testing.assert_close(out, swiglu(x, g.gate[i], g.up[i], g.down[i]), rtol=1e-5, atol=1e-6)


def test_appended_rows_with_an_expert_inserted_in_the_middle_would_fail(dense):
    """The paper code's bug: expert list [g0, new, g1] but rows [g0, g1, new]. The
    row-correspondence check above catches it; show it on such a layout."""
    layer = moe.UpcycledMoE(dense, k=2)
    for seed in range(3):
        layer.add_group(random_experts(seed))
    g0, g1, new = layer.groups
    x = tokens(6)
    new.router_bias.data[0] = 30.0  # the new group's first row: global row 16
    _, weights, indices = layer.route(x)
    assert (indices[:, 0] == 16).all()
    good = layer.experts_forward(x, weights, indices)
    torch.testing.assert_close(good, swiglu(x, new.gate[0], new.up[0], new.down[0]), rtol=1e-5, atol=1e-6)
    # misaligned: experts inserted in the middle, rows appended at the end
    experts = layer.experts()
    misaligned = experts[:8] + experts[16:] + experts[8:16]
    bad = swiglu(x, *misaligned[16])
    assert not torch.allclose(good, bad, atol=1e-3)


def test_upcycled_model_starts_as_the_dense_model():
    dense_model, _, _ = tiny_llama(0)
    model = copy.deepcopy(dense_model)
    layers = moe.upcycle_model(model)
    assert len(layers) == 2 and moe.experts_per_layer(model) == [8, 8]
    ids = torch.randint(3, 259, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, dense_model(ids).logits, rtol=1e-5, atol=1e-5)
        # the paper code's layer (dense + routed slices, unscaled) is a different function
        paper = copy.deepcopy(dense_model)
        moe.upcycle_model(paper, shared="add", routed_scale_init=1.0)
        assert not torch.allclose(paper(ids).logits, dense_model(ids).logits, atol=1e-3)
        # a scale initialised to 0 also starts as the dense model
        zero = copy.deepcopy(dense_model)
        moe.upcycle_model(zero, shared="add", routed_scale_init=0.0)
        assert torch.equal(zero(ids).logits, dense_model(ids).logits)


def test_swap_stays_the_dense_mlp_for_any_routing_and_trains_the_chosen_experts(dense):
    """With experts equal to their slices, any router (here random, over 3 groups
    whose slots repeat) gives the dense output; the experts a token chose get the
    gradient of its share of the slice."""
    torch.manual_seed(0)
    layer = moe.UpcycledMoE(dense, k=2)
    for _ in range(3):
        layer.add_group(router_std=1.0)
    x = tokens(12)
    y = layer(x)
    torch.testing.assert_close(y, dense(x), rtol=1e-5, atol=1e-6)
    y.square().sum().backward()
    _, weights, indices = layer.route(x)
    used = set(indices.reshape(-1).tolist())
    grads = [g.gate.grad[i] for g in layer.groups for i in range(len(g))]
    for e, grad in enumerate(grads):
        assert (grad.abs().sum() > 0) == (e in used), e
    # a changed expert changes the output only through the tokens routed to it
    share = torch.zeros(x.shape[0], layer.n_experts).scatter_add_(1, indices, weights)  # (N, E)
    e = int(share.amax(dim=0).argmax())  # the expert with the largest weight on some token
    group, i = layer.groups[e // 8], e % 8
    with torch.no_grad():
        group.down[i] += 0.1
        y2 = layer(x)
    moved = (y2 - y).abs().amax(dim=1) > 1e-6
    assert not moved[share[:, e] == 0].any()  # tokens not routed to it: unchanged
    assert moved[share[:, e] > 0.1].all() and moved.any()


def test_slots_follow_the_expert_and_survive_saving():
    model, _, _ = tiny_llama(0)
    moe.upcycle_model(model, layers=[0])
    layer = moe.moe_layers(model)[0]
    layer.add_group(random_experts(3), slots=[7, 6, 5, 4, 3, 2, 1, 0])
    assert layer.slots().tolist() == list(range(8)) + list(range(7, -1, -1))
    fresh, _, _ = tiny_llama(0)  # as a checkpoint restores it: the layout, then the state_dict
    moe.rebuild(fresh, moe.group_sizes(model))
    fresh.load_state_dict(model.state_dict())
    assert moe.moe_layers(fresh)[0].slots().tolist() == layer.slots().tolist()


@pytest.mark.parametrize("ratio,n_drop", [(0.25, 4), (0.5, 8), (0.75, 12), (0.3, 4)])
def test_drop_upcycle_reinitialises_a_ratio_of_each_expert_with_one_index_set(dense, ratio, n_drop):
    """floor(ratio h) of each expert's h = 16 neurons re-drawn (0.3: floor(4.8) = 4), so
    the share of re-initialised entries of every matrix is n_drop / h."""
    torch.manual_seed(0)
    gate, up, down = moe.drop_upcycle_experts(dense, K, ratio=ratio)
    gate0, up0, down0 = moe.slice_experts(dense, K)
    for w, w0 in ((gate, gate0), (up, up0), (down, down0)):
        assert float((w != w0).float().mean()) == pytest.approx(n_drop / h)
    for i in range(K):
        rows_g = (gate[i] != gate0[i]).any(dim=1)  # (h,) neurons whose gate row changed
        rows_u = (up[i] != up0[i]).any(dim=1)
        cols_d = (down[i] != down0[i]).any(dim=0)
        assert int(rows_g.sum()) == n_drop
        assert torch.equal(rows_g, rows_u) and torch.equal(rows_g, cols_d)
        assert (gate[i][rows_g] != gate0[i][rows_g]).all()  # the whole row is redrawn
        # drawn from N(mean, std) of the entries replaced (n_drop * 64 draws: loose check)
        old, new = gate0[i][rows_g], gate[i][rows_g]
        assert abs(float(new.std() / old.std()) - 1) < 0.25
    masks = [(gate[i] != gate0[i]).any(dim=1) for i in range(K)]
    assert any(not torch.equal(masks[0], m) for m in masks[1:])  # one index set per expert


@pytest.mark.filterwarnings(r"ignore:std\(\)")  # ratio 0: torch warns on the std of the empty block (never written)
@pytest.mark.parametrize("ratio", [0.0, 1.0])
def test_drop_upcycle_at_ratio_0_is_the_slices_and_at_1_redraws_everything(dense, ratio):
    torch.manual_seed(0)
    dropped = moe.drop_upcycle_experts(dense, K, ratio=ratio)
    for w, w0 in zip(dropped, moe.slice_experts(dense, K)):
        assert float((w != w0).float().mean()) == ratio


@pytest.mark.parametrize("layers", [None, [1]])
def test_varying_experts_per_layer_round_trip(layers):
    model, _, _ = tiny_llama(0)
    moe.upcycle_model(model, layers=layers)
    last = moe.moe_layers(model)[-1]
    last.add_group(random_experts(1))
    last.add_group(random_experts(2))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))  # trained-looking weights, scale != 0
    expected = [8, 24] if layers is None else [0, 24]
    assert moe.experts_per_layer(model) == expected
    ids = torch.randint(3, 259, (2, 10), generator=torch.Generator().manual_seed(1))
    model.eval()
    want = model(ids).logits

    fresh, _, _ = tiny_llama(5)  # other weights: all must come from the state_dict
    moe.rebuild(fresh, expected)
    fresh.load_state_dict(model.state_dict())  # strict
    assert moe.group_sizes(fresh) == moe.group_sizes(model)
    assert torch.equal(fresh.eval()(ids).logits, want)
