"""Whether and where a run continues: the one place that decides it.

`cl-bench run --resume DIR` continues a run that is not complete (recorded: its
record read, its config built and checked once, before anything loads or --nproc
starts ranks). Under the folder's lock the record is read again (under_lock:
another process may have finished or resumed the run in between; the first read
cannot be under the lock, which rank 0 takes once the backend the config names has
started), and the run either
- continues after its last stage checkpoint (restore: the checkpoint comes back
  and the record drops what the interrupted stage wrote after it), or,
- with no stage checkpoint yet (a stop in stage 1), starts again from stage 1 in
  its folder (start_again), keeping the zero-shot scores of the same model
  (keep_zero_shot).
Inside the stage it continues with, an in-stage checkpoint (load_in_stage) says
which step training starts from: the stage's hooks run again from its start,
which are deterministic given the stage checkpoint's generator states, so that
whatever before_task and before_phase built (a teacher, a new expert group, an
anchor) exists again; at the saved phase its state is loaded over them
(enter_in_stage) and the backend passes over the steps already taken
(train_stage's start_step). The result is the uninterrupted run's, byte for byte
(tests/run/test_resume_in_stage.py). An interrupt says what it left and the
command that continues it (left_by_interrupt).
"""
from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from cl_bench.config import build
from cl_bench.errors import UserError
from cl_bench.record import io as results
from cl_bench.run.machine import calibration
from cl_bench.record.schema import RunRecord
from cl_bench.run import checkpoint
from cl_bench.run.checks import Checked, check_config
from cl_bench.run.checkpoint import CHECKPOINT_DIR, STEP_CHECKPOINT_DIR, InStage

if TYPE_CHECKING:
    from cl_bench.run.state import Run

log = logging.getLogger(__name__)


@dataclass
class Resuming:
    """A run --resume can continue: its folder, and the config built from its record
    (read before the folder is locked), checked."""

    run_dir: Path
    checked: Checked


def recorded(resume_dir: Path) -> Resuming:
    """The run in `resume_dir`, if --resume can continue it (resumable), with its
    config built from the record and checked (an error names the record). A folder
    holding only a lock file that no process holds (a start stopped before its first
    record) says how to start it again."""
    try:
        record = resumable(results.read_record(resume_dir), resume_dir)
    except UserError:
        if (resume_dir / results.LOCK_FILE).is_file():  # a run starting there, before its first record?
            if not results.is_running(resume_dir) and [p.name for p in resume_dir.iterdir()] == [results.LOCK_FILE]:
                raise UserError(f"{resume_dir}: the run stopped before its record was written, so there is "
                                f"nothing to resume; start it again with its own flags and --run-id "
                                f"{resume_dir.name} --output-dir {resume_dir.parent} (a folder holding only "
                                f"{results.LOCK_FILE} counts as empty)") from None
            results.lock_run(resume_dir).close()  # if so, this names its PID
        raise
    with _naming_the_record(resume_dir):
        checked = check_config(build(record.config, f"{resume_dir / results.RUN_FILE}: config"))
    return Resuming(resume_dir, checked)


@contextlib.contextmanager
def _naming_the_record(run_dir: Path):
    """A recorded config that fails a check: the error names the record's file."""
    path = run_dir / results.RUN_FILE
    try:
        yield
    except UserError as exc:
        if str(path) in str(exc):
            raise
        raise UserError(f"{path}: in field config: {exc}") from None


def resumable(record: RunRecord, resume_dir: Path) -> RunRecord:
    """`record`, if --resume can continue it: not complete, its config recorded, and
    the checkpoint of its finished stages there (stranded)."""
    if record.status == "complete":
        raise UserError(f"{resume_dir}: this run is already complete; nothing to resume")
    if record.config is None:
        raise UserError(f"{resume_dir / results.RUN_FILE}: the record has no 'config'; it cannot be "
                        f"resumed: start a new run")
    why = stranded(resume_dir, record.stages_done)
    if why:
        raise UserError(why)
    return record


def stranded(run_dir: Path, stages_done: int) -> str | None:
    """Why --resume cannot continue a record of `stages_done` finished stages whose
    folder holds no stage checkpoint (None: it can). With 0 or 1 stages recorded none
    is needed: a stop in stage 1, or between stage 1's record and its checkpoint, and
    the run starts again. With more, cl-bench has always left one, so the folder was
    copied without its git-ignored checkpoint folders (to another machine, a clone) or
    the checkpoint was removed; starting again would overwrite the recorded stages."""
    if stages_done < 2 or checkpoint.has_checkpoint(run_dir):
        return None
    return (f"{run_dir / results.RUN_FILE}: stages_done is {stages_done}, but {run_dir} holds no "
            f"{CHECKPOINT_DIR}/state.pt (copied without its git-ignored checkpoint folders, or removed), and "
            f"--resume would start again from stage 1 over the {stages_done} recorded stages: put "
            f"{CHECKPOINT_DIR}/ back beside {results.RUN_FILE}, or move the folder away and start the run again")


