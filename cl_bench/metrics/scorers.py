"""TRACE's per-task scorers, as pure functions on a 0-100 scale.

Shared rules, from TRACE's `metrics.py` and the cl-bench protocol:
  - predictions and answers are `.strip()`ped before scoring;
  - an item whose prediction or answer is empty scores 0 and still counts in
    the denominator (TRACE skips such items but divides by the full count);
  - a corpus score is the mean of the per-item scores, so `score` equals the
    mean of `per_item_scores` for every metric;
  - an empty list of items raises ValueError.

Deviations from TRACE (each also noted where it applies):
  - TRACE's SARI does not zero empty predictions; here they score 0 like
    every other metric.
  - TRACE scores MeetingBank with the PyPI `rouge` package; here it is
    `rouge-score`, as the protocol asks.
"""

import re
import string
from statistics import fmean
from typing import Callable

from rapidfuzz import fuzz
from rouge_score import rouge_scorer

from cl_bench.errors import UserError, did_you_mean
from cl_bench.metrics.sari import sentence_sari

ItemScorer = Callable[[str, str, str | None], float]  # (prediction, answer, prompt) -> 0-100

_ROUGE_L = rouge_scorer.RougeScorer(["rougeL"])  # stateless; default tokenizer, no stemming
_LIT_WITH_VALUE = re.compile(r"<([A-Z]+)_LIT:(.*?)>", re.S)


def py150_postprocess(code: str) -> str:
    """TRACE's Py150 literal clean-up (`evaluations/eval_Py150.py::postprocess`):
    `<NUM_LIT>` -> `0`, `<STR_LIT>` and `<CHAR_LIT>` -> ``, `<X_LIT:v>` -> `v`;
    `<EOL>` is left as is.

    TRACE's pattern names only STR, NUM and CHAR in `<X_LIT:v>`, the only kinds
    Py150 has; this one takes any upper-case X.
    """
    code = code.replace("<NUM_LIT>", "0").replace("<STR_LIT>", "").replace("<CHAR_LIT>", "")
    return _LIT_WITH_VALUE.sub(lambda m: m.group(2), code)


# ---- per-item scorers: (prediction, answer, prompt) -> 0-100, inputs stripped ----


def _as_is(text: str) -> str:
    return text


def normalize_label(text: str) -> str:
    """O-LoRA's answer normalisation (its src/compute_metrics.py, normalize_answer):
    lower-cased, ASCII punctuation removed, whitespace runs made one space."""
    return " ".join("".join(c for c in text.lower() if c not in string.punctuation).split())


# The metrics that compare a whole answer, each with its key: an item scores 100 where the
# prediction's key equals the answer's, else 0. The label answer form compares a prediction
# with a task's labels by the same key (cl_bench/metrics/answer_form.py, label).
ANSWER_KEYS: dict[str, Callable[[str], str]] = {"accuracy": _as_is, "exact_match": normalize_label}


def _equal_by(key: Callable[[str], str]) -> ItemScorer:
    def scorer(pred: str, ans: str, prompt: str | None) -> float:
        return 100.0 if key(pred) == key(ans) else 0.0
    return scorer


_exact, _exact_normalized = _equal_by(ANSWER_KEYS["accuracy"]), _equal_by(ANSWER_KEYS["exact_match"])


def _first_char(pred: str, ans: str, prompt: str | None) -> float:
    return 100.0 if pred[0] == ans[0] else 0.0


def _rouge_l(pred: str, ans: str, prompt: str | None) -> float:
    return 100.0 * _ROUGE_L.score(ans, pred)["rougeL"].fmeasure


def _edit_similarity(pred: str, ans: str, prompt: str | None) -> float:
    pred, ans = py150_postprocess(pred), py150_postprocess(ans)
    # TRACE checks emptiness after post-processing: "<STR_LIT>" alone scores 0.
    if not pred or not ans:
        return 0.0
    return fuzz.ratio(pred, ans)


def _sari(pred: str, ans: str, prompt: str | None) -> float:
    if prompt is None:
        raise ValueError("sari needs the prompts: they are the SARI sources")
    return 100.0 * sentence_sari(prompt, pred, [ans])


_ITEM_SCORERS: dict[str, ItemScorer] = {
    "accuracy": _exact,
    "exact_match": _exact_normalized,
    "first_char_accuracy": _first_char,
    "rouge_l": _rouge_l,
    "edit_similarity": _edit_similarity,
    "sari": _sari,
}


def _item_scores(
    scorer: ItemScorer,
    predictions: list[str],
    answers: list[str],
    prompts: list[str] | None,
) -> list[float]:
    if len(predictions) != len(answers):
        raise ValueError(f"{len(predictions)} predictions but {len(answers)} answers")
    if prompts is not None and len(prompts) != len(answers):
        raise ValueError(f"{len(prompts)} prompts but {len(answers)} answers")
    if not predictions:
        raise ValueError("no items to score")
    prompts_or_none = prompts if prompts is not None else [None] * len(answers)
    out = []
    for pred, ans, prompt in zip(predictions, answers, prompts_or_none):
        pred, ans = pred.strip(), ans.strip()
        out.append(0.0 if not pred or not ans else float(scorer(pred, ans, prompt)))
    return out


# ---- public corpus scorers: mean of the per-item scores, 0-100 ----


