"""bilevel-cka's guided mask initialisation (mask_init=guided): where the paper's
search starts, from the two measurements its section 2.1 names, computed at the
start of each task t >= 1 before the search.

    alpha_{l,c,recycle} = 0
    alpha_{l,c,expand}  = log(p0 / (1 - p0)) + kappa_flat (s_{l,c} - 0.5) + kappa_depth depth_l

- flatness s_{l,c}: the replay loss's gradient norm per active expert,
  ||grad_theta L_replay|| / sqrt(|theta|) over `probe_batches` replay micro-batches
  of the harness's buffer (the paper's (1/|theta|) ||grad||^2 is its square; the
  code's probe takes this root), min-max scaled to [0, 1] within each layer (0.5
  where a layer's experts are all equal);
- depth_l, depth_prior=cka: the drift 1 - CKA(Phi_l before, Phi_l after) of layer
  l's output on old-task replay data across the previous task, min-max scaled over
  the candidate layers to [0, 1] (0 everywhere where they are all equal). For t = 1
  the buffer holds only task 0's items, so the drift is task 0's own: its replay
  items through the model before and after task 0. depth_prior=fixed: 1 on the
  last 3/16 of the decoder layers (the code's deep_layer_expand_bias on 13-15 of
  16), 0 elsewhere.

Source: CKA-guided bilevel MoE upcycling (ICML 2026), section 2.1; the authors'
code (bilevel-reference.md §1, §4 and the checklist: init_expand_prob 0.6,
deep_layer_expand_bias 1.0 on the last layers, (s - 0.5) * 4, nas_probe_batches 20).

Differs from the paper/code (docs/methods/bilevel-cka.md, "Guided initialisation"):
- the flatness term covers every candidate layer (the code's probe reaches only its
  three hard-coded deep layers);
- the depth term is measured (the code's is a fixed list of layers; that is
  depth_prior=fixed).
"""
from __future__ import annotations

import math
from typing import Any, Callable

import torch
from torch import nn

from cl_bench.eval.probes.cka import linear_cka
from cl_bench.data.encode import collate, tokenize_train
from cl_bench.method import lm_loss
from cl_bench.models.modes import substituted
from cl_bench.models.moe import decoder_layers
from cl_bench.data.replay import sample_rows
from cl_bench.record.schema import rounded

# Letters: L_c candidate layers, K slots (experts per task), n tokens, d width.


def replay_batches(ctx, examples: list, n_batches: int, key: str) -> list[dict]:
    """At most `n_batches` micro-batches (train.micro_batch_size rows each) of
    `examples` (replay examples), drawn without replacement under `key`, collated
    as the harness collates training rows."""
    if not examples:
        return []
    rows = list(tokenize_train(ctx.encoder, examples, None))
    size = ctx.config.train.micro_batch_size
    rows = sample_rows(rows, min(len(rows), n_batches * size), key)
    return [collate(rows[i:i + size], ctx.pad_id) for i in range(0, len(rows), size)]


def expert_owners(layer) -> list[tuple[nn.Module, int]]:
    """Expert e of an UpcycledMoE -> (its group, its index in the group), in router-row order."""
    return [(g, j) for g in layer.groups for j in range(len(g))]


def expert_sensitivity(model: nn.Module, layers: list[int], active: dict[int, list[int]],
                       batches: list[dict], autocast: Callable) -> torch.Tensor:
    """(L_c, K): ||grad L_replay|| / sqrt(numel) of each active expert (its gate, up and
    down), L_replay the mean answer-token CE over `batches`; the experts' own
    requires_grad is restored after."""
    blocks = decoder_layers(model)
    where = []  # per layer, per slot: (group, index in the group)
    for i in layers:
        owner = expert_owners(blocks[i].mlp)
        where.append([owner[e] for e in active[i]])
    groups = list({id(g): g for row in where for g, _ in row}.values())
    params = [w for g in groups for w in (g.gate, g.up, g.down)]
    was = [p.requires_grad for p in params]
    grads = [torch.zeros_like(p, dtype=torch.float32) for p in params]
    try:
        for p in params:
            p.requires_grad_(True)
        for b in batches:
            with autocast():
                loss = lm_loss(model, b) / len(batches)
            for acc, g in zip(grads, torch.autograd.grad(loss, params, allow_unused=True)):
                if g is not None:
                    acc += g.float()
    finally:
        for p, w in zip(params, was):
            p.requires_grad_(w)
    of = {id(p): acc for p, acc in zip(params, grads)}
    scores = torch.zeros(len(layers), len(next(iter(active.values()))))
    for c, row in enumerate(where):
        for k, (g, j) in enumerate(row):
            parts = [of[id(w)][j] for w in (g.gate, g.up, g.down)]
            numel = sum(p.numel() for p in parts)
            scores[c, k] = math.sqrt(sum(float(p.pow(2).sum()) for p in parts)) / math.sqrt(numel)
    return scores


