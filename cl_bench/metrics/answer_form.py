"""Answer form: whether a prediction has the shape its task's answers have,
whatever its content (SAME, ICML 2026: much of continual-learning "forgetting" is
forgetting of the answer's form, such as "a" where "A" is required).

Each rule is a pure function (prediction, prompt) -> bool on the stripped
prediction, as it is scored:
- option:   one option letter and nothing else (C-STANCE, FOMC: "A", "B", "C");
            a generation that stops right after the letter, i.e. at EOS;
- option_first: an option letter first, then nothing or a line break (ScienceQA's
            "letter + rationale" answers; only the letter is scored);
- number:   one number, such as "12", "-3", "0.25" or "1,200" (NumGLUE);
- text:     non-empty and not an echo of the prompt (the generation tasks). An echo
            is a prediction of at least ECHO_MIN_CHARS characters that appears
            verbatim in the prompt (whitespace collapsed): the model copied the
            input instead of answering it. Shorter copies (a closing bracket, `x`)
            are ordinary answers and count as well formed.
"""
from __future__ import annotations

import re
from collections import Counter
from typing import Callable, Sequence

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


# Task name -> its rule (benchmarks/trace/tasks.py lists the tasks).
RULES: dict[str, Callable[[str, str], bool]] = {
    "C-STANCE": option("ABC"),
    "FOMC": option("ABC"),
    "ScienceQA": option_first("ABCDE"),
    "NumGLUE-cm": number,
    "NumGLUE-ds": number,
    "MeetingBank": text,
    "Py150": text,
    "20Minuten": text,
}


def well_formed(task: str, predictions: Sequence[str], prompts: Sequence[str]) -> list[bool]:
    """One flag per prediction: has it `task`'s answer form?"""
    rule = RULES[task]
    return [rule(p, q) for p, q in zip(predictions, prompts)]


def majority_answer(answers: Sequence[str], first_char: bool = False) -> str:
    """The most frequent training answer (its first character for first-character
    scoring); ties go to the answer seen first."""
    keys = [a.strip()[:1] if first_char else a.strip() for a in answers]
    counts = Counter(keys)
    best = max(counts.values())
    return next(k for k in keys if counts[k] == best)
