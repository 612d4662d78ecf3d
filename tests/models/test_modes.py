"""cl_bench/models/modes.py: which module's forward reads a parameter, and a forward
with other values in some parameters' place (`substituted`, the EMA teacher's and
the flagship's pre-task reference), checked against torch.func.functional_call, the
way both ran before it (which ZeRO-3 cannot run: tests/backends/test_deepspeed.py)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from cl_bench.models.modes import forward_readers, substituted


class Stacked(nn.Module):
    """A module without a forward holding parameters (as an MoE layer's expert group)."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4))


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.group = Stacked()
        self.proj = nn.Linear(4, 4)

    def forward(self, x):
        return self.proj(x @ self.group.w)


class Tied(nn.Module):
    """An embedding and a head sharing one weight (SmolLM2's, Llama-3.2's)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.layer = Layer()
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        return self.head(self.layer(self.embed(ids)))


def _model():
    torch.manual_seed(0)
    return Tied()


def test_readers_are_the_modules_whose_forward_reads_the_parameters():
    model = _model()
    readers = forward_readers(model)
    assert readers[model.layer.group] is model.layer  # no forward of its own
    assert readers[model.layer.proj] is model.layer.proj
    assert readers[model.embed] is model.embed and readers[model.head] is model.head


@pytest.mark.parametrize("names", [["embed.weight"], ["layer.group.w", "layer.proj.bias"],
                                   ["embed.weight", "layer.group.w", "layer.proj.weight"]])
def test_substituted_gives_functional_calls_outputs_and_puts_the_weights_back(names):
    """Mutation caught: each parameter swapped in one of its readers only (the tied
    weight then reads its own value in the embedding: outputs differ by ~1)."""
    model = _model()
    params = dict(model.named_parameters())
    values = {n: params[n].detach() + torch.randn(params[n].shape) for n in names}
    before = {n: p.detach().clone() for n, p in params.items()}
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        want = torch.func.functional_call(model, values, (ids,))
        with substituted(model, values):
            got = model(ids)
        own = model(ids)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert not torch.allclose(got, own)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def test_substituted_puts_the_weights_back_when_the_forward_raises():
    """Between the two hooks (an id past the vocabulary). Mutation caught: no restore
    in the context's `finally`."""
    model = _model()
    own = model.embed.weight.data_ptr()
    with pytest.raises(IndexError), torch.no_grad():
        with substituted(model, {"embed.weight": torch.zeros(10, 4)}):
            model(torch.tensor([[1, 12]]))
    assert model.embed.weight.data_ptr() == own and model.embed.weight.abs().sum() > 0


def test_substituted_names_an_unknown_parameter():
    with pytest.raises(KeyError, match="no parameter named 'head.bias'"):
        with substituted(_model(), {"head.bias": torch.zeros(10)}):
            pass
