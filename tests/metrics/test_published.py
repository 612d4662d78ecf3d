"""Published summaries (TRACE's OP, TreeLoRA's BWT) on a matrix worked out by hand."""

import pytest

from cl_bench.metrics.cl import bwt
from cl_bench.metrics.published import trace_bwt, trace_op, treelora_bwt

N = None
# 3 tasks. Task 0: 80 -> 60 (drop 20); task 1: 70 -> 75 (gain 5); task 2: 50 (its own stage).
R = [
    [80, N, N],
    [70, 70, N],
    [60, 75, 50],
]


def test_trace_op_is_the_final_row_mean():
    # (60 + 75 + 50) / 3 = 61.666...
    assert trace_op(R) == pytest.approx(185 / 3)


def test_trace_op_needs_a_complete_final_row():
    # the Individual-FT reference: one task per row, the final row lacks tasks 0 and 1
    assert trace_op([[80, N, N], [N, 70, N], [N, N, 50]]) is None
    # the multitask reference: one stage scoring every task
    assert trace_op([[60, 75, 50]]) == pytest.approx(185 / 3)


def test_treelora_bwt_clamps_gains_and_divides_by_t():
    # min(60-80, 0) + min(75-70, 0) + min(50-50, 0) = -20 + 0 + 0; / T = 3 -> -6.667
    assert treelora_bwt(R) == pytest.approx(-20 / 3)
    # cl-bench's BWT on the same matrix: (-20 + 5) / (T-1) = -7.5
    assert bwt(R) == pytest.approx(-7.5)


def test_treelora_bwt_is_zero_when_every_task_improves():
    assert treelora_bwt([[10, N], [30, 40]]) == 0.0


def test_treelora_bwt_needs_a_square_matrix():
    assert treelora_bwt([[60, 75, 50]]) is None
    assert treelora_bwt([[80, N], [N, 70]]) is None  # final row misses task 0


def test_trace_bwt_keeps_gains_and_divides_by_t():
    """Mutations caught: dividing by T-1 (cl-bench's), clamping gains (TreeLoRA's)."""
    # (60-80) + (75-70) + (50-50) = -15; / T = 3 -> -5
    assert trace_bwt(R) == pytest.approx(-5.0)
    assert trace_bwt(R) == pytest.approx(2 / 3 * bwt(R))  # (T-1)/T of cl-bench's
    assert trace_bwt([[10, N], [30, 40]]) == pytest.approx(10.0)  # a gain of 20, / 2


def test_trace_bwt_needs_a_square_matrix():
    assert trace_bwt([[60, 75, 50]]) is None
    assert trace_bwt([[80, N], [N, 70]]) is None
