"""The bootstrap, the BWT split and the answer-form rules: pure functions on
hand-computed fixtures (cl_bench/metrics/bootstrap.py, cl.py, answer_form.py)."""
from __future__ import annotations

import numpy as np
import pytest

from cl_bench.metrics import bootstrap
from cl_bench.metrics.answer_form import majority_answer, well_formed
from cl_bench.metrics.cl import bwt, bwt_split
from cl_bench.benchmarks.trace.tasks import ANSWER_FORMS as RULES, CL_TASKS


def test_draws_are_seeded_and_per_task():
    a = bootstrap.draws([3, 5], resamples=4, seed=7)
    b = bootstrap.draws([3, 5], resamples=4, seed=7)
    assert [x.shape for x in a] == [(4, 3), (4, 5)]
    assert all((x == y).all() for x, y in zip(a, b))
    assert a[0].max() < 3 and a[1].max() < 5
    assert not all((x == y).all() for x, y in zip(a, bootstrap.draws([3, 5], 4, seed=8)))


def test_resample_cells_means_the_drawn_items_and_leaves_missing_cells_nan():
    idx = [np.array([[0, 0, 1], [2, 2, 2]])]  # task 0: two replicates over 3 items
    cells = {(0, 0): [10.0, 20.0, 60.0], (1, 0): [0.0, 30.0, 90.0]}
    out = bootstrap.resample_cells(cells, idx, (3, 1))
    assert out.shape == (2, 3, 1)
    assert out[0, 0, 0] == pytest.approx(40 / 3) and out[1, 0, 0] == 60.0
    assert out[0, 1, 0] == pytest.approx(10.0) and out[1, 1, 0] == 90.0
    assert np.isnan(out[:, 2, 0]).all()


def test_percentile_interval():
    assert bootstrap.interval(np.arange(101.0)) == pytest.approx((2.5, 97.5))
    assert bootstrap.interval(np.array([np.nan, np.nan])) is None


def test_paired_difference_p_value_agrees_with_the_interval():
    rng = np.random.default_rng(0)
    base = rng.normal(0, 1, 2000)
    clear = bootstrap.paired_difference(base + 3 + rng.normal(0, 0.5, 2000), base, 3.0)
    assert clear["ci"][0] > 0 and clear["p"] < 0.05
    # a shift of the whole draw that straddles 0: interval holds 0, p large
    vague = bootstrap.paired_difference(base + rng.normal(0, 1, 2000), base, 0.0)
    assert vague["ci"][0] < 0 < vague["ci"][1] and vague["p"] > 0.5
    # identical runs: difference exactly 0 everywhere, p = 1
    same = bootstrap.paired_difference(base, base, 0.0)
    assert same["ci"] == (0.0, 0.0) and same["p"] == 1.0


def test_pooled_mixes_runs_and_keeps_their_own_spread():
    runs = [np.full(500, 10.0), np.full(500, 20.0)]
    pooled = bootstrap.pooled(runs, 500, seed=1)
    # each replicate averages 2 runs drawn with replacement: 10, 15 or 20
    assert set(np.unique(pooled)) <= {10.0, 15.0, 20.0} and len(np.unique(pooled)) == 3
    assert bootstrap.pooled([np.full(500, 7.0)], 500, 1) == pytest.approx(np.full(500, 7.0))


# ---- BWT = format part + content part ----------------------------------------

def test_bwt_split_on_a_hand_computed_matrix():
    # task 0 learned to 60 with 100% form, then 30 with 50% form: content per
    # well-formed answer unchanged (60), so the whole drop is format.
    # task 1 learned to 40 at 80% form (C = 50), then 20 at 80% form (C = 25): content.
    R = [[60.0, None, None], [50.0, 40.0, None], [30.0, 20.0, 70.0]]
    F = [[1.0, None, None], [1.0, 0.8, None], [0.5, 0.8, 1.0]]
    split = bwt_split(R, F)
    # format_0 = (0.5 - 1)(60 + 60)/2 = -30; content_0 = -30 - (-30) = 0
    # format_1 = 0; content_1 = -20
    assert split["format"] == pytest.approx(-15.0)
    assert split["content"] == pytest.approx(-10.0)
    assert split["format"] + split["content"] == pytest.approx(bwt(R))


def test_bwt_split_with_no_well_formed_answer_left():
    R, F = [[50.0, None], [0.0, 80.0]], [[1.0, None], [0.0, 1.0]]
    split = bwt_split(R, F)
    assert split == {"format": pytest.approx(-25.0), "content": pytest.approx(-25.0)}
    assert split["format"] + split["content"] == pytest.approx(bwt(R))
    assert bwt_split(R, [[1.0, None], [None, 1.0]]) == {"format": None, "content": None}


# ---- answer form --------------------------------------------------------------

@pytest.mark.parametrize("task, prediction, prompt, ok", [
    ("C-STANCE", "B", "", True),
    ("C-STANCE", "b", "", False),          # case is form
    ("C-STANCE", "B. neutral", "", False),  # more text than the letter
    ("C-STANCE", "D", "", False),           # not an option of the task
    ("FOMC", "C", "", True),
    ("ScienceQA", "A\nBecause ...", "", True),
    ("ScienceQA", "A", "", True),
    ("ScienceQA", "Answer: A", "", False),
    ("NumGLUE-cm", "12", "", True),
    ("NumGLUE-cm", "-0.25", "", True),
    ("NumGLUE-cm", "1,200", "", True),
    ("NumGLUE-cm", "12 apples", "", False),
    ("NumGLUE-ds", "", "", False),
    ("Py150", "return x", "def f(x):<EOL> return x", True),   # short copies are answers
    ("Py150", "", "def f(x):", False),
    ("MeetingBank", "the council  approved the budget for 2024",
     "Transcript: the council approved the budget for 2024 after a long debate", False),  # echo
    ("MeetingBank", "The council approved the budget.", "Transcript: a long debate", True),
    ("20Minuten", "Der Hund lief.", "Paragraph: Der Hund lief heute schnell.", True),
])
def test_answer_form_rules(task, prediction, prompt, ok):
    assert well_formed(task, [prediction], [prompt], RULES) == [ok]


def test_every_scored_task_has_a_form_rule():
    assert set(CL_TASKS) <= set(RULES)


def test_majority_answer_and_first_character():
    assert majority_answer(["B", "A", "B", "C"]) == "B"
    assert majority_answer(["A", "B"]) == "A"  # a tie goes to the first seen
    assert majority_answer(["A\nwhy", "B\nwhy", "B\nbecause"], first_char=True) == "B"
