"""Batched greedy decoding equals one-at-a-time decoding and HF's greedy search."""
from __future__ import annotations

import pytest
import torch

from cl_bench.run import precision
from cl_bench.eval.generation import greedy_generate
from cl_bench.models.loading import tiny_llama
from helpers import assert_decodes_as_the_plain_loop


def prompts(tok):
    texts = ["Solve: 3 + 4 =", "hi", "A much longer prompt with many more tokens in it", "Py: def f(x):"]
    return [tok(t).input_ids for t in texts]


def test_batched_equals_single_prompt_decoding():
    model, tok, _ = tiny_llama(0)
    ps = prompts(tok)
    batched = greedy_generate(model, ps, 12, tok.eos_token_id, tok.pad_token_id, batch_size=4)
    single = greedy_generate(model, ps, 12, tok.eos_token_id, tok.pad_token_id, batch_size=1)
    assert batched == single
    assert all(len(g) == 12 for g in batched)  # random model: no EOS within 12 tokens


def test_matches_transformers_greedy_search():
    model, tok, _ = tiny_llama(1)
    (p,) = prompts(tok)[:1]
    ours = greedy_generate(model, [p], 10, tok.eos_token_id, tok.pad_token_id, batch_size=1)[0]
    ref = model.generate(torch.tensor([p]), max_new_tokens=10, do_sample=False,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    assert ours == ref[0, len(p):].tolist()


def test_stops_at_eos_and_drops_it():
    model, tok, _ = tiny_llama(0)
    ps = prompts(tok)
    free = greedy_generate(model, ps, 6, tok.eos_token_id, tok.pad_token_id, batch_size=4)
    # Make the 3rd token the model picks for prompt 0 behave as EOS.
    eos = free[0][2]
    stopped = greedy_generate(model, ps, 6, eos, tok.pad_token_id, batch_size=4)
    assert stopped[0] == free[0][:2]


@pytest.mark.parametrize("precision_name", ["fp32", "bf16"])
def test_stopped_rows_leave_the_batch_and_the_others_decode_as_before(precision_name):
    """The rows still decoding give what the plain loop gives (every row to the end)."""
    model, tok, _ = tiny_llama(0)
    ps = prompts(tok) + [tok(t).input_ids for t in ["x = 1", "Summarise: the meeting was long"]]
    with precision.evaluation(precision_name, torch.device("cpu"), model):
        assert_decodes_as_the_plain_loop(model, ps, 10, tok.pad_token_id, batch_size=4)


def test_keys_and_values_stay_in_the_buffers_reserved_after_the_prefill():
    """Every step writes into the same buffers, each with exactly the room the budget needs,
    and decodes what transformers' growing cache decodes.
    Mutations caught: reserve() not called (transformers' cache: new storage every step);
    the buffers grown a step (no room reserved); a view one position off (other tokens)."""
    model, tok, _ = tiny_llama(0)
    ps, new_tokens = prompts(tok), 8
    width = max(len(p) for p in ps)
    seen = []  # per forward: (data pointer, filled length, room) of each layer's keys

    def look(module, args, out):
        cache = out.cache if getattr(out, "cache", None) is not None else out.past_key_values
        seen.append([(layer.keys.data_ptr(), layer.keys.shape[-2], layer.keys.untyped_storage().nbytes())
                     for layer in cache.layers])

    handle = model.register_forward_hook(look)
    try:
        ours = greedy_generate(model, ps, new_tokens, -1, tok.pad_token_id, batch_size=4)
    finally:
        handle.remove()
    steps = seen[1:]  # the prefill's cache is transformers' own, moved after the call
    assert len(steps) == new_tokens - 1
    for i, layers in enumerate(steps):
        assert [p for p, _, _ in layers] == [p for p, _, _ in steps[0]]  # the same storage
        assert {t for _, t, _ in layers} == {width + i + 1}
    room = steps[0][0][2]  # bytes: B x heads x (width + budget - 1) x d x 4 (fp32)
    assert room == len(ps) * model.config.num_key_value_heads * (width + new_tokens - 1) \
        * (model.config.hidden_size // model.config.num_attention_heads) * 4
    assert ours == greedy_generate(model, ps, new_tokens, -1, tok.pad_token_id, batch_size=4, reserve_kv=False)
