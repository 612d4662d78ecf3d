"""The headline leaderboard, written down once: `results/headline.yaml` names the folder
of run folders it reads and the run folders it leaves out. `cl-bench leaderboard`
reads it when --runs is not given (so does `make readme`, through that), so the
README's table and a bare `cl-bench leaderboard` are one table; --runs still takes
any folder, and then the file plays no part.

The headline is TRACE's (the default benchmark's): a bare `cl-bench leaderboard` shows
the runs of that benchmark under the folder and leaves out any other benchmark's runs
there, so the README's table keeps its scope as runs of other benchmarks are added;
`--runs DIR` shows every benchmark under DIR, one table each.

    runs: .             # the folder of run folders, relative to the file's folder
    exclude:            # globs of run folders left out, relative to runs ('*' spans '/')
      - long/*

A bad file is one UserError naming the file, the field and the fix.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import yaml

from cl_bench.benchmark import DEFAULT as BENCHMARK
from cl_bench.errors import UserError, did_you_mean

log = logging.getLogger(__name__)

HEADLINE = Path("results") / "headline.yaml"
FALLBACK = Path("results")  # what --runs meant before the file, where there is none
FIELDS = ("runs", "exclude")


@dataclass(frozen=True)
class Headline:
    path: Path
    runs: Path
    exclude: tuple[str, ...]


def load_headline(path: Path = HEADLINE) -> Headline | None:
    """The headline file at `path` (relative to the working directory), checked; None
    where there is no such file."""
    path = Path(path)
    if not path.exists():
        return None
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise UserError(f"{path}: cannot read the headline file ({e.strerror}); make it a readable YAML file, "
                        f"or pass --runs DIR") from None
    except UnicodeDecodeError:
        raise UserError(f"{path}: not a text file; write the headline file as YAML (UTF-8)") from None
    except yaml.YAMLError as e:
        raise UserError(f"{path}: not valid YAML ({str(e).splitlines()[0]}); fix the file") from None
    if not isinstance(raw, dict):
        raise UserError(f"{path}: must be a mapping with the fields {' and '.join(FIELDS)}, e.g. "
                        f"'runs: .' and 'exclude: [long/*]'")
    for key in raw:
        if key not in FIELDS:
            raise UserError(f"{path}: unknown field {str(key)!r}; {did_you_mean(str(key), FIELDS)}"
                            f"the fields are {', '.join(FIELDS)}")
    if "runs" not in raw:
        raise UserError(f"{path}: missing field 'runs'; add 'runs: .' (the folder of run folders, relative to "
                        f"{path.parent})")
    if not isinstance(raw["runs"], str) or not raw["runs"].strip():
        raise UserError(f"{path}: field 'runs' must be a folder, relative to {path.parent}, e.g. 'runs: .'; "
                        f"got {raw['runs']!r}")
    runs = path.parent / raw["runs"]
    if not runs.is_dir():
        raise UserError(f"{path}: field 'runs': {runs} is not a folder; name the folder of run folders, relative "
                        f"to {path.parent}, e.g. 'runs: .'")
    exclude = raw.get("exclude") or []
    if not isinstance(exclude, list) or not all(isinstance(g, str) and g for g in exclude):
        raise UserError(f"{path}: field 'exclude' must be a list of globs of run folders, relative to runs, "
                        f"e.g. 'exclude: [long/*]'; got {raw.get('exclude')!r}")
    return Headline(path, runs, tuple(exclude))


def leaderboard_runs(runs: Path | None, exclude: list[str], include: list[str],
                     path: Path = HEADLINE) -> tuple[Path, list[str], list[str]]:
    """What `cl-bench leaderboard` reads: --runs as given, with its filters; without
    --runs, the headline file's folder and exclusions (any --exclude / --include
    given narrow it further), or `results` where there is no headline file."""
    if runs is not None:
        return runs, list(exclude), list(include)
    head = load_headline(path)
    if head is None:
        return FALLBACK, list(exclude), list(include)
    return head.runs, [*head.exclude, *exclude], list(include)


def headline_records(records: list, where: Path) -> list:
    """The headline's runs among `records` (read from `where`): those of its benchmark,
    TRACE; the others are left out, and said so in the log."""
    kept = [r for r in records if r.benchmark == BENCHMARK]
    others = sorted({r.benchmark for r in records} - {BENCHMARK})
    if others:
        log.info("headline leaderboard: %d runs of %s left out (it is %s's); --runs %s shows them",
                 len(records) - len(kept), ", ".join(others), BENCHMARK, where)
    if not kept:
        raise UserError(f"no {BENCHMARK} run under {where} for the headline leaderboard (only runs of "
                        f"{', '.join(others)}); pass --runs {where} for their tables")
    return kept