def under_lock(resuming: Resuming) -> tuple[RunRecord, bool]:
    """The record read again now that the folder is locked (no one else writes it),
    and whether the run starts again from stage 1 (no stage checkpoint yet)."""
    record = resumable(results.read_record(resuming.run_dir), resuming.run_dir)
    return record, not checkpoint.has_checkpoint(resuming.run_dir)


def take_up(run: Run, recorded: RunRecord, restart: bool, command: str) -> None:
    """Continue the prepared `run` where its folder says (`command`: the resume's):
    after the last stage checkpoint (restore), or with none, from stage 1 with the
    zero-shot scores of `recorded` it keeps (`restart`: run.record is a fresh one)."""
    if restart:
        run.predictions = keep_zero_shot(recorded, run.record, run.run_dir)
        start_again(run, command)
    else:
        restore(run, command)


def keep_zero_shot(old: RunRecord, new: RunRecord, run_dir: Path) -> list[dict]:
    """A restart (no stage checkpoint yet): the zero-shot scores of `old`, the record
    read, go into `new`, the fresh one, if the model is the same (its sha256 among
    the info compared); returns their predictions. A task whose predictions are not
    all in predictions.jsonl (a stop between the record's write and theirs) is
    scored again."""
    if old.zero_shot is None or old.model != new.model or len(old.zero_shot) != len(new.tasks):
        return []
    rows: dict[str, list[dict]] = {}
    for row in results.read_jsonl(run_dir / results.PREDICTIONS_FILE, staged=True):
        if row["stage"] == results.ZERO_SHOT_STAGE:
            rows.setdefault(row.get("task"), []).append(row)
    n = {m["task"]: m["n"] for m in old.task_metrics if m["stage"] == results.ZERO_SHOT_STAGE}
    kept = [name for name, score in zip(new.tasks, old.zero_shot)
            if score is not None and name in n and len(rows.get(name, [])) == n[name]]
    if not kept:
        return []
    new.zero_shot = [score if name in kept else None for name, score in zip(new.tasks, old.zero_shot)]
    new.task_metrics = [m for m in old.task_metrics if m["stage"] == results.ZERO_SHOT_STAGE and m["task"] in kept]
    new.timing.zero_shot_s = old.timing.zero_shot_s
    return [row for name in kept for row in rows[name]]


def start_again(run: Run, command: str) -> None:
    """No stage checkpoint yet: the run starts again from its first stage, in its
    folder, with its fresh record (which notes the resume, `command`); the step log
    goes, and the record and the kept predictions are written."""
    run.record.resumes = [{"at_stage": 0, "command": command, "backend": run.backend.describe()}]
    if run.backend.is_main:
        within = checkpoint.has_checkpoint(run.run_dir, STEP_CHECKPOINT_DIR)
        scored = sum(score is not None for score in run.record.zero_shot or [])
        log.info("%s: no stage checkpoint (it stopped in stage 1, or before stage 1's was written); "
                 "restarting it from stage 1%s%s", run.run_dir,
                 f" (keeping the {scored} zero-shot scores)" if scored else "",
                 ", then from its in-stage checkpoint" if within else "")
    run.backend.barrier()  # every rank has read the files before rank 0 rewrites them
    run.backend.on_main(lambda: (run.run_dir / results.METRICS_FILE).unlink(missing_ok=True))
    run.write_files()


def restore(run: Run, command: str) -> None:
    """The last stage checkpoint into the run; the record and the step log keep the
    stages it holds, and note the resume (`command`)."""
    saved = checkpoint.loaded(run, CHECKPOINT_DIR)
    rec = run.record
    hi = min(len(run.stages), rec.stages_done) - 1  # the record is written before the checkpoint
    done = saved.index("stage", 0, hi) + 1
    checkpoint.load_training_state(run, saved)
    with saved.applying("replay"):
        run.replay.load_state_dict(saved.get("replay", dict), run.replay_sources)
    for name, probe in (("probe", run.probe), ("routing", run.routing)):
        if probe is not None and saved.state.get(name) is not None:
            with saved.applying(name):
                probe.load_state_dict(saved.state[name])
    for kind in (rec.probes or {}).values():  # what the interrupted stage recorded
        for key in [k for k in kind if int(k) >= done]:
            del kind[key]
    # Drop whatever the interrupted stage wrote after its checkpoint.
    rec.stages_done = done
    rec.params = rec.params[:done]
    rec.timing.stages = rec.timing.stages[:done]
    rec.task_metrics = [m for m in rec.task_metrics if m["stage"] < done]
    for b in range(done, len(rec.matrix)):
        rec.matrix[b] = [None] * len(rec.tasks)
    run.predictions = [r for r in results.read_jsonl(run.run_dir / results.PREDICTIONS_FILE, staged=True)
                       if r["stage"] < done]
    metrics = run.run_dir / results.METRICS_FILE
    kept = [r for r in results.read_jsonl(metrics, staged=True) if r["stage"] < done]
    run.backend.barrier()  # every rank has read the files before rank 0 rewrites one
    run.backend.on_main(lambda: results.write_jsonl(metrics, kept))
    rec.status = "running"
    rec.error = None  # of the interrupted attempt
    rec.failed_at = None
    rec.resumes = [*(rec.resumes or []), {"at_stage": done, "command": command,
                                          "backend": run.backend.describe(),
                                          "machine": calibration(run.backend.train_precision)}]
    if run.backend.is_main:
        log.info("resuming %s at stage %d/%d", run.run_dir, done + 1, len(run.stages))


