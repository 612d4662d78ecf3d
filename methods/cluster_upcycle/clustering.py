"""Clustering of the current task's prompts for cluster-upcycle
(docs/methods/cluster-upcycle.md, steps 1, 2 and 4): calibration rows, the FFN
inputs captured from one forward, spherical k-means per layer, and a new group
whose router rows are the centroids.

Formula: x_hat = x / ||x||; assign = argmax_e mu_e^T x_hat; mu_e = normalised sum
of its members (k-means++ seeds, distance 1 - cos; best mean cosine of the
restarts). Router row e = mu_e at t = 0, mu_e * mean norm of the existing rows
(bias: their mean bias) at t >= 1.
Source: cluster-aware upcycling (CAU, CVPR 2026, arXiv 2604.13508; no code).

Differs from the paper:
- calibration on the current task's training prompts only (continual form);
- one forward for every layer (not layer-sequential), up to calib_tokens tokens;
- position 0 (the attention sink), padding and answer tokens are dropped.
"""
from __future__ import annotations

import random

import torch

from cl_bench.data.encode import IGNORE, Encoder, collate
from cl_bench.errors import UserError
from cl_bench.losses import lm_loss
from cl_bench.method import Stage
from cl_bench.methods.cluster_upcycle.whiten import spherical_kmeans
from cl_bench.models.expert_init import slice_experts
from cl_bench.models.modes import device_of, eval_mode
from cl_bench.models.moe import UpcycledMoE, decoder_layers


def calibration_rows(ctx, args, stage: Stage) -> list[dict[str, list[int]]]:
    """Training rows (prompt + answer) of the stage's own tasks, in a seeded order,
    until calib_examples rows or calib_tokens usable prompt tokens. Only
    `stage.tasks` is read: no other task's data, earlier or later."""
    examples = [e for task in stage.tasks for e in task.train]
    if not examples:
        raise UserError(f"cluster-upcycle: stage {stage.label!r} has no training examples to "
                        f"calibrate its experts on")
    order = list(range(len(examples)))
    random.Random(f"{ctx.config.seed}/cluster-upcycle/{stage.index}").shuffle(order)
    encoder = Encoder.from_config(ctx.tokenizer, ctx.config.train)
    rows, tokens = [], 0
    for i in order:
        if len(rows) >= args.calib_examples or tokens >= args.calib_tokens:
            break
        row = encoder.train_example(examples[i].prompt, examples[i].answer)
        rows.append(row)
        tokens += max(sum(1 for label in row["labels"] if label == IGNORE) - 1, 0)
    return rows


def forward_rows(model, ctx, rows: list[dict], on_input=None) -> float:
    """Run `rows` through the model in micro-batches (eval mode, no gradient);
    on_input(layer index, mlp module, x, y) gets each decoder layer's FFN input x
    and output y at the calibration positions (prompt tokens but position 0; no
    padding), x, y: (n, d).
    Returns the answer-token LM loss over the rows."""
    blocks = decoder_layers(model)
    device = device_of(model)
    pad = ctx.tokenizer.pad_token_id
    selected: dict[str, torch.Tensor] = {}

    def hook(i):
        def post(module, args, output):
            m = selected["mask"]
            on_input(i, module, args[0][m], output[m])
        return post

    handles = [b.mlp.register_forward_hook(hook(i)) for i, b in enumerate(blocks)] if on_input else []
    total = n = 0.0
    try:
        with eval_mode(model), torch.no_grad():
            size = ctx.config.train.micro_batch_size
            for start in range(0, len(rows), size):
                batch = {k: v.to(device) for k, v in collate(rows[start:start + size], pad).items()}
                mask = (batch["attention_mask"] == 1) & (batch["labels"] == IGNORE)  # (B, T)
                mask[:, 0] = False  # position 0: the attention sink
                selected["mask"] = mask
                loss = lm_loss(model, batch)
                answer = int((batch["labels"][:, 1:] != IGNORE).sum())
                total += loss.item() * answer
                n += answer
    finally:
        for handle in handles:
            handle.remove()
    return total / n if n else float("nan")


def add_centroid_groups(layers: list[UpcycledMoE], captured: dict[int, list[torch.Tensor]], args,
                        seed: int, stage: Stage) -> list:
    """Cluster each layer's captured FFN inputs (seeded by (run seed, stage, layer)) and
    add a group of K dense slices with the centroid router rows (the drift guard's
    reference; the experts are fitted afterwards). Pops `captured`. Returns per layer
    (x (N, d), its k-means, router row scale)."""
    K = args.experts_per_task
    fits = []
    for i, layer in enumerate(layers):
        x = torch.cat(captured.pop(i))[:args.calib_tokens]  # (N, d)
        if x.shape[0] < K:
            raise UserError(f"cluster-upcycle: {x.shape[0]} calibration tokens for {K} clusters in "
                            f"stage {stage.label!r}; raise calib_examples / calib_tokens")
        generator = torch.Generator().manual_seed(
            random.Random(f"{seed}/cluster-upcycle/{stage.index}/{i}").getrandbits(63))
        km = spherical_kmeans(x, K, args.kmeans_iters, args.kmeans_restarts, generator)
        if layer.groups:
            scale = layer.router_weight().detach().norm(dim=1).mean()
            bias = layer.router_bias().detach().mean()
        else:
            scale, bias = torch.ones(()), torch.zeros(())
        layer.add_group(slice_experts, router_std=0.0)  # experts fitted below
        group = layer.groups[-1]
        with torch.no_grad():
            group.router_weight.copy_(km.centroids.to(group.router_weight) * scale)
            group.router_bias.fill_(float(bias))
        fits.append((x, km, float(scale)))
    return fits
