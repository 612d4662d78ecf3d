"""TRACE scorers: hand-computed cases on a 0-100 scale."""

import sys

import pytest

from cl_bench.errors import UserError
from cl_bench.metrics.scorers import (
    EXTRA_METRICS,
    METRICS,
    accuracy,
    codebleu_score,
    edit_similarity,
    first_char_accuracy,
    per_item_scores,
    py150_postprocess,
    rouge_l,
    sari,
    score,
)


# ---- accuracy ----


def test_accuracy_strips_and_counts_empty():
    # " A" == "A" after strip -> 100; "B" vs "C" -> 0; "C\n" == "C" -> 100;
    # "" is empty -> 0 and still counts: (100 + 0 + 100 + 0)/4 = 50.
    assert accuracy([" A", "B", "C\n", ""], ["A", "C", "C", "A"]) == pytest.approx(50.0)


def test_accuracy_is_exact_not_normalised():
    # Case and inner spacing matter: "a" != "A", "4.0" != "4".
    assert accuracy(["a", "4.0", "12"], ["A", "4", "12"]) == pytest.approx(100 / 3)


def test_empty_answer_scores_zero():
    # TRACE skips items whose prediction or answer is "", so "" vs "" scores 0,
    # and a non-empty prediction against an empty answer scores 0 everywhere.
    assert accuracy(["", "x"], ["", "x"]) == pytest.approx(50.0)
    assert first_char_accuracy(["A"], [" "]) == 0.0  # no IndexError on ""[0]
    # Raw SARI of "a" against source "a b" and reference "" is not 0.
    assert sari(["a"], [""], ["a b"]) == 0.0


# ---- first_char_accuracy (ScienceQA) ----


def test_first_char_accuracy():
    # "A\nBecause..." vs "A\n...": A == A -> 100.
    # " B. x" strips to "B. x"; B vs C -> 0.
    # "c" vs "C": case-sensitive -> 0.   "" -> 0.
    # (100 + 0 + 0 + 0)/4 = 25.
    preds = ["A\nBecause it is.", " B. x", "c", ""]
    answers = ["A\nThe rationale.", "C\nother", "C", "A"]
    assert first_char_accuracy(preds, answers) == pytest.approx(25.0)


# ---- rouge_l (MeetingBank) ----


def test_rouge_l_hand_computed():
    # 1) "the cat sat on the mat" vs "the cat is on the mat": 6 tokens each,
    #    LCS "the cat on the mat" = 5 -> P = R = 5/6 -> F = 5/6.
    # 2) "A B" vs "a b c d": lower-cased, LCS 2, P = 1, R = 1/2 -> F = 2/3.
    # 3) "" -> 0.
    # mean = 100 * (5/6 + 2/3 + 0)/3 = 100 * 1.5/3 = 50.
    preds = ["the cat sat on the mat", "A B", ""]
    answers = ["the cat is on the mat", "a b c d", "anything"]
    assert per_item_scores("rouge_l", preds, answers) == pytest.approx([250 / 3, 200 / 3, 0.0])
    assert rouge_l(preds, answers) == pytest.approx(50.0)


# ---- Py150 post-processing and edit similarity ----


@pytest.mark.parametrize(
    "code, expected",
    [
        ("x = <NUM_LIT>", "x = 0"),
        ("s = <STR_LIT>", "s = "),
        ("c = <CHAR_LIT>", "c = "),
        ("f(<NUM_LIT:3>, <STR_LIT:foo>)", "f(3, foo)"),
        ("<CHAR_LIT:a> <NUM_LIT:1>", "a 1"),  # non-greedy: stops at the first '>'
        ("<STR_LIT:%s>", "%s"),
        ("flag = <BOOL_LIT:True>", "flag = True"),  # any upper-case X
        ("a <EOL> b", "a <EOL> b"),  # <EOL> left as is
        ("<s> x", "<s> x"),
    ],
)
def test_py150_postprocess(code, expected):
    assert py150_postprocess(code) == expected


def test_edit_similarity_hand_computed():
    # 1) "return <NUM_LIT>" -> "return 0" == answer -> 100 (prediction post-processed).
    # 2) "f(0)" vs "f(<NUM_LIT>)" -> "f(0)" -> 100 (answer post-processed).
    # 3) "abc" vs "abd": indel distance 2 (drop c, add d), lengths 3+3
    #    -> 100 * (1 - 2/6) = 66.67, unrounded (fuzzywuzzy would give 67).
    # 4) "" -> 0.
    preds = ["return <NUM_LIT>", "f(0)", "abc", ""]
    answers = ["return 0", "f(<NUM_LIT>)", "abd", "x"]
    assert per_item_scores("edit_similarity", preds, answers) == pytest.approx(
        [100.0, 100.0, 200 / 3, 0.0]
    )
    assert edit_similarity(preds, answers) == pytest.approx((200 + 200 / 3) / 4)


