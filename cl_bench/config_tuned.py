"""The tuned file of a benchmark and profile (`cl-bench tune choose` writes it:
cl_bench/tools/tuning/rule.py), read for a run.

A tuned value is chosen on one benchmark's eval split and belongs to it, so each
benchmark has its own files: TRACE's configs/tuned/<profile>.yaml (where they were
before benchmarks were plugins), another's configs/tuned/<benchmark>/<profile>.yaml,
<benchmark> its registered name, or the `name` a folder's benchmark.yaml declares
(else the folder's own name). A benchmark without its file is refused, never given
TRACE's. Their grids follow the same layout under configs/tuning/.

`cl-bench run --tuned` (a config file's `tuned: true`): the method's arguments come
from the file of the run's benchmark and profile, under the run's own --method-arg
(an argument both give is refused), and the run's config records `tuned: <the
file>@<commit of the file>`; a file that is not committed, or has uncommitted
changes, is refused, since the record could not name it. cl_bench/config.py's
resolve calls `apply`.
"""
from __future__ import annotations

import subprocess
from pathlib import Path

import yaml

from cl_bench import registry
from cl_bench.benchmark import DEFAULT as DEFAULT_BENCHMARK
from cl_bench.errors import UserError

ROOT = Path(__file__).resolve().parents[1]  # the checkout whose code runs: the file is read from it
FOLDER = Path("configs") / "tuned"
GRIDS = Path("configs") / "tuning"


def benchmark_name(benchmark: str) -> str:
    """The name a benchmark's tuned files are kept under (module docstring); `benchmark`
    as a run or grid gives it: a registered name or a folder holding benchmark.yaml."""
    bench = registry.get_benchmark(benchmark)
    if "/" in bench.name or bench.name.startswith("."):
        raise UserError(f"{benchmark}: its name {bench.name!r} cannot name the folder of its tuned files; give "
                        f"it a plain `name:` in its benchmark.yaml")
    if registry.benchmarks().get(bench.name, bench) is not bench:
        raise UserError(f"{benchmark}: declares the name '{bench.name}' of a registered benchmark, whose tuned "
                        f"files are not its own; give it its own `name:` in its benchmark.yaml")
    return bench.name


def keyed(folder: Path, profile: str, benchmark: str = DEFAULT_BENCHMARK) -> Path:
    """<folder>/<profile>.yaml for TRACE, <folder>/<benchmark>/<profile>.yaml for another."""
    name = benchmark_name(benchmark)
    return (folder if name == DEFAULT_BENCHMARK else folder / name) / f"{profile}.yaml"


def path_for(profile: str, benchmark: str = DEFAULT_BENCHMARK) -> Path:
    """The tuned file of the benchmark and profile, in the checkout whose code runs."""
    return ROOT / keyed(FOLDER, profile, benchmark)


def read(profile: str, benchmark: str = DEFAULT_BENCHMARK) -> tuple[Path, dict[str, dict]]:
    """The benchmark's tuned file of the profile and its methods (`load`); a benchmark
    other than TRACE without its file is refused, never given TRACE's."""
    name, path = benchmark_name(benchmark), path_for(profile, benchmark)
    if name != DEFAULT_BENCHMARK and not path.is_file():
        raise UserError(f"{path.relative_to(ROOT)}: no tuned file of benchmark {name} for profile {profile} "
                        f"({path_for(profile).relative_to(ROOT)} is TRACE's, chosen on TRACE's eval split); tune "
                        f"it on {name}'s eval split: a grid naming `benchmark: {benchmark}` "
                        f"({keyed(GRIDS, profile, benchmark)}), `cl-bench tune plan` it, run the plan, then "
                        f"`cl-bench tune choose` it")
    return path, load(path)


def load(path: Path) -> dict[str, dict]:
    """Method -> its tuned arguments."""
    if not path.is_file():
        grid = ROOT / GRIDS / f"{path.stem}.yaml"
        if grid.is_file():
            raise UserError(f"{path}: no tuned file for this profile; make it with `cl-bench tune choose "
                            f"{grid.relative_to(ROOT)}` once its tuning runs are done")
        grids = ", ".join(sorted(g.stem for g in (ROOT / GRIDS).glob("*.yaml"))) or "none"
        raise UserError(f"{path}: no tuned file for this profile, nor a tuning grid ({GRIDS}/{path.stem}.yaml; "
                        f"profiles with one: {grids}); run without --tuned, or write a grid "
                        f"(docs/tuning.md) and tune it")
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


def apply(raw: dict, profile: str, benchmark: str = DEFAULT_BENCHMARK) -> dict:
    """The config fields with the tuned arguments of the method merged in (module docstring)."""
    method = registry.get(raw.get("method") or registry.baseline()).name
    path, args = read(profile, benchmark)
    if method not in args:
        raise UserError(f"{path}: no tuned arguments for {method}; tune it (add it to "
                        f"{keyed(GRIDS, profile, benchmark)}) or run it without --tuned")
    given = dict(raw.get("method_args") or {})
    both = sorted(set(given) & set(args[method]))
    if both:
        raise UserError(f"--tuned sets {', '.join(both)} of {method} from {path.relative_to(ROOT)}; drop "
                        f"--method-arg {both[0]}=... (or run without --tuned)")
    return {**raw, "method_args": {**args[method], **given},
            "tuned": f"{path.relative_to(ROOT).as_posix()}@{file_commit(path)}"}
