"""Whether every rank holds the same model and method state at a stage's end.

On N ranks each rank runs the whole sequencer, and between phases it computes the
method's state itself (EWC's Fisher, OGD's basis, the flagship's decisions, SAME's
subspaces): the same on every rank only as long as every computation on the way is
deterministic. On CPU it is (the tests assert the runs equal); on GPUs some kernels
are not (atomics in the backward of index_add and of embeddings), and a rank that
drifts from the others takes its own decisions and its own projections while the
run goes on as if nothing happened.

`fingerprint` summarises each tensor of the model's and the method's state (shape,
dtype; a float tensor by its sum and its sum of magnitudes, anything else by a digest
of its bytes) and each plain value; `compare` reads every rank's against rank 0's:
entries that differ exactly (a shape, an integer or boolean tensor, a decision, a
key) and the largest difference of a float one's sums, relative to its sum of
magnitudes.
"""
from __future__ import annotations

import hashlib
import math
from typing import Any

import torch
from torch import nn

PLAIN = (bool, int, float, str, type(None))


def fingerprint(model: nn.Module, method_state: dict[str, Any]) -> dict[str, tuple]:
    out: dict[str, tuple] = {}
    for name, tensor in model.state_dict().items():
        out[f"model.{name}"] = _tensor(tensor)
    _walk("method", method_state, out)
    return out


def _tensor(t: torch.Tensor) -> tuple:
    t = t.detach()
    if t.is_floating_point():  # summed in float64 without a float64 copy of the tensor
        return ("float", tuple(t.shape), str(t.dtype), float(t.sum(dtype=torch.float64)),
                float(torch.linalg.vector_norm(t, 1, dtype=torch.float64)))
    return ("exact", tuple(t.shape), str(t.dtype), hashlib.sha1(t.cpu().contiguous().numpy().tobytes()).hexdigest())


def _walk(path: str, value: Any, out: dict[str, tuple]) -> None:
    if torch.is_tensor(value):
        out[path] = _tensor(value)
    elif isinstance(value, dict):
        for key, item in value.items():
            _walk(f"{path}.{key}", item, out)
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _walk(f"{path}[{i}]", item, out)
    elif isinstance(value, float):
        out[path] = ("float", (), "float", value, abs(value))
    elif isinstance(value, PLAIN):
        out[path] = ("exact", value)
    else:  # an object the method keeps: its type only (a repr may hold an address)
        out[path] = ("exact", type(value).__name__)


def compare(prints: list[dict[str, tuple]]) -> tuple[float, list[str]]:
    """(the largest relative difference of a float entry between rank 0 and another,
    'rank r: entry' for each entry that differs otherwise, a missing one included)."""
    spread, differ = 0.0, []
    first = prints[0]
    for rank, other in enumerate(prints[1:], start=1):
        for key in sorted(first.keys() | other.keys()):
            a, b = first.get(key), other.get(key)
            if a is None or b is None or a[:3] != b[:3] or (a[0] == "exact" and a != b):
                differ.append(f"rank {rank}: {key}")
            elif a[0] == "float":
                if all(map(math.isfinite, a[3:] + b[3:])):
                    spread = max(spread, _gap(a[3:], b[3:]))
                elif any(not (x == y or (math.isnan(x) and math.isnan(y))) for x, y in zip(a[3:], b[3:])):
                    differ.append(f"rank {rank}: {key}")  # a NaN or an infinity on one rank only
    return spread, differ


def _gap(a: tuple[float, float], b: tuple[float, float]) -> float:
    """How far two finite (sum, sum of magnitudes) pairs are apart, relative to the larger
    sum of magnitudes (a sum near zero would magnify rounding)."""
    scale = max(a[1], b[1])
    far = max(abs(a[0] - b[0]), abs(a[1] - b[1]))
    return far / scale if scale else 0.0
