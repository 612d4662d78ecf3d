"""Continual-learning summaries on matrices worked out by hand."""

import numpy as np
import pytest

from cl_bench.metrics.cl import bwt, forgetting, fwt, last_acc, stage_acc, summarise

N = None


def test_two_tasks():
    # R = [[90, -], [60, 80]]
    # last_acc  = (60 + 80)/2 = 70
    # stage_acc = (90 + (60+80)/2)/2 = (90 + 70)/2 = 80
    # bwt       = (60 - 90)/1 = -30
    # forgetting= max(90) - 60 = 30
    R = [[90, N], [60, 80]]
    assert summarise(R) == {
        "last_acc": pytest.approx(70.0),
        "stage_acc": pytest.approx(80.0),
        "bwt": pytest.approx(-30.0),
        "fwt": None,
        "forgetting": pytest.approx(30.0),
        "learn_gain": None,  # no zero-shot row
    }


def test_two_tasks_ragged_and_numpy_agree():
    expected = summarise([[90, N], [60, 80]])
    assert summarise([[90], [60, 80]]) == expected
    assert summarise(np.array([[90, np.nan], [60, 80]])) == expected
    assert summarise(np.array([[90, None], [60, 80]], dtype=object)) == expected


# 3 tasks; row 1 scores task 0 above its diagonal value, so forgetting != -bwt.
R3 = [
    [80, N, N],
    [85, 90, N],
    [60, 85, 70],
]


def test_three_tasks():
    # last_acc  = (60 + 85 + 70)/3 = 215/3 = 71.67
    # stage_acc = (80 + (85+90)/2 + 215/3)/3 = (80 + 87.5 + 71.67)/3 = 1435/18 = 79.72
    # bwt       = ((60-80) + (85-90))/2 = -12.5
    # forgetting: task 0: max(80, 85) - 60 = 25; task 1: max(90) - 85 = 5 -> 15
    assert last_acc(R3) == pytest.approx(215 / 3)
    assert stage_acc(R3) == pytest.approx(1435 / 18)
    assert bwt(R3) == pytest.approx(-12.5)
    assert forgetting(R3) == pytest.approx(15.0)
    assert fwt(R3, None) is None


def test_fwt_with_zero_shot_row():
    # R3 plus the pre-training scores R[j-1][j]: R[0][1] = 95, R[1][2] = 40.
    # zero_shot R0 = [20, 25, 10].
    # fwt = ((95 - 25) + (40 - 10))/2 = 50
    # The above-diagonal entries change nothing else:
    #   last_acc still (60+85+70)/3 (the last entry of each column is row 2);
    #   stage_acc only averages j <= b;
    #   forgetting's max starts at b = j, so task 1 is 90 - 85 = 5, not 95 - 85.
    R = [
        [80, 95, N],
        [85, 90, 40],
        [60, 85, 70],
    ]
    assert fwt(R, [20, 25, 10]) == pytest.approx(50.0)
    assert fwt(np.array(R, dtype=object), np.array([20.0, 25.0, 10.0])) == pytest.approx(50.0)
    assert last_acc(R) == pytest.approx(215 / 3)
    assert stage_acc(R) == pytest.approx(1435 / 18)
    assert forgetting(R) == pytest.approx(15.0)
    assert bwt(R) == pytest.approx(-12.5)


def test_fwt_missing_entry_is_none():
    # Lower-triangular R has no R[j-1][j]: nothing to compare with the zero-shot row.
    assert fwt(R3, [20, 25, 10]) is None
    # A zero-shot row with a hole is not enough either.
    R = [[80, 95, N], [85, 90, 40], [60, 85, 70]]
    assert fwt(R, [20, N, 10]) is None


def test_individual_diagonal():
    # One model per task: only R[j][j] is present.
    # last_acc = stage_acc = (80 + 90 + 70)/3 = 80; nothing to compare for bwt/forgetting.
    R = [[80, N, N], [N, 90, N], [N, N, 70]]
    assert summarise(R) == {
        "last_acc": pytest.approx(80.0),
        "stage_acc": pytest.approx(80.0),
        "bwt": None,
        "fwt": None,
        "forgetting": None,
        "learn_gain": None,
    }


