"""Answer form: whether a prediction has the shape its task's answers have,
whatever its content (SAME, ICML 2026: much of continual-learning "forgetting" is
forgetting of the answer's form, such as "a" where "A" is required).

Which task has which rule is its benchmark's to declare (`Benchmark.answer_forms`;
TRACE's are in benchmarks/trace/tasks.py, long-sequence's in
cl_bench/benchmarks/long_sequence.py, a task folder's in its benchmark.yaml,
cl_bench/benchmarks/folder.py); a task without a rule has no form share and stays out
of BWT's format/content split, as does every task of a benchmark that declares none.
`rules_of` finds a record's benchmark's rules.

Each rule is a pure function (prediction, prompt) -> bool on the stripped
prediction, as it is scored:
- option:   one option letter and nothing else (TRACE's C-STANCE, FOMC: "A", "B",
            "C"); a generation that stops right after the letter, i.e. at EOS;
- option_first: an option letter first, then nothing or a line break (ScienceQA's
            "letter + rationale" answers; only the letter is scored);
- number:   one number, such as "12", "-3", "0.25" or "1,200" (NumGLUE);
- text:     non-empty and not an echo of the prompt (the generation tasks). An echo
            is a prediction of at least ECHO_MIN_CHARS characters that appears
            verbatim in the prompt (whitespace collapsed): the model copied the
            input instead of answering it. Shorter copies (a closing bracket, `x`)
            are ordinary answers and count as well formed;
- label:    one of the task's labels, compared as its metric compares a prediction
            with its answer (scorers.ANSWER_KEYS): exact_match after O-LoRA's
            normalisation, so "Entailment." is the label "entailment" (long-sequence);
            accuracy as it is. Only those metrics compare a whole answer.
"""
from __future__ import annotations

import logging
import re
from collections import Counter
from typing import Callable, Mapping, Sequence

from cl_bench.metrics.scorers import ANSWER_KEYS

log = logging.getLogger(__name__)

Rule = Callable[[str, str], bool]  # (stripped prediction, prompt) -> has the task's answer form
ECHO_MIN_CHARS = 20
_NUMBER = re.compile(r"[-+]?(\d{1,3}(,\d{3})+|\d+)(\.\d+)?")


def _squash(text: str) -> str:
    return " ".join(text.split())


def option(letters: str) -> Callable[[str, str], bool]:
    def rule(prediction: str, prompt: str) -> bool:
        return len(prediction) == 1 and prediction in letters
    return rule


def option_first(letters: str) -> Callable[[str, str], bool]:
    def rule(prediction: str, prompt: str) -> bool:
        return bool(prediction) and prediction[0] in letters and (len(prediction) == 1 or prediction[1] == "\n")
    return rule


def number(prediction: str, prompt: str) -> bool:
    return _NUMBER.fullmatch(prediction) is not None


def text(prediction: str, prompt: str) -> bool:
    squashed = _squash(prediction)
    if not squashed:
        return False
    return not (len(squashed) >= ECHO_MIN_CHARS and squashed in _squash(prompt))


def label(labels: Sequence[str], metric: str) -> Rule:
    """The label rule of a task scored by `metric` (accuracy or exact_match) whose answers
    are `labels`: the prediction's key under that metric is a label's key."""
    if metric not in ANSWER_KEYS:
        raise ValueError(f"a label form needs a metric that compares whole answers ({', '.join(ANSWER_KEYS)}), "
                         f"not {metric}")
    key = ANSWER_KEYS[metric]
    keys = {key(x.strip()) for x in labels}

    def rule(prediction: str, prompt: str) -> bool:
        return bool(prediction) and key(prediction) in keys
    return rule


def rules_of(*benchmarks: str | None) -> Mapping[str, Rule]:
    """The answer-form rules, by task, of the first of `benchmarks` that names a benchmark
    here (registry.get_benchmark: a registered name, or a folder holding benchmark.yaml);
    none where none does, or where that benchmark declares none."""
    from cl_bench import registry
    from cl_bench.errors import UserError

    for name in benchmarks:
        if name is None:
            continue
        try:
            return registry.get_benchmark(name).answer_forms
        except UserError as e:
            log.info("answer forms: benchmark %r not found here (%s)", name, e)
    log.info("answer forms: none of %s found here; their tasks have no form rule", benchmarks)
    return {}


def well_formed(task: str, predictions: Sequence[str], prompts: Sequence[str],
                rules: Mapping[str, Rule]) -> list[bool]:
    """One flag per prediction: has it `task`'s answer form (its rule in `rules`)?"""
    rule = rules[task]
    return [rule(p, q) for p, q in zip(predictions, prompts)]


def majority_answer(answers: Sequence[str], first_char: bool = False) -> str:
    """The most frequent training answer (its first character for first-character
    scoring); ties go to the answer seen first."""
    keys = [a.strip()[:1] if first_char else a.strip() for a in answers]
    counts = Counter(keys)
    best = max(counts.values())
    return next(k for k in keys if counts[k] == best)
