"""The decoder as it was before issue 42, kept as the baseline that `cl-bench perf
eval-speed` times cl_bench.eval.generation against, and the oracle its tests compare
predictions with: every row stays in the batch to the last step (a stopped row is
fed pads), the attention mask grows by one concatenated column a step, and each
step's tokens go into Python lists row by row.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from cl_bench.models.modes import device_of, eval_mode


@torch.no_grad()
def plain_generate(model: nn.Module, prompts: list[list[int]], max_new_tokens: int, eos_id: int,
                    pad_id: int, batch_size: int,
                    on_batch: Callable[[int], None] | None = None) -> list[list[int]]:
    """Greedy continuations (token ids, EOS excluded) for each prompt, in input order."""
    device = device_of(model)
    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
    outputs: list[list[int]] = [[] for _ in prompts]
    with eval_mode(model):
        for start in range(0, len(order), batch_size):
            rows = order[start:start + batch_size]
            for i, gen in zip(rows, _generate_batch(model, [prompts[i] for i in rows], max_new_tokens,
                                                    eos_id, pad_id, device)):
                outputs[i] = gen
            if on_batch is not None:
                on_batch(len(rows))
    return outputs


def _generate_batch(model, prompts, max_new_tokens, eos_id, pad_id, device):
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, p in enumerate(prompts):  # left padding
        ids[row, width - len(p):] = torch.tensor(p)
        mask[row, width - len(p):] = 1
    ids, mask = ids.to(device), mask.to(device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # (B, L)
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                logits_to_keep=1)
    # transformers 5 names the KV cache `cache` (in and out); 4.x `past_key_values`.
    # Read the name off the output, so wrappers with **kwargs forwards work too.
    cache_arg = "cache" if getattr(out, "cache", None) is not None else "past_key_values"
    cache = getattr(out, cache_arg)
    next_tok = out.logits[:, -1].argmax(-1)  # (B,)
    done = torch.zeros(len(prompts), dtype=torch.bool, device=device)
    generated: list[list[int]] = [[] for _ in prompts]
    last_pos = positions[:, -1:]  # (B, 1)
    for step in range(max_new_tokens):
        done |= next_tok == eos_id
        for row in (~done).nonzero().flatten().tolist():
            generated[row].append(int(next_tok[row]))
        if bool(done.all()) or step == max_new_tokens - 1:
            break
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        last_pos = last_pos + 1
        feed = torch.where(done, torch.full_like(next_tok, pad_id), next_tok)[:, None]
        out = model(input_ids=feed, attention_mask=mask, position_ids=last_pos, use_cache=True,
                    **{cache_arg: cache})
        cache = getattr(out, cache_arg)
        next_tok = out.logits[:, -1].argmax(-1)
    return generated
