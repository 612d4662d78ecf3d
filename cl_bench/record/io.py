"""The run folder: the run record (run.json, cl_bench/record/schema.py) and its one
reader, predictions.jsonl and metrics.jsonl, the claim and lock of the folder
(its checkpoints: cl_bench/run/checkpoint.py). Everything is written atomically:
a write goes to a temporary file in the same folder and replaces the target with
os.replace, so an interrupted write never damages what was there.
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import platform
import stat
import subprocess
import tempfile
from pathlib import Path
from collections.abc import Iterator
from typing import Any

from cl_bench.errors import UserError, resume_line
from cl_bench.record.schema import RunRecord

RUN_FILE = "run.json"
PREDICTIONS_FILE = "predictions.jsonl"
METRICS_FILE = "metrics.jsonl"
LOCK_FILE = "run.lock"  # flock-ed by the process writing the run; holds its PID
ZERO_SHOT_STAGE = -1  # the `stage` of the zero-shot row's predictions and task metrics


# Stage numbers. What a user reads or types (show, the site, `score --stage`, `params`,
# `analyze --from-stage`, logs and messages) counts stages from 1 (1..T; 0 is the zero-shot
# row); the files keep the 0-based position they always had (`stage` in predictions.jsonl,
# run.json's stages, params, timing and task_metrics, the matrix's row; -1 the zero-shot
# row), so records written before and after read the same. These two convert between them.
def stage_number(index: int) -> int:
    """The number a user reads for the stage at 0-based `index` (ZERO_SHOT_STAGE -> 0)."""
    return index + 1


def stage_index(number: int) -> int:
    """The 0-based position in the files of the stage a user numbered `number` (0 -> ZERO_SHOT_STAGE)."""
    return number - 1


def atomic_write_text(path: Path, text: str) -> None:
    """Write via a temporary file in the same folder, then os.replace; an existing
    file keeps its permission bits (mkstemp would make it 0600)."""
    mode = stat.S_IMODE(path.stat().st_mode) if path.exists() else 0o644
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json(path: Path, data: Any) -> None:
    # allow_nan=False: a NaN or inf raises here rather than writing a file that is not JSON
    atomic_write_text(path, json.dumps(data, indent=2, ensure_ascii=False, allow_nan=False) + "\n")


def write_jsonl(path: Path, rows: list[dict]) -> None:
    atomic_write_text(path, "".join(json.dumps(r, ensure_ascii=False, allow_nan=False) + "\n" for r in rows))


def json_lines(path: Path, text: str, fix: str) -> Iterator[tuple[int, Any]]:
    """(line number, the JSON value) for each non-blank line of `text`, read from
    `path`; a line that is not JSON: one line naming it, then `fix`."""
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            yield n, json.loads(line)
        except json.JSONDecodeError as exc:
            raise UserError(f"{path}:{n}: not valid JSON ({exc.msg}); {fix}") from None


def read_jsonl(path: Path, staged: bool = False) -> list[dict]:
    """The JSON objects of a run's .jsonl file, one a line (none if it is absent);
    `staged`: each with an integer "stage". Anything else: one line naming the line."""
    if not path.exists():
        return []
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise UserError(f"{path}: byte {exc.start} is not UTF-8; the file is damaged: put back the file as "
                        f"cl-bench wrote it, or move the run folder away") from None
    rows = []
    for n, row in json_lines(path, text, "the file is damaged: put back the file as cl-bench wrote it, or move "
                                         "the run folder away"):
        if not isinstance(row, dict) or staged and (not isinstance(row.get("stage"), int)
                                                    or isinstance(row["stage"], bool)):
            raise UserError(f"{path}:{n}: field stage: each line must be a JSON object with an integer stage; the "
                            f"file is damaged: put back the file as cl-bench wrote it, or move the run folder away")
        rows.append(row)
    return rows


def read_record(run_dir: Path) -> RunRecord:
    """The run record of `run_dir`, of any schema version cl-bench has written: the
    one reader (run --resume, show, compare, analyze, cost, leaderboard); every
    failure is one line naming the file (and, for its content, the schema version)."""
    run_dir = Path(run_dir)
    path = run_dir / RUN_FILE
    if run_dir.exists() and not run_dir.is_dir():
        raise UserError(f"{run_dir}: is a file, not a run folder; pass the folder that holds {RUN_FILE}")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"{path}: no run record here; pass the folder of a run "
                        f"(it holds {RUN_FILE})") from None
    except json.JSONDecodeError as exc:
        raise UserError(f"{path}: not valid JSON (line {exc.lineno}); the record is damaged") from None
    except UnicodeDecodeError as exc:
        raise UserError(f"{path}: not UTF-8 text (byte {exc.start}); the record is damaged") from None
    except OSError as exc:
        raise UserError(f"{path}: cannot read the run record ({exc.strerror}); check the path") from None
    return RunRecord.from_json(data, path)


def read_finished(run_dir: Path) -> RunRecord:
    """read_record, for readers that need at least one finished stage (analyze, cost)."""
    record = read_record(Path(run_dir))
    if not record.stages_done:
        raise UserError(f"{Path(run_dir) / RUN_FILE}: no stage finished yet; nothing to draw")
    return record


def write_run(run_dir: Path, record: RunRecord, predictions: list[dict]) -> None:
    """The record, then the predictions; a failure to write is a UserError that says
    the last checkpoint is kept and how to resume."""
    try:
        write_json(run_dir / RUN_FILE, record.to_json())
        write_jsonl(run_dir / PREDICTIONS_FILE, predictions)
    except (OSError, ValueError) as exc:  # ValueError: a NaN or inf, which JSON cannot hold
        raise _cannot_write(run_dir, exc) from None


def append_metrics(run_dir: Path, rows: list[dict]) -> None:
    """Step log rows appended to metrics.jsonl (strict JSON: a NaN fails)."""
    try:
        with (run_dir / METRICS_FILE).open("a") as fh:
            fh.writelines(json.dumps(r, allow_nan=False) + "\n" for r in rows)
    except (OSError, ValueError) as exc:
        raise _cannot_write(run_dir, exc) from None


def _cannot_write(run_dir: Path, exc: Exception) -> UserError:
    reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
    return UserError(f"{run_dir}: cannot write the run's files ({reason}); the last checkpoint is "
                     f"kept: free space or fix permissions, then {resume_line(run_dir)}")


def ensure_writable(directory: Path) -> None:
    """Fail early, before loading a model, if the output folder cannot be written."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".write-check-"):
            pass
    except OSError as exc:
        raise UserError(f"{directory}: output directory is not writable ({exc.strerror}); "
                        f"pass --output-dir with a folder you can write") from None


