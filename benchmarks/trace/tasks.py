"""The TRACE tasks: what each one is scored with, how long its answers run,
and the named task orders (docs/PROTOCOL.md, "Data" and "Decoding and scoring")."""

from __future__ import annotations

from dataclasses import dataclass

from cl_bench.errors import UserError, did_you_mean

# Scorer names implemented in cl_bench.metrics.scorers.
METRICS = ("accuracy", "first_char_accuracy", "rouge_l", "edit_similarity", "sari")


@dataclass(frozen=True)
class TaskSpec:
    """One TRACE task. `metric` is the score reported for it (0-100);
    `extra_metrics` are logged beside it but never enter the R matrix."""

    name: str
    metric: str
    max_new_tokens: int  # generation budget; greedy decoding stops earlier at EOS
    description: str  # one line
    language: str
    extra_metrics: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.metric not in METRICS:
            raise ValueError(
                f"task {self.name}: metric {self.metric!r} not in {list(METRICS)}"
            )
        if self.max_new_tokens < 1:
            raise ValueError(f"task {self.name}: max_new_tokens must be >= 1")


# max_new_tokens: answer lengths were measured in characters on the 500-example
# release (../shared/trace/LLM-CL-Benchmark_500, train+eval+test). Budgets sit
# above the 95th percentile at ~3.5 chars/token, and above the longest answer at
# ~2.5 chars/token where that is affordable (German and code tokenize worse than
# English). TRACE itself uses 512 for every task (max_ans_len).
TASKS: dict[str, TaskSpec] = {
    spec.name: spec
    for spec in [
        # Answers are exactly one character (A/B/C) in every split; room for EOS
        # or a stray newline, anything longer fails exact match anyway.
        TaskSpec(
            name="C-STANCE",
            metric="accuracy",
            max_new_tokens=4,
            description="Stance of a Chinese text toward a target (A/B/C); exact match.",
            language="zh",
        ),
        # One character (A/B/C) in every split.
        TaskSpec(
            name="FOMC",
            metric="accuracy",
            max_new_tokens=4,
            description="Monetary-policy stance of an FOMC sentence (A dovish, B hawkish, C neutral); exact match.",
            language="en",
        ),
        # Summaries: chars mean 392 / p95 1006 / max 1100 (train=eval), test mean
        # 368 / p90 596 / p95 807 / max 1100. 384 tokens = 1100 chars at 2.9 c/t.
        TaskSpec(
            name="MeetingBank",
            metric="rouge_l",
            max_new_tokens=384,
            description=(
                "Meeting-transcript summarisation; in the 500 release train.json is a copy of "
                "eval.json (100 examples), so never select models on its eval split."
            ),
            language="en",
        ),
        # Next line of pre-tokenised code: chars mean 36 / p95 84 / p99 122 / max
        # 143. Literal markers (<STR_LIT>, <NUM_LIT:…>) split into many tokens,
        # so 64 tokens = 143 chars at 2.2 c/t.
        TaskSpec(
            name="Py150",
            metric="edit_similarity",
            max_new_tokens=64,
            description="Python next-line completion on pre-tokenised code with literal markers; edit similarity.",
            language="python",
            extra_metrics=("codebleu",),
        ),
        # Answers are "<letter>\n<rationale>": chars mean ~1000 / p95 2100-2800 /
        # max 3433, but only the first character is scored. Under greedy decoding
        # the first tokens do not depend on the budget, so a longer budget only
        # generates rationale nobody scores; 8 tokens leave room for leading
        # whitespace, which is stripped before scoring. TRACE generates 512.
        TaskSpec(
            name="ScienceQA",
            metric="first_char_accuracy",
            max_new_tokens=8,
            description="Science multiple choice answered as letter + rationale; only the letter is scored.",
            language="en",
        ),
        # Number strings: chars mean 2.5 / p95 6 / max 18 (a float artefact,
        # "1.4300000000000002"); some answers are words ("November"). Digits
        # may tokenize one per token, so 24 tokens cover the longest answer.
        TaskSpec(
            name="NumGLUE-cm",
            metric="accuracy",
            max_new_tokens=24,
            description="Arithmetic word problems with commonsense knowledge (NumGLUE task 1); exact match.",
            language="en",
        ),
        # Number strings: chars mean 2.2 / max 5 in every split.
        TaskSpec(
            name="NumGLUE-ds",
            metric="accuracy",
            max_new_tokens=12,
            description="Arithmetic word problems in domain-specific contexts (NumGLUE task 2); exact match.",
            language="en",
        ),
        # German simplifications: chars mean 280 / p95 428-474 / p99 523-669 /
        # max 676. 256 tokens = 676 chars at 2.6 c/t.
        TaskSpec(
            name="20Minuten",
            metric="sari",
            max_new_tokens=256,
            description="German news paragraph simplification (20 Minuten); SARI against the prompt.",
            language="de",
        ),
        # Replay only, never generated by the harness (its eval/test answers are
        # empty strings). Train answers run long (p50 1563 / p95 8927 chars), so
        # a budget sized to them would be ~2500 tokens; TRACE's 512 is kept.
        TaskSpec(
            name="Lima",
            metric="rouge_l",
            max_new_tokens=512,
            description="General instruction data (LIMA) mixed into replay; not a scored CL task.",
            language="en",
        ),
    ]
}

