"""Which code a campaign's run imports: a clone of one commit of the repository,
made once under <root>/.campaign/code-<commit>, so that editing the tree while a
campaign runs changes nothing a run imports, and a run's record names that commit.
A new run takes HEAD (a tree with uncommitted changes is refused: the clone would
not hold them); a resumed run takes the commit it started from, so that no run
mixes two versions of the code.
"""
from __future__ import annotations

import fcntl
import os
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path

from cl_bench.tools.campaign.plan import Entry
from cl_bench.errors import UserError, resume_line


def git(root: Path, *argv: str) -> str:
    return subprocess.run(["git", "-C", str(root), *argv], check=True, capture_output=True, text=True).stdout.strip()


def repository_root(start: Path) -> Path:
    try:
        return Path(git(start, "rev-parse", "--show-toplevel"))
    except (subprocess.CalledProcessError, FileNotFoundError):
        raise UserError(f"{start}: not inside a git repository; run the campaign from the cl-bench checkout "
                        f"(or give --root): each run is pinned to a commit") from None


def commit_of(entry: Entry, record: dict | None, root: Path) -> str:
    """The commit whose code the entry runs: HEAD for a new run, the commit it
    started from for one that has a record."""
    if record is not None:
        started = record.get("git_commit") or ""
        try:
            if started and "+" not in started:
                return git(root, "rev-parse", "--verify", "--quiet", f"{started}^{{commit}}")
        except subprocess.CalledProcessError:
            pass
        raise UserError(f"{entry.run_dir} started from {started or 'an unrecorded commit'}, which is not a "
                        f"commit of this repository; resume it by hand "
                        f"({resume_line(entry.run_dir, shlex.join(['cl-bench', 'run', *entry.flags]))}) or take it "
                        f"out of the plan")
    if git(root, "status", "--porcelain", "--untracked-files=no"):
        raise UserError(f"{root}: the tree has uncommitted changes; commit them (new runs run a clone of HEAD)")
    return git(root, "rev-parse", "HEAD")


def link_packages(code: Path) -> None:
    """Make `code` importable from PYTHONPATH as the editable install imports the
    tree. Today's tree needs nothing: the links cl_bench/methods and
    cl_bench/benchmarks are committed. A commit from before issue 43 may map them in
    pyproject.toml's package-dir instead; each such package is linked where the
    import system looks for it."""
    import tomllib

    setuptools = tomllib.loads((code / "pyproject.toml").read_text()).get("tool", {}).get("setuptools", {})
    mapping = setuptools.get("package-dir", {})
    for package, folder in sorted(mapping.items(), key=lambda kv: kv[0].count(".")):
        where = code / package.replace(".", "/")
        if "." in package and not where.exists():
            where.symlink_to(os.path.relpath(code / folder, where.parent), target_is_directory=True)


def checkout(root: Path, commit: str) -> Path:
    """A clone of the repository at `commit` with its packages linked, made once under
    .campaign/ (built in a folder of its own and renamed, so a failed clone leaves
    nothing behind; under a lock, so that two campaigns started together make it once)."""
    code = root / ".campaign" / f"code-{commit[:12]}"
    code.parent.mkdir(parents=True, exist_ok=True)
    with open(code.with_name(code.name + ".lock"), "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # another campaign making this clone: wait for it, then use it
        if code.is_dir():
            return code
        for stale in code.parent.glob(f"{code.name}.partial-*"):  # an earlier attempt's, killed midway
            shutil.rmtree(stale, ignore_errors=True)
        partial = Path(tempfile.mkdtemp(prefix=f"{code.name}.partial-", dir=code.parent))
        try:
            subprocess.run(["git", "clone", "--quiet", "--no-checkout", str(root), str(partial)], check=True,
                           capture_output=True, text=True)
            git(partial, "checkout", "--quiet", commit)
            link_packages(partial)
            partial.rename(code)
        except BaseException as e:
            shutil.rmtree(partial, ignore_errors=True)
            if not isinstance(e, (subprocess.CalledProcessError, OSError, KeyError, ValueError)):
                raise  # Ctrl-C and the like, with nothing left behind
            said = (getattr(e, "stderr", None) or f"{type(e).__name__}: {e}").strip().splitlines()
            raise UserError(f"{code}: cannot make the clone of {commit[:12]} ({said[-1]}); nothing was "
                            f"started: fix that, then run the campaign again") from None
    return code
