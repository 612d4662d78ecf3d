"""Continual-learning summaries of a stage x task score matrix.

R[b][j] = score on task j after training through stage b (0-based); T = the
number of tasks = the number of columns. Entries not evaluated are None (NaN
in a numpy array); rows may be ragged (a lower-triangular run may store row b
with b+1 entries). All functions are pure and return None when the summary
cannot be computed from the entries present.
"""

import math
from dataclasses import dataclass
from statistics import fmean
from typing import Sequence

Matrix = list[list[float | None]]


def padded_rows(R) -> Matrix:
    """R as lists of float-or-None, short rows padded with None to T columns;
    None and NaN both mean "not evaluated"."""
    rows = [list(row) for row in R]
    t = max((len(row) for row in rows), default=0)
    out = []
    for row in rows:
        vals = [None if v is None or math.isnan(float(v)) else float(v) for v in row]
        out.append(vals + [None] * (t - len(vals)))
    return out


def _n_tasks(rows: Matrix) -> int:
    return len(rows[0]) if rows else 0


def last_acc(R) -> float | None:
    """Last Acc = mean_j (last non-None R[b][j] over b).

    For a full lower-triangular run this is mean_j R[T-1][j] (TRACE's "OP");
    for the Individual-FT reference, whose matrix holds only the diagonal, it
    is mean_j R[j][j].
    """
    rows = padded_rows(R)
    last = []
    for j in range(_n_tasks(rows)):
        col = [row[j] for row in rows if row[j] is not None]
        if col:
            last.append(col[-1])
    return fmean(last) if last else None


def stage_acc(R) -> float | None:
    """Stage Acc = mean_b ( mean_{j<=b, R[b][j] present} R[b][j] ), over rows
    with at least one such entry: the A-bar of the upcycling paper (average
    accuracy over all stages, each stage over the tasks seen so far).

    Row b is the stage that trained task b, so Stage Acc needs one row per task:
    a plan with fewer stages than tasks (the multitask reference, which trains
    every task in one stage) has no Stage Acc and gets None, not the R[0][0]
    that reading row 0 as "after task 0" would give.
    """
    rows = padded_rows(R)
    if len(rows) != _n_tasks(rows):
        return None
    stage_means = []
    for b, row in enumerate(rows):
        seen = [v for v in row[: b + 1] if v is not None]
        if seen:
            stage_means.append(fmean(seen))
    return fmean(stage_means) if stage_means else None


def bwt(R) -> float | None:
    """BWT = 1/(T-1) * sum_{j<T-1} (R[T-1][j] - R[j][j]), no clamping
    (Lopez-Paz & Ranzato, 2017). Negative means forgetting.

    None unless R is square with T >= 2 and every needed entry present.
    """
    rows = padded_rows(R)
    t = _n_tasks(rows)
    if t < 2 or len(rows) != t:
        return None
    diffs = [(rows[t - 1][j], rows[j][j]) for j in range(t - 1)]
    if any(a is None or b is None for a, b in diffs):
        return None
    return sum(a - b for a, b in diffs) / (t - 1)


def fwt(R, zero_shot: Sequence[float | None] | None) -> float | None:
    """FWT = 1/(T-1) * sum_{j>=1} (R[j-1][j] - R0[j]), R0 = the zero-shot row
    (the base model's score on each task; Lopez-Paz & Ranzato, 2017).

    Needs the harness to score task j at stage j-1, before training on it.
    None if `zero_shot` is None, T < 2, or any needed entry is missing.
    """
    if zero_shot is None:
        return None
    rows = padded_rows(R)
    t = _n_tasks(rows)
    r0 = padded_rows([zero_shot])[0]
    if t < 2 or len(rows) < t - 1 or len(r0) < t:
        return None
    pairs = [(rows[j - 1][j], r0[j]) for j in range(1, t)]
    if any(a is None or b is None for a, b in pairs):
        return None
    return sum(a - b for a, b in pairs) / (t - 1)


def forgetting(R) -> float | None:
    """Forgetting = mean_{j<T-1} ( max_{j<=b<T-1} R[b][j] - R[T-1][j] )
    (Chaudhry et al., 2018), over the tasks j whose entries are present.

    The max runs over stages that have trained on j (b >= j); on a
    lower-triangular R that is every b < T-1, and it keeps zero-shot entries
    R[j-1][j] (if scored for FWT) out of the max. None unless R has T >= 2
    rows of T columns and some task j < T-1 has the entries.
    """
    rows = padded_rows(R)
    t = _n_tasks(rows)
    if t < 2 or len(rows) != t:
        return None
    drops = []
    for j in range(t - 1):
        final = rows[t - 1][j]
        before = [rows[b][j] for b in range(j, t - 1) if rows[b][j] is not None]
        if final is not None and before:
            drops.append(max(before) - final)
    return fmean(drops) if drops else None


