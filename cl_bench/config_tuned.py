"""The tuned file, configs/tuned/<profile>.yaml (`cl-bench tune choose` writes it:
cl_bench/tools/tuning/rule.py), read for a run.

`cl-bench run --tuned` (a config file's `tuned: true`): the method's arguments come
from the file of the run's profile, under the run's own --method-arg (an argument
both give is refused), and the run's config records `tuned:
configs/tuned/<profile>.yaml@<commit of the file>`; a file that is not committed,
or has uncommitted changes, is refused, since the record could not name it.
cl_bench/config.py's resolve calls `apply`.
"""
from __future__ import annotations

import subprocess
from pathlib import Path

import yaml

from cl_bench import registry
from cl_bench.errors import UserError

ROOT = Path(__file__).resolve().parents[1]  # the checkout whose code runs: the file is read from it
FOLDER = Path("configs") / "tuned"


def path_for(profile: str) -> Path:
    return ROOT / FOLDER / f"{profile}.yaml"


def load(path: Path) -> dict[str, dict]:
    """Method -> its tuned arguments."""
    if not path.is_file():
        raise UserError(f"{path}: no tuned file for this profile; make it with `cl-bench tune choose "
                        f"configs/tuning/{path.stem}.yaml` once its tuning runs are done")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
        methods = {str(m): dict(entry["args"]) for m, entry in data["methods"].items()}
    except (yaml.YAMLError, TypeError, KeyError, AttributeError, ValueError):
        raise UserError(f"{path}: not a tuned file (methods.<method>.args); write it again with "
                        f"`cl-bench tune choose`") from None
    return methods


def file_commit(path: Path) -> str:
    """The commit that last changed the file, which must be committed as it is."""
    rel = path.relative_to(ROOT).as_posix()
    try:
        changed = subprocess.run(["git", "status", "--porcelain", "--", rel], cwd=ROOT, capture_output=True,
                                 text=True, check=True).stdout.strip()
        commit = subprocess.run(["git", "log", "-1", "--format=%H", "--", rel], cwd=ROOT, capture_output=True,
                                text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        raise UserError(f"{path}: cannot ask git for its commit; run from a cl-bench checkout") from None
    if changed or not commit:
        raise UserError(f"{path}: {'has uncommitted changes' if commit else 'is not committed'}; commit it "
                        f"(a --tuned run's record names the file's commit)")
    return commit


def apply(raw: dict, profile: str) -> dict:
    """The config fields with the tuned arguments of the method merged in (module docstring)."""
    method = registry.get(raw.get("method") or registry.baseline()).name
    path = path_for(profile)
    args = load(path)
    if method not in args:
        raise UserError(f"{path}: no tuned arguments for {method}; tune it (add it to configs/tuning/"
                        f"{profile}.yaml) or run it without --tuned")
    given = dict(raw.get("method_args") or {})
    both = sorted(set(given) & set(args[method]))
    if both:
        raise UserError(f"--tuned sets {', '.join(both)} of {method} from {path.relative_to(ROOT)}; drop "
                        f"--method-arg {both[0]}=... (or run without --tuned)")
    return {**raw, "method_args": {**args[method], **given},
            "tuned": f"{path.relative_to(ROOT).as_posix()}@{file_commit(path)}"}
