"""The campaign tests' shared pieces: the command run from a root, a dry run on this tree,
and the rows of its printed table (the plan fixture is in conftest.py)."""
from __future__ import annotations

from pathlib import Path

from helpers import run_cli

ROOT = Path(__file__).resolve().parents[2]


def campaign(*argv, root: Path = ROOT) -> int:
    """The command, from `root` (where .campaign/ goes: logs, clones, jobs); the plans
    of these tests name absolute run folders."""
    return run_cli("campaign", *argv, "--root", root)


def here(*argv):
    """A dry run on the tree as it is (the tree under test may have changes, which
    a new run's clone of HEAD refuses)."""
    return [*argv, "--dry-run", "--code", str(ROOT)]


def table_rows(out: str) -> list[list[str]]:
    """(state, run folder) per row of the printed table."""
    rows = [line.split() for line in out.splitlines()[1:] if not line.startswith(("scale:", "total left"))]
    return [[r[0], next(w for w in r[1:] if "/" in w)] for r in rows]
