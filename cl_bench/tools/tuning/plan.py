"""The plans of the tuning protocol, for `cl-bench campaign`.

The tuning plan: one line per grid point (grid.py), every line on the eval split,
the plan marked TUNING_MARK so that the campaign refuses a line that scores the
test split. The rate points of every method first; a method's strength points
once its rate is decided (its rate runs complete: the plan is written again then,
and adds them at the chosen rate). A committed record that fits a point (`fits`:
the same method arguments, seed, data, training and decoding budget, trained and
scored in the precision the run would compute in) is named instead of a new
folder, so the campaign counts it done.

The finals plan: each method at its tuned arguments (`--tuned`: the tuned file of the
grid's benchmark, which every line names where it is not TRACE) on the profile's own
order and test split, at the seeds the grid file's `finals` gives it, with its `set`
fields (general.lima=64: a probe, which only measures); a seed whose committed row
fits is named, not re-run.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import shlex
from pathlib import Path

from cl_bench import registry
from cl_bench.benchmark import file_sha256
from cl_bench.tools.campaign.plan import TUNING_MARK, Entry, planned
from cl_bench.errors import UserError
from cl_bench.tools.tuning.grid import Grid, refuse_test_split

# What fixes a run's training and scores: the model and these sections of its config (the method, its
# arguments, the seed and the profile are compared apart); the rest (output, logging, backend, the
# `general` probes) only measures or places the run, but for the Lima probe where Lima replay is on
# (run/prepare.py leaves the probe's items out of the replay buffer).
SCORED = ("model",)
SCORED_SECTIONS = ("data", "train", "eval", "replay")
# Fields of those sections that do not change what a run trains or scores: a record may differ in them.
NOT_SCORED = {"data.data_dir", "train.lr_by_family", "train.checkpoint_every_s", "train.precision", "eval.precision",
              "eval.cka_probe", "eval.cka_probe_tokens", "eval.routing_probe", "eval.sharpness",
              "eval.sharpness_iters", "eval.sharpness_layers"}


def _scored(config: dict, method: str) -> dict:
    """The fields of a config that fix what its run trains and scores, defaults filled
    as the run resolves them (the lr schedule: the method's; the split: test)."""
    flat = {key: config.get(key) for key in SCORED}
    for section in SCORED_SECTIONS:
        flat.update({f"{section}.{k}": v for k, v in (config.get(section) or {}).items()
                     if f"{section}.{k}" not in NOT_SCORED})
    kind, warmup = registry.get(method).lr_schedule
    flat["train.lr_schedule"] = flat.get("train.lr_schedule") or kind
    flat["train.warmup_ratio"] = warmup if flat.get("train.warmup_ratio") is None else flat["train.warmup_ratio"]
    flat["data.test_split"] = flat.get("data.test_split") or "test"
    flat["data.benchmark"] = flat.get("data.benchmark") or registry.DEFAULT_BENCHMARK  # records before it: trace
    flat["eval.generator"] = flat.get("eval.generator") or "hf"  # records from before eval.generator: hf
    if flat.get("replay.lima"):  # Lima replay leaves out the probe's items: then the probe changes what trains
        flat["general.lima"] = (config.get("general") or {}).get("lima", 0)
    return flat


@functools.lru_cache(maxsize=None)
def _digests(benchmark: str, root: str, order: str | None, test_split: str) -> dict | None:
    bench = registry.get_benchmark(benchmark)
    try:
        return {task: {"train": file_sha256(bench.split_file(Path(root), task, "train")),
                       "test": file_sha256(bench.split_file(Path(root), task, test_split))}
                for task in bench.present_order(Path(root), order)}
    except UserError:
        return None


def data_digests(config) -> dict | None:
    """Task -> the sha256 of the train and scored split files the run `config` asks for
    would read here; None where its data is not found here (then `fits` cannot compare
    the data, as before a data folder is given)."""
    d = config.data
    try:
        root = registry.get_benchmark(d.benchmark).resolve_data_dir(d.data_dir)
    except UserError:
        return None
    order = d.order if isinstance(d.order, str) or d.order is None else ",".join(d.order)
    return _digests(d.benchmark, str(root), order, d.test_split)


def computes_in(config) -> dict[str, str]:
    """The precisions (train, eval) the run `config` computes in where the campaign runs
    it, a CPU with native bf16 (auto: bf16)."""
    return {part: {"auto": "bf16"}.get(p, p) for part, p in (("train", config.train.precision),
                                                             ("eval", config.eval.precision))}


def ran_precision(record: dict) -> dict[str, str]:
    """The precisions (train, eval) a record computed in (records from before
    `backend.precision`: fp32)."""
    ran = (record.get("backend") or {}).get("precision") or {}
    return {part: ran.get(part, "fp32") for part in ("train", "eval")}


def fits(record: dict, config, method_args, digests: dict | None = None) -> bool:
    """Whether a complete record is the run `config` asks for, computed in the precision
    that run computes in where the campaign runs it, a CPU with native bf16 (auto: bf16),
    and, given `digests` (data_digests), on the same data files: `data.data_dir` is not
    compared (machines keep the data in other folders), so a record made on another
    release of the benchmark would otherwise fit."""
    if (record.get("status") != "complete" or record.get("method") != config.method
            or record.get("profile") != config.profile):  # the boards keep a profile's rows alone
        return False
    if ran_precision(record) != computes_in(config):
        return False
    if digests is not None:
        ran = record.get("data") or {}
        if any(((ran.get(task) or {}).get(role) or {}).get("sha256") != sha
               for task, shas in digests.items() for role, sha in shas.items()):
            return False
    return (record.get("method_args") == dataclasses.asdict(method_args) and record.get("seed") == config.seed
            and _scored(record.get("config") or {}, config.method) == _scored(config.to_dict(), config.method))


class Records:
    """The complete run records under a folder, by method, but those in run folders
    matching a glob of `exclude` (relative to the folder, as --exclude's)."""

    def __init__(self, folder: Path, root: Path, exclude: list[str] = ()):
        from cl_bench.report.leaderboard.files import record_paths

        self.root = root
        self.by_method: dict[str, list[tuple[Path, dict]]] = {}
        for path in record_paths(root / folder, exclude) if (root / folder).is_dir() else []:
            try:
                data = json.loads(path.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                continue
            if isinstance(data, dict) and data.get("status") == "complete":
                self.by_method.setdefault(data.get("method"), []).append((path.parent.relative_to(root), data))

    def find(self, config, method_args) -> tuple[Path, dict] | None:
        """The first record (by path) that fits the run, on the data it would read here."""
        digests = data_digests(config)
        return next(((p, r) for p, r in self.by_method.get(config.method, [])
                     if fits(r, config, method_args, digests)), None)


def _line(folder: Path, flags: list[str], note: str = "") -> str:
    return f"{folder.as_posix()}: {shlex.join(flags)}" + (f"  # {note}" if note else "")


def point(grid: Grid, records: Records, method: str, args: dict[str, float]) -> tuple[Path, list[str], str]:
    """A grid point's folder (a fitting record's, else a new one), flags and note."""
    flags = grid.flags(method, args)
    config, method_args = planned(Entry(grid.folder(method, args), flags, 0))
    refuse_test_split(config, f"{grid.path}: {method} {args}")
    found = records.find(config, method_args)
    if found is None:
        return grid.folder(method, args), flags, ""
    folder, record = found
    return folder, flags, f"reused: code {str(record.get('git_commit') or '?')[:8]}"


def tuning_plan(grid: Grid, records: Records, decided: dict[str, float]) -> str:
    """The plan text. `decided`: method -> its chosen rate, for the methods whose
    rate runs are done (their strength points follow)."""
    lines = [TUNING_MARK,
             f"# The tuning runs of {grid.path} (rule {grid.rule}), written by `cl-bench tune plan {grid.path}`;",
             f"# order {','.join(grid.order)}, eval split, seed {grid.seed}. Write it again once a method's rate",
             "# runs are done: its strength runs are added at the chosen rate.",
             "# ---- rates ----"]
    waiting = []
    for method, g in grid.methods.items():
        lines += [_line(*point(grid, records, method, args)) for args in g.rate_points()]
    lines.append("# ---- strengths, at the chosen rate ----")
    for method, g in grid.methods.items():
        if not g.strength:
            continue
        if method not in decided:
            waiting.append(f"{method} ({g.strength} {', '.join(f'{v:g}' for v in g.values)})")
            continue
        for args in g.strength_points(decided[method]):
            if args[g.strength] != g.base_strength:  # that point is the rate's run
                lines.append(_line(*point(grid, records, method, args)))
    if waiting:
        lines.append(f"# not yet (rate runs not done): {'; '.join(waiting)}")
    return "\n".join(lines) + "\n"


def finals_plan(grid: Grid, tuned_path: Path, tuned: dict, records: Records, output: Path,
                seeds: list[int], seeded: list[str]) -> str:
    """The finals: each method of the tuned file at its tuned arguments, on the
    profile's order and test split; `seeded` methods at every seed of `seeds`, the
    others at the first. Every method's first seed comes first, the extra seeds after
    them all: a campaign runs a plan in order (under --hours, the first run that fits),
    so where hours run short the extra seeds are what is cut, never a row."""
    lines = [f"# The finals of {tuned_path}: each method at its tuned arguments (`cl-bench run --tuned`), on the",
             f"# {grid.profile} profile's order and test split; written by `cl-bench tune finals {grid.path}`.",
             "# A line naming a committed folder is a row whose arguments the tuning kept (done)."]
    missing = [m for m in grid.methods if m not in tuned]
    if missing:
        raise UserError(f"{tuned_path}: no tuned arguments for {', '.join(missing)}; choose again "
                        f"(`cl-bench tune choose {grid.path}`)")
    for i, seed in enumerate(seeds):
        if i == 1:
            lines.append("# The extra seeds of the seeded methods, after every row's first: cut first where hours "
                         "run short.")
        for method in grid.methods if i == 0 else [m for m in grid.methods if m in seeded]:
            flags = grid.run_flags(method) + ["--tuned", "--seed", str(seed)]
            flags += [arg for pair in grid.finals.sets for arg in ("--set", pair)]
            name = method + ("" if seed == seeds[0] else f"-seed{seed}")
            config, method_args = planned(Entry(output / name, flags, 0))
            found = records.find(config, method_args)
            lines.append(_line(output / name, flags) if found is None else
                         _line(found[0], flags, f"kept: code {str(found[1].get('git_commit') or '?')[:8]}"))
    return "\n".join(lines) + "\n"
