"""Linear CKA (cl_bench/eval/probes/cka.py): its invariances, a case solved on paper, agreement with
the textbook Gram formula, and its gradient."""
from __future__ import annotations

import math

import pytest
import torch

from cl_bench.eval.probes.cka import linear_cka


def randn(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def gram_cka(x: torch.Tensor, y: torch.Tensor) -> float:
    """The definition, in float64: <Kx, Ky>_F / (||Kx||_F ||Ky||_F) on centred Grams."""
    x, y = x.double(), y.double()
    x, y = x - x.mean(0), y - y.mean(0)
    kx, ky = x @ x.T, y @ y.T
    return float((kx * ky).sum() / (kx.norm() * ky.norm()))


@pytest.mark.parametrize("n", [6, 300])  # fewer / more examples than features: Gram / feature form
def test_identical_inputs_give_one(n):
    x = randn(n, 32)
    assert float(linear_cka(x, x)) == pytest.approx(1.0, abs=1e-5)


def test_a_dominant_direction_does_not_push_it_above_one():
    """SmolLM2's deep layers have a direction ~1000x the rest (activations up to
    2e4); in float32 the rounding over ~1,000 tokens gave CKA(X, X) = 1 + 2.5e-5
    there, and 1 + 1.6e-5 on this stand-in. In float64 it is 1 to 1e-9."""
    x = randn(1024, 1, seed=4) @ randn(1, 576, seed=5) * 1e3 + randn(1024, 576, seed=6)
    assert abs(float(linear_cka(x, x)) - 1.0) < 1e-9
    moved = x + 1e-3 * randn(1024, 576, seed=7)
    assert float(linear_cka(x, moved)) <= 1.0 and linear_cka(x, moved).dtype == torch.float32


@pytest.mark.parametrize("n", [6, 300])
def test_invariant_to_orthogonal_transforms_and_isotropic_scaling(n):
    x, y = randn(n, 16, seed=1), randn(n, 16, seed=2)
    q, _ = torch.linalg.qr(randn(16, 16, seed=3))  # orthogonal
    base = float(linear_cka(x, y))
    assert 0 < base < 1
    assert float(linear_cka(x @ q, y)) == pytest.approx(base, rel=1e-4)
    assert float(linear_cka(x, 7.5 * y)) == pytest.approx(base, rel=1e-4)
    assert float(linear_cka(x @ q * 0.01, y @ q.T * 300)) == pytest.approx(base, rel=1e-4)
    assert float(linear_cka(x + 5.0, y - 2.0)) == pytest.approx(base, rel=1e-4)  # centred first
    # an anisotropic scaling is not an invariance
    assert float(linear_cka(x * torch.linspace(0.1, 3, 16), y)) != pytest.approx(base, rel=1e-3)


def test_hand_computed_cases():
    # one feature: CKA is the squared Pearson correlation. x = (1, 2, 3), y = (1, 3, 2):
    # centred (-1, 0, 1) and (-1, 1, 0), so r = 1 / (sqrt 2 sqrt 2) and r^2 = 1/4.
    x = torch.tensor([[1.0], [2.0], [3.0]])
    y = torch.tensor([[1.0], [3.0], [2.0]])
    assert float(linear_cka(x, y)) == pytest.approx(0.25, abs=1e-6)
    # X: the 4 points (+-1, 0), (0, +-1) (centred); Y = X diag(1, 2).
    # X^T X = diag(2, 2), Y^T Y = diag(2, 8), Y^T X = diag(2, 4):
    # CKA = (4 + 16) / sqrt((4 + 4) (4 + 64)) = 20 / sqrt(544) = 5 / sqrt(34)
    x = torch.tensor([[1.0, 0], [0, 1], [-1, 0], [0, -1]])
    y = x * torch.tensor([1.0, 2.0])
    assert float(linear_cka(x, y)) == pytest.approx(5 / math.sqrt(34), abs=1e-6)


@pytest.mark.parametrize("n,p,q", [(5, 40, 24), (200, 4, 6)])
def test_both_forms_match_the_definition(n, p, q):
    x, y = randn(n, p, seed=4), randn(n, q, seed=5)
    y = y + 0.5 * x[:, :1]  # some shared signal
    assert float(linear_cka(x, y)) == pytest.approx(gram_cka(x, y), rel=1e-5)


def test_gradient_flows_to_the_input():
    y = randn(12, 8, seed=6)
    x = (y @ randn(8, 8, seed=7) + 0.3 * randn(12, 8, seed=8)).requires_grad_()
    (1 - linear_cka(x, y)).backward()
    assert torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0
    # a small step against the gradient raises CKA
    with torch.no_grad():
        assert linear_cka(x - 0.1 * x.grad / x.grad.norm(), y) > linear_cka(x, y)
    xd, yd = randn(7, 3, seed=9, dtype=torch.float64), randn(7, 4, seed=10, dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda a: linear_cka(a, yd), (xd.requires_grad_(),))


def test_shapes_are_checked():
    with pytest.raises(ValueError, match="same n"):
        linear_cka(randn(4, 3), randn(5, 3))
