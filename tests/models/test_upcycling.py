"""The core pieces the upcycling methods compose (cl_bench/models/upcycling.py), on the
tiny Llama (2 layers, FFN 128: K = 8 slices)."""
from __future__ import annotations

import pytest
import torch

from cl_bench.errors import UserError
from cl_bench.method import lm_loss
from cl_bench.models import moe
from cl_bench.models.expert_init import slice_experts
from cl_bench.models.loading import tiny_llama
from cl_bench.models.upcycling import (MoEArgs, grow_groups, lm_and_balancing, moe_everywhere, moe_settings,
                                       train_newest_group, train_routers)


def batch():
    ids = torch.randint(3, 259, (2, 10), generator=torch.Generator().manual_seed(0))
    labels = ids.clone()
    labels[:, :4] = -100
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}


def trainable(model):
    return {n for n, p in model.named_parameters() if p.requires_grad}


def test_groups_grow_idempotently_and_only_the_newest_trains():
    model, _, _ = tiny_llama(0)
    args = MoEArgs(shared="add")
    moe.upcycle_model(model, init=slice_experts, **moe_settings(args))
    grow_groups(model, 3, slice_experts, args.router_std)
    grow_groups(model, 3, slice_experts, args.router_std)  # a resumed run: nothing added
    assert moe.group_sizes(model) == [[8, 8, 8]] * 2
    train_newest_group(model, train_shared=False)
    assert trainable(model) == {f"model.layers.{i}.mlp.{p}" for i in range(2)
                                for p in ("routed_scale", *(f"groups.2.{w}" for w in
                                          ("gate", "up", "down", "router_weight", "router_bias")))}
    train_newest_group(model, train_shared=False, newest=False)
    assert trainable(model) == {f"model.layers.{i}.mlp.routed_scale" for i in range(2)}
    train_newest_group(model, train_shared=True)
    assert "model.embed_tokens.weight" in trainable(model)
    assert not any(".mlp.dense." in n or ".groups.0." in n for n in trainable(model))
    model.requires_grad_(False)
    train_routers(model)
    assert trainable(model) == {f"model.layers.{i}.mlp.{p}" for i in range(2) for p in
                                ("routed_scale", *(f"groups.{g}.router_{w}" for g in range(3)
                                                   for w in ("weight", "bias")))}


def test_dense_layers_become_moe_layers_without_a_group():
    model, _, _ = tiny_llama(0)
    layers = moe_everywhere(model, MoEArgs(top_k=1))
    assert [len(layer.groups) for layer in layers] == [0, 0] and layers[0].k == 1
    assert moe_everywhere(model, MoEArgs()) == layers  # already MoE: kept as they are


def test_the_task_loss_adds_the_balancing_terms_of_its_own_forward():
    model, _, _ = tiny_llama(0)
    moe.upcycle_model(model)
    model.train()
    b = batch()
    loss, parts = lm_and_balancing(model, b)
    with moe.balancing_losses() as lb:
        lm = lm_loss(model, b)
    assert len(lb.terms) == 2 and parts == {"lm": lm.item(), "lb": lb.total().item()}
    assert loss.item() == pytest.approx(lm.item() + lb.total().item())
    assert parts["lb"] > 0
    model.eval()
    assert lm_and_balancing(model, b)[1]["lb"] == 0.0  # no training forward, no term


def test_the_family_arguments_are_checked():
    with pytest.raises(UserError, match="exceeds experts_per_task"):
        MoEArgs(top_k=9)
    with pytest.raises(UserError, match="choose one of swap, add"):
        MoEArgs(shared="sum")
