"""The "trace" scorer set: each task's score as TRACE's own evaluation code computes
it, through the libraries TRACE uses, on a 0-100 scale.

Source: BeyonderXX/TRACE, `metrics.py` (caculate_accuracy, caculate_rouge,
caculate_fuzz, caculate_sari) and `evaluations/eval_*.py` (which metric each task
uses, ScienceQA's first-character split, Py150's literal clean-up). Its
`requirements.txt` pins `rouge==1.0.1` and lists `fuzzywuzzy`. The libraries come
with the optional extra `cl-bench[trace-scorers]`; cl-bench's own scorers
(cl_bench/metrics/scorers.py, rouge-score and rapidfuzz) stay the default.

TRACE's rules, kept here:
  - texts are compared as given, not stripped (cl-bench stores its predictions
    already stripped, so that matters only for answers);
  - an item whose prediction or answer is "" adds nothing but counts in the
    denominator: score = 100 * sum_i s_i / n (fuzz.ratio is already 0-100);
  - SARI alone scores every item, empty or not (HF's metric averages over all).
Where TRACE's script would stop with an exception, an item scores 0 instead and
the reason is given below.

The metric names are cl-bench's (`scorers.METRICS`), so a run's `task_metrics`
pick the scorer.
"""

import warnings
from typing import Callable

from cl_bench.errors import UserError, did_you_mean
from cl_bench.metrics.sari import corpus_sari
from cl_bench.metrics.scorers import py150_postprocess

SET_NAME = "trace"
INSTALL = "pip install 'cl-bench[trace-scorers]' (rouge==1.0.1, fuzzywuzzy)"


def _rouge_l_scorer():
    try:
        from rouge import Rouge
    except ImportError as e:
        raise UserError(f"the '{SET_NAME}' scorer set needs the `rouge` package: {INSTALL} ({e})") from e
    return Rouge(metrics=["rouge-l"])


def _fuzz():
    try:
        with warnings.catch_warnings():  # "slow pure-python SequenceMatcher" at import, without python-Levenshtein
            warnings.simplefilter("ignore")
            from fuzzywuzzy import fuzz
    except ImportError as e:
        raise UserError(f"the '{SET_NAME}' scorer set needs the `fuzzywuzzy` package: {INSTALL} ({e})") from e
    return fuzz


def fuzz_backend() -> str:
    """Which ratio fuzzywuzzy computes here: 'python-Levenshtein' (its indel ratio,
    when that package is installed) or 'difflib' (SequenceMatcher.ratio, the
    fallback). The two differ; TRACE's requirements.txt installs neither on purpose,
    so the column that uses it names the backend."""
    matcher = _fuzz().SequenceMatcher
    return "difflib" if matcher.__module__ == "difflib" else "python-Levenshtein"


def _check(predictions: list[str], answers: list[str]) -> None:
    if len(predictions) != len(answers):
        raise ValueError(f"{len(predictions)} predictions but {len(answers)} answers")
    if not predictions:
        raise ValueError("no items to score")


def _skip_empty_mean(item: Callable[[str, str], float], predictions: list[str], answers: list[str]) -> float:
    """sum_i item(p_i, a_i) / n over the items with p_i != "" and a_i != "" (TRACE's loop)."""
    _check(predictions, answers)
    return sum(item(p, a) for p, a in zip(predictions, answers) if p != "" and a != "") / len(predictions)


def accuracy(predictions: list[str], answers: list[str]) -> float:
    """caculate_accuracy: 100 * #{p_i == a_i, both non-empty} / n, exact and unstripped
    (C-STANCE, FOMC, NumGLUE-cm, NumGLUE-ds)."""
    return 100.0 * _skip_empty_mean(lambda p, a: float(p == a), predictions, answers)


def first_char_accuracy(predictions: list[str], answers: list[str]) -> float:
    """eval_ScienceQA: accuracy of the first characters (the option letter).

    TRACE indexes datum[0], which raises on an empty prediction; here that item
    scores 0 (its first character is taken as "")."""
    _check(predictions, answers)
    return accuracy([p[:1] for p in predictions], [a[:1] for a in answers])


def rouge_l(predictions: list[str], answers: list[str]) -> float:
    """caculate_rouge: 100 * sum_i F_i / n, F_i = `rouge` 1.0.1's
    Rouge(metrics=["rouge-l"]).get_scores(answer, prediction, avg=True)['rouge-l']['f'].

    That package splits each text into sentences on "." and scores the
    summary-level (union) LCS on whitespace tokens, unlike rouge-score's single
    LCS over [a-z0-9]+ tokens. It raises ValueError on a text with no sentence
    (only dots); that item scores 0 here, where TRACE's script would stop.
    """
    rouge = _rouge_l_scorer()

    def item(pred: str, ans: str) -> float:
        try:
            return rouge.get_scores(ans, pred, avg=True)["rouge-l"]["f"]
        except ValueError:
            return 0.0

    return 100.0 * _skip_empty_mean(item, predictions, answers)


def edit_similarity(predictions: list[str], answers: list[str]) -> float:
    """caculate_fuzz after eval_Py150's postprocess of both sides: sum_i
    fuzz.ratio(p_i, a_i) / n, fuzzywuzzy's ratio rounded to an integer per item,
    empties judged after the clean-up (see `fuzz_backend` for which ratio)."""
    fuzz = _fuzz()
    preds = [py150_postprocess(p) for p in predictions]
    refs = [py150_postprocess(a) for a in answers]
    return _skip_empty_mean(lambda p, a: float(fuzz.ratio(p, a)), preds, refs)


def sari(predictions: list[str], answers: list[str], sources: list[str]) -> float:
    """caculate_sari: HF's `sari` metric (`datasets.load_metric("sari")`, loaded from the
    hub) with sources = the prompts and references = [[answer]]: the mean sentence
    SARI over all items x100, empty predictions included. cl_bench/metrics/sari.py
    implements that metric's conventions and is checked against the values of its
    metric card (tests/metrics/test_sari.py), so it is used here without the hub."""
    if sources is None:
        raise ValueError("sari needs the sources (prompts)")
    _check(predictions, answers)
    return corpus_sari(list(sources), list(predictions), [[a] for a in answers])


METRICS: dict[str, Callable[..., float]] = {
    "accuracy": accuracy,
    "first_char_accuracy": first_char_accuracy,
    "rouge_l": rouge_l,
    "edit_similarity": edit_similarity,
    "sari": sari,
}


def score(metric: str, predictions: list[str], answers: list[str], prompts: list[str] | None = None) -> float:
    """The task score, 0-100, as TRACE's evaluation code gives it; `prompts` only for sari."""
    if metric not in METRICS:
        raise UserError(f"the '{SET_NAME}' scorer set has no metric '{metric}'; {did_you_mean(metric, METRICS)}"
                        f"available: {', '.join(sorted(METRICS))}")
    if metric == "sari":
        return sari(predictions, answers, prompts)
    return METRICS[metric](predictions, answers)
