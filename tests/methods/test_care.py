"""CaRE on the tiny Llama (2 layers, width 64): prompt pooling in each kind of forward,
the KV cache, the routing pieces by hand (the model and runs: test_care_model.py)."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from cl_bench.data.encode import IGNORE, Encoder
from cl_bench.eval.generation import greedy_generate
from cl_bench.methods.care.layer import entropy, select_routers, top_k_softmax
from cl_bench.methods.care.pseudo_labels import kmeans, perceiver_loss
from cl_bench.models.loading import tiny_llama
from cl_bench.models.prompt_pool import DECODE, POOL, PromptPool, first_tokens, masked_mean, prompt_mask, prompt_tokens
from care_setup import G, TASKS, batch_of, grow, left_pad, make


# ---- prompt pooling ---------------------------------------------------------------------

def test_prompt_mask_keeps_prompt_tokens_and_drops_position_zero():
    # training rows: prompt (-100), answer, right padding
    attn = torch.tensor([[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 0, 0]])
    labels = torch.tensor([[-100, -100, -100, 5, 6, -100], [-100, 7, 8, 2, -100, -100]])
    assert prompt_mask(attn, labels).int().tolist() == [[0, 1, 1, 0, 0, 0],
                                                        [1, 0, 0, 0, 0, 0]]  # one-token prompt: kept
    assert prompt_mask(attn, labels, skip_first=False).int().tolist() == [[1, 1, 1, 0, 0, 0],
                                                                          [1, 0, 0, 0, 0, 0]]
    # prefill: left padding, every attended token is prompt, the first attended one dropped
    attn = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    assert prompt_mask(attn).int().tolist() == [[0, 0, 0, 1, 1], [0, 1, 1, 1, 1]]
    # a row without prompt tokens pools its attended ones
    assert prompt_mask(torch.tensor([[1, 1, 1]]), torch.tensor([[4, 5, 6]])).int().tolist() == [[0, 1, 1]]
    # the pieces: the raw prompt tokens (no fallback), each row's first attended token
    assert prompt_tokens(torch.tensor([[1, 1, 1]]), torch.tensor([[4, 5, 6]])).int().tolist() == [[0, 0, 0]]
    assert first_tokens(torch.tensor([[0, 0, 1, 1], [1, 1, 0, 0]])).int().tolist() == [[0, 0, 1, 0], [1, 0, 0, 0]]
    x = torch.arange(12.0).reshape(1, 3, 4).repeat(2, 1, 1)
    pooled = masked_mean(x, torch.tensor([[0, 1, 1], [0, 0, 0]]).bool())
    assert pooled.dtype == torch.float32
    assert pooled.tolist() == [[6.0, 7.0, 8.0, 9.0], [0.0] * 4]


def test_the_pre_hook_tells_training_prefill_and_decode_apart():
    model, _, _ = tiny_llama(0)
    pool = PromptPool()
    pool.install(model)
    ids = torch.randint(3, 259, (2, 6))
    labels = ids.clone()
    labels[:, :3] = IGNORE
    model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=labels)
    assert pool.kind == POOL and pool.mask.int().tolist() == [[0, 1, 1, 0, 0, 0]] * 2
    out = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=True)
    assert pool.kind == POOL and pool.mask.int().tolist() == [[0, 1, 1, 1, 1, 1]] * 2
    mask = torch.ones(2, 7, dtype=torch.long)
    model(input_ids=ids[:, :1], attention_mask=mask, use_cache=True, cache=out.cache)
    assert pool.kind == DECODE and pool.mask is None
    with pytest.raises(ValueError, match="chunked prefill"):
        model(input_ids=ids[:, :2], attention_mask=torch.ones(2, 9, dtype=torch.long), use_cache=True,
              cache=out.cache)
    # SAME's rule (refuse_chunked=False): any forward after a non-empty cache is a decode step
    lenient = PromptPool(skip_first=False, refuse_chunked=False)
    lenient.read((), {"input_ids": ids, "attention_mask": torch.ones_like(ids)})
    assert lenient.kind == POOL and lenient.mask.all() and lenient.attended.all()
    lenient.read((), {"input_ids": ids[:, :2], "cache": out.cache})
    assert lenient.kind == DECODE and lenient.mask is None and lenient.attended is None


def test_routing_pools_the_prompt_only_and_matches_the_prefill():
    method, model = make()
    grow(method, 3)
    model.eval()
    b = batch_of(method, TASKS[1])
    answer = b["labels"] != IGNORE

    def routing(batch):
        with torch.no_grad():
            method._forward(batch, None)
        return [layer.routing.clone() for layer in method.layers]  # L x (B, n)

    base = routing(b)
    assert base[1].shape == (8, 3) and base[1].std() > 0
    other = {k: v.clone() for k, v in b.items()}
    other["input_ids"][answer] = (b["input_ids"][answer] + 17) % 250 + 3  # different answers
    other["labels"] = torch.where(answer, other["input_ids"], b["labels"])
    for x, y in zip(base, routing(other)):
        torch.testing.assert_close(x, y, rtol=0, atol=0)  # answers never enter the pool
    changed = {k: v.clone() for k, v in b.items()}
    changed["input_ids"][:, 3] = (b["input_ids"][:, 3] + 17) % 250 + 3  # a prompt token
    assert not torch.allclose(routing(changed)[1], base[1])

    # the same prompts alone, left padded as the decoder prefills them: the same routing
    enc = Encoder.from_config(method.ctx.tokenizer, method.ctx.config.train)
    ids, mask = left_pad([enc.prompt_ids(e.prompt) for e in TASKS[1].train], 0)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
              use_cache=True)
    for x, layer in zip(base, method.layers):
        torch.testing.assert_close(layer.routing, x, rtol=0, atol=1e-5)


def test_same_logits_with_and_without_the_kv_cache_under_left_padding():
    method, model = make()
    grow(method, 3)
    model.eval()
    enc = Encoder.from_config(method.ctx.tokenizer, method.ctx.config.train)
    prompts = [enc.prompt_ids(TASKS[j].test[0].prompt) for j in range(3)]
    g = torch.Generator().manual_seed(3)
    cont = torch.randint(3, 259, (3, 4), generator=g)  # tokens fed after the prompts
    ids, mask = left_pad(prompts, 0)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True)
        cached = [out.logits[:, -1]]
        cache = out.cache
        for s in range(cont.shape[1]):
            mask = torch.cat([mask, torch.ones(3, 1, dtype=torch.long)], dim=1)
            out = model(input_ids=cont[:, s:s + 1], attention_mask=mask, position_ids=pos[:, -1:] + s + 1,
                        use_cache=True, cache=cache)
            cache = out.cache
            cached.append(out.logits[:, -1])
        # one full forward over prompt + continuation: labels mark the prompt (-100)
        full_ids = torch.cat([ids, cont], dim=1)
        labels = torch.cat([torch.full_like(ids, IGNORE), cont], dim=1)
        full = model(input_ids=full_ids, attention_mask=mask, labels=labels,
                     position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits
    width = ids.shape[1]
    torch.testing.assert_close(torch.stack(cached, 1), full[:, width - 1:], rtol=0, atol=1e-5)

    # and the harness's decoder agrees with unpadded full forwards of its own outputs
    generated = greedy_generate(model, prompts, 5, eos_id=-1, pad_id=0, batch_size=3)
    for p, gen in zip(prompts, generated):
        row = torch.tensor([p + gen])
        with torch.no_grad():
            logits = model(input_ids=row, labels=torch.tensor([[IGNORE] * len(p) + gen])).logits
        assert logits[0, len(p) - 1:-1].argmax(-1).tolist() == gen


def test_a_decode_step_needs_a_prefill_first():
    method, model = make()
    grow(method, 2)
    model.eval()
    for layer in method.layers:
        layer.routing = None
    ids = torch.randint(3, 259, (2, 5))
    with torch.no_grad():
        with pytest.raises(RuntimeError, match="no prompt mask"):  # a submodule alone: no pool set
            model.base_model(input_ids=ids, use_cache=True)
        method.control.bypass = True
        cache = model.base_model(input_ids=ids, use_cache=True).cache  # no routing made
        method.control.bypass = False
        with pytest.raises(RuntimeError, match="without a prefill"):
            model(input_ids=ids[:, :1], attention_mask=torch.ones(2, 6, dtype=torch.long), use_cache=True,
                  cache=cache)


# ---- routing pieces by hand ------------------------------------------------------------

def test_router_selection_by_lowest_entropy_and_forced_in_training():
    h = torch.tensor([[0.9, 0.2, 0.5, 0.1], [0.3, 0.4, 0.1, 2.0]])
    assert select_routers(h, None, 2).tolist() == [[0, 1, 0, 1], [1, 0, 1, 0]]
    assert select_routers(h, None, 9).tolist() == [[1, 1, 1, 1]] * 2
    # training task 3: R_3 plus the lowest-entropy router among 0..2
    assert select_routers(h, torch.tensor([3, 3]), 2).tolist() == [[0, 1, 0, 1], [0, 0, 1, 1]]
    # oracle for an earlier task: only routers before it compete; task 0 has none
    assert select_routers(h, torch.tensor([2, 0]), 2).tolist() == [[0, 1, 1, 0], [1, 0, 0, 0]]
    assert select_routers(h, torch.tensor([1, 1]), 1).tolist() == [[0, 1, 0, 0]] * 2


def test_top_k_router_and_fp32_entropy():
    p = top_k_softmax(torch.tensor([[1.0, 5.0, 2.0, 4.0, 3.0]]), 3)
    torch.testing.assert_close(p[0, [1, 3, 4]], torch.tensor([5.0, 4.0, 3.0]).softmax(0))
    assert float(p[0, [0, 2]].max()) < 1e-40  # -100 logits
    torch.testing.assert_close(top_k_softmax(torch.tensor([[1.0, 2.0]]), 3), torch.tensor([[1.0, 2.0]]).softmax(-1))
    low = torch.tensor([[0.3, -1.1, 2.5, 0.0]], dtype=torch.bfloat16)
    h = entropy(low)
    assert h.dtype == torch.float32
    q = low.float().softmax(-1)
    torch.testing.assert_close(h, -(q * q.log()).sum(-1))
    assert entropy(torch.zeros(1, G)).item() == pytest.approx(math.log(G))


def test_entropies_and_routing_stay_fp32_in_a_bf16_model():
    method, model = make()
    grow(method, 2)
    model.to(torch.bfloat16).eval()
    b = batch_of(method, TASKS[0])
    with torch.no_grad():
        out, records = method._forward(b, None)
    assert out.logits.dtype == torch.bfloat16 and len(records) == 2
    for r in records:
        assert r["entropy"].dtype == r["perceiver"].dtype == torch.float32
    assert all(layer.routing.dtype == torch.float32 for layer in method.layers)


def test_perceiver_loss_by_hand():
    g = torch.Generator().manual_seed(0)
    z = [torch.randn(3, G, generator=g).requires_grad_() for _ in range(2)]
    y = torch.tensor([1, 4, 7])
    loss, ce, kl = perceiver_loss(z, y, 20.0, [1.0, 2.0])
    ce0, ce1 = F.cross_entropy(20 * z[0], y), F.cross_entropy(20 * z[1], y)
    t = z[1].detach()
    kl0 = (t.softmax(-1) * (t.log_softmax(-1) - z[0].log_softmax(-1))).sum(-1).mean()
    torch.testing.assert_close(loss, 0.5 * ((ce0 + ce1) / 2 + (kl0 + 0) / 2))
    torch.testing.assert_close(kl, kl0 / 2)
    loss.backward()
    # the last layer is its own (detached) teacher: only its CE reaches it
    (expect,) = torch.autograd.grad(0.25 * F.cross_entropy(20 * z[1], y), z[1])
    torch.testing.assert_close(z[1].grad, expect)


def test_kmeans_recovers_separated_groups_and_is_seeded():
    g = torch.Generator().manual_seed(0)
    centres = torch.randn(4, 16, generator=g) * 10
    x = torch.cat([c + 0.1 * torch.randn(10, 16, generator=g) for c in centres])
    labels, cents = kmeans(x, 4, 50, torch.Generator().manual_seed(1))
    groups = labels.reshape(4, 10)
    assert all(len(set(row.tolist())) == 1 for row in groups) and len(set(groups[:, 0].tolist())) == 4
    assert torch.equal(kmeans(x, 4, 50, torch.Generator().manual_seed(1))[0], labels)
    assert torch.equal(torch.cdist(x, cents).argmin(1), labels)  # labels = nearest centroid
    few, c = kmeans(x[:3], 8, 50, torch.Generator().manual_seed(1))
    assert few.tolist() == [0, 1, 2] and c.shape == (3, 16)
