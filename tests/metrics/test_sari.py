"""SARI: published reference values and hand-worked cases."""

import pytest

from cl_bench.metrics.sari import corpus_sari, normalize, sentence_sari

# The running example of Xu et al. (2016), used by HF evaluate and tensor2tensor.
SOURCE = "About 95 species are currently accepted ."
REFS = [
    "About 95 species are currently known .",
    "About 95 species are now accepted .",
    "95 species are now accepted .",
]


def test_hf_metric_card_partial_match():
    # huggingface/evaluate metrics/sari/README.md and the sari.py docstring:
    # {'sari': 26.953601953601954}, with the periods attached to the words.
    score = corpus_sari(
        ["About 95 species are currently accepted."],
        ["About 95 you now get in."],
        [[r.replace(" .", ".") for r in REFS]],
    )
    assert score == pytest.approx(26.953601953601954, abs=1e-12)


def test_hf_metric_card_partial_match_pretokenised():
    # Same card, "Examples" section, with the periods already split off.
    assert corpus_sari([SOURCE], ["About 95 you now get in ."], [REFS]) == pytest.approx(
        26.953601953601954, abs=1e-12
    )


def test_hf_metric_card_perfect_match():
    # Same card: source = prediction = reference gives {'sari': 100.0}.
    assert corpus_sari([SOURCE], [SOURCE], [[SOURCE]]) == pytest.approx(100.0)


@pytest.mark.parametrize(
    "prediction, expected",
    [
        # tensorflow/tensor2tensor utils/sari_hook_test.py, testSariSent1..3
        # (assertAlmostEqual, 7 places). Sent1 also equals the HF card value.
        ("About 95 you now get in .", 0.2695360),
        ("About 95 species are now agreed .", 0.6170966),
        ("About 95 species are currently agreed .", 0.5088682),
    ],
)
def test_tensor2tensor_paper_sentences(prediction, expected):
    assert sentence_sari(SOURCE, prediction, REFS) == pytest.approx(expected, abs=5e-8)


def test_tensor2tensor_output_equals_reference():
    # sari_hook_test.py testMatchingOutputAndReference: output = reference -> 1.
    out = "3 1 4 1 80 70"
    assert sentence_sari("3 1 4 1 5 9 2 6 5", out, [out]) == pytest.approx(1.0)


def test_hand_worked_add_only_wrong():
    # source "a b", prediction "a c", reference "a d" (k = 1 reference).
    # n=1: keep {a}: P=1, R=1 -> 1.  del {b}, b not in ref -> 1.
    #      add {c}: none in ref -> P=0; ref adds {d} -> R=0 -> F=0.
    # n=2: keep nothing, nothing to keep -> 1.  del {ab} -> 1.  add {ac}: P=0, R=0 -> 0.
    # n=3,4: all sets empty -> 1, 1, 1.
    # keep 1, del 1, add (0+0+1+1)/4 = 0.5 -> (1 + 1 + 0.5)/3 = 5/6.
    assert sentence_sari("a b", "a c", ["a d"]) == pytest.approx(5 / 6)
    # Lower-casing makes case irrelevant.
    assert sentence_sari("A B", "A C", ["a D"]) == pytest.approx(5 / 6)


def test_hand_worked_deletion_precision():
    # source "a b c", prediction "a", reference "a b".
    # n=1: kept {a} good -> P=1; ref keeps {a,b} -> R=1/2 -> F=2/3.
    #      deleted {b,c}: b is in the ref (bad), c is not (good) -> P=1/2.
    #      nothing added, ref adds nothing -> F=1.
    # n=2: kept {} -> P=1; ref keeps {ab} -> R=0 -> F=0.
    #      deleted {ab, bc}: only bc good -> 1/2.  add -> 1.
    # n=3: keep 1 (nothing either way), deleted {abc} good -> 1, add 1.  n=4: 1, 1, 1.
    # keep (2/3+0+1+1)/4 = 2/3, del (1/2+1/2+1+1)/4 = 3/4, add 1.
    # SARI = (2/3 + 3/4 + 1)/3 = 29/36.
    assert sentence_sari("a b c", "a", ["a b"]) == pytest.approx(29 / 36)


def test_hand_worked_reference_weighting():
    # source "a b", prediction "a b", references ["a", "b"] (k = 2).
    # Counts are scaled by k: S = C = {a:2, b:2}; R = {a:1, b:1}.
    # n=1: kept {a:2, b:2}, good {a:1, b:1} -> P = (1/2 + 1/2)/2 = 1/2;
    #      R = (1+1)/(1+1) = 1 -> F = 2/3.  del nothing -> 1.  add nothing -> 1.
    # n=2: kept {ab:2}, no ref has ab -> P=0; R has no bigram -> recall 1 -> F=0.
    #      del 1, add 1.   n=3,4: 1, 1, 1.
    # keep (2/3+0+1+1)/4 = 2/3 -> SARI = (2/3 + 1 + 1)/3 = 8/9.
    # (Without the k-scaling, n=1 keep would be 1 and SARI 11/12.)
    assert sentence_sari("a b", "a b", ["a", "b"]) == pytest.approx(8 / 9)


def test_empty_prediction_is_one_empty_token_like_hf():
    # HF splits "" on " " into [""]: the empty token is an added unigram not in
    # the reference, so add P=0 at n=1 even though the reference adds nothing.
    # source "a b", prediction "", reference "a":
    # n=1: keep F=0 (a not kept); del {a,b}, only b good -> 1/2; add F=0.
    # n=2: keep 1, del {ab} -> 1, add 1.  n=3,4: 1s.
    # keep 3/4, del 7/8, add 3/4 -> (3/4 + 7/8 + 3/4)/3 = 19/24.
    # (Dropping the empty token would give add 1 and 7/8.)
    assert normalize("") == [""]
    assert sentence_sari("a b", "", ["a"]) == pytest.approx(19 / 24)


def test_empty_strings_do_not_crash():
    assert sentence_sari("", "", [""]) == pytest.approx(1.0)
    assert 0.0 <= sentence_sari("", "a b", ["c"]) <= 1.0
    assert 0.0 <= sentence_sari("a b", "a", [""]) <= 1.0


def test_normalize_uses_13a_and_lowercases():
    assert normalize('Hello, "World".') == ["hello", ",", '"', "world", '"', "."]


def test_corpus_is_mean_of_sentences():
    a = sentence_sari("a b", "a c", ["a d"])
    b = sentence_sari("a b c", "a", ["a b"])
    got = corpus_sari(["a b", "a b c"], ["a c", "a"], [["a d"], ["a b"]])
    assert got == pytest.approx(100 * (a + b) / 2)


def test_errors():
    with pytest.raises(ValueError):
        corpus_sari([], [], [])
    with pytest.raises(ValueError):
        corpus_sari(["a"], ["a", "b"], [["a"]])
    with pytest.raises(ValueError):
        sentence_sari("a", "a", [])
