"""The grid file of the tuning protocol, `configs/tuning/<profile>.yaml` (another
benchmark's: `configs/tuning/<benchmark>/<profile>.yaml`), written before any tuning run:

    profile: cpu
    benchmark: trace                       # optional (default trace): whose tasks the order names
    order: [Py150, NumGLUE-ds, C-STANCE]   # the tuning order: three tasks, eval split
    seed: 1234
    rule: last-acc-keep-base               # RULES
    output: results/tuning/cpu             # where new tuning runs go
    methods:
      seqft: {lr: [1.0e-4, 3.0e-4, 1.0e-3]}
      ewc: {lr: [...], strength: {lambda_ewc: [1.0e+3, 1.0e+4, 1.0e+5]}}

Each method's base rate (the rate it has without arguments on the profile: its
family's, train.lr_by_family, else its own default) and its strength's default must
be points of its grid. A grid point is one run over the tuning order, scored on the
eval split (`--set data.test_split=eval`): the plan line of every point carries it,
and `cl-bench campaign` refuses a tuning plan with a line that scores the test split
(plan.TUNING_MARK). The strength is tuned after the rate, at the chosen rate.
The order's tasks are the benchmark's (the registry's; none whose eval split is its
train copy, `Benchmark.eval_is_train`: TRACE's MeetingBank); a grid of a benchmark
other than TRACE passes it to every run (`--benchmark`), and its tuned file is that
benchmark's (cl_bench/config_tuned.py: configs/tuned/<benchmark>/<profile>.yaml).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from cl_bench.benchmark import DEFAULT as DEFAULT_BENCHMARK
from cl_bench.errors import UserError

# last-acc-keep-base: the value with the highest Last Acc on the tuning order; the base value
# is kept unless that value's Last Acc is higher than the base's at 95% (compare's paired test).
RULES = ("last-acc-keep-base",)
EVAL_SET = "data.test_split=eval"


def short(value: float) -> str:
    """A grid value as a folder name writes it: 1e-4, 3e-4, 1e3, 3.3e-1."""
    mantissa, exponent = f"{value:e}".split("e")
    return f"{mantissa.rstrip('0').rstrip('.')}e{int(exponent)}"


@dataclass
class MethodGrid:
    method: str
    lr: list[float]
    base_lr: float  # the rate of the shared-rate leaderboard
    strength: str | None = None  # the argument tuned after the rate
    values: list[float] = field(default_factory=list)
    base_strength: float | None = None  # its default

    def rate_points(self) -> list[dict[str, float]]:
        return [{"lr": lr} for lr in self.lr]

    def strength_points(self, lr: float) -> list[dict[str, float]]:
        """The strength's points at the chosen rate (its default's point is the rate's point)."""
        return [{"lr": lr, self.strength: v} for v in self.values] if self.strength else []


@dataclass
class Finals:
    """The finals: where new runs go, the seeds, and the methods run at every seed
    where their tuned arguments differ from the committed rows (the rest at the first)."""

    output: Path
    seeds: list[int]
    seeded: list[str]
    sets: list[str] = field(default_factory=list)  # SECTION.FIELD=VALUE of every finals run (--set)
    # Record folders (globs relative to the records folder) that are not leaderboard rows: the
    # finals keep none of them as a row and the tuned and shared leaderboards read none, so a row
    # the finals keep is one the boards show.
    exclude: list[str] = field(default_factory=list)


@dataclass
class Grid:
    path: Path
    profile: str
    order: list[str]
    seed: int
    rule: str
    output: Path
    methods: dict[str, MethodGrid]
    finals: Finals
    benchmark: str = DEFAULT_BENCHMARK  # as the grid names it (a folder benchmark: its folder), for --benchmark

    def run_flags(self, method: str) -> list[str]:
        """`cl-bench run` flags of every run of the method: the profile, the method, and the
        benchmark where it is not TRACE."""
        benchmark = ["--benchmark", self.benchmark] if self.benchmark != DEFAULT_BENCHMARK else []
        return ["--profile", self.profile, "--method", method, *benchmark]

    def flags(self, method: str, args: dict[str, float]) -> list[str]:
        """`cl-bench run` flags of one grid point: always the eval split."""
        out = self.run_flags(method)
        for key, value in args.items():
            out += ["--method-arg", f"{key}={value:g}"]
        return out + ["--order", ",".join(self.order), "--seed", str(self.seed), "--set", EVAL_SET]

    def folder(self, method: str, args: dict[str, float]) -> Path:
        """Where a new run of the point goes: <output>/<method>-lr1e-4[-lambda_ewc1e3]; a
        name ending in a digit takes a `_` before its value (olora's lambda1: `-lambda1_1.7e-1`,
        not `-lambda11.7e-1`)."""
        return self.output / "-".join([method, *(f"{k}{'_' if k[-1].isdigit() else ''}{short(v)}"
                                                 for k, v in args.items())])


