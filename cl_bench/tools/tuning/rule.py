"""The rule, applied to finished tuning runs (`cl-bench tune choose GRID`), and the
file it writes, the tuned file of the grid's benchmark and profile: configs/tuned/<profile>.yaml
for TRACE, configs/tuned/<benchmark>/<profile>.yaml for another (cl_bench/config_tuned.py).

Rule last-acc-keep-base (grid.RULES), per method, the rate first, then its strength
at the chosen rate: the value with the highest Last Acc on the tuning order (a tie
goes to the base value); the base value is kept unless that value's Last Acc is
higher than the base's at 95%, i.e. the 95% paired-bootstrap interval of
Last Acc(best) - Last Acc(base) over the eval items lies above 0 (`cl-bench compare
BASE BEST`, cl_bench/report/compare.py).
"""
from __future__ import annotations

from pathlib import Path

import yaml

from cl_bench.report.compare import compare
from cl_bench.errors import UserError
from cl_bench.record.io import atomic_write_text, read_record
from cl_bench.tools.campaign.plan import Entry, planned
from cl_bench.tools.tuning import plan
from cl_bench.tools.tuning.grid import Grid, MethodGrid


def decide(runs: dict[float, Path], base: float, root: Path) -> dict:
    """The rule over one grid line: {"chosen", "base", "best", "last_acc", "runs",
    "best_vs_base", "at_edge"} (best_vs_base: compare's Last Acc difference, None when
    best is base; at_edge: "lowest" or "highest" where the chosen value is the grid's
    end, whose other side the grid did not try, and which the rule does not extend)."""
    last = {}
    for value, folder in runs.items():
        record = read_record(root / folder)
        if record.split != "eval":
            raise UserError(f"{folder}: scored the {record.split} split; the rule reads tuning runs on the eval split "
                            "only")
        last[value] = record.summary["last_acc"]
    best = max(sorted(runs), key=lambda v: (last[v], v == base))
    out = {"base": base, "best": best, "chosen": base, "best_vs_base": None,
           "last_acc": {v: last[v] for v in sorted(runs)}, "runs": {v: str(runs[v]) for v in sorted(runs)}}
    if best != base:
        summary = compare([root / runs[base], root / runs[best]])["comparisons"][0]["summaries"]["last_acc"]
        out["best_vs_base"] = {"diff": summary["diff"], "ci": list(summary["ci"]) if summary["ci"] else None,
                               "p": summary["p"]}
        if summary["ci"] is not None and summary["ci"][0] > 0:
            out["chosen"] = best
    values = sorted(runs)
    out["at_edge"] = (None if len(values) < 2 else "lowest" if out["chosen"] == values[0]
                      else "highest" if out["chosen"] == values[-1] else None)
    return out


def _folders(grid: Grid, records: plan.Records, g: MethodGrid, points: list[dict], key: str) -> dict | None:
    """Grid value -> the folder of its complete run; None while one is missing. A run in
    a grid point's folder that is not that point's (another method, argument, seed,
    order, profile or precision: moved or hand-made there) is refused in one line, not
    read as the point's."""
    folders = {}
    for args in points:
        folder, flags, _ = plan.point(grid, records, g.method, args)
        if not (records.root / folder / "run.json").is_file():
            return None
        record = read_record(records.root / folder)
        if record.status != "complete":
            return None
        _is_the_point(record, folder, g.method, args, grid, planned(Entry(folder, flags, 0))[0])
        folders[args[key]] = folder
    return folders


def _is_the_point(record, folder: Path, method: str, args: dict, grid: Grid, config) -> None:
    """The fields that place a run at a grid point, and the profile and precision it ran
    at (`config`: the point's planned run; the full fit, plan.fits, also compares every
    scored config field, which a record made before a field was added lacks)."""
    ran_args = record.method_args or {}
    wrong = ([("method", record.method, method)] if record.method != method else []) + [
        (f"method_args.{k}", ran_args.get(k), v) for k, v in args.items()
        if not isinstance(ran_args.get(k), (int, float)) or abs(ran_args[k] - v) > 1e-9 * abs(v)]
    if record.seed != grid.seed:
        wrong.append(("seed", record.seed, grid.seed))
    if list(record.tasks) != list(grid.order):
        wrong.append(("tasks", ",".join(record.tasks), ",".join(grid.order)))
    if record.profile != grid.profile:
        wrong.append(("profile", record.profile, grid.profile))
    ran = plan.ran_precision({"backend": record.backend})
    wrong += [(f"backend.precision.{part}", ran[part], asked) for part, asked in plan.computes_in(config).items()
              if ran[part] != asked]
    if wrong:
        field, ran, asked = wrong[0]
        raise UserError(f"{folder / 'run.json'}: {field} is {ran!r} where {grid.path}'s point asks {asked!r}; "
                        f"move that run out of {folder} and run the plan again (`cl-bench tune plan {grid.path}`)")


def decided_rates(grid: Grid, records: plan.Records) -> dict[str, float]:
    """Method -> its chosen rate, for each method whose rate runs are all complete."""
    out = {}
    for method, g in grid.methods.items():
        folders = _folders(grid, records, g, g.rate_points(), "lr")
        if folders is not None:
            out[method] = decide(folders, g.base_lr, records.root)["chosen"]
    return out


def choose(grid: Grid, records: plan.Records) -> dict:
    """The tuned file's content: per method its arguments and the decisions behind them."""
    methods, missing = {}, []
    for method, g in grid.methods.items():
        folders = _folders(grid, records, g, g.rate_points(), "lr")
        if folders is None:
            missing.append(f"{method} (rate)")
            continue
        rate = decide(folders, g.base_lr, records.root)
        entry = {"args": {"lr": rate["chosen"]}, "lr": rate}
        if g.strength:
            at = rate["chosen"]
            points = [args for args in g.strength_points(at) if args[g.strength] != g.base_strength]
            others = _folders(grid, records, g, points, g.strength)
            if others is None:
                missing.append(f"{method} ({g.strength} at lr {at:g})")
                continue
            others[g.base_strength] = folders[at]  # the default strength's point is the rate's run
            strength = decide(others, g.base_strength, records.root)
            entry[g.strength] = strength
            entry["args"][g.strength] = strength["chosen"]
        methods[method] = entry
    if missing:
        raise UserError(f"{grid.path}: tuning runs not complete for {'; '.join(missing)}; run the plan "
                        f"(`cl-bench tune plan {grid.path}`, then `cl-bench campaign`) and choose again")
    return {"profile": grid.profile, "grid": str(grid.path), "rule": grid.rule, "order": grid.order,
            "methods": methods}


def write(path: Path, tuned: dict, command: str) -> None:
    head = (f"# Written by `{command}`: each method's arguments by the grid file's rule, with the tuning runs\n"
            f"# they came from (cl_bench/tools/tuning/rule.py). `cl-bench run --tuned` reads `args`.\n")
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, head + yaml.safe_dump(tuned, sort_keys=False, width=110))
