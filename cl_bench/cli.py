"""`cl-bench`: run | campaign | show | compare | claims | list | data | leaderboard | site | analyze | score | params |
perf.

Bad input raises UserError anywhere below; here it becomes one line on stderr
and exit code 2 (a traceback only with --debug).
"""
from __future__ import annotations

import os
import signal
import sys

# As the `cl-bench` command (its console script, or `python -m cl_bench.cli`), SIGINT and
# SIGTERM are only noted until main() takes over, so that a stop while the imports below
# run ends the command as an interrupt (exit 130, one line), not with a traceback.
_EARLY_SIGNALS: list[int] = []


def _note_early(signum, frame) -> None:
    _EARLY_SIGNALS.append(signum)


if os.path.basename(sys.argv[0] if sys.argv else "") == "cl-bench" or __name__ == "__main__":
    for _sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(_sig, _note_early)

import contextlib  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import shlex  # noqa: E402
from pathlib import Path  # noqa: E402

from cl_bench.run import signals  # noqa: E402
from cl_bench.cli_parser import RUN_CONFIG_FLAGS, build_parser, run_overrides  # noqa: E402
from cl_bench.errors import UserError, program  # noqa: E402

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130
EXIT_LOST_RANK = 1  # a rank of the run ended (Backend.lost_peer): --resume goes on from its last checkpoint