def test_edit_similarity_empty_after_postprocess_scores_zero():
    # "<STR_LIT>" becomes "" on both sides; TRACE checks emptiness after
    # post-processing, so this is 0, not the 100 that ratio("", "") gives.
    assert edit_similarity(["<STR_LIT>"], ["<STR_LIT>"]) == 0.0


# ---- SARI scorer (20Minuten) ----


def test_sari_scorer_one_reference_and_prompt_as_source():
    # Item 1: hand-worked in test_sari.py: source "a b", pred "a c", ref "a d" -> 5/6.
    # Item 2: prediction == reference == source -> 100.
    # mean = (250/3 + 100)/2 = 91.67.
    got = sari(["a c", "x y z"], ["a d", "x y z"], ["a b", "x y z"])
    assert got == pytest.approx((250 / 3 + 100) / 2)


def test_sari_empty_prediction_scores_zero():
    # The raw SARI of "" here is 19/24 (test_sari.py); the harness rule makes it 0.
    assert per_item_scores("sari", ["", "a c"], ["a", "a d"], ["a b", "a b"]) == pytest.approx(
        [0.0, 250 / 3]
    )


def test_sari_needs_prompts():
    with pytest.raises(ValueError):
        score("sari", ["a"], ["a"])


# ---- registry ----

PREDS = ["A", "the cat", "", "b <NUM_LIT:2>", "a c"]
ANSWERS = ["A", "the cat sat", "A", "b 2", "a d"]
PROMPTS = ["p q", "the dog", "a", "b", "a b"]


@pytest.mark.parametrize("metric", sorted(METRICS))
def test_score_is_mean_of_per_item_and_matches_function(metric):
    items = per_item_scores(metric, PREDS, ANSWERS, PROMPTS)
    assert len(items) == len(PREDS)
    assert items[2] == 0.0  # the empty prediction
    assert score(metric, PREDS, ANSWERS, PROMPTS) == pytest.approx(sum(items) / len(items))
    fn = METRICS[metric]
    direct = fn(PREDS, ANSWERS, PROMPTS) if metric == "sari" else fn(PREDS, ANSWERS)
    assert direct == pytest.approx(sum(items) / len(items))


def test_registry_names():
    assert set(METRICS) == {"accuracy", "exact_match", "first_char_accuracy", "rouge_l", "edit_similarity", "sari"}
    assert EXTRA_METRICS == {"edit_similarity": {"codebleu": codebleu_score}}


def test_unknown_metric_lists_choices():
    with pytest.raises(UserError) as e:
        score("acuracy", ["a"], ["a"])
    msg = str(e.value)
    assert "did you mean 'accuracy'" in msg
    for name in METRICS:
        assert name in msg


@pytest.mark.parametrize("metric", sorted(METRICS))
def test_empty_list_raises(metric):
    with pytest.raises(ValueError):
        score(metric, [], [], [])


def test_length_mismatch_raises():
    with pytest.raises(ValueError):
        score("accuracy", ["a", "b"], ["a"])
    with pytest.raises(ValueError):
        score("sari", ["a"], ["a"], ["p", "q"])


# ---- CodeBLEU (extra) ----


def test_codebleu_identical_is_100_and_postprocessed():
    # Identical code with >= 4 tokens: BLEU, weighted BLEU, syntax and data-flow
    # match are all 1 -> 100. The prediction's <NUM_LIT:1> becomes 1 first.
    pred = ["result = compute ( a , <NUM_LIT:1> ) + offset"]
    ans = ["result = compute ( a , 1 ) + offset"]
    assert codebleu_score(pred, ans) == pytest.approx(100.0)
    assert codebleu_score(["total = other ( b )"], ans) < 100.0


def test_codebleu_missing_package_is_clear(monkeypatch):
    monkeypatch.setitem(sys.modules, "codebleu", None)  # makes `import codebleu` fail
    with pytest.raises(UserError, match="pip install codebleu"):
        codebleu_score(["x"], ["x"])


def test_codebleu_empty_list_raises():
    with pytest.raises(ValueError):
        codebleu_score([], [])

