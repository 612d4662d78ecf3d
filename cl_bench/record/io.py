"""The run folder: the run record (run.json, cl_bench/record/schema.py) and its one
reader, predictions.jsonl and metrics.jsonl, the claim and lock of the folder,
checkpoints. Everything is written atomically: a write goes to a temporary file
in the same folder and replaces the target with os.replace, so an interrupted
write never damages what was there.
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import pickle
import platform
import re
import random
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from cl_bench.errors import UserError, program
from cl_bench.record.schema import RunRecord

RUN_FILE = "run.json"
PREDICTIONS_FILE = "predictions.jsonl"
METRICS_FILE = "metrics.jsonl"
CHECKPOINT_DIR = "checkpoint"  # after the last finished stage
STEP_CHECKPOINT_DIR = "checkpoint-step"  # inside the stage in progress (train.checkpoint_every_s)
LOCK_FILE = "run.lock"  # flock-ed by the process writing the run; holds its PID
ZERO_SHOT_STAGE = -1  # the `stage` of the zero-shot row's predictions and task metrics


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
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise UserError(f"{path}:{n}: not valid JSON ({exc.msg}); the file is damaged: put back the file as "
                            f"cl-bench wrote it, or move the run folder away") from None
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


def _write_failure(exc: Exception, folder: Path) -> str:
    """Why a write failed, in words: the OS's reason, or for torch.save's RuntimeError
    ("[enforce fail at inline_container.cc:N] . PytorchStreamWriter failed writing file
    data/3: file write failed") its last clause and the space left on that disk."""
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    last = str(exc).splitlines()[0].rsplit(": ", 1)[-1] if str(exc) else type(exc).__name__
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        return last
    return f"{last}; {free / 2**20:.0f} MiB free on its disk"


def _cannot_write(run_dir: Path, exc: Exception) -> UserError:
    reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
    return UserError(f"{run_dir}: cannot write the run's files ({reason}); the last checkpoint is "
                     f"kept: free space or fix permissions, then {program()} run --resume {run_dir}")


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
    root = Path(__file__).resolve().parents[1]
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True,
                             text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return sha + ("+dirty" if dirty else "")


# ---- checkpoints ---------------------------------------------------------------

def rng_state() -> dict[str, Any]:
    """Python's, numpy's and torch's generator states as tensors and plain values
    (numpy's key array as a tensor), so checkpoints load with weights_only=True."""
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    return {"python": random.getstate(),
            "numpy": [name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(gauss)],
            "torch": torch.get_rng_state()}


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    name, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.int64).astype(np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])


def save_checkpoint(run_dir: Path, state: dict[str, Any], name: str = CHECKPOINT_DIR) -> None:
    """Write the folder `name` (checkpoint/) whole, then swap it in: the previous one
    survives a crash."""
    final = run_dir / name
    staging = run_dir / f"{name}.new"
    old = run_dir / f"{name}.old"
    shutil.rmtree(staging, ignore_errors=True)
    try:
        staging.mkdir()
        torch.save(state, staging / "state.pt")
    except (OSError, RuntimeError) as exc:  # torch.save reports a full disk as RuntimeError
        shutil.rmtree(staging, ignore_errors=True)
        raise UserError(f"{staging}: cannot write the checkpoint ({_write_failure(exc, run_dir)}); the "
                        f"previous one is kept: free space, then {program()} run --resume {run_dir}") from None
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
    staging.rename(final)
    shutil.rmtree(old, ignore_errors=True)


def has_checkpoint(run_dir: Path, name: str = CHECKPOINT_DIR) -> bool:
    return any((run_dir / folder / "state.pt").exists() for folder in (name, f"{name}.old"))


def stranded(run_dir: Path, stages_done: int) -> str | None:
    """Why --resume cannot continue a record of `stages_done` finished stages whose
    folder holds no stage checkpoint (None: it can). With 0 or 1 stages recorded none
    is needed: a stop in stage 1, or between stage 1's record and its checkpoint, and
    the run starts again. With more, cl-bench has always left one, so the folder was
    copied without its git-ignored checkpoint folders (to another machine, a clone) or
    the checkpoint was removed; starting again would overwrite the recorded stages."""
    if stages_done < 2 or has_checkpoint(run_dir):
        return None
    return (f"{run_dir / RUN_FILE}: stages_done is {stages_done}, but {run_dir} holds no {CHECKPOINT_DIR}/state.pt "
            f"(copied without its git-ignored checkpoint folders, or removed), and --resume would start again "
            f"from stage 1 over the {stages_done} recorded stages: put {CHECKPOINT_DIR}/ back beside "
            f"{RUN_FILE}, or move the folder away and start the run again")


def remove_checkpoint(run_dir: Path, name: str) -> None:
    for folder in (name, f"{name}.old", f"{name}.new"):
        shutil.rmtree(run_dir / folder, ignore_errors=True)


def checkpoint_file(run_dir: Path, name: str = CHECKPOINT_DIR) -> Path | None:
    """The state.pt that load_checkpoint reads (None: there is none)."""
    for folder in (name, f"{name}.old"):
        if (run_dir / folder / "state.pt").exists():
            return run_dir / folder / "state.pt"
    return None


def load_checkpoint(run_dir: Path, name: str = CHECKPOINT_DIR) -> dict[str, Any]:
    """The last checkpoint, loaded with `weights_only=True`: tensors and plain types
    only, so a checkpoint from someone else cannot run code on --resume."""
    path = checkpoint_file(run_dir, name)
    if path is not None:
        try:
            return torch.load(path, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as exc:
            found = re.search(r"GLOBAL ([\w.]+)", str(exc))  # what the file asked to import
            first = f"it imports {found.group(1)}" if found else type(exc).__name__
            raise UserError(f"{path}: refused: it holds more than tensors and plain values ({first}); "
                            f"a cl-bench checkpoint never does, so it was not written by cl-bench") from None
        except (EOFError, RuntimeError, OSError) as exc:
            raise UserError(f"{path}: unreadable checkpoint ({type(exc).__name__}); the run cannot "
                            f"resume from it: start it again under a new --run-id") from None
    raise UserError(f"{run_dir}: no checkpoint to resume from (the run stopped before its "
                    f"first stage finished); start it again without --resume")