def accuracy(predictions: list[str], answers: list[str]) -> float:
    """Exact-match accuracy: 100 * mean_i [pred_i.strip() == ans_i.strip()]."""
    return fmean(_item_scores(_exact, predictions, answers, None))


def exact_match(predictions: list[str], answers: list[str]) -> float:
    """The long-sequence benchmark's score, as O-LoRA's release computes it: 100 * mean_i
    [normalize_label(pred_i) == normalize_label(ans_i)] (an answer that is empty after
    stripping scores 0, the shared rule above)."""
    return fmean(_item_scores(_exact_normalized, predictions, answers, None))


def first_char_accuracy(predictions: list[str], answers: list[str]) -> float:
    """ScienceQA accuracy: 100 * mean_i [pred_i.strip()[0] == ans_i.strip()[0]]
    (the option letter)."""
    return fmean(_item_scores(_first_char, predictions, answers, None))


def rouge_l(predictions: list[str], answers: list[str]) -> float:
    """100 * mean ROUGE-L F1 (Lin, 2004) from `rouge-score`'s
    RougeScorer(['rougeL']): F = 2PR/(P+R), P = LCS/|pred|, R = LCS/|ans|,
    over its default tokens (lower-cased [a-z0-9]+ runs, no stemming)."""
    return fmean(_item_scores(_rouge_l, predictions, answers, None))


def edit_similarity(predictions: list[str], answers: list[str]) -> float:
    """Py150 edit similarity: mean `rapidfuzz.fuzz.ratio` after
    `py150_postprocess` of both sides.

    ratio = 100 * (1 - indel_distance(a, b) / (|a| + |b|)), unrounded. TRACE used
    fuzzywuzzy's `fuzz.ratio`, which rounds to an integer; rapidfuzz's ratio
    equals python-Levenshtein's `ratio` (the indel ratio fuzzywuzzy calls when
    python-Levenshtein is installed) x100, before that rounding.
    """
    return fmean(_item_scores(_edit_similarity, predictions, answers, None))


def sari(predictions: list[str], answers: list[str], sources: list[str]) -> float:
    """20Minuten SARI (Xu et al., 2016), 0-100: mean sentence SARI with
    source = the prompt and one reference (the answer), as TRACE calls HF
    `sari` with `references=[[gold] for gold in answers]`. See `sari.py`.

    HF's `_compute` also averages sentence SARI over items (sum / n x100), so
    this mean of per-item scores is its corpus score. Unlike TRACE, an empty
    prediction scores 0 here.
    """
    if sources is None:
        raise ValueError("sari needs the sources (prompts)")
    return fmean(_item_scores(_sari, predictions, answers, sources))


def codebleu_score(predictions: list[str], answers: list[str]) -> float:
    """Extra Py150 metric: CodeBLEU (Ren et al., 2020) x100 from the `codebleu`
    package, lang="python", default weights (0.25 each for n-gram, weighted
    n-gram, syntax and data-flow match), after `py150_postprocess` of both sides.

    Corpus-level, not a mean over items: an empty prediction adds nothing to
    the matches but still counts towards lengths and totals. The package
    counts a data-flow score of 0 as 1 (`dataflow_match_score or 1`), so even
    an all-empty corpus scores 25.
    """
    try:
        from codebleu import calc_codebleu
    except ImportError as e:
        raise UserError(
            "codebleu_score needs the `codebleu` package and tree-sitter-python "
            f"0.21: pip install codebleu tree-sitter-python==0.21.0 ({e})"
        ) from e
    if len(predictions) != len(answers):
        raise ValueError(f"{len(predictions)} predictions but {len(answers)} answers")
    if not predictions:
        raise ValueError("no items to score")
    preds = [py150_postprocess(p.strip()) for p in predictions]
    refs = [py150_postprocess(a.strip()) for a in answers]
    return 100.0 * calc_codebleu(refs, preds, lang="python")["codebleu"]


# ---- registry ----

METRICS: dict[str, Callable[..., float]] = {
    "accuracy": accuracy,
    "exact_match": exact_match,
    "first_char_accuracy": first_char_accuracy,
    "rouge_l": rouge_l,
    "edit_similarity": edit_similarity,
    "sari": sari,
}

# Extra metrics computed beside a headline metric; never used for ranking.
EXTRA_METRICS: dict[str, dict[str, Callable[[list[str], list[str]], float]]] = {
    "edit_similarity": {"codebleu": codebleu_score},
}


def _item_scorer(metric: str) -> ItemScorer:
    if metric not in _ITEM_SCORERS:
        raise UserError(
            f"unknown metric '{metric}'; {did_you_mean(metric, _ITEM_SCORERS)}"
            f"available: {', '.join(sorted(_ITEM_SCORERS))}"
        )
    return _ITEM_SCORERS[metric]


def per_item_scores(
    metric: str,
    predictions: list[str],
    answers: list[str],
    prompts: list[str] | None = None,
) -> list[float]:
    """Each item's 0-100 score under `metric`; `prompts` is used only by sari."""
    return _item_scores(_item_scorer(metric), predictions, answers, prompts)


def score(
    metric: str,
    predictions: list[str],
    answers: list[str],
    prompts: list[str] | None = None,
) -> float:
    """The task score, 0-100: the mean of `per_item_scores` (for every metric,
    SARI included, TRACE's corpus score is that mean)."""
    return fmean(per_item_scores(metric, predictions, answers, prompts))
