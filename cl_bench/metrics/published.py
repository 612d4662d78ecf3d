"""Summaries of a stage x task matrix as other codebases define them, for setting a
run beside a published table. R[b][j] as in cl_bench/metrics/cl.py (0-based, None:
not evaluated); T = the number of tasks.

cl-bench's own summaries (cl.py) stay the reference; these differ in divisor or
clamping, and each names its source.

TRACE's BWT (trace_bwt) is the paper's formula: BeyonderXX/TRACE has no code that
computes OP or BWT (its evaluation scripts score single cells). The formula is taken
as the project's reading notes quote the paper (../shared/docs/reference/
baselines.md: "TRACE divides by t and includes the zero i=T term", marked there
for checking against the paper, whose text no source here holds); see
docs/protocol.md, "Published definitions".
"""

from statistics import fmean

from cl_bench.metrics.cl import padded_rows


def trace_op(R) -> float | None:
    """TRACE's OP (Overall Performance; Wang et al., 2023) = mean_j R[last row][j], the
    mean of the matrix's final row: the last stage's scores on every task.

    None when the final row misses a task (the Individual-FT reference, whose rows
    hold one task each). Equals cl.last_acc on a complete lower-triangular run.
    """
    rows = padded_rows(R)
    if not rows or any(v is None for v in rows[-1]):
        return None
    return fmean(rows[-1])


def trace_bwt(R) -> float | None:
    """BWT as the TRACE paper writes it (Wang et al., 2023, section 4):
        BWT_T = (1/T) * sum_{i<=T} (R[T-1][i] - R[i][i])
    the sum over every task, the last one's own term (always 0) included, divided
    by T; cl.bwt divides the same sum over i < T-1 by T-1, so on one matrix
    trace_bwt = (T-1)/T * cl.bwt. Gains are kept (unlike treelora_bwt).

    None unless R is square with the diagonal and the final row present.
    """
    pairs = _final_and_diagonal(R)
    return None if pairs is None else sum(a - b for a, b in pairs) / len(pairs)


def _final_and_diagonal(R) -> list[tuple[float, float]] | None:
    """[(R[T-1][i], R[i][i]) for every task i], or None unless R is square (one stage
    per task) with the diagonal and the final row present."""
    rows = padded_rows(R)
    t = len(rows)
    if t == 0 or len(rows[0]) != t:
        return None
    pairs = [(rows[t - 1][i], rows[i][i]) for i in range(t)]
    return None if any(a is None or b is None for a, b in pairs) else pairs


def treelora_bwt(R) -> float | None:
    """BWT as TreeLoRA's `inference/collect_results.py` (ZinYY/TreeLoRA) computes it:
        (1/T) * sum_{i<T} min(R[T-1][i] - R[i][i], 0)
    every gain clamped to 0 and the sum divided by T (the last task's own term,
    always 0, included), where cl.bwt divides the unclamped sum over i < T-1 by T-1.
    So it is never above 0, and a method whose old tasks improve shows no gain.

    None unless R is square (one stage per task) with the diagonal and the final
    row present.
    """
    pairs = _final_and_diagonal(R)
    return None if pairs is None else sum(min(a - b, 0.0) for a, b in pairs) / len(pairs)