def load_in_stage(run: Run) -> InStage | None:
    """The in-stage checkpoint of the stage the run continues with, if there is one:
    where training starts (one of an earlier stage, left by a stop between the stage
    checkpoint and its removal, is removed)."""
    if not checkpoint.has_checkpoint(run.run_dir, STEP_CHECKPOINT_DIR):
        return None
    saved = checkpoint.loaded(run, STEP_CHECKPOINT_DIR)
    if saved.index("stage", 0, len(run.stages) - 1) != run.record.stages_done:
        run.backend.barrier()
        run.backend.on_main(lambda: checkpoint.remove_checkpoint(run.run_dir, STEP_CHECKPOINT_DIR))
        return None
    log_rows = saved.get("log_rows", list)
    if not all(isinstance(r, dict) and isinstance(r.get("step"), int) for r in log_rows):
        raise saved.fail("log_rows", "must be the stage's step log rows (objects with an integer step)")
    train_s = saved.get("train_s", (int, float))
    return InStage(saved.index("stage", 0, len(run.stages) - 1), saved.index("phase", 0, 1 << 30),
                   saved.index("step", 0, 1 << 30), log_rows, saved.index("global_step", 0, 1 << 62),
                   float(train_s), saved)


def enter_in_stage(run: Run, at: InStage) -> None:
    """Load the in-stage checkpoint's state (its phase's hooks have run) and note the
    resume in the record. The loaded file goes then: kept in `at` for the rest of the
    stage, it would hold a second copy of the weights on every rank (and at ZeRO-3 the
    whole optimiser state)."""
    checkpoint.load_training_state(run, at.state)
    at.state = None
    run.global_step = at.global_step
    last = (run.record.resumes or [None])[-1]
    if last is not None and last.get("at_stage") == at.stage:
        last["at_step"] = {"phase": at.phase, "step": at.step}
    if run.backend.is_main:
        log.info("%s: continuing stage %d at step %d of its phase %d (in-stage checkpoint)", run.run_dir,
                 at.stage + 1, at.step, at.phase + 1)


def stop_recorded(run_dir: Path, wait_s: float = 5.0) -> bool:
    """Whether the run's record says it stopped (status no longer `running`) within
    `wait_s`: on a rank other than 0 whose collective failed (Backend.lost_peer), that
    rank 0 is alive and says what the stop left; if not, rank 0 is the rank that ended."""
    import json
    import time

    deadline = time.monotonic() + wait_s
    while True:
        try:
            if json.loads((run_dir / results.RUN_FILE).read_text(encoding="utf-8")).get("status") != "running":
                return True
        except (OSError, ValueError, AttributeError):  # not there, or caught mid-write: look again
            pass
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.2)


def left_by_interrupt(run: Run, again: str, what: str = "interrupted") -> str:
    """What an interrupt (or another stop: `what`) leaves, in one line: resume continues
    after the last checkpoint, or, with none yet, starts the run again in its folder.
    `again`: the command that does either (report.text.resume_command)."""
    done, total = run.record.stages_done, len(run.stages)
    if checkpoint.has_checkpoint(run.run_dir, STEP_CHECKPOINT_DIR):
        return (f"{what}; {done} of {total} stages are saved, and stage {done + 1} up to its last in-stage "
                f"checkpoint; continue with: {again}")
    if checkpoint.has_checkpoint(run.run_dir):
        return f"{what}; {done} of {total} stages are saved; continue with: {again}"
    scored = sum(score is not None for score in run.record.zero_shot or [])
    if scored:
        return (f"{what} before the first stage was saved; {scored} of {len(run.tasks)} zero-shot scores "
                f"are saved; continue with: {again}")
    return f"{what} before the first stage was saved; nothing to keep; start it again with: {again}"
