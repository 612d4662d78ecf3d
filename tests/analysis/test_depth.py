"""cl_bench/analysis/depth.py: do deep layers expand more than shallow ones, on
hand-made decision maps (30 layers as SmolLM2, 8 slots)."""
from __future__ import annotations

import numpy as np
import pytest

from cl_bench.analysis.depth import depth_profile

L, K = 30, 8


def maps(rate_of, tasks: int = 2) -> list:
    """Decision maps whose layer l expands the first round(rate_of(l) * K) slots."""
    return [[[int(k < round(rate_of(l) * K)) for k in range(K)] for l in range(L)] for _ in range(tasks)]


def test_deep_layers_that_expand_more_are_told_apart_and_the_layer_order_does_not_matter():
    """Mutations caught: the thirds swapped (sign), the rate taken over slots only
    (per_task rates equal the pooled ones here, so the pooled diff is the check),
    the layers' names ignored when they are not in order."""
    m = maps(lambda l: 0.25 if l < 10 else 0.75 if l >= 20 else 0.5)
    out = depth_profile(m, list(range(L)))
    assert out["shallow"] == list(range(10)) and out["deep"] == list(range(20, 30))
    assert (out["shallow_rate"], out["deep_rate"], out["diff"]) == (0.25, 0.75, 0.5)
    assert out["ci"] == [0.5, 0.5] and out["p"] < 0.01 and out["verdict"] == "deep layers expand more"
    backwards = depth_profile([row[::-1] for row in m], list(range(L))[::-1])
    assert {k: backwards[k] for k in ("diff", "ci", "p", "verdict")} == {k: out[k] for k in ("diff", "ci", "p", "verdict")}
    assert depth_profile(m[::-1], list(range(L)))["diff"] == 0.5
    flipped = depth_profile(maps(lambda l: 0.75 if l < 10 else 0.25 if l >= 20 else 0.5), list(range(L)))
    assert flipped["diff"] == -0.5 and flipped["verdict"] == "shallow layers expand more"


def test_rates_pool_tasks_and_slots():
    """Layer 0 expands 1 of 4 slots in one task and 2 of 4 in the other: 3/8."""
    m = [[[1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]], [[1, 1, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]]]
    out = depth_profile(m, [0, 1, 2])
    assert out["rate"] == [3 / 8, 0.0, 1.0] and out["diff"] == pytest.approx(5 / 8)
    assert out["per_task"] == [{"deep_rate": 1.0, "shallow_rate": 0.25}, {"deep_rate": 1.0, "shallow_rate": 0.5}]
    assert out["verdict"] == "not distinguishable"  # one layer a third: no evidence, however large the gap


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_no_depth_effect_is_not_distinguishable(seed):
    """Coin-flip decisions everywhere: the same expected rate at every depth, so no
    verdict. (The bootstrap-only verdict is caught by test_rates_pool_tasks_and_slots,
    where one layer a third gives an interval of width 0.)"""
    rng = np.random.default_rng(seed)
    m = rng.integers(0, 2, size=(5, L, K)).tolist()
    out = depth_profile(m, list(range(L)))
    assert out["verdict"] == "not distinguishable", out
    same = depth_profile(maps(lambda l: 0.5), list(range(L)))
    assert same["diff"] == 0 and same["p"] == 1.0 and same["verdict"] == "not distinguishable"


def test_too_few_layers_or_a_wrong_shape_is_refused():
    with pytest.raises(ValueError, match="too few"):
        depth_profile([[[1], [0]][:1]], [0])
    with pytest.raises(ValueError, match="for 3 layers"):
        depth_profile([[[1], [0]]], [0, 1, 2])