# The tasks a continual-learning order may contain (Lima is replay data only).
CL_TASKS: tuple[str, ...] = (
    "C-STANCE", "FOMC", "MeetingBank", "Py150",
    "ScienceQA", "NumGLUE-cm", "NumGLUE-ds", "20Minuten",
)

ORDERS: dict[str, list[str]] = {
    # The upcycling paper's 6-task order.
    "paper6": ["MeetingBank", "Py150", "NumGLUE-cm", "NumGLUE-ds", "20Minuten", "C-STANCE"],
    # TRACE's 8-task order.
    "trace8": list(CL_TASKS),
}


def get_task(name: str) -> TaskSpec:
    """The TaskSpec called `name` (exact spelling), or a UserError with suggestions."""
    if name in TASKS:
        return TASKS[name]
    raise UserError(
        f"unknown TRACE task {name!r}; {did_you_mean(name, TASKS)}"
        f"valid tasks: {', '.join(TASKS)}"
    )


def resolve_order(order: str | list[str]) -> list[str]:
    """Task names in training order.

    `order` is a named order ("paper6", "trace8"), a list of task names, or a
    comma-separated string of them ("FOMC,C-STANCE"). Names match exactly."""
    if isinstance(order, str):
        if order in ORDERS:
            return list(ORDERS[order])
        names = [part.strip() for part in order.split(",")]
        # A single unknown word is more likely a misspelt order than a task.
        if len(names) == 1 and names[0] not in CL_TASKS:
            hint = did_you_mean(names[0], list(ORDERS) + list(CL_TASKS))
            raise UserError(
                f"unknown task order {order!r}; {hint}named orders: {', '.join(ORDERS)}; "
                f"or give task names separated by commas from: {', '.join(CL_TASKS)}"
            )
    else:
        names = list(order)

    if not names or any(n == "" for n in names):
        raise UserError(
            f"task order {order!r} has an empty entry; give task names from: {', '.join(CL_TASKS)}"
        )
    for name in names:
        if not isinstance(name, str):
            raise UserError(
                f"task order {order!r}: entry {name!r} is a {type(name).__name__}, "
                f"expected a task name from: {', '.join(CL_TASKS)}"
            )
        if name in TASKS and name not in CL_TASKS:
            raise UserError(
                f"task order {order!r}: {name} is replay-only data, not a continual-learning "
                f"task; remove it (valid tasks: {', '.join(CL_TASKS)})"
            )
        if name not in CL_TASKS:
            raise UserError(
                f"task order {order!r}: unknown task {name!r}; {did_you_mean(name, CL_TASKS)}"
                f"valid tasks: {', '.join(CL_TASKS)}"
            )
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise UserError(
            f"task order {order!r} lists {', '.join(dupes)} more than once; "
            f"each task may appear once"
        )
    return names
