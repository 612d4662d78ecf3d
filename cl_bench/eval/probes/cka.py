"""Linear CKA (centred kernel alignment; Kornblith et al., ICML 2019), differentiable.

For n examples (rows) with features X: [n, p] and Y: [n, q], centred over the rows
(Xc = X - mean_rows X),

    CKA(X, Y) = <Kx, Ky>_F / (||Kx||_F ||Ky||_F),    Kx = Xc Xc^T, Ky = Yc Yc^T   (Gram form)
              = ||Yc^T Xc||_F^2 / (||Xc^T Xc||_F ||Yc^T Yc||_F)                 (feature form)

the two being equal because <Xc Xc^T, Yc Yc^T>_F = tr(Xc Xc^T Yc Yc^T) = ||Yc^T Xc||_F^2.
It lies in [0, 1], is 1 for X = Y, and is invariant to orthogonal transforms and
isotropic scaling of either side (not to arbitrary invertible maps). With one
feature each it is the squared Pearson correlation. This is the standard form the
paper's code computes (bilevel-reference.md §3) but keeps the autograd graph, so a
loss 1 - CKA trains what produced X.
"""
from __future__ import annotations

import torch


def linear_cka(x: torch.Tensor, y: torch.Tensor, eps: float = 1e-12) -> torch.Tensor:
    """CKA between x: [n, p] and y: [n, q] (rows are the same n examples); a scalar.

    Computed in float64, after scaling each side to unit Frobenius norm (CKA does
    not change; the fourth powers below stay far from overflow for large
    activations). float32 is not enough: with SmolLM2's outlier features its
    rounding over ~1,000 tokens put CKA(X, X) at 1 + 2.5e-5 and CKA of two
    near-identical representations up to 1.0002. The result has the
    inputs' dtype promoted to float32 at least, and carries gradient. Uses the Gram
    form when the n x n Gram matrices are the cheaper ones, else the feature form.
    0 when either side is constant."""
    if x.dim() != 2 or y.dim() != 2 or x.shape[0] != y.shape[0]:
        raise ValueError(f"linear_cka needs [n, p] and [n, q] with the same n; got {tuple(x.shape)} "
                         f"and {tuple(y.shape)}")
    out_dtype = torch.promote_types(torch.promote_types(x.dtype, y.dtype), torch.float32)
    x = x.to(torch.float64)
    y = y.to(torch.float64)
    x = x - x.mean(dim=0, keepdim=True)
    y = y - y.mean(dim=0, keepdim=True)
    x = x / x.norm().clamp_min(eps)
    y = y / y.norm().clamp_min(eps)
    n, p = x.shape
    q = y.shape[1]
    if n * (p + q) <= p * q + p * p + q * q:  # cost n^2 (p + q) vs n (pq + p^2 + q^2)
        kx, ky = x @ x.T, y @ y.T  # [n, n]
        cross, norm_x, norm_y = (kx * ky).sum(), kx.norm(), ky.norm()
    else:
        cross = (y.T @ x).square().sum()  # ||Yc^T Xc||_F^2
        norm_x, norm_y = (x.T @ x).norm(), (y.T @ y).norm()
    return (cross / (norm_x * norm_y).clamp_min(eps)).to(out_dtype)