def _fail(path: Path, where: str, why: str) -> UserError:
    return UserError(f"{path}: {where}: {why}")


def _values(path: Path, where: str, raw) -> list[float]:
    if not isinstance(raw, list) or not raw or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0 for v in raw):
        raise _fail(path, where, f"{raw!r} must be a list of positive numbers, e.g. [1.0e-4, 3.0e-4, 1.0e-3]")
    return sorted(float(v) for v in raw)


def _has(values: list[float], value: float) -> bool:
    return any(math.isclose(v, value, rel_tol=1e-9) for v in values)


def load(path: Path) -> Grid:
    """The grid file, checked: one line naming the file, the field and the fix on bad input."""
    from cl_bench import config as cfg
    from cl_bench import config_tuned, registry
    from cl_bench.tools.tuning.tuned import default_args
    raw = cfg.load_yaml(path)
    unknown = sorted(set(raw) - {"profile", "benchmark", "order", "seed", "rule", "output", "methods", "finals"})
    if unknown:
        raise _fail(path, unknown[0], "unknown field; the fields are profile, benchmark, order, seed, rule, output, "
                                      "methods, finals")
    profile = raw.get("profile")
    if not isinstance(profile, str):
        raise _fail(path, "profile", "give the profile the grid tunes, e.g. cpu")
    if raw.get("rule") not in RULES:
        raise _fail(path, "rule", f"{raw.get('rule')!r} is not a rule; the rules: {', '.join(RULES)}")
    benchmark = raw.get("benchmark", DEFAULT_BENCHMARK)
    if not isinstance(benchmark, str) or not benchmark:
        raise _fail(path, "benchmark", f"{benchmark!r} must be a benchmark's name (`cl-bench list --benchmarks`)")
    try:
        bench = registry.get_benchmark(benchmark)
        config_tuned.benchmark_name(benchmark)  # a name its tuned file cannot have: refused before any run
    except UserError as e:
        raise _fail(path, "benchmark", str(e)) from None
    order = raw.get("order")
    try:
        order = bench.resolve_order(order)
    except (UserError, TypeError, ValueError) as e:
        raise _fail(path, "order", f"{e}; list three {bench.title} tasks") from None
    never = bench.eval_is_train
    if len(order) != 3 or set(order) & set(never):
        raise _fail(path, "order", f"{order} must be three tasks" + (f", none of {', '.join(never)} (its eval "
                                   f"split is its train copy)" if never else ""))
    seed = raw.get("seed", 1234)
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise _fail(path, "seed", f"{seed!r} must be a whole number")
    if not isinstance(raw.get("output"), str):
        raise _fail(path, "output", "give the folder new tuning runs go to, e.g. results/tuning/cpu")
    methods = raw.get("methods")
    if not isinstance(methods, dict) or not methods:
        raise _fail(path, "methods", "give each method its grid, e.g. seqft: {lr: [1.0e-4, 3.0e-4, 1.0e-3]}")
    grids = {}
    for name, spec in methods.items():
        where = f"methods.{name}"
        cls = registry.get(str(name))
        if cls.reference:
            raise _fail(path, where, "a reference row is never ranked, so never tuned; drop it")
        if not isinstance(spec, dict) or "lr" not in spec or set(spec) - {"lr", "strength"}:
            raise _fail(path, where, "give {lr: [...]} and, optionally, strength: {ARGUMENT: [...]}")
        lrs = _values(path, f"{where}.lr", spec["lr"])
        base_lr = default_args(cls.name, profile, benchmark)["lr"]
        if not _has(lrs, base_lr):
            raise _fail(path, f"{where}.lr", f"{lrs} lacks the base rate {base_lr:g} (the shared-rate "
                                             f"leaderboard's); add it")
        grid = MethodGrid(cls.name, lrs, base_lr)
        if "strength" in spec:
            strength = spec["strength"]
            if not isinstance(strength, dict) or len(strength) != 1:
                raise _fail(path, f"{where}.strength", "give one argument and its values, e.g. {lambda_ewc: [...]}")
            (arg, values), = strength.items()
            defaults = {a: d for a, _, d in cls.arg_table()}
            if arg == "lr" or not isinstance(defaults.get(arg), (int, float)) or isinstance(defaults.get(arg), bool):
                raise _fail(path, f"{where}.strength", f"{arg!r} is not a numeric argument of {cls.name} "
                                                       f"(`cl-bench list --verbose`)")
            grid.strength, grid.values, grid.base_strength = arg, _values(path, f"{where}.strength.{arg}", values), \
                float(defaults[arg])
            if not _has(grid.values, grid.base_strength):
                raise _fail(path, f"{where}.strength.{arg}", f"{grid.values} lacks the default "
                                                             f"{grid.base_strength:g}; add it")
        grids[cls.name] = grid
    return Grid(path, profile, order, seed, raw["rule"], Path(raw["output"]), grids,
                _finals(path, raw.get("finals"), grids), benchmark)


