"""The tuned leaderboards' runs: which records hold each method at given arguments.
(The tuned file itself, configs/tuned/<profile>.yaml, or configs/tuned/<benchmark>/<profile>.yaml
for a benchmark other than TRACE, is read by cl_bench/config_tuned.py, for `cl-bench run
--tuned` and here.)

`select`: the runs of one leaderboard of a profile: each ranked method at given
arguments (the tuned file's, or the arguments each method has without any: the
shared-rate leaderboard), with the reference rows at theirs, on the profile's own
order and its test split, of one benchmark (TRACE by default; its order and the
profile's fields are that benchmark's, through the registry).
"""
from __future__ import annotations

import dataclasses
import logging

from cl_bench import config as cfg
from cl_bench import registry
from cl_bench.benchmark import DEFAULT as DEFAULT_BENCHMARK
from cl_bench.errors import UserError

log = logging.getLogger(__name__)


def default_args(method: str, profile: str, benchmark: str = DEFAULT_BENCHMARK) -> dict:
    """The arguments a method runs with on the profile and benchmark when none are given."""
    return expected_args({method: {}}, profile, benchmark)[registry.get(method).name]


def expected_args(methods: dict[str, dict], profile: str, benchmark: str = DEFAULT_BENCHMARK) -> dict[str, dict]:
    """Method -> the full parsed arguments of a run given `methods[method]` on the profile
    and benchmark."""
    out = {}
    for method, given in methods.items():
        cls = registry.get(method)
        config = cfg.resolve(profile, None, {"method": cls.name, "method_args": dict(given),
                                             "data": {"benchmark": benchmark}})
        out[cls.name] = dataclasses.asdict(cls.parse_args(cls.args_for(config)))
    return out


def select(runs: list, args: dict[str, dict], profile: str, benchmark: str = DEFAULT_BENCHMARK) -> list:
    """The runs (RunRecord) of `benchmark`, of the profile's order and test split, whose
    method is in `args` at exactly those arguments, and the reference rows at their defaults."""
    bench = registry.get_benchmark(benchmark)
    order = bench.resolve_order(cfg.resolve(profile, None, {"data": {"benchmark": benchmark}}).data.order)
    keep = []
    for run in runs:
        if run.benchmark != bench.name or run.profile != profile or list(run.tasks) != order or run.split != "test":
            continue
        try:
            cls = registry.get(run.method)
        except UserError:
            continue
        wanted = default_args(cls.name, profile, benchmark) if cls.reference else args.get(cls.name)
        if wanted is not None and run.method_args == wanted:
            keep.append(run)
    return keep


def check_rows(runs: list, board: str, finals, ranked: list[str]) -> list:
    """`runs` (select's), refused in one line where a row (ranked or reference) has two
    runs at one seed (they would be pooled as two replicates) or a run at a seed the
    finals do not give (pooled unseen into its row), or a ranked method none at the
    finals' first seed (the rows' own: a row the finals keep but the board's excludes
    drop would go missing unseen); a seeded method short of the finals' other seeds is
    said on stderr (the extra seeds are cut first where hours run short). `finals`: the
    grid's (grid.Finals)."""
    seeds: dict[str, dict[int, list[str]]] = {m: {} for m in ranked}
    for run in runs:
        seeds.setdefault(run.method, {}).setdefault(run.seed, []).append(str(run.source.parent))
    faults = [f"{m} seed {seed}: {len(folders)} runs ({', '.join(folders)})"
              for m, by_seed in seeds.items() for seed, folders in by_seed.items() if len(folders) > 1]
    faults += [f"{m} seed {seed}: not a seed of the finals ({', '.join(folders)})"
               for m, by_seed in seeds.items() for seed, folders in by_seed.items() if seed not in finals.seeds]
    faults += [f"{m}: no run at seed {finals.seeds[0]}" for m in ranked if finals.seeds[0] not in seeds[m]]
    if faults:
        raise UserError(f"the {board} leaderboard: {'; '.join(faults)}; a row is one run at each seed: finish the "
                        "finals (`cl-bench tune finals`, then `cl-bench campaign`), and leave out duplicates and "
                        "runs at other seeds with the grid's finals.exclude or --exclude")
    short = [f"{m} ({', '.join(str(x) for x in finals.seeds[1:] if x not in seeds[m])})"
             for m in finals.seeded if m in seeds and set(finals.seeds) - set(seeds[m])]
    if short:
        log.warning("the %s leaderboard pools fewer seeds than the finals give: %s", board, "; ".join(short))
    return runs
