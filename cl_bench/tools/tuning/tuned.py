"""The tuned file, configs/tuned/<profile>.yaml (rule.py writes it), read back.

`cl-bench run --tuned` (a config file's `tuned: true`): the method's arguments come
from the file of the run's profile, under the run's own --method-arg (an argument
both give is refused), and the run's config records `tuned:
configs/tuned/<profile>.yaml@<commit of the file>`; a file that is not committed,
or has uncommitted changes, is refused, since the record could not name it.

`select`: the runs of one leaderboard of a profile: each ranked method at given
arguments (the tuned file's, or the arguments each method has without any: the
shared-rate leaderboard), with the reference rows at theirs, on the profile's own
order and its test split.
"""
from __future__ import annotations

import dataclasses
import subprocess
from pathlib import Path

import yaml

from cl_bench.errors import UserError

ROOT = Path(__file__).resolve().parents[2]  # the checkout whose code runs: the file is read from it
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
    from cl_bench import registry

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


def default_args(method: str, profile: str) -> dict:
    """The arguments a method runs with on the profile when none are given."""
    from cl_bench import config as cfg
    from cl_bench import registry

    cls = registry.get(method)
    return dataclasses.asdict(cls.parse_args(cls.args_for(cfg.resolve(profile, None, {"method": cls.name}))))


def expected_args(methods: dict[str, dict], profile: str) -> dict[str, dict]:
    """Method -> the full parsed arguments of a run given `methods[method]` on the profile."""
    from cl_bench import config as cfg
    from cl_bench import registry

    out = {}
    for method, given in methods.items():
        cls = registry.get(method)
        config = cfg.resolve(profile, None, {"method": cls.name, "method_args": dict(given)})
        out[cls.name] = dataclasses.asdict(cls.parse_args(cls.args_for(config)))
    return out


def select(runs: list, args: dict[str, dict], profile: str) -> list:
    """The runs (RunRecord) of the profile's order and test split whose method is in
    `args` at exactly those arguments, and the reference rows at their defaults."""
    from cl_bench import config as cfg
    from cl_bench import registry
    from cl_bench.benchmarks.trace.tasks import resolve_order

    order = resolve_order(cfg.resolve(profile, None, {}).data.order)
    keep = []
    for run in runs:
        split = ((run.config or {}).get("data") or {}).get("test_split") or "test"
        if run.profile != profile or list(run.tasks) != order or split != "test":
            continue
        try:
            cls = registry.get(run.method)
        except UserError:
            continue
        wanted = default_args(cls.name, profile) if cls.reference else args.get(cls.name)
        if wanted is not None and run.method_args == wanted:
            keep.append(run)
    return keep
