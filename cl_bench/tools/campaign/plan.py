"""A campaign's plan file and where each of its runs stands.

One run a line, `<output dir>/<run id>: <cl-bench run flags>` (without
--output-dir, --run-id, --no-progress or --resume, which the line gives), the flags
split as a shell splits them; `#` starts a comment; the order is the order of
starting. Paths are relative to the repository root.
"""
from __future__ import annotations

import dataclasses
import json
import shlex
from dataclasses import dataclass
from pathlib import Path

from cl_bench.record import io as results
from cl_bench.errors import UserError, command_flags, last_command, launch_flags

GIVEN_BY_LINE = ("--output-dir", "--run-id", "--no-progress", "--resume")
# A plan holding this line is a tuning plan (cl_bench/tools/tuning/plan.py): each of its runs must score the eval split.
TUNING_MARK = "#! tuning: eval split only"


@dataclass
class Entry:
    run_dir: Path  # as written in the plan: relative to the repository root, or absolute
    flags: list[str]
    line: int

    @property
    def run_id(self) -> str:
        return self.run_dir.name

    def folder(self, root: Path) -> Path:
        return root / self.run_dir

    def record_path(self, root: Path) -> Path:
        return self.folder(root) / results.RUN_FILE

    def log_path(self, root: Path) -> Path:
        """root/.campaign/logs/<run folder, its '/' as '__'>.log: one log a planned folder
        (a/x and b/x are two runs, so two logs)."""
        return root / ".campaign" / "logs" / f"{self._flat()}.log"

    def claim_path(self, root: Path) -> Path:
        """root/.campaign/claims/<as log_path>.claim: held by the campaign that launches
        the run, from before its launch until its process ends."""
        return root / ".campaign" / "claims" / f"{self._flat()}.claim"

    def _flat(self) -> str:
        return "__".join(p for p in self.run_dir.parts if p != "/")


def read_plan(path: Path) -> list[Entry]:
    """The plan's entries; a malformed line is one message naming the file, the line and the fix."""
    entries, seen = [], set()
    for n, raw in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        text = raw.strip()
        if not text or text.startswith("#"):
            continue
        target, sep, rest = text.partition(":")
        target = target.strip()
        try:
            flags = shlex.split(rest, comments=True)
        except ValueError as e:
            raise UserError(f"{path}:{n}: cannot split the flags ({e}); check the quotes") from None
        if not sep or "/" not in target or "#" in target or not flags:
            raise UserError(f"{path}:{n}: write '<output dir>/<run id>: <cl-bench run flags>', got {raw.strip()!r}")
        if any(part in (".", "..") for part in target.split("/")):
            raise UserError(f"{path}:{n}: '{target}' has a '.' or '..' part; name the run folder plainly, inside "
                            f"the repository (or as an absolute path)")
        given = sorted({f.split("=", 1)[0] for f in flags} & set(GIVEN_BY_LINE))
        if given:
            raise UserError(f"{path}:{n}: drop {', '.join(given)}: the line's '{target}:' gives the folder")
        if target in seen:
            raise UserError(f"{path}:{n}: {target} is planned twice; give each run its own id")
        seen.add(target)
        entries.append(Entry(Path(target), flags, n))
    return entries


def recorded(entry: Entry, root: Path) -> dict | None:
    """The entry's run record (None: not started)."""
    path = entry.record_path(root)
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if not all(isinstance(data["config"][section]["precision"], str) for section in ("train", "eval")):
            raise KeyError("precision")
        return data
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise UserError(f"{path}: not a readable run record ({type(e).__name__}: {e}); look at the run, then "
                        f"resume it by hand or take it out of the plan") from None


def action(record: dict | None) -> str:
    """done | resume | start."""
    if record is None:  # a folder holding only a lock counts as empty: `run` starts in it
        return "start"
    return "done" if record.get("status") == "complete" else "resume"


def planned(entry: Entry):
    """The RunConfig the line asks for, and its method's parsed arguments, checked as
    `cl-bench run` checks them (a UserError for flags `run` lacks)."""
    from cl_bench import config as cfg
    from cl_bench.cli_parser import build_parser, run_overrides
    from cl_bench.run.checks import check_config

    try:
        args = build_parser().parse_args(["run", *entry.flags])
    except SystemExit:  # argparse printed why
        raise UserError("these are not `cl-bench run` flags (the message above says which)") from None
    config = cfg.resolve("cpu", args.config, run_overrides(args))
    return config, check_config(config).method_args


def drift(record: dict, config, method_args) -> list[str]:
    """What the plan line now asks for that its recorded run does not have."""
    out = [f"{key} {record.get(key)!r} -> {getattr(config, key)!r}" for key in ("method", "profile", "seed")
           if record.get(key) != getattr(config, key)]
    asked = dataclasses.asdict(method_args)
    ran = record.get("method_args") or {}
    out += [f"method_args.{k} {ran.get(k)!r} -> {v!r}" for k, v in sorted(asked.items()) if ran.get(k) != v]
    return out


def launch_drift(record: dict, entry: Entry) -> str | None:
    """Where the line's launch flags (errors.LAUNCH_FLAGS: --nproc, --keep-checkpoint)
    differ from those of the command that last ran its recorded run: the resume takes the
    line's (launch.command), which is how a run moves to another number of ranks."""
    ran = command_flags(last_command(record.get("resumes"), record.get("command")))
    now = launch_flags(entry.flags)
    if ran == now:
        return None
    return f"its resume takes the line's {shlex.join(now) or 'no launch flags'}, where it last ran with " \
           f"{shlex.join(ran) or 'none'}"


def is_tuning_plan(path: Path) -> bool:
    return any(line.strip() == TUNING_MARK for line in path.read_text(encoding="utf-8").splitlines())


def refuse_test_split(path: Path, entries: list[Entry]) -> None:
    """A tuning plan whose line would score the test split is refused, whole."""
    for entry in entries:
        config, _ = planned(entry)
        if config.data.test_split != "eval":
            raise UserError(f"{path}:{entry.line}: {entry.run_dir} would score the test split, in a tuning plan "
                            f"({TUNING_MARK!r}): tuning runs score the eval split only; add --set "
                            f"data.test_split=eval to the line")