def test_multitask_single_row():
    # Joint training: one stage evaluated on all 3 tasks.
    # last_acc = (70 + 80 + 90)/3 = 80; Stage Acc needs one stage per task (row 0
    # is not "after task 0" here), and bwt, fwt and forgetting need more stages -> None.
    R = [[70, 80, 90]]
    assert last_acc(R) == pytest.approx(80.0)
    assert stage_acc(R) is None
    assert bwt(R) is None
    assert forgetting(R) is None
    assert fwt(R, [10, 20, 30]) is None  # no R[1][2] to read


def test_missing_entries():
    # R[1][0] missing in the last row: bwt cannot be computed, forgetting has
    # no task left, last_acc falls back to each column's last entry:
    # column 0 -> 90, column 1 -> 80 -> 85.  stage_acc = (90 + 80)/2 = 85.
    R = [[90, N], [N, 80]]
    assert bwt(R) is None
    assert forgetting(R) is None
    assert last_acc(R) == pytest.approx(85.0)
    assert stage_acc(R) == pytest.approx(85.0)


def test_forgetting_over_available_tasks_only():
    # Task 0 has no final score; only task 1 counts: max(90) - 85 = 5.
    R = [[80, N, N], [85, 90, N], [N, 85, 70]]
    assert forgetting(R) == pytest.approx(5.0)
    assert bwt(R) is None


def test_bwt_is_not_clamped():
    # Backward transfer can be positive: (95 - 80)/1 = +15; forgetting is -15.
    R = [[80, N], [95, 70]]
    assert bwt(R) == pytest.approx(15.0)
    assert forgetting(R) == pytest.approx(-15.0)


def test_degenerate_matrices():
    assert summarise([]) == dict.fromkeys(["last_acc", "stage_acc", "bwt", "fwt", "forgetting", "learn_gain"])
    assert summarise([[N, N], [N, N]])["last_acc"] is None
    assert stage_acc([[N, N], [N, N]]) is None
    # One task: accuracy is defined, transfer is not (T - 1 = 0).
    one = summarise([[50]], zero_shot=[10])
    assert (one["last_acc"], one["stage_acc"]) == (50.0, 50.0)
    assert one["bwt"] is None and one["fwt"] is None and one["forgetting"] is None
    assert one["learn_gain"] == pytest.approx(40.0)  # 50 - 10


def test_learning_gain_against_the_zero_shot_row():
    # R3's diagonal 80, 90, 70 against zero-shot 20, 30, 70: gains 60, 60, 0 -> 40
    from cl_bench.metrics.cl import learn_gain

    assert learn_gain(R3, [20, 30, 70]) == pytest.approx(40.0)
    assert learn_gain(R3, None) is None
    assert learn_gain([[80, N, N], [85, N, N], [60, 85, 70]], [20, 30, 70]) is None  # R[1][1] missing


def test_stage_acc_ignores_entries_above_the_diagonal():
    # eval_all: every row scores every task, so row b also holds tasks not yet
    # trained (j > b); Stage Acc averages each row over j <= b only:
    #   row 0: 80; row 1: (60 + 90)/2 = 75; row 2: (50 + 70 + 60)/3 = 60 -> (80 + 75 + 60)/3 = 215/3.
    # Over all columns it would be ((80+10+20)/3 + (60+90+30)/3 + 60)/3 = (110/3 + 60 + 60)/3 = 470/9.
    R = [[80, 10, 20],
         [60, 90, 30],
         [50, 70, 60]]
    assert stage_acc(R) == pytest.approx(215 / 3)
    # An unscored entry on or below the diagonal leaves its row's mean over the rest.
    assert stage_acc([[80, 10, 20], [N, 90, 30], [50, 70, 60]]) == pytest.approx((80 + 90 + 60) / 3)