def learn_gain(R, zero_shot: Sequence[float | None] | None) -> float | None:
    """Learning gain = 1/T * sum_j (R[j][j] - R0[j]): how far training on each task
    lifted it above the model's zero-shot score R0 (plasticity; the "learned"
    beside which forgetting means something). None without the zero-shot row or
    a needed diagonal entry."""
    if zero_shot is None:
        return None
    rows = padded_rows(R)
    t = _n_tasks(rows)
    r0 = padded_rows([zero_shot])[0]
    if t < 1 or len(rows) != t or len(r0) < t:
        return None
    pairs = [(rows[j][j], r0[j]) for j in range(t)]
    if any(a is None or b is None for a, b in pairs):
        return None
    return sum(a - b for a, b in pairs) / t


def summarise(R, zero_shot: Sequence[float | None] | None = None) -> dict[str, float | None]:
    """All summaries of R: last_acc, stage_acc, bwt, fwt, forgetting, learn_gain."""
    return {
        "last_acc": last_acc(R),
        "stage_acc": stage_acc(R),
        "bwt": bwt(R),
        "fwt": fwt(R, zero_shot),
        "forgetting": forgetting(R),
        "learn_gain": learn_gain(R, zero_shot),
    }


def bwt_split(R, F) -> dict[str, float | None]:
    """BWT = format part + content part, exactly.

    F[b][j] is the share (0-1) of task j's predictions after stage b that have the
    task's answer form (cl_bench/metrics/answer_form.py). Write each cell as R = F·C,
    with C = R / F the score per well-formed answer (C = 0 where F = 0). For task j
    the change from R[j][j] to R[T-1][j] splits as the product rule's symmetric
    (Shapley) split does:
        format_j  = (F[T-1][j] - F[j][j]) · (C[T-1][j] + C[j][j]) / 2
        content_j = (R[T-1][j] - R[j][j]) - format_j
    which, where both F > 0, is (C[T-1][j] - C[j][j]) · (F[T-1][j] + F[j][j]) / 2:
    the change in score per well-formed answer, at the average form share. Each
    part is averaged over j < T-1 as BWT is, so format + content = BWT. None where
    BWT is None or a needed F is missing.
    """
    rows, forms = padded_rows(R), padded_rows(F)
    total = bwt(rows)
    t = _n_tasks(rows)
    if total is None or len(forms) != t or _n_tasks(forms) != t:
        return {"format": None, "content": None}
    fmt = 0.0
    for j in range(t - 1):
        (r0, f0), (r1, f1) = (rows[j][j], forms[j][j]), (rows[t - 1][j], forms[t - 1][j])
        if f0 is None or f1 is None:
            return {"format": None, "content": None}
        c0, c1 = (r0 / f0 if f0 else 0.0), (r1 / f1 if f1 else 0.0)
        fmt += (f1 - f0) * (c1 + c0) / 2
    fmt /= t - 1
    return {"format": fmt, "content": total - fmt}


@dataclass(frozen=True)
class Summary:
    """One summary as the records and reports name it."""

    key: str  # the field of run.json's "summary" (and of intervals' "summary_ci")
    label: str  # what every report calls it (`show`, compare, the leaderboard's columns, figures, site)
    higher_is_better: bool
    needs_learning: bool = False  # says something only of a run that learned its tasks (Gain above 0)


# Every summary, in the order the reports list them: summarise's six, then bwt_split's two parts.
SUMMARIES = (
    Summary("last_acc", "Last Acc", higher_is_better=True),
    Summary("stage_acc", "Stage Acc", higher_is_better=True),
    Summary("bwt", "BWT", higher_is_better=True, needs_learning=True),
    Summary("fwt", "FWT", higher_is_better=True),
    Summary("forgetting", "Forgetting", higher_is_better=False, needs_learning=True),
    Summary("learn_gain", "Gain", higher_is_better=True),
    Summary("bwt_format", "BWT format", higher_is_better=True, needs_learning=True),
    Summary("bwt_content", "BWT content", higher_is_better=True, needs_learning=True),
)
SUMMARY = {s.key: s for s in SUMMARIES}


def summaries(*keys: str) -> tuple[Summary, ...]:
    """The table's rows for `keys`, in that order (a view's choice of summaries)."""
    return tuple(SUMMARY[k] for k in keys)
