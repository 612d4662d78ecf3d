"""What the leaderboard reads and writes: the complete run records under a folder,
and the section of a README (between its markers) that holds a table."""

from __future__ import annotations

import fnmatch
import logging
from pathlib import Path

from cl_bench.errors import UserError
from cl_bench.record.io import atomic_write_text, read_record
from cl_bench.record.schema import RunRecord

log = logging.getLogger(__name__)


def load_runs(runs_dir: Path, exclude: list[str] = (), include: list[str] = ()) -> list[RunRecord]:
    """Every complete run under runs_dir (recursive), parsed, sorted by path,
    except run folders matching a glob of `exclude` (relative to runs_dir); with
    `include`, only run folders matching one of its globs.

    Each record's `source` is the run.json it came from, so later errors can name
    the file. Incomplete runs are skipped with a warning.
    """
    runs_dir = Path(runs_dir)
    if not runs_dir.is_dir():
        raise UserError(f"runs directory {runs_dir} does not exist; pass the folder holding <run-id>/run.json")
    paths = record_paths(runs_dir, exclude, include)
    if not paths:
        chosen = f" matching {', '.join(include)}" if include else ""
        raise UserError(f"no run.json{chosen} found under {runs_dir}; run `cl-bench run` first or point at the "
                        f"right folder")
    runs, skipped = [], []
    for path in paths:
        run = read_record(path.parent)
        if run.status != "complete":
            log.warning("skipping %s: status is %r, not 'complete'", path, run.status)
            skipped.append(str(path))
            continue
        runs.append(run)
    if not runs:
        raise UserError(
            f"no complete run under {runs_dir}; all {len(skipped)} found are unfinished: {', '.join(skipped)}"
        )
    return runs


def record_paths(runs_dir: Path, exclude=(), include=()) -> list[Path]:
    """The run.json files under runs_dir (recursive, sorted) that load_runs reads, before
    it reads them: run folders matching a glob of `exclude` left out; with `include`,
    only those matching one of its globs."""
    runs_dir = Path(runs_dir)
    return [p for p in sorted(runs_dir.rglob("run.json")) if not _matches(p.parent.relative_to(runs_dir), exclude)
            and (not include or _matches(p.parent.relative_to(runs_dir), include))]


def _matches(folder: Path, globs) -> bool:
    """`folder` (relative) or one of its parent folders matches a glob ('*' spans '/')."""
    names = [folder.as_posix()] + [q.as_posix() for q in folder.parents if q != Path(".")]
    return any(fnmatch.fnmatch(name, g) for name in names for g in globs)


def update_readme(
    readme_path: Path,
    table_md: str,
    begin: str = "<!-- leaderboard:begin -->",
    end: str = "<!-- leaderboard:end -->",
) -> None:
    """Replace the text between the begin and end markers (kept) with table_md, atomically."""
    readme_path = Path(readme_path)
    if not readme_path.is_file():
        raise UserError(f"{readme_path} does not exist; pass the README that should hold the leaderboard")
    text = readme_path.read_text(encoding="utf-8")
    start = text.find(begin)
    stop = text.find(end, start + len(begin)) if start >= 0 else -1
    if start < 0 or stop < 0:
        raise UserError(
            f"{readme_path}: table markers not found; add a line {begin} and, below it, "
            f"a line {end} where the table should go"
        )
    new = text[: start + len(begin)] + "\n\n" + table_md.strip("\n") + "\n\n" + text[stop:]
    atomic_write_text(readme_path, new)
