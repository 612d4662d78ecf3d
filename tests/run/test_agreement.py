"""cl_bench/run/agreement.py: what two ranks' fingerprints say of their states."""
from __future__ import annotations

import torch
from torch import nn

from cl_bench.run.agreement import compare, fingerprint


def _state(scale: float = 1.0, decision: int = 1, extra: dict | None = None):
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    with torch.no_grad():
        model.weight.mul_(scale)
    return fingerprint(model, {"fisher": [torch.ones(4) * scale], "decisions": torch.tensor([decision, 0]),
                               "note": "x", "lr": 0.5, "object": object(), **(extra or {})})


def test_equal_states_agree_exactly():
    """Two fingerprints of the same state: no spread, nothing apart (an object is
    compared by its type only: its repr holds an address)."""
    assert compare([_state(), _state()]) == (0.0, [])


def test_a_float_drift_is_a_spread_and_a_discrete_difference_is_named():
    """Mutations caught: float entries compared exactly (the drift named as apart), an
    integer tensor compared by its sum only (the decision missed), a key missing on one
    rank left out."""
    spread, apart = compare([_state(), _state(scale=1.001)])
    assert apart == [] and 5e-4 < spread < 2e-3
    assert compare([_state(), _state(decision=0)])[1] == ["rank 1: method.decisions"]
    assert compare([_state(), _state(), _state(extra={"more": 1})])[1] == ["rank 2: method.more"]
    assert compare([_state(), _state(extra={"lr": 0.25})])[0] == 0.5  # a plain float: relative to the larger


def test_a_sum_near_zero_does_not_magnify_rounding():
    """A tensor whose values cancel: a rounding-sized change is measured against its
    magnitudes, not its sum. Mutation caught: the gap relative to the sum itself."""
    values = torch.tensor([1.0, -1.0, 1e-6], dtype=torch.float64)
    nudged = values + torch.tensor([1e-9, 0.0, 0.0], dtype=torch.float64)
    spread, apart = compare([fingerprint(nn.Identity(), {"w": values}), fingerprint(nn.Identity(), {"w": nudged})])
    assert apart == [] and spread < 1e-8


def test_a_value_not_finite_on_one_rank_only_is_named():
    """NaN or an infinity on both ranks agrees; on one rank only (or inf against -inf)
    it is a difference that stops the run, not a drift. Mutation caught: non-finite
    sums measured as a drift (inf against 1.0 gave no spread and nothing named)."""
    prints = {name: fingerprint(nn.Identity(), {"w": torch.tensor([value])})
              for name, value in (("one", 1.0), ("nan", float("nan")), ("inf", float("inf")),
                                  ("-inf", float("-inf")))}
    for same in ("nan", "inf"):
        assert compare([prints[same], prints[same]]) == (0.0, [])
    for a, b in (("one", "inf"), ("one", "nan"), ("inf", "-inf")):
        assert compare([prints[a], prints[b]]) == (0.0, ["rank 1: method.w"]), (a, b)