def scale_per_layer(raw: torch.Tensor) -> torch.Tensor:
    """(L_c, K) -> s in [0, 1]: min-max within each row (layer); 0.5 where a row is flat."""
    lo, hi = raw.min(dim=1, keepdim=True).values, raw.max(dim=1, keepdim=True).values
    span = hi - lo
    return torch.where(span > 0, (raw - lo) / span.clamp_min(1e-30), torch.full_like(raw, 0.5))


def scale_over_layers(drift: list[float]) -> list[float]:
    """Drift per layer -> [0, 1], min-max over the layers; 0 everywhere where all are equal."""
    lo, hi = min(drift), max(drift)
    return [(x - lo) / (hi - lo) if hi > lo else 0.0 for x in drift]


def fixed_depth(layers: list[int], n_layers: int) -> list[float]:
    """depth_prior=fixed: 1 on the last max(1, round(3 n / 16)) decoder layers, else 0:
    the authors' share (their bias covers layers 13-15 of 16); 6 of SmolLM2's 30."""
    deep = max(1, round(3 * n_layers / 16))
    return [1.0 if i >= n_layers - deep else 0.0 for i in layers]


def layer_outputs(model: nn.Module, features, batches: list[dict], autocast: Callable,
                  params: dict[str, torch.Tensor] | None = None) -> dict[int, torch.Tensor]:
    """{layer: (n, d)}: the outputs of `features.layers` on the non-pad tokens of
    `batches` (in order, at most features.max_tokens evenly spaced), no gradient;
    `params`: values that stand in for the model's own (models/modes.py's substituted)."""
    per_layer: dict[int, list[torch.Tensor]] = {l: [] for l in features.layers}
    for b in batches:
        kwargs = dict(input_ids=b["input_ids"], attention_mask=b["attention_mask"], use_cache=False,
                      logits_to_keep=1)
        with torch.no_grad(), autocast(), features.capture() as feats, substituted(model, params or {}):
            model(**kwargs)
        keep = b["attention_mask"].bool()
        for l in features.layers:
            per_layer[l].append(feats[l][keep].float())
    return {l: features.spaced(torch.cat(h)) for l, h in per_layer.items()}


def drift(before: dict[int, torch.Tensor], after: dict[int, torch.Tensor]) -> list[float]:
    """1 - linear CKA per layer, in `before`'s layer order."""
    return [round(1.0 - float(linear_cka(after[l], before[l])), 6) for l in before]


def guided_logits(n_layers: int, K: int, init_expand_prob: float, s: torch.Tensor, depth: list[float],
                  kappa_flat: float, kappa_depth: float) -> torch.Tensor:
    """(L_c, K, 2) mask logits (recycle, expand): the module docstring's formula."""
    init = torch.zeros(n_layers, K, 2)
    prior = math.log(init_expand_prob / (1 - init_expand_prob))
    init[..., 1] = prior + kappa_flat * (s - 0.5) + kappa_depth * torch.tensor(depth)[:, None]
    return init


def guidance_record(raw: torch.Tensor, s: torch.Tensor, measured: list[float] | None, depth: list[float],
                    source: str, n_rows: int) -> dict[str, Any]:
    """What a guided init was computed from (run.json "params" -> "init" -> "guidance")."""
    return {"sensitivity": [[rounded(x) for x in row] for row in raw.tolist()],
            "s": [[rounded(x) for x in row] for row in s.tolist()],
            "drift": measured, "depth": [rounded(x) for x in depth], "depth_source": source,
            "probe_rows": n_rows}
