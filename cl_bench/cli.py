"""`cl-bench`: run | show | compare | list | leaderboard | analyze | score | params | perf.

Bad input raises UserError anywhere below; here it becomes one line on stderr
and exit code 2 (a traceback only with --debug).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import sys
from pathlib import Path

from cl_bench.errors import UserError

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


def _kv(text: str) -> tuple[str, str]:
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"'{text}' is not key=value")
    key, value = text.split("=", 1)
    return key.strip(), value.strip()


def _add_run(sub) -> None:
    p = sub.add_parser("run", help="train a method over a TRACE task sequence and score it",
                       description="Train a continual-learning method task after task, evaluate "
                                   "after each stage, and write <output-dir>/<run-id>/run.json.")
    p.add_argument("--method", help="method name (see `cl-bench list`); default seqft")
    p.add_argument("--model", help="smollm2-135m | tiny-llama | a local HF directory | a hub id")
    p.add_argument("--profile", help="smoke | cpu | paper (default: the config file's, else cpu)")
    p.add_argument("--config", type=Path, help="YAML file of config fields (profile <- file <- flags)")
    p.add_argument("--seed", type=int)
    p.add_argument("--data-dir", help="TRACE data root (default: $CL_BENCH_DATA, then conventional places)")
    p.add_argument("--order", help="paper6 | trace8 | comma-separated task names")
    p.add_argument("--n-train", type=int, help="training examples per task")
    p.add_argument("--n-test", type=int, help="test examples per task")
    p.add_argument("--output-dir", help="where run folders go (default runs/)")
    p.add_argument("--run-id", help="the run folder's name (default <method>-<time>-<random>)")
    p.add_argument("--method-arg", type=_kv, action="append", default=[], metavar="KEY=VALUE",
                   help="a method argument (repeatable); see `cl-bench list --verbose`")
    p.add_argument("--set", type=_kv, action="append", default=[], metavar="SECTION.FIELD=VALUE",
                   help="any config field, e.g. train.epochs=2 (repeatable)")
    p.add_argument("--eval-all", action="store_true",
                   help="evaluate every task at every stage plus a zero-shot row (for FWT)")
    p.add_argument("--resume", type=Path, metavar="RUN_DIR", help="continue an interrupted run")
    p.add_argument("--keep-checkpoint", action="store_true",
                   help="keep the last checkpoint (weights, optimiser) after the run completes")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--backend", choices=["torch", "deepspeed"],
                   help="torch: one process (default); deepspeed: ZeRO-2/3 over --nproc ranks")
    p.add_argument("--zero", type=int, choices=[2, 3], help="deepspeed: the ZeRO stage (default 2)")
    p.add_argument("--nproc", type=int, metavar="N",
                   help="deepspeed: start N ranks on this machine through DeepSpeed's launcher "
                        "(one per GPU; without it, the ranks of an outer deepspeed/torchrun launch, else 1)")


def _overrides(args) -> dict:
    from cl_bench.config import set_dotted

    raw: dict = {}
    for key in ("method", "model", "profile", "seed", "output_dir", "run_id", "backend"):
        if getattr(args, key) is not None:
            raw[key] = getattr(args, key)
    data = {key: getattr(args, key) for key in ("data_dir", "order", "n_train", "n_test")
            if getattr(args, key) is not None}
    if data:
        raw["data"] = data
    if args.eval_all:
        raw.setdefault("eval", {})["eval_all"] = True
    if args.zero is not None:
        raw.setdefault("deepspeed", {})["zero"] = args.zero
    if args.method_arg:
        raw["method_args"] = dict(args.method_arg)
    for key, value in args.set:
        set_dotted(raw, key, value)
    return raw


def cmd_run(args) -> int:
    from cl_bench import signals

    # First, before the imports of torch and transformers (seconds, and transformers'
    # lazy imports swallow a KeyboardInterrupt): from here a signal stops the run as
    # an interrupt, and one that was swallowed is still seen (stop.check).
    with signals.interrupt_on_signals() as stop:
        return _run(args, stop)


def _run(args, stop) -> int:
    from cl_bench import config as cfg
    from cl_bench import sequencer
    from cl_bench.report import format_matrix

    config = None
    if args.resume is None:
        overrides = _overrides(args)  # its --profile, if given, beats the file's `profile:`
        config = cfg.resolve("cpu", args.config, overrides)
    else:
        given = [f"--{key.replace('_', '-')}" for key in RUN_CONFIG_FLAGS
                 if getattr(args, key) is not None and getattr(args, key) is not False and getattr(args, key) != []]
        if given:
            raise UserError(f"--resume continues a run with its recorded config; drop {', '.join(given)} "
                            f"(to change them, start a new run)")
    if args.nproc is not None and _must_launch(args, config):
        return _launch(args)  # this process starts the ranks; each runs this command
    stop.check()
    run = sequencer.prepare(config, args.resume, progress=not args.no_progress, command=args.command_line)
    try:
        record = sequencer.execute(run, keep_checkpoint=args.keep_checkpoint, stop=stop)
    except KeyboardInterrupt:
        if run.backend.is_main:
            print(f"\n{_interrupted(run)}", file=sys.stderr)
        return EXIT_INTERRUPTED
    if run.backend.is_main:
        print(format_matrix(record, record.get("intervals")))
        print(f"\nrun record: {run.run_dir / 'run.json'}")
    return 0


# Flags of `run` that set config fields; --resume keeps the recorded config and refuses them.
RUN_CONFIG_FLAGS = ("method", "model", "profile", "config", "seed", "data_dir", "order", "n_train", "n_test",
                    "output_dir", "run_id", "method_arg", "set", "eval_all", "backend", "zero")


def _interrupted(run) -> str:
    """What an interrupt leaves, in one line: resume continues after the last checkpoint,
    or, with none yet, starts the run again in its folder."""
    from cl_bench.results import has_checkpoint

    again = f"cl-bench run --resume {run.run_dir}"
    done, total = run.record.get("stages_done", 0), len(run.stages)
    if has_checkpoint(run.run_dir):
        return f"interrupted; {done} of {total} stages are saved; continue with: {again}"
    return f"interrupted before the first stage was saved; nothing to keep; start it again with: {again}"


def _must_launch(args, config) -> bool:
    """--nproc N: whether this process must start the N ranks (False: it is one of
    them). Everything checkable is checked here, once, before N processes start."""
    from cl_bench import registry
    from cl_bench.backends import check_support
    from cl_bench.config import build
    from cl_bench.results import RUN_FILE, read_record
    from cl_bench.sequencer import _resumable

    if args.nproc < 1:
        raise UserError(f"--nproc {args.nproc}: give at least 1 rank")
    if config is None:
        record = _resumable(read_record(args.resume), args.resume)
        config = build(record["config"], f"{args.resume / RUN_FILE}: config")
    if config.backend != "deepspeed":
        raise UserError("--nproc starts ranks of the deepspeed backend; add --backend deepspeed")
    if "RANK" in os.environ:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world != args.nproc:
            raise UserError(f"--nproc {args.nproc} inside a launch of {world} ranks; drop --nproc "
                            f"or launch {args.nproc}")
        return False
    check_support(registry.get(config.method), config)
    from cl_bench.backends.deepspeed_backend import ds_config

    ds_config(config, args.nproc, False)  # a conflicting DeepSpeed config file fails here, once
    return True


def _launch(args) -> int:
    """Start --nproc ranks of this same command through DeepSpeed's launcher; each
    sees RANK in its environment and runs the command as one rank. SIGINT or SIGTERM
    to this process stops the launcher and every rank, and it returns only when all
    have exited (cl_bench/signals.py)."""
    from cl_bench import signals
    from cl_bench.backends.deepspeed_backend import free_port

    launcher = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(args.nproc),
                "--master_port", str(free_port()), "--no_local_rank", "--module", "cl_bench.cli"]
    env = {**os.environ, "CL_BENCH_COMMAND": args.command_line}
    code, stop = signals.wait_forwarding(signals.start_group([*launcher, *args.argv], env))
    return EXIT_INTERRUPTED if stop.fired else code  # the ranks said what the interrupt left


def cmd_show(args) -> int:
    from cl_bench.intervals import record_intervals
    from cl_bench.report import format_matrix
    from cl_bench.results import read_record

    record = read_record(args.run_dir)
    print(format_matrix(record, record_intervals(record, args.run_dir)))
    return 0


def cmd_compare(args) -> int:
    from cl_bench.compare import compare, format_comparison

    result = compare(args.runs, args.resamples)
    print(json.dumps(result, indent=2) if args.format == "json" else format_comparison(result))
    _save(args, result)
    return 0


def cmd_list(args) -> int:
    from cl_bench import registry

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
            for arg, typ, default in cls.arg_table():
                print(f"{'':<{width}}    {arg}: {typ} = {default!r}")
    for b in registry.broken():
        print(f"{'(broken)':<{width}}  {b.source}: {b.error}")
    return 0


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
    from cl_bench import leaderboard

    table = leaderboard.build_table(leaderboard.load_runs(args.runs, args.exclude, args.include))
    print(leaderboard.format_table(table, args.format), end="")
    if args.update_readme:
        leaderboard.update_readme(args.update_readme, leaderboard.format_table(table, "md"),
                                  f"<!-- {args.section}:begin -->", f"<!-- {args.section}:end -->")
    return 0


def cmd_analyze(args) -> int:
    from cl_bench.analysis.plots import analyze

    for path in analyze(args.run_dir, args.against, args.from_stage, args.calibrate_stage):
        print(path)
    return 0


def cmd_score(args) -> int:
    from cl_bench.benchmarks.trace import get_task
    from cl_bench.metrics import scorers

    spec = get_task(args.task)
    rows = _read_predictions(args.predictions, args.task, args.stage)
    preds = [r["prediction"].strip() for r in rows]
    answers = [r["answer"] for r in rows]
    prompts = [r["prompt"] for r in rows]
    score = scorers.score(spec.metric, preds, answers, prompts)
    print(json.dumps({"task": spec.name, "metric": spec.metric, "score": score, "n": len(rows)}))
    return 0


def _read_predictions(path: Path, task: str, stage: int | None) -> list[dict]:
    """Lines of {"prompt", "prediction", "answer"}; lines that carry "task"/"stage"
    fields (cl-bench's own predictions.jsonl) are filtered to --task/--stage."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise UserError(f"{path}: cannot read predictions ({exc.strerror}); check the path") from None
    except UnicodeDecodeError as exc:
        raise UserError(f"{path}: not UTF-8 text (byte {exc.start}); write the predictions as UTF-8 JSONL") from None
    rows = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise UserError(f"{path}:{n}: not valid JSON ({exc.msg}); each line must be one "
                            f"JSON object") from None
        if not isinstance(row, dict):
            raise UserError(f"{path}:{n}: a line must be a JSON object with prompt, prediction, answer")
        for key in ("prompt", "prediction", "answer"):
            if not isinstance(row.get(key), str):
                found = type(row[key]).__name__ if key in row else "nothing"
                raise UserError(f"{path}:{n}: field '{key}' must be a string, found {found}; "
                                f"fix that line")
        if "task" in row and row["task"] != task:
            continue
        if stage is not None and row.get("stage") != stage:
            continue
        rows.append(row)
    if not rows:
        raise UserError(f"{path}: no predictions for task {task}"
                        + (f" at stage {stage}" if stage is not None else "")
                        + "; check --task and --stage")
    stages = sorted({r["stage"] for r in rows if isinstance(r.get("stage"), int)})
    if stage is None and len(stages) > 1:  # pooling stages would score no cell of the matrix
        raise UserError(f"{path}: task {task} has predictions of stages {', '.join(map(str, stages))}"
                        + (" (-1: zero-shot)" if -1 in stages else "") + "; pass --stage to score one")
    return rows


def cmd_params(args) -> int:
    from cl_bench.models.params import format_schedule, load_decisions, params_command

    decisions = load_decisions(args.decisions) if args.decisions is not None else None
    rows = params_command(args.model, args.method, args.tasks, dict(args.method_arg),
                          decisions=decisions, experts_per_layer=args.experts_per_layer)
    print(json.dumps(rows, indent=2) if args.json else format_schedule(rows))
    return 0


def cmd_perf(args) -> int:
    from cl_bench import perf, registry

    args.method = args.method or registry.baseline()
    registry.get(args.method)  # an unknown name fails here, in one line
    result = perf.run(args.what, args)
    print(json.dumps(result, indent=2))
    _save(args, result)
    return 0


def _save(args, result: dict) -> None:
    """--output: the result as JSON, its command line inside."""
    if args.output:
        from cl_bench.results import write_json

        args.output.parent.mkdir(parents=True, exist_ok=True)
        write_json(args.output, {"command": args.command_line, **result})


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cl-bench", description=__doc__.splitlines()[0])
    parser.add_argument("--debug", action="store_true", help="show tracebacks and debug logs")
    # `deepspeed script.py ARGS` passes --local_rank=N before ARGS; the rank comes from the environment
    parser.add_argument("--local_rank", "--local-rank", type=int, help=argparse.SUPPRESS)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_run(sub)
    p = sub.add_parser("show", help="print a run's matrix and summary from its record")
    p.add_argument("run_dir", type=Path, metavar="RUN_DIR")
    p = sub.add_parser("compare", help="paired differences between runs over the same test items",
                       description="Each run against the first: the difference in every summary with its "
                                   "95%% paired-bootstrap interval and p-value. Runs whose tasks, test items "
                                   "or budgets differ are refused.")
    p.add_argument("runs", type=Path, nargs="+", metavar="RUN_DIR", help="the baseline first, then the others")
    p.add_argument("--format", choices=["table", "json"], default="table")
    p.add_argument("--resamples", type=int, default=1000, help="bootstrap resamples (default 1000)")
    p.add_argument("--output", type=Path, help="also write the result as JSON here")
    p = sub.add_parser("list", help="list methods with one-line descriptions")
    p.add_argument("--verbose", "-v", action="store_true", help="also show each method's arguments")
    p = sub.add_parser("leaderboard", help="tables from run records")
    p.add_argument("--runs", type=Path, default=Path("results"), help="folder of run folders")
    p.add_argument("--format", choices=["md", "csv", "latex"], default="md")
    p.add_argument("--update-readme", type=Path, metavar="README",
                   help="also write the Markdown table between the section's markers of README")
    p.add_argument("--section", default="leaderboard",
                   help="README markers <!-- SECTION:begin --> / <!-- SECTION:end --> (default leaderboard)")
    p.add_argument("--exclude", action="append", default=[], metavar="GLOB",
                   help="skip run folders matching GLOB, relative to --runs (repeatable), e.g. 'sweeps/*'")
    p.add_argument("--include", action="append", default=[], metavar="GLOB",
                   help="only run folders matching GLOB (repeatable), e.g. 'bilevel-cka-*'")
    p = sub.add_parser("analyze", help="figures from a run record (heatmap, decisions, CKA, sharpness), "
                                       "written beside it")
    p.add_argument("run_dir", type=Path, metavar="RUN_DIR")
    p.add_argument("--against", type=Path, metavar="OTHER_RUN",
                   help="also compare step time and peak memory with this run (cost-vs-<id>.json)")
    p.add_argument("--from-stage", type=int, default=0, metavar="B",
                   help="--against: compare stages B.. (0-based; 1 skips a first task both train alike)")
    p.add_argument("--calibrate-stage", type=int, metavar="B",
                   help="--against: a stage both runs compute identically; ratios also divided by its "
                        "ratio, cancelling a difference in machine load")
    p = sub.add_parser("score", help="score predictions made elsewhere")
    p.add_argument("--task", required=True, help="TRACE task name, e.g. 20Minuten")
    p.add_argument("--predictions", type=Path, required=True,
                   help='JSONL, one {"prompt", "prediction", "answer"} per line')
    p.add_argument("--stage", type=int, help="with cl-bench's predictions.jsonl: which stage")
    p = sub.add_parser("params", help="parameter counts per stage of a method's schedule, no training")
    p.add_argument("--model", required=True, help="llama-3.2-1b | llama-3.2-3b | tiny-llama")
    p.add_argument("--method", required=True)
    p.add_argument("--tasks", type=int, required=True)
    p.add_argument("--method-arg", type=_kv, action="append", default=[], metavar="KEY=VALUE")
    grown = p.add_mutually_exclusive_group()
    grown.add_argument("--decisions", type=Path, metavar="FILE",
                       help="methods that decide Expand / Recycle (bilevel-cka): count this decision map, "
                            "JSON [task][layer][slot] of 0/1 for tasks 1..T-1, or a run.json; default: "
                            "the upper bound, every decision Expand")
    grown.add_argument("--experts-per-layer", type=float, metavar="X",
                       help="as --decisions, from the mean experts per MoE layer after the last task "
                            "(e.g. a paper's 17.8), expansions spread evenly over tasks and layers")
    p.add_argument("--json", action="store_true")
    p = sub.add_parser("perf", help="measure generation speed-up, harness overhead, MoE dispatch, "
                                    "the loss upcycling adds before training, deepspeed's per-step cost, or fp32 against bf16")
    p.add_argument("what", choices=["generation", "harness", "moe", "upcycle-gap", "deepspeed", "precision"])
    p.add_argument("--method", help="harness, deepspeed: the method whose stage is timed (default: the baseline)")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--task", help="task(s) or order; default NumGLUE-ds (upcycle-gap: paper6)")
    p.add_argument("--n", type=int, default=32, help="prompts (generation) or examples (harness)")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--data-dir")
    p.add_argument("--output", type=Path, help="also write the result as JSON here")
    return parser


COMMANDS = {"run": cmd_run, "show": cmd_show, "compare": cmd_compare, "list": cmd_list, "leaderboard": cmd_leaderboard,
            "analyze": cmd_analyze, "score": cmd_score, "params": cmd_params, "perf": cmd_perf}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    args.argv = argv
    # recorded beside what the command writes; a launched rank records its launcher's
    args.command_line = os.environ.get("CL_BENCH_COMMAND") or shlex.join(
        ["cl-bench", *(a for a in argv if not a.startswith(("--local_rank", "--local-rank")))])
    rank = int(os.environ.get("RANK", "0"))  # ranks > 0 of a launch log errors only: rank 0 says the rest
    logging.basicConfig(level=logging.DEBUG if args.debug else logging.INFO if rank == 0 else logging.ERROR,
                        format="%(levelname)s %(name)s: %(message)s")
    for noisy in ("transformers", "datasets", "urllib3", "filelock", "httpx", "absl"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    import datasets

    datasets.disable_progress_bars()
    try:
        return COMMANDS[args.command](args)
    except UserError as exc:
        if args.debug:
            raise
        if rank == 0:  # every rank raises the same error; one says it
            print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
