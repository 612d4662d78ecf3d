"""Per-sequence pooling over prompt tokens, for layers that route a whole sequence
by its prompt (CaRE's perceiver input, SAME's per-sequence router mean): the one
place that builds the prompt masks.

Which tokens are "the prompt" depends on the kind of forward:

- a training forward (labels given): the attended tokens whose label is -100
  (cl_bench/data/encode.py: the prompt, right padding after the answer);
- a prefill (no labels, nothing cached yet): every attended token, since the
  harness's decoder (cl_bench/eval/generation.py) prefills exactly the left-padded
  prompts;
- a decode step (no labels, a non-empty KV cache, one new token): none; a layer
  reuses what it computed at the prefill.

The first attended token of each row (position 0: BOS where the tokenizer adds
one, an attention sink with an outsized norm) is left out of the pool, unless
the row has no other prompt token. A row without any prompt token (labels with
no -100) pools its attended tokens instead.

`PromptPool` is a forward pre-hook on the whole model that classifies each
forward and holds the pooling mask for the layers to read: the layers only see
hidden states, never the labels, the attention mask or the cache. Pooling a
prompt is non-causal within the prompt, so a prefill must hold the whole
prompt: a multi-token forward that continues a non-empty cache (chunked
prefill) is refused (`refuse_chunked=False`: any forward after a non-empty
cache is a decode step, SAME's rule).

Letters: B batch, T tokens in this forward, d width.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

IGNORE = -100  # as cl_bench.data.encode.IGNORE

POOL, DECODE = "pool", "decode"


def prompt_tokens(attention_mask: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """(B, T) bool: the attended tokens whose label is -100, as they are (no fallback
    for a row without any, position 0 kept)."""
    return attention_mask.bool() & (labels == IGNORE)


def first_tokens(attention_mask: torch.Tensor) -> torch.Tensor:
    """(B, T) bool: each row's first attended token (left or right padding)."""
    return attention_mask.bool() & (attention_mask.long().cumsum(dim=1) == 1)


def prompt_mask(attention_mask: torch.Tensor, labels: torch.Tensor | None = None,
                skip_first: bool = True) -> torch.Tensor:
    """(B, T) bool: the tokens each row pools (module docstring). `attention_mask`
    (B, T) of 0/1; `labels` (B, T) with -100 on prompt tokens, or None (prefill:
    every attended token is prompt)."""
    attended = attention_mask.bool()
    prompt = attended if labels is None else prompt_tokens(attention_mask, labels)
    prompt = torch.where(prompt.any(dim=1, keepdim=True), prompt, attended)  # no prompt: all attended
    if not skip_first:
        return prompt
    rest = prompt & ~first_tokens(attention_mask)
    return torch.where(rest.any(dim=1, keepdim=True), rest, prompt)  # one-token prompt: keep it


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of x (B, T, d) over the tokens where mask (B, T) is true, in fp32: (B, d).
    A row with no token gives zeros."""
    m = mask.to(torch.float32).unsqueeze(-1)  # (B, T, 1)
    return (x.float() * m).sum(dim=1) / m.sum(dim=1).clamp(min=1.0)


@dataclass
class PromptPool:
    """What the running forward is, for the layers: `kind` POOL (a training forward
    or a prefill; `mask` (B, T) the tokens to pool, `attended` (B, T) bool the
    attended tokens) or DECODE (both None)."""

    kind: str = POOL
    mask: torch.Tensor | None = None
    skip_first: bool = True
    refuse_chunked: bool = True  # a multi-token or labelled forward after a non-empty cache: an error
    attended: torch.Tensor | None = None

    def install(self, model: nn.Module):
        """Keep this pool up to date on every forward of `model`; returns the hook handle."""
        return model.register_forward_pre_hook(self._before_forward, with_kwargs=True)

    def _before_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        self.read(args, kwargs)

    def read(self, args: tuple, kwargs: dict) -> None:
        """Classify the forward of the model called with (args, kwargs) (module docstring)."""
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:
            ids = kwargs["inputs_embeds"][..., 0]  # (B, T): only its shape is used
        labels = kwargs.get("labels")
        # transformers 5 calls the KV cache `cache`, 4.x `past_key_values`
        cache = kwargs.get("cache")
        if cache is None:
            cache = kwargs.get("past_key_values")
        cached = cache is not None and cache.get_seq_length() > 0
        if cached:
            if self.refuse_chunked and (labels is not None or ids.shape[1] != 1):
                raise ValueError(
                    f"prompt pooling needs the whole prompt in one prefill; got a forward of "
                    f"{ids.shape[1]} tokens{' with labels' if labels is not None else ''} after "
                    f"{cache.get_seq_length()} cached ones (chunked prefill is not supported)")
            self.kind, self.mask, self.attended = DECODE, None, None
            return
        mask = kwargs.get("attention_mask")
        if mask is None:
            mask = torch.ones(ids.shape[:2], dtype=torch.long, device=ids.device)
        if mask.dim() != 2:
            raise ValueError(f"prompt pooling needs a 2-D attention mask (B, T), got shape "
                             f"{tuple(mask.shape)}")
        self.kind, self.mask, self.attended = POOL, prompt_mask(mask, labels, self.skip_first), mask.bool()
