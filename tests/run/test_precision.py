"""bf16 evaluation casts each weight once (cl_bench.run.precision.evaluation): the same
greedy outputs as plain autocast, the weights cast once per block instead of at every
forward, and the model's requires_grad flags as they were afterwards."""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from cl_bench.run import precision
from cl_bench.eval.generation import greedy_generate
from cl_bench.models.expert_init import slice_experts
from cl_bench.models.loading import tiny_llama
from cl_bench.models.upcycling import MoEArgs, grow_groups, moe_everywhere, train_newest_group

CPU = torch.device("cpu")
NEW_TOKENS = 6


class WeightCasts(TorchDispatchMode):
    """Counts the dtype casts whose input lives in a parameter's storage (a weight,
    or a slice of a stacked one); activations are not counted."""

    def __init__(self, model):
        super().__init__()
        self.storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._to_copy.default and torch.is_tensor(args[0]):
            self.n += args[0].untyped_storage().data_ptr() in self.storages
        return func(*args, **(kwargs or {}))


def upcycled_model():
    """The tiny Llama upcycled with two groups, only the newest trainable (as in a task
    after the first): attention, dense MLPs and the old group frozen."""
    model, _, _ = tiny_llama(0)
    moe_everywhere(model, MoEArgs())
    grow_groups(model, 2, slice_experts, 0.02)
    train_newest_group(model, train_shared=False)
    return model.eval()


def prompts():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(5, 200, (int(n),), generator=g).tolist() for n in (7, 12, 9)]


def generate(model, context):
    casts = WeightCasts(model)
    with context, casts:
        out = greedy_generate(model, prompts(), NEW_TOKENS, eos_id=-1, pad_id=0, batch_size=3)
    return out, casts.n


@pytest.mark.filterwarnings("ignore")
def test_bf16_evaluation_gives_autocasts_outputs_with_each_weight_cast_once():
    """Mutations caught: no requires_grad on frozen weights during the block (attention
    and dense MLPs recast every token), no cast_once in the MoE layer (expert slices
    recast every token), flags not restored."""
    model = upcycled_model()
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    plain, plain_casts = generate(model, precision.autocast("bf16", CPU))
    once, once_casts = generate(model, precision.evaluation("bf16", CPU, model))
    assert once == plain
    n_weights = sum(1 for _ in model.parameters())
    # plain autocast: the frozen weights again at the prefill and each of the NEW_TOKENS - 1 steps
    assert plain_casts > NEW_TOKENS * n_weights // 2
    assert 0 < once_casts <= n_weights  # each weight (a stacked group counts once) at most once
    assert {n: p.requires_grad for n, p in model.named_parameters()} == flags


def test_evaluation_restores_the_flags_after_an_error_and_is_plain_autocast_in_fp32():
    model = upcycled_model()
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    with pytest.raises(RuntimeError), precision.evaluation("bf16", CPU, model):
        assert all(p.requires_grad for p in model.parameters())
        raise RuntimeError("stop")
    assert {n: p.requires_grad for n, p in model.named_parameters()} == flags
    with precision.evaluation("fp32", CPU, model):
        assert not torch.is_autocast_enabled("cpu")
        assert {n: p.requires_grad for n, p in model.named_parameters()} == flags


def test_cast_once_is_the_tensor_itself_outside_an_evaluation_or_while_autograd_records():
    w = torch.randn(4, 3)
    assert precision.cast_once(w) is w
    with precision.evaluation("bf16", CPU, torch.nn.Linear(3, 4)):
        with torch.no_grad():
            first = precision.cast_once(w)
            assert first.dtype == torch.bfloat16 and precision.cast_once(w) is first
            w.add_(1.0)  # changed in place: cast again
            assert torch.equal(precision.cast_once(w), w.to(torch.bfloat16))
        assert precision.cast_once(w) is w  # gradients on: training never sees a copy