def lock_run(run_dir: Path):
    """An exclusive flock on run_dir/run.lock for as long as the returned file stays
    open (close it to release; the kernel releases it when the process dies). Our
    PID goes into the file, so a second writer can say who holds the run."""
    path = run_dir / LOCK_FILE
    try:
        fh = os.fdopen(os.open(path, os.O_RDWR | os.O_CREAT, 0o644), "r+", encoding="utf-8")
    except OSError as exc:
        raise UserError(f"{run_dir}: run folder is not writable ({exc.strerror}); fix its permissions "
                        f"or choose another --output-dir/--run-id") from None
    try:
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        holder = fh.read().strip() or "unknown"
        fh.close()
        if exc.errno not in (errno.EAGAIN, errno.EACCES):
            raise UserError(f"{path}: cannot lock the run folder ({exc.strerror})") from None
        raise UserError(f"{run_dir}: in use by another cl-bench process (PID {holder}, holding {path}); "
                        f"wait for it to finish or stop it, or choose another --run-id") from None
    try:
        with tempfile.NamedTemporaryFile(dir=run_dir, prefix=".write-check-"):
            pass  # the folder itself takes new files (the lock file may predate a chmod)
        fh.truncate(0)
        fh.write(f"{os.getpid()}\n")
        fh.flush()
    except OSError as exc:
        fh.close()
        raise UserError(f"{run_dir}: run folder is not writable ({exc.strerror}); free space or fix "
                        f"its permissions") from None
    return fh


def is_running(run_dir: Path) -> bool:
    """Whether a process holds the run folder's lock (lock_run) now."""
    path = run_dir / LOCK_FILE
    if not path.is_file():
        return False
    with open(path, "a") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return True
        fcntl.flock(fh, fcntl.LOCK_UN)
    return False


def claim_run_dir(run_dir: Path):
    """Fail early, before loading a model, if the run folder cannot be written or is
    taken; returns its lock. A run starts only in an absent or empty folder (one that
    holds only a lock file counts as empty: a start that failed before writing)."""
    ensure_writable(run_dir.parent)
    if run_dir.exists() and not run_dir.is_dir():
        raise UserError(f"{run_dir}: is a file, not a run folder; choose another --run-id")
    if not (run_dir / LOCK_FILE).exists():
        _refuse_taken(run_dir)  # before a lock file goes into someone else's folder
    run_dir.mkdir(exist_ok=True)
    lock = lock_run(run_dir)  # a second writer fails here, naming the first one's PID
    try:
        _refuse_taken(run_dir)  # again, under the lock
    except UserError:
        lock.close()
        raise
    return lock


def _refuse_taken(run_dir: Path) -> None:
    found = sorted(p.name for p in run_dir.iterdir() if p.name != LOCK_FILE) if run_dir.is_dir() else []
    if RUN_FILE in found:
        raise UserError(f"{run_dir}: a run with this id exists; resume it with "
                        f"--resume {run_dir} or choose another --run-id")
    if found:
        shown = ", ".join(found[:3]) + (", ..." if len(found) > 3 else "")
        raise UserError(f"{run_dir}: folder exists and is not empty ({shown}); a run starts only in an "
                        f"absent or empty folder: choose another --run-id or --output-dir")


def versions() -> dict[str, str]:
    import importlib.metadata as md

    out = {"python": platform.python_version()}
    for pkg in ("cl-bench", "torch", "transformers", "peft", "datasets", "numpy"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            continue
    return out


def git_commit() -> str | None:
    """The project's commit (with '+dirty' when the tree has uncommitted changes)."""
    root = Path(__file__).resolve().parents[2]  # the checkout: cl_bench/record/io.py -> the repository
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True,
                             text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return sha + ("+dirty" if dirty else "")

