"""The end-of-run screen (and `cl-bench show`): the stage x task matrix with a 95%
interval on every cell, the summary with intervals, BWT's format and content
parts, the answer-form share of every cell and the majority-class levels."""
from __future__ import annotations

from pathlib import Path

from tabulate import tabulate

from cl_bench.metrics.cl import SUMMARIES, Summary
from cl_bench.record.schema import RunRecord
from cl_bench.report.general import format_general


def _fmt(value) -> str:
    return "–" if value is None else f"{value:.1f}"


def with_ci(value, ci) -> str:
    """'23.5 [18.1, 29.0]', or the value alone without an interval."""
    if value is None:
        return "–"
    return f"{value:.1f} [{ci[0]:.1f}, {ci[1]:.1f}]" if ci else _fmt(value)


def point_and_interval(score) -> str:
    """A (point, lo, hi) triple as "p [lo, hi]" to one decimal; "not run" for none
    (the sensitivity table and its site page)."""
    if not score or score[0] is None:
        return "not run"
    point, lo, hi = score
    return f"{point:.1f}" + ("" if lo is None else f" [{lo:.1f}, {hi:.1f}]")


def summary_cells(record: RunRecord, intervals: dict | None, shown=SUMMARIES) -> list[tuple[Summary, str]]:
    """(summary, '23.5 [18.1, 29.0]') for each of `shown` that the run has: the
    intervals' point where they hold one (BWT's format and content parts), else the record's."""
    iv = intervals or {}
    values = {**(record.summary or {}), **(iv.get("summary") or {})}
    cis = iv.get("summary_ci") or {}
    return [(s, with_ci(values[s.key], cis.get(s.key))) for s in shown if values.get(s.key) is not None]


def summary_line(record: RunRecord, intervals: dict | None, shown=SUMMARIES) -> str:
    """'Last Acc 23.5 [18.1, 29.0] | BWT ...': summary_cells on one line."""
    return " | ".join(f"{s.label} {text}" for s, text in summary_cells(record, intervals, shown))


def _table(record: RunRecord, zero, rows_, headers) -> str:
    rows = []
    if zero is not None:
        rows.append(["zero-shot", *zero])
    for stage, row in zip(record.stages, rows_):
        rows.append([f"{stage.index + 1}: {stage.label}", *row])
    return tabulate(rows, headers=headers, tablefmt="github", disable_numparse=True)


def format_matrix(record: RunRecord, intervals: dict | None = None) -> str:
    tasks = record.tasks
    iv = intervals or {}
    cis = iv.get("matrix_ci") or [[None] * len(tasks) for _ in record.matrix]
    zero = record.zero_shot
    zero_cells = None if zero is None else [
        with_ci(v, c) for v, c in zip(zero, iv.get("zero_shot_ci") or [None] * len(tasks))]
    cells = [[with_ci(v, c) for v, c in zip(row, ci)] for row, ci in zip(record.matrix, cis)]
    out = [f"{record.method} on {record.model.get('id', 'an unnamed model')} ({record.profile} profile, seed {record.seed})",
           _table(record, zero_cells, cells, ["after stage", *tasks])]
    out.append(summary_line(record, iv))
    if iv:
        out.append(f"[95% bootstrap intervals over {record.split} items, {iv['resamples']} paired resamples, "
                   f"seed {iv['seed']}; items per task: {', '.join(map(str, iv['n_items']))}]")
        pct = lambda v: "–" if v is None else f"{100 * v:.0f}%"  # noqa: E731
        zf = iv.get("zero_shot_form_share") if zero is not None else None
        if any(v is not None for row in iv["form_share"] for v in row):  # none where the benchmark declares no form
            out.append("\nanswer form (share of predictions with the task's answer form):")
            out.append(_table(record, None if zf is None else [pct(v) for v in zf],
                              [[pct(v) for v in row] for row in iv["form_share"]], ["after stage", *tasks]))
    majority = record.majority or {}
    if majority:
        out.append("majority-class level (always the most frequent training answer): " + ", ".join(
            f"{t} {m['score']:.1f} ('{m['answer']}')" for t, m in majority.items()))
    general = format_general(record.general, [s.label for s in record.stages])
    if general:
        out.append(general)
    return "\n".join(out)


def resume_command(record: RunRecord, run_dir: Path) -> str:
    """What continues the run in `run_dir` (an interrupt's line, `cl-bench show`'s): --resume
    with the launch flags of its last command (errors.resume_line: --nproc N,
    --keep-checkpoint); for ranks started by an outer launcher, which no flag gives, how."""
    from cl_bench.errors import command_flags, last_command, resume_line

    command = last_command(record.resumes, record.command)
    line = resume_line(run_dir, command)
    last = record.resumes[-1] if record.resumes else {}
    ranks = (last.get("backend") or record.backend or {}).get("world_size", 1)
    if isinstance(ranks, int) and ranks > 1 and "--nproc" not in command_flags(command):
        line += f" (on the {ranks} ranks of an outer launcher, as it ran: torchrun or deepspeed)"
    return line


def status_line(record: RunRecord, run_dir: Path) -> str:
    """`cl-bench show` of a run that is not complete: where it stands and what to do, in one line."""
    from cl_bench.record.io import LOCK_FILE, is_running

    done = f"{record.stages_done} of {len(record.stages)} stages done"
    if is_running(run_dir):
        pid = (run_dir / LOCK_FILE).read_text(encoding="utf-8").strip() or "unknown"
        return f"status: running (PID {pid}), {done}; the matrix fills in as stages finish"
    again = f"continue with: {resume_command(record, run_dir)}"
    if record.status == "running":  # its process is gone without writing its end
        return f"status: stopped ({record.status} when its process ended: killed?), {done}; {again}"
    why = f" ({record.error})" if record.error else ""
    # a diverged run (failed_at) would diverge again: its error says to start a new one
    after = {"interrupted": f"; {again}", "failed": "" if record.failed_at else f"; once its cause is fixed, {again}"}
    return f"status: {record.status}{why}, {done}" + after.get(record.status, "")
