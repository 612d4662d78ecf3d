"""Batched greedy decoding with left padding and the KV cache.

Prompts are sorted by length (less padding), left-padded so every row's last
prompt token sits in the final column, run once through the model (prefill,
logits for the last position only), then extended one token per step from the
cache. Position ids come from the attention mask, so padded rows see the same
positions as they would alone. A row stops at EOS; the batch stops when all
rows have, or at `max_new_tokens`.

What a step costs beyond the model (issue 42; `cl-bench perf eval-profile`):
- a row that has stopped leaves the batch: its cache rows go
  (`Cache.batch_select_indices`) and so do those of every module that keeps
  per-row state from the prefill to the steps (`keep_rows(index)`: SAME's and
  CaRE's routing weights), so later steps compute only live rows;
- the attention mask of every step is a slice of one (B, prompt + budget) mask
  made at the prefill, not a new concatenation;
- after the prefill, each layer's keys and values move into one (B, heads,
  prompt + budget - 1, d) buffer (`ReservedLayer`); a step writes its column in
  place and attention reads the filled part as a view, where transformers' cache
  (`DynamicLayer`) concatenates, copying every layer's whole cache, every step
  (`reserve_kv=False` keeps transformers' cache: the baseline of
  `cl-bench perf eval-speed --baseline growing-cache`);
- the tokens go into one (B, budget) tensor, read out once at the end, not into
  Python lists row by row.
Each live row's arithmetic is that of the plain loop (every row to the end,
pads fed to stopped rows): the kernels compute rows independently, which
`cl-bench perf eval-speed` and tests/eval/test_generation.py check prediction by
prediction against the plain loop (cl_bench/tools/perf/plain_decoding.py).
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn
from transformers.cache_utils import DynamicLayer

from cl_bench.models.modes import device_of, eval_mode


@torch.no_grad()
def greedy_generate(model: nn.Module, prompts: list[list[int]], max_new_tokens: int, eos_id: int,
                    pad_id: int, batch_size: int,
                    on_batch: Callable[[int], None] | None = None, reserve_kv: bool = True) -> list[list[int]]:
    """Greedy continuations (token ids, EOS excluded) for each prompt, in input order."""
    device = device_of(model)
    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
    outputs: list[list[int]] = [[] for _ in prompts]
    with eval_mode(model):
        row_state = [m for m in model.modules() if hasattr(m, "keep_rows")]
        for start in range(0, len(order), batch_size):
            rows = order[start:start + batch_size]
            for i, gen in zip(rows, _generate_batch(model, [prompts[i] for i in rows], max_new_tokens,
                                                    eos_id, pad_id, device, row_state, reserve_kv)):
                outputs[i] = gen
            if on_batch is not None:
                on_batch(len(rows))
    return outputs


def left_padded(prompts: list[list[int]], pad_id: int, extra: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ids (B, L) left-padded with pad_id, and the attention mask (B, L + extra): 0 on the
    pads, 1 on the prompt and on the `extra` columns the decoded tokens will take."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.ones((len(prompts), width + extra), dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):] = torch.tensor(p)
        mask[row, :width - len(p)] = 0
    return ids, mask


class ReservedLayer(DynamicLayer):
    """One layer's keys and values (B, heads, T, d) in buffers with room for `extra` positions
    beyond those it starts with; `keys` and `values` are views of the filled part."""

    def __init__(self, filled: DynamicLayer, extra: int):
        super().__init__()
        self.lazy_initialization(filled.keys, filled.values)
        b, h, t, _ = filled.keys.shape
        self.key_buffer = filled.keys.new_empty((b, h, t + extra, filled.keys.shape[-1]))
        self.value_buffer = filled.values.new_empty((b, h, t + extra, filled.values.shape[-1]))
        self.filled = 0
        self.update(filled.keys, filled.values)

    def update(self, key_states, value_states, *args, **kwargs):
        # past the room reserved, the slice is short and the copy fails on its shape
        start, self.filled = self.filled, self.filled + key_states.shape[-2]
        self.key_buffer[:, :, start:self.filled] = key_states
        self.value_buffer[:, :, start:self.filled] = value_states
        return self._views()

    def _views(self):
        self.keys = self.key_buffer[:, :, :self.filled]
        self.values = self.value_buffer[:, :, :self.filled]
        return self.keys, self.values

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.key_buffer, self.value_buffer = self.key_buffer[indices], self.value_buffer[indices]
        self._views()


def reserve(cache, extra: int):
    """`cache` (transformers' after the prefill) with each growing layer moved into a
    ReservedLayer with room for `extra` more positions; other layer kinds stay as they are."""
    cache.layers = [ReservedLayer(layer, extra) if type(layer) is DynamicLayer else layer
                    for layer in cache.layers]
    return cache


def _generate_batch(model, prompts, max_new_tokens, eos_id, pad_id, device, row_state, reserve_kv):
    ids, full_mask = left_padded(prompts, pad_id, max_new_tokens)
    ids, full_mask = ids.to(device), full_mask.to(device)
    width = ids.shape[1]
    positions = (full_mask[:, :width].cumsum(-1) - 1).clamp(min=0)  # (B, L)
    out = model(input_ids=ids, attention_mask=full_mask[:, :width], position_ids=positions, use_cache=True,
                logits_to_keep=1)
    # transformers 5 names the KV cache `cache` (in and out); 4.x `past_key_values`.
    # Read the name off the output, so wrappers with **kwargs forwards work too.
    cache_arg = "cache" if getattr(out, "cache", None) is not None else "past_key_values"
    cache = getattr(out, cache_arg)
    if reserve_kv:
        cache = reserve(cache, max_new_tokens - 1)  # the last token is never fed back
    next_tok = out.logits[:, -1].argmax(-1)  # (b,) for the live rows
    tokens = torch.full((len(prompts), max_new_tokens), eos_id, dtype=torch.long, device=device)  # (B, N)
    live = torch.arange(len(prompts), device=device)  # (b,) the batch row of each live row
    last_pos = positions[:, -1:]  # (b, 1)
    mask = full_mask  # (b, L + N)
    for step in range(max_new_tokens):
        tokens[live, step] = next_tok
        if step == max_new_tokens - 1:
            break
        going = next_tok != eos_id
        if not bool(going.all()):
            if not bool(going.any()):
                break
            keep = going.nonzero().flatten()
            live, next_tok, last_pos, mask = live[keep], next_tok[keep], last_pos[keep], mask[keep]
            cache.batch_select_indices(keep)
            for module in row_state:
                module.keep_rows(keep)
        last_pos = last_pos + 1
        out = model(input_ids=next_tok[:, None], attention_mask=mask[:, :width + step + 1], position_ids=last_pos,
                    use_cache=True, **{cache_arg: cache})
        cache = getattr(out, cache_arg)
        next_tok = out.logits[:, -1].argmax(-1)
    return [row[:row.index(eos_id)] if eos_id in row else row for row in tokens.tolist()]