def _finals(path: Path, raw, grids: dict[str, MethodGrid]) -> Finals:
    from cl_bench import registry

    if not isinstance(raw, dict) or not isinstance(raw.get("output"), str) or set(raw) - {"output", "seeds", "seeded",
                                                                                           "set", "exclude"}:
        raise _fail(path, "finals", "give {output: results/tuned/<profile>, seeds: [1234, 2, 3], seeded: [...], "
                                    "set: [SECTION.FIELD=VALUE, ...], exclude: [GLOB, ...]}")
    exclude = raw.get("exclude") or []
    if not isinstance(exclude, list) or not all(isinstance(x, str) and x for x in exclude):
        raise _fail(path, "finals.exclude", f"{exclude!r} must be a list of folder globs relative to the records, "
                                            "e.g. ['sweeps/*']")
    sets = raw.get("set") or []
    if not isinstance(sets, list) or not all(isinstance(x, str) and "=" in x and "." in x.split("=")[0] for x in sets):
        raise _fail(path, "finals.set", f"{sets!r} must be a list of SECTION.FIELD=VALUE, e.g. [general.lima=64]")
    seeds = raw.get("seeds", [1234])
    if not isinstance(seeds, list) or not seeds or not all(isinstance(x, int) and not isinstance(x, bool)
                                                           for x in seeds):
        raise _fail(path, "finals.seeds", f"{seeds!r} must be a list of whole numbers, the first the rows' own")
    seeded = [registry.get(str(m)).name for m in raw.get("seeded") or []]
    if set(seeded) - set(grids):
        raise _fail(path, "finals.seeded", f"{sorted(set(seeded) - set(grids))} are not methods of the grid")
    return Finals(Path(raw["output"]), seeds, seeded, list(sets), list(exclude))


def third_and_triple(rate: float) -> list[float]:
    """A rate, a third of it and three times it, each on the 1-3-10 ladder (the
    sweeps' values): 3e-4 -> 1e-4, 3e-4, 1e-3 (9e-4 is taken as 1e-3)."""
    def snap(x: float) -> float:
        decade = math.floor(math.log10(x))
        ladder = [m * 10.0 ** e for e in (decade - 1, decade, decade + 1) for m in (1, 3)]
        return min(ladder, key=lambda v: abs(math.log10(v / x)))
    return [float(f"{snap(v):.0e}") for v in (rate / 3, rate, rate * 3)]


def refuse_test_split(config, where: str) -> None:
    """A tuning run scores the eval split, never the test split."""
    if config.data.test_split != "eval":
        raise UserError(f"{where}: a tuning run scores the test split (data.test_split={config.data.test_split!r}); "
                        f"tuning uses the eval split only: add --set {EVAL_SET}")
