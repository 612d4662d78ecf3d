"""cl_bench/report/figures/depth.py: do deep layers expand more than shallow ones, on
hand-made decision maps (30 layers as SmolLM2, 8 slots); and how often two runs'
decision maps agree (compare's "decisions")."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from cl_bench.report.figures import depth
from cl_bench.report.figures.depth import depth_profile

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


def _rows(maps: dict[int, list], layers=(0, 1, 2)) -> list:
    """Parameter rows as a run record holds them: stage 0 decides nothing."""
    return [SimpleNamespace(stage=0, diagnostics={})] + [
        SimpleNamespace(stage=s, diagnostics={"decisions": m, "decision_layers": list(layers)})
        for s, m in maps.items()]


def test_decision_agreement_counts_cells_alike_and_corrects_for_chance():
    """Mutations caught: kappa without the chance correction; stages paired by position
    instead of by stage; runs on other layers compared."""
    rng = np.random.default_rng(0)
    a = rng.integers(0, 2, (3, 200)).tolist()
    b = rng.integers(0, 2, (3, 200)).tolist()  # independent of a: agreement near chance
    flipped = [row[:] for row in a]
    flipped[1][:20] = [1 - x for x in flipped[1][:20]]
    same = depth.decision_agreement(_rows({1: a, 2: flipped}), _rows({1: a, 2: a}))
    assert same["n"] == 1200 and same["agree"] == pytest.approx(1 - 20 / 1200)
    assert same["stages"][1]["agree"] == 1.0 and same["stages"][1]["kappa"] == pytest.approx(1.0)
    assert same["stages"][2]["agree"] == pytest.approx(1 - 20 / 600)
    chance = depth.decision_agreement(_rows({1: a}), _rows({1: b}))
    assert 0.4 < chance["agree"] < 0.6 and abs(chance["kappa"]) < 0.1
    ones = [[1] * 200] * 3
    all_expand = depth.decision_agreement(_rows({1: ones}), _rows({1: ones}))
    assert all_expand["agree"] == 1.0 and all_expand["kappa"] is None and all_expand["expand"] == [1.0, 1.0]
    only_shared_stage = depth.decision_agreement(_rows({1: a, 2: b}), _rows({2: b}))
    assert only_shared_stage["n"] == 600 and only_shared_stage["agree"] == 1.0
    assert depth.decision_agreement(_rows({1: a}), _rows({1: a}, layers=(3, 4, 5))) is None
    assert depth.decision_agreement(_rows({}), _rows({1: a})) is None


def test_compare_prints_the_agreement_of_decisions():
    from cl_bench.report.compare import format_comparison

    decisions = depth.decision_agreement(_rows({1: [[1, 0], [1, 1]]}), _rows({1: [[1, 1], [1, 1]]}))
    text = format_comparison({"baseline": "base", "baseline_method": "bilevel-cka", "resamples": 10,
                              "comparisons": [{"run": "shared", "summaries": {}, "decisions": decisions}]})
    assert "shared: decisions agree with the baseline's in 75.0% of 4 (stage 2 75% of 4)" in text
    assert "expand rate 75% vs 100%" in text and "kappa +0.00" in text  # one run constant: no agreement beyond chance
