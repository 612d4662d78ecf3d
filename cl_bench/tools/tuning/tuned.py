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

from cl_bench import config as cfg
from cl_bench import registry
from cl_bench.benchmark import DEFAULT as DEFAULT_BENCHMARK
from cl_bench.errors import UserError


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
        split = ((run.config or {}).get("data") or {}).get("test_split") or "test"
        if run.benchmark != bench.name or run.profile != profile or list(run.tasks) != order or split != "test":
            continue
        try:
            cls = registry.get(run.method)
        except UserError:
            continue
        wanted = default_args(cls.name, profile, benchmark) if cls.reference else args.get(cls.name)
        if wanted is not None and run.method_args == wanted:
            keep.append(run)
    return keep