def cmd_run(args) -> int:
    """`main` guards the whole command (args.stop): from its start a signal stops the run
    as an interrupt, and one that transformers' lazy imports swallowed is still seen."""
    stop = args.stop
    from cl_bench import config as cfg
    from cl_bench.run import resume
    from cl_bench.run.checks import check_config
    from cl_bench.run.prepare import prepare
    from cl_bench.report.text import format_matrix, resume_command
    from cl_bench.run.sequencer import execute

    resuming = None
    if args.resume is None:
        overrides = run_overrides(args)  # its --profile, if given, beats the file's `profile:`
        config = cfg.resolve("cpu", args.config, overrides)
        checked = check_config(config)  # the method's class looked up once, here; what follows takes `checked`
    else:
        given = [f"--{key.replace('_', '-')}" for key in RUN_CONFIG_FLAGS
                 if getattr(args, key) is not None and getattr(args, key) is not False and getattr(args, key) != []]
        if given:
            raise UserError(f"--resume continues a run with its recorded config; drop {', '.join(given)} "
                            f"(to change them, start a new run)")
        resuming = resume.recorded(args.resume)  # read once before the lock; its config built and checked once
        checked = resuming.checked
    config = checked.config
    if args.nproc is not None:
        from cl_bench.backends.launch import launch, must_launch

        if must_launch(args.nproc, config):  # this process starts the ranks; each runs this command
            code, interrupted = launch(args.nproc, args.argv, args.command_line)
            return EXIT_INTERRUPTED if interrupted else code
    stop.check()
    started: list[Path] = []
    named = resuming is None and config.run_id is not None  # by --run-id or the config file
    try:
        run = prepare(checked, resuming, progress=not args.no_progress, command=args.command_line,
                      on_start=lambda run_dir, *rest: (started.append(run_dir), _announce(run_dir, *rest)))
    except KeyboardInterrupt:
        from cl_bench.record.io import RUN_FILE

        same = shlex.split(args.command_line)[1:]
        if started and (started[0] / RUN_FILE).exists():  # --resume: the record is read, not yet rewritten
            print(f"\ninterrupted before the run was taken up; its record is as it was; continue with: "
                  f"{program()} {shlex.join(same)}", file=sys.stderr)
            return EXIT_INTERRUPTED
        if not started:
            print(f"\n{_NOT_STARTED}{program()} {shlex.join(same)}", file=sys.stderr)
            return EXIT_INTERRUPTED
        again = shlex.split(args.command_line)[1:] + ([] if named else ["--run-id", started[0].name])
        print(f"\ninterrupted before the run's record was written; nothing to keep; start it again (its folder "
              f"counts as empty) with: {program()} {shlex.join(again)}", file=sys.stderr)
        return EXIT_INTERRUPTED
    try:
        record = execute(run, keep_checkpoint=args.keep_checkpoint, stop=stop)
    except KeyboardInterrupt:
        if run.backend.is_main:
            print(f"\n{resume.left_by_interrupt(run, resume_command(run.record, run.run_dir))}", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as exc:
        if args.debug or not run.backend.lost_peer(exc):
            raise
        return _lost_rank(run, exc, stop)
    if run.backend.is_main:
        print(format_matrix(record, record.intervals))
        print(f"\nrun record: {run.run_dir / 'run.json'}")
    return 0


def _lost_rank(run, exc: Exception, stop) -> int:
    """A collective failed for want of a rank (Backend.lost_peer): one line, from rank 0,
    which recorded the run failed; where rank 0 is the rank that ended (its record stays
    `running`), from the first of the others to take the run's lock, which rank 0 held.
    The launcher's SIGTERM, which follows, cannot cut it."""
    from cl_bench.record.io import lock_run
    from cl_bench.report.text import resume_command
    from cl_bench.run import resume

    if stop is not None:
        stop.settled = True
    who = "another rank's"
    if not run.backend.is_main:
        if resume.stop_recorded(run.run_dir):  # rank 0 is alive and says it
            return EXIT_LOST_RANK
        try:
            run.lock = lock_run(run.run_dir)  # held until this process ends
        except UserError:  # another rank took it: that one says it
            return EXIT_LOST_RANK
        who = "rank 0's"
    said = str(exc).strip().splitlines()[0].split(". ")[0][:200]  # gloo's first sentence says it; its advice follows
    ended = (f"{run.run_dir}: a collective between the ranks failed ({said}): {who} process ended or stopped "
             f"answering (killed? out of memory? its output says why; --debug shows this one's traceback)")
    if run.record.status == "complete":  # at the last barrier: the record and predictions are written
        print(f"\n{ended}; the run is complete", file=sys.stderr)
        return 0
    again = resume.left_by_interrupt(run, resume_command(run.record, run.run_dir), "the run stopped")
    print(f"\n{ended}; {again}", file=sys.stderr)
    return EXIT_LOST_RANK


def _announce(run_dir: Path, config, method_args, record) -> None:
    """The first lines of a run: where it writes, and how long it should take."""
    from cl_bench.tools.campaign.estimate import for_run

    print(f"run folder: {run_dir}", flush=True)
    left = for_run(config, method_args, record.stages_done if record else 0,
                   bool(record and record.zero_shot is not None))
    print(f"estimated time{' left' if record else ''}: {left}", flush=True)


def cmd_show(args) -> int:
    from cl_bench.metrics.intervals import record_intervals
    from cl_bench.report.text import format_matrix, status_line
    from cl_bench.record.io import read_record

    record = read_record(args.run_dir)
    if record.status != "complete":
        print(status_line(record, args.run_dir))
    print(format_matrix(record, record_intervals(record, args.run_dir)))
    return 0


def cmd_compare(args) -> int:
    from cl_bench.report.compare import compare, format_comparison

    result = compare(args.runs, args.resamples)
    print(json.dumps(result, indent=2) if args.format == "json" else format_comparison(result))
    _save(args, result)
    return 0


def cmd_claims(args) -> int:
    from cl_bench.report import claims
    from cl_bench.report import leaderboard

    rows = claims.evaluate(args.file, args.root)
    table = claims.format_table(rows)
    print(table, end="")
    if args.update_readme:
        leaderboard.update_readme(args.update_readme, table, f"<!-- {args.section}:begin -->",
                                  f"<!-- {args.section}:end -->")
    _save(args, {"claims": rows})
    return 0


def cmd_list(args) -> int:
    from cl_bench import registry

    if args.benchmarks:
        return _list_benchmarks(args.verbose)
    methods = registry.available()
    width = max((len(n) for n in methods), default=10)
    for name, cls in sorted(methods.items()):
        tags = [t for t, on in (("reference", cls.reference), ("replay", cls.uses_replay)) if on]
        alias = f" (alias: {', '.join(cls.aliases)})" if cls.aliases else ""
        print(f"{name:<{width}}  {cls.description}{alias}" + (f"  [{', '.join(tags)}]" if tags else ""))
        if args.verbose:
            print(f"{'':<{width}}    backends: {_support(cls)}")
            if cls.lr_family:
                print(f"{'':<{width}}    lr family: {cls.lr_family} (a profile's train.lr_by_family sets its lr)")
            kind, warmup = cls.lr_schedule
            print(f"{'':<{width}}    lr schedule: {kind}" + (f" after {warmup:.0%} warm-up" if warmup else "")
                  + " (train.lr_schedule / train.warmup_ratio override it)")
            for arg, typ, default in cls.arg_table():
                print(f"{'':<{width}}    {arg}: {typ} = {default!r}")
    for b in registry.broken():
        print(f"{'(broken)':<{width}}  {b.source}: {b.error}")
    return 0


def _list_benchmarks(verbose: bool) -> int:
    from cl_bench import registry

    found = registry.benchmarks()
    width = max((len(n) for n in found), default=10)
    for name, bench in found.items():
        default = "  [default]" if name == registry.DEFAULT_BENCHMARK else ""
        print(f"{name:<{width}}  {bench.description} ({len(bench.cl_tasks)} tasks){default}")
        if verbose:
            print(f"{'':<{width}}    tasks: {', '.join(bench.cl_tasks)}")
            for order, tasks in bench.orders.items():
                print(f"{'':<{width}}    order {order}{' (default)' if order == bench.default_order else ''}: "
                      f"{','.join(tasks)}")
            print(f"{'':<{width}}    source: {bench.reference}")
    for b in registry.broken_benchmarks():
        print(f"{'(broken)':<{width}}  {b.source}: {b.error}")
    return 0


def cmd_data(args) -> int:
    from cl_bench.benchmarks.folder import check

    faults = check(args.folder)
    for fault in faults:
        print(fault)
    if not faults:
        print(f"{args.folder}: no faults")
    return EXIT_USAGE if faults else 0


def _support(cls) -> str:
    """The backends a method runs on, and why not where it does not."""
    refused = cls.zero_unsupported
    ok = [f"deepspeed ZeRO-{z}" for z in (2, 3) if z not in refused]
    text = ", ".join(["torch", *ok])
    reasons: dict[str, list[int]] = {}
    for z in sorted(refused):
        reasons.setdefault(refused[z], []).append(z)
    for reason, stages in reasons.items():
        text += f"; not deepspeed ZeRO-{'/'.join(map(str, stages))}: {reason}"
    return text


def cmd_leaderboard(args) -> int:
    from cl_bench.report import leaderboard, published
    from cl_bench.report.figures import sources
    from cl_bench.report.leaderboard import headline

    build, render = {"scores": (leaderboard.build_table, leaderboard.format_table),
                     "forms": (leaderboard.build_forms_table, leaderboard.format_forms_table),
                     "winners": (leaderboard.build_winners_table, leaderboard.format_winners_table),
                     "sources": (sources.build_table, sources.format_table),
                     "published": (published.build_table, published.format_table)}[args.view]
    runs, exclude, include = headline.leaderboard_runs(args.runs, args.exclude, args.include)
    records = leaderboard.load_runs(runs, exclude, include)
    if args.runs is None:  # the headline: TRACE's runs alone
        records = headline.headline_records(records, runs)
    tables = leaderboard.per_benchmark(records, build)  # one table per benchmark
    print(leaderboard.render_tables(tables, render, args.format), end="")
    if args.update_readme:
        leaderboard.update_readme(args.update_readme, leaderboard.render_tables(tables, render, "md"),
                                  f"<!-- {args.section}:begin -->", f"<!-- {args.section}:end -->")
    return 0


def cmd_site(args) -> int:
    from cl_bench.report.site.build import build_site

    print(build_site(args.runs, args.out, args.exclude, args.include, browser=not args.no_browser))
    return 0


def cmd_analyze(args) -> int:
    from cl_bench.report.figures.plots import analyze

    from cl_bench.record.io import stage_index

    if args.against is None and (args.from_stage, args.calibrate_stage) != (None, None):
        raise UserError("--from-stage and --calibrate-stage choose the stages of a comparison with another "
                        "run; add --against OTHER_RUN, or drop them")
    calibrate = None if args.calibrate_stage is None else stage_index(args.calibrate_stage)
    for path in analyze(args.run_dir, args.against, stage_index(args.from_stage or 1), calibrate):
        print(path)
    return 0


def cmd_score(args) -> int:
    from cl_bench.metrics.predictions import score_file

    print(json.dumps(score_file(args.predictions, args.task, args.stage, args.benchmark)))
    return 0


def cmd_params(args) -> int:
    from cl_bench.models.params import format_schedule, load_decisions, params_command

    decisions = load_decisions(args.decisions) if args.decisions is not None else None
    rows = params_command(args.model, args.method, args.tasks, dict(args.method_arg),
                          decisions=decisions, experts_per_layer=args.experts_per_layer)
    print(json.dumps(rows, indent=2) if args.json else format_schedule(rows))
    return 0


def cmd_perf(args) -> int:
    from cl_bench import registry
    from cl_bench.tools import perf

    args.method = args.method or registry.baseline()
    registry.get(args.method)  # an unknown name fails here, in one line
    result = perf.run(args.what, args)
    if result is None:  # a launched rank that reports nothing (perf deepspeed --ranks N)
        return 0
    print(json.dumps(result, indent=2))
    _save(args, result)
    return 0


def _save(args, result: dict) -> None:
    """--output: the result as JSON, its command line inside."""
    if args.output:
        from cl_bench.record.io import write_json

        args.output.parent.mkdir(parents=True, exist_ok=True)
        write_json(args.output, {"command": args.command_line, **result})


def cmd_campaign(args) -> int:
    from cl_bench.tools import campaign

    return campaign.main(args)


def cmd_tune(args) -> int:
    from cl_bench.tools.tuning.cli import main as tune

    return tune(args)


_NOT_STARTED = "interrupted before the run folder was made; nothing was written; start it again with: "

COMMANDS = {"run": cmd_run, "campaign": cmd_campaign, "tune": cmd_tune, "show": cmd_show, "compare": cmd_compare,
            "claims": cmd_claims,
            "list": cmd_list, "data": cmd_data, "leaderboard": cmd_leaderboard, "site": cmd_site,
            "analyze": cmd_analyze, "score": cmd_score, "params": cmd_params, "perf": cmd_perf}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    # `run` is guarded from here, before its flags are parsed and datasets, torch and
    # transformers are imported (seconds), and a signal noted before (_EARLY_SIGNALS)
    # stops it at once: a signal at any moment ends it with exit 130 and one line. (The
    # first token naming a command is the command: only --debug and --local_rank=N
    # come before it.)
    command = next((a for a in argv if a in COMMANDS), None)
    early = list(_EARLY_SIGNALS)
    if command == "run":
        guard = signals.interrupt_on_signals(signals.Stop(early))
    else:
        _default_handlers()
        guard = contextlib.nullcontext()
    with guard as stop:
        try:
            if early:
                raise KeyboardInterrupt(signal.Signals(early[0]).name)
            return _main(argv, stop)
        except KeyboardInterrupt:  # before cmd_run's own handlers (flags, imports, config)
            print(f"\n{_NOT_STARTED}{program()} {shlex.join(argv)}" if command == "run" else "\ninterrupted",
                  file=sys.stderr)
            return EXIT_INTERRUPTED


def _default_handlers() -> None:
    """Python's own SIGINT and SIGTERM handling back, where the early ones were installed."""
    for sig, default in ((signal.SIGINT, signal.default_int_handler), (signal.SIGTERM, signal.SIG_DFL)):
        if signal.getsignal(sig) is _note_early:
            signal.signal(sig, default)


def _main(argv: list[str], stop: signals.Stop | None) -> int:
    args = build_parser().parse_args(argv)
    args.argv, args.stop = argv, stop
    # recorded beside what the command writes; a launched rank records its launcher's
    args.command_line = os.environ.get("CL_BENCH_COMMAND") or shlex.join(
        ["cl-bench", *(a for a in argv if not a.startswith(("--local_rank", "--local-rank")))])
    rank = int(os.environ.get("RANK", "0"))  # ranks > 0 of a launch log errors only: rank 0 says the rest
    logging.basicConfig(level=logging.DEBUG if args.debug else logging.INFO if rank == 0 else logging.ERROR,
                        format="%(levelname)s %(name)s: %(message)s")
    # torch._subclasses: FakeTensor's cache statistics, logged at INFO when the process exits
    for noisy in ("transformers", "datasets", "urllib3", "filelock", "httpx", "absl", "torch._subclasses"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    try:
        import datasets

        datasets.disable_progress_bars()
        return COMMANDS[args.command](args)
    except UserError as exc:
        if args.debug:
            raise
        if rank == 0:  # every rank raises the same error; one says it
            print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
