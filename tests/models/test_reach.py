"""ExpertReach (cl_bench/models/reach.py): an expert group no token of a step reached is
what the torch backend sees without a gradient, and the MoE methods name it idle so that
ZeRO's optimiser leaves it alone too (zero_engine). Mutations caught: the layers not
counting (every group named idle, group 0 included), a padding copy's tokens counted
(group 1 no longer idle), a forward without gradients counted (the same), the groups
routed beside a layer's own (bilevel-cka's supernet clones) left uncounted."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from cl_bench.models import moe
from cl_bench.models.loading import tiny_llama
from cl_bench.models.reach import ExpertReach
from cl_bench.methods.bilevel_cka.supernet import Supernet
from cl_bench.step_gradients import StepGradients


def _two_groups(bias: float):
    """The tiny Llama upcycled, each layer with a second group whose router bias is `bias`
    (-1e4: no token goes there; +1e4: every token's top-k is in it)."""
    torch.manual_seed(0)
    model, tok, _ = tiny_llama(0)
    layers = moe.upcycle_model(model, k=2, n_per_group=4)
    for layer in layers:
        layer.add_group()
        layer.groups[1].router_bias.data.fill_(bias)
    return model, tok, layers


def _forward(model, tok):
    ids = torch.tensor([tok.encode("12 plus 13 is 25")])
    return model(input_ids=ids, labels=ids).loss


def test_the_groups_no_token_reached_are_the_ones_without_a_gradient():
    model, tok, layers = _two_groups(-1e4)
    ctx = SimpleNamespace(padding=False, grads=StepGradients())
    reach = ExpertReach(model, ctx)
    model.train()
    _forward(model, tok).backward()
    idle = reach.idle(0)
    assert {id(p) for p in idle} == {id(p) for layer in layers for p in (layer.groups[1].gate, layer.groups[1].up,
                                                                         layer.groups[1].down)}
    assert all(p.grad is None for p in idle)
    assert all(p.grad is not None for layer in layers for p in (layer.groups[0].gate, layer.groups[0].down))
    assert reach.units() == [[g.gate, g.up, g.down] for layer in layers for g in layer.groups]


def test_a_padding_copy_and_a_forward_without_gradients_reach_nothing():
    model, tok, layers = _two_groups(1e4)  # every token goes to group 1
    ctx = SimpleNamespace(padding=True, grads=StepGradients())
    reach = ExpertReach(model, ctx)
    model.train()
    _forward(model, tok)
    ctx.padding = False
    with torch.no_grad():
        _forward(model, tok)
    assert len(reach.idle(0)) == 2 * 3 * len(layers)  # both groups of every layer
    _forward(model, tok)
    assert {id(p) for p in reach.idle(1)} == {id(p) for layer in layers for p in (layer.groups[0].gate,
                                                                                  layer.groups[0].up,
                                                                                  layer.groups[0].down)}


def test_clones_whose_masks_are_all_closed_are_idle_as_torch_sees_them():
    """bilevel-cka's supernet: a layer whose step sample closes every clone (pi = 0) routes
    no token to them, so on one process they get no gradient and AdamW skips them; they
    must be named idle so that ZeRO skips them too. A layer with its clones open is not."""
    torch.manual_seed(0)
    model, tok, _ = tiny_llama(0)
    layers = moe.upcycle_model(model, k=2, n_per_group=4)
    for layer in layers:
        layer.requires_grad_(False)
    blocks = moe.decoder_layers(model)
    nets = [Supernet(blocks[i].mlp, [0, 1, 2, 3], 0.02, torch.Generator().manual_seed(i)) for i in range(len(blocks))]
    for block, net, pi in zip(blocks, nets, (0.0, 1.0, 0.0)):
        block.mlp = net
        net.pi = torch.full((4,), pi)
    ctx = SimpleNamespace(padding=False, grads=StepGradients())
    reach = ExpertReach(model, ctx)
    model.train()
    _forward(model, tok).backward()
    idle = {id(p) for p in reach.idle(0)}
    closed = {id(p) for net in nets if not net.pi.any() for p in (net.clones.gate, net.clones.up, net.clones.down)}
    assert closed and idle == closed
    trained = [p for unit in reach.units() for p in unit if p.requires_grad]
    assert {id(p) for p in trained if p.grad is None} == idle  # exactly what torch's AdamW skips
    assert len(reach.units()) == 2 * len(nets)  # each layer's own group, then its clones
