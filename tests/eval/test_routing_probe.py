"""The routing-drift probe (cl_bench/eval/probes/routing.py) on the tiny Llama,
upcycled: distributions of top-k assignments and their JS divergence from the
stage that learned the task."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from cl_bench.eval.probes.routing import RoutingProbe, js_divergence, routed_layers
from cl_bench.benchmarks.trace.loader import Example
from cl_bench.config import TrainConfig
from cl_bench.data.encode import Encoder
from cl_bench.models import moe
from cl_bench.models.loading import tiny_llama


def task(name="A", n=6):
    test = [Example(f"Question: {i} plus {i + 1}? Answer:", f"{2 * i + 1}", i) for i in range(n)]
    return SimpleNamespace(name=name, test=test)


@pytest.fixture
def upcycled():
    model, tokenizer, _ = tiny_llama(0)
    torch.manual_seed(0)
    layers = moe.upcycle_model(model, k=2, n_per_group=8, router_std=0.5)
    encoder = Encoder.from_config(tokenizer, TrainConfig(max_prompt_len=96, max_answer_len=16,
                                                         truncation_head=16))
    return model, layers, encoder


def test_js_divergence_bounds_and_padding():
    assert js_divergence([0.5, 0.5], [0.5, 0.5]) == 0.0
    assert js_divergence([1.0, 0.0], [0.0, 1.0]) == pytest.approx(1.0)
    # an expert added later has probability 0 in the reference
    assert js_divergence([0.5, 0.5, 0.0], [0.5, 0.5]) == 0.0
    p, q = [0.7, 0.2, 0.1], [0.1, 0.3, 0.6]
    m = [(a + b) / 2 for a, b in zip(p, q)]
    by_hand = 0.5 * sum(a * math.log2(a / c) for a, c in zip(p, m)) + \
        0.5 * sum(b * math.log2(b / c) for b, c in zip(q, m))
    assert js_divergence(p, q) == pytest.approx(by_hand)
    assert js_divergence(p, q) == pytest.approx(js_divergence(q, p))


def test_shares_count_the_top_k_assignments_of_the_probe_tokens(upcycled):
    model, layers, encoder = upcycled
    probe = RoutingProbe(n_examples=4)
    t = task()
    shares = probe.distributions(model, encoder, t)
    assert len(shares) == len(layers) == len(routed_layers(model))
    for layer, s in zip(layers, shares):
        assert len(s) == layer.n_experts
        assert sum(s) == pytest.approx(1.0)
    # by hand for layer 0: route the layer's inputs at the non-pad tokens
    inputs = []
    handle = layers[0].register_forward_pre_hook(lambda m, a: inputs.append(a[0].reshape(-1, a[0].shape[-1])))
    rows = [encoder.train_example(e.prompt, e.answer) for e in t.test[:4]]
    from cl_bench.data.encode import collate
    batch = collate(rows, encoder.tokenizer.pad_token_id)
    with torch.no_grad():
        model.eval()
        model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False)
    handle.remove()
    x = inputs[0][batch["attention_mask"].reshape(-1).bool()]
    _, _, picked = layers[0].route(x)
    want = torch.bincount(picked.reshape(-1), minlength=layers[0].n_experts).double() / picked.numel()
    assert shares[0] == pytest.approx(want.tolist())
    assert max(shares[0]) < 1.0  # a real spread, so the test can see a change


def test_js_is_zero_for_an_unchanged_model_and_grows_when_routing_moves(upcycled):
    model, layers, encoder = upcycled
    probe = RoutingProbe(n_examples=4)
    a = task("A")
    first = probe.after_stage(model, encoder, [a])
    assert "js" not in first["A"] and len(first["A"]["shares"]) == len(layers)
    same = probe.after_stage(model, encoder, [a])
    assert same["A"]["js"] == [0.0] * len(layers)
    # a new group whose router rows dominate: a's tokens now go to the new experts
    for layer in layers:
        layer.add_group(router_std=0.0)
        with torch.no_grad():
            layer.groups[-1].router_bias.fill_(50.0)
    moved = probe.after_stage(model, encoder, [a])
    assert all(js > 0.9 for js in moved["A"]["js"])
    assert all(len(s) == layer.n_experts == 16 for s, layer in zip(moved["A"]["shares"], layers))
    # the reference survives a checkpoint
    restored = RoutingProbe(n_examples=4)
    restored.load_state_dict(probe.state_dict())
    assert restored.after_stage(model, encoder, [a])["A"]["js"] == moved["A"]["js"]


def test_a_dense_model_records_nothing():
    model, tokenizer, _ = tiny_llama(0)
    encoder = Encoder.from_config(tokenizer, TrainConfig(max_prompt_len=96, max_answer_len=16,
                                                         truncation_head=16))
    assert RoutingProbe(2).after_stage(model, encoder, [task()]) == {}
