"""`cl-bench tune ACTION GRID`: the tuning protocol's commands (cl_bench/tools/tuning/;
their flags are in cl_bench/cli_parser.py).

  plan         the plan of tuning runs, for `cl-bench campaign` (eval split only)
  choose       the rule over the finished tuning runs -> the tuned file of the grid's
               benchmark and profile (configs/tuned/[<benchmark>/]<profile>.yaml)
  finals       the plan of the finals: each method at its tuned arguments, test split
  sensitivity  Last Acc and BWT at each grid value: a Markdown table and a figure
  leaderboard  the tuned (or the shared-rate) leaderboard of the profile
  verdict      does the order change between the shared-rate and tuned leaderboards
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

def main(args) -> int:
    from cl_bench.report import leaderboard
    from cl_bench.errors import UserError
    from cl_bench.record.io import atomic_write_text
    from cl_bench.tools.tuning import grid as grids
    from cl_bench.tools.tuning import plan
    from cl_bench.tools.tuning import rule
    from cl_bench.tools.tuning import sensitivity
    from cl_bench import config_tuned
    from cl_bench.tools.tuning import tuned

    grid = grids.load(args.grid)
    records = plan.Records(args.records, Path("."))
    not_rows = grid.finals.exclude + args.exclude  # record folders that are no leaderboard's rows
    if args.action in ("plan", "finals"):
        if args.action == "plan":
            text = plan.tuning_plan(grid, records, rule.decided_rates(grid, records))
        else:
            tuned_path, chosen = config_tuned.read(grid.profile, grid.benchmark)
            f = grid.finals
            text = plan.finals_plan(grid, tuned_path.relative_to(config_tuned.ROOT), chosen,
                                    plan.Records(args.records, Path("."), not_rows), f.output, f.seeds, f.seeded)
        _emit(args.out, text, atomic_write_text)
        return 0
    if args.action == "choose":
        out = args.out or config_tuned.path_for(grid.profile, grid.benchmark)
        rule.write(out, rule.choose(grid, records), args.command_line)
        print(out)
        return 0
    if args.action == "sensitivity":
        table = sensitivity.rows(grid, records, rule.decided_rates(grid, records))
        text = sensitivity.format_table(table)
        print(text, end="")
        if args.out:
            args.out.mkdir(parents=True, exist_ok=True)
            atomic_write_text(args.out / "sensitivity.md", text)
            atomic_write_text(args.out / "sensitivity.json", json.dumps({"command": args.command_line,
                                                                        "rows": table}, indent=1) + "\n")
            print(sensitivity.figure(table, args.out / "sensitivity.png"), file=sys.stderr)
        _readme(args, text, "sensitivity")
        return 0
    runs = leaderboard.load_runs(args.records, not_rows)
    shared = tuned.expected_args({m: {} for m in grid.methods}, grid.profile, grid.benchmark)

    def board(view: str) -> list:
        wanted = shared if view == "shared" else _at_tuned(grid)
        return tuned.check_rows(tuned.select(runs, wanted, grid.profile, grid.benchmark), view, grid.finals,
                                list(wanted))

    if args.action == "leaderboard":
        table = leaderboard.format_table(leaderboard.build_table(board(args.view)), "md")
        print(table, end="")
        _readme(args, table, f"{args.view}-leaderboard")  # the shared view never overwrites the tuned table
        return 0
    if args.top < 1:
        raise UserError(f"--top {args.top} must be at least 1")
    print(sensitivity.format_verdict(sensitivity.verdict(board("shared"), board("tuned"), args.top)), end="")
    return 0


def _at_tuned(grid) -> dict[str, dict]:
    """Method -> its full arguments at the grid's benchmark's tuned file."""
    from cl_bench import config_tuned
    from cl_bench.tools.tuning import tuned

    return tuned.expected_args(config_tuned.read(grid.profile, grid.benchmark)[1], grid.profile, grid.benchmark)


def _emit(out: Path | None, text: str, write) -> None:
    if out is None:
        print(text, end="")
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    write(out, text)
    print(out)


def _readme(args, text: str, default: str) -> None:
    if args.update_readme:
        from cl_bench.report import leaderboard

        section = args.section or default
        leaderboard.update_readme(args.update_readme, text, f"<!-- {section}:begin -->", f"<!-- {section}:end -->")
