"""The grammar of `cl-bench`: every subcommand and its flags (argparse), and the
flags of `run` as config overrides (profile <- file <- these; cl_bench/config.py).
What each command does is in cl_bench/cli.py.
"""
from __future__ import annotations

import argparse
from pathlib import Path

DESCRIPTION = ("`cl-bench`: run | campaign | tune | show | compare | claims | list | data | leaderboard | site | "
               "analyze | score | params | perf.")


def _kv(text: str) -> tuple[str, str]:
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"'{text}' is not key=value")
    key, value = text.split("=", 1)
    return key.strip(), value.strip()


MIN_RESAMPLES = 100


def _resamples(text: str) -> int:
    """An argparse type: bootstrap resamples, at least MIN_RESAMPLES (fewer give a 95%
    interval from a handful of tail draws, or none at all)."""
    try:
        number = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a whole number") from None
    if number < MIN_RESAMPLES:
        raise argparse.ArgumentTypeError(f"{number}: at least {MIN_RESAMPLES} resamples make a 95% interval "
                                         f"(the default is 1000)")
    return number


def _stage_number(lowest: int):
    """An argparse type: a stage as the user numbers it (1..T, 0 the zero-shot row;
    cl_bench/record/io.stage_number), at least `lowest`."""
    def parse(text: str) -> int:
        try:
            number = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"'{text}' is not a stage number") from None
        if number < lowest:
            raise argparse.ArgumentTypeError(
                f"{number}: stages are numbered from 1, as `cl-bench show` numbers them"
                + (" (0: the zero-shot row)" if lowest == 0 else ""))
        return number
    return parse


def _add_run(sub) -> None:
    p = sub.add_parser("run", help="train a method over a task sequence (TRACE's by default) and score it",
                       description="Train a continual-learning method task after task, evaluate "
                                   "after each stage, and write <output-dir>/<run-id>/run.json.")
    p.add_argument("--method", help="method name (see `cl-bench list`); default: the baseline, the method that "
                                     "declares `baseline` (full fine-tuning)")
    p.add_argument("--model", help="smollm2-135m | tiny-llama | a local HF directory | a hub id")
    p.add_argument("--profile", help="smoke | cpu | cpu-long | paper (default: the config file's, else cpu)")
    p.add_argument("--config", type=Path, help="YAML file of config fields (profile <- file <- flags)")
    p.add_argument("--seed", type=int)
    p.add_argument("--benchmark", help="trace (default) | long-sequence | an outside one (`cl-bench list "
                                        "--benchmarks`) | a folder of your own tasks holding benchmark.yaml")
    p.add_argument("--data-dir", help="the benchmark's data folder (TRACE: default $CL_BENCH_DATA, then "
                                      "conventional places)")
    p.add_argument("--order", help="a named order of the benchmark (TRACE: paper6 | trace8) | comma-separated "
                                   "task names")
    p.add_argument("--n-train", type=int, help="training examples per task")
    p.add_argument("--n-test", type=int, help="test examples per task")
    p.add_argument("--output-dir", help="where run folders go (default runs/)")
    p.add_argument("--run-id", help="the run folder's name (default <method>-<time>-<random>)")
    p.add_argument("--method-arg", type=_kv, action="append", default=[], metavar="KEY=VALUE",
                   help="a method argument (repeatable); see `cl-bench list --verbose`")
    p.add_argument("--set", type=_kv, action="append", default=[], metavar="SECTION.FIELD=VALUE",
                   help="any config field, e.g. train.epochs=2 (repeatable)")
    p.add_argument("--tuned", action="store_true",
                   help="the method's arguments from the benchmark's tuned file of the profile, "
                        "configs/tuned/<profile>.yaml (TRACE) or configs/tuned/<benchmark>/<profile>.yaml "
                        "(`cl-bench tune choose`); "
                        "the record names the file's commit")
    p.add_argument("--eval-all", action="store_true",
                   help="evaluate every task at every stage plus a zero-shot row (for FWT)")
    p.add_argument("--resume", type=Path, metavar="RUN_DIR", help="continue an interrupted run")
    p.add_argument("--keep-checkpoint", action="store_true",
                   help="keep the last checkpoint (weights, optimiser) after the run completes")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--log", choices=["none", "tensorboard", "wandb"],
                   help="per-step training metrics also to TensorBoard (<run>/tensorboard/) or W&B "
                        "(offline unless WANDB_MODE says otherwise), rank 0 only; default none")
    p.add_argument("--backend", choices=["torch", "deepspeed"],
                   help="torch: one process (default); deepspeed: ZeRO-2/3 over --nproc ranks")
    p.add_argument("--zero", type=int, choices=[2, 3], help="deepspeed: the ZeRO stage (default 2)")
    p.add_argument("--nproc", type=int, metavar="N",
                   help="deepspeed: start N ranks on this machine through DeepSpeed's launcher "
                        "(one per GPU; without it, the ranks of an outer deepspeed/torchrun launch, else 1)")


# Flags of `run` that set config fields; --resume keeps the recorded config and refuses them.
RUN_CONFIG_FLAGS = ("method", "model", "profile", "config", "seed", "benchmark", "data_dir", "order", "n_train", "n_test",
                    "output_dir", "run_id", "method_arg", "set", "eval_all", "backend", "zero", "log", "tuned")


def run_overrides(args) -> dict:
    """The config fields that `run`'s flags set, nested as in a config file."""
    from cl_bench.config import set_dotted

    raw: dict = {}
    for key in ("method", "model", "profile", "seed", "output_dir", "run_id", "backend", "log"):
        if getattr(args, key) is not None:
            raw[key] = getattr(args, key)
    data = {key: getattr(args, key) for key in ("benchmark", "data_dir", "order", "n_train", "n_test")
            if getattr(args, key) is not None}
    if data:
        raw["data"] = data
    if args.eval_all:
        raw.setdefault("eval", {})["eval_all"] = True
    if args.tuned:
        raw["tuned"] = True
    if args.zero is not None:
        raw.setdefault("deepspeed", {})["zero"] = args.zero
    if args.method_arg:
        raw["method_args"] = dict(args.method_arg)
    for key, value in args.set:
        set_dotted(raw, key, value)
    return raw


def _add_show(sub) -> None:
    p = sub.add_parser("show", help="print a run's matrix and summary from its record")
    p.add_argument("run_dir", type=Path, metavar="RUN_DIR")


def _add_compare(sub) -> None:
    p = sub.add_parser("compare", help="paired differences between runs over the same test items",
                       description="Each run against the first: the difference in every summary with its "
                                   "95% paired-bootstrap interval and p-value. Runs whose tasks, test items "
                                   "or budgets differ are refused.")
    p.add_argument("runs", type=Path, nargs="+", metavar="RUN_DIR", help="the baseline first, then the others")
    p.add_argument("--format", choices=["table", "json"], default="table")
    p.add_argument("--resamples", type=_resamples, default=1000,
                   help=f"bootstrap resamples (default 1000, at least {MIN_RESAMPLES})")
    p.add_argument("--output", type=Path, help="also write the result as JSON here")


def _add_claims(sub) -> None:
    p = sub.add_parser("claims", help="a paper's claims tested on run records: holds, does not hold, or not "
                                      "distinguishable at 95%%",
                       description="Reads a claims file (YAML; format in cl_bench/report/claims.py, e.g. "
                                   "scripts/claims/flagship.yaml) and gives each claim its measurement and "
                                   "verdict; a claim whose runs are missing or unfinished is 'not run yet'.")
    p.add_argument("file", type=Path, metavar="FILE")
    p.add_argument("--root", type=Path, default=Path("."), help="where the file's run folders start (default .)")
    p.add_argument("--update-readme", type=Path, metavar="README",
                   help="also write the table between the section's markers of README")
    p.add_argument("--section", default="claims", help="README markers (default claims)")
    p.add_argument("--output", type=Path, help="also write the verdicts as JSON here")


def _add_list(sub) -> None:
    p = sub.add_parser("list", help="list methods (or benchmarks) with one-line descriptions")
    p.add_argument("--verbose", "-v", action="store_true", help="also show each method's arguments, each "
                                                                "benchmark's tasks and orders")
    p.add_argument("--benchmarks", action="store_true", help="list the benchmarks instead of the methods")


def _add_data(sub) -> None:
    p = sub.add_parser("data", help="check a folder of your own tasks (benchmark.yaml and one folder per task)",
                       description="Lists every fault of the folder, one line each, naming the file, the item "
                                   "and the fix; exit 2 where there is any (docs/benchmarks.md).")
    p.add_argument("action", choices=["check"])
    p.add_argument("folder", type=Path, metavar="DIR")


def _add_run_filters(p) -> None:
    """--exclude / --include of the commands that read a folder of run folders (--runs)."""
    p.add_argument("--exclude", action="append", default=[], metavar="GLOB",
                   help="skip run folders matching GLOB, relative to --runs (repeatable), e.g. 'sweeps/*'")
    p.add_argument("--include", action="append", default=[], metavar="GLOB",
                   help="only run folders matching GLOB (repeatable), e.g. '*-cpu-paper6'")


def _add_leaderboard(sub) -> None:
    p = sub.add_parser("leaderboard", help="tables from run records",
                       description="Without --runs: the headline leaderboard, the folder and exclusions that "
                                   "results/headline.yaml names (the README's table; results/ whole where there "
                                   "is no such file). --runs DIR reads any folder of run folders instead.")
    p.add_argument("--runs", type=Path, default=None,
                   help="folder of run folders (default: the headline leaderboard, results/headline.yaml)")
    p.add_argument("--format", choices=["md", "csv", "latex"], default="md",
                   help="md: Markdown; csv: raw numbers; latex: a booktabs tabular (\\usepackage{booktabs}) that "
                        "pdflatex sets (±, ≠, Δ written as math)")
    p.add_argument("--view", choices=["scores", "winners", "forms", "sources", "published"], default="scores",
                   help="scores: the leaderboard (default); winners: the best row on each score with the rows "
                        "not distinguishable from it (on BWT only rows whose Gain is above 0 at 95%%), the cheapest on "
                        "each cost; forms: each row's BWT split "
                        "into answer form and content; sources: per MoE row, whether its forgetting tracks routing drift or "
                        "representation change (cl_bench/report/figures/sources.py); published: per run, TRACE's OP, "
                        "TreeLoRA's BWT and the cells as TRACE's own code scores them (cl_bench/report/published.py)")
    p.add_argument("--update-readme", type=Path, metavar="README",
                   help="also write the Markdown table between the section's markers of README")
    p.add_argument("--section", default="leaderboard",
                   help="README markers <!-- SECTION:begin --> / <!-- SECTION:end --> (default leaderboard)")
    _add_run_filters(p)


def _add_site(sub) -> None:
    p = sub.add_parser("site", help="the leaderboard and every run as a static web site (opens from disk)",
                       description="Writes OUT/index.html (the leaderboard, one table per folder of runs), a page "
                                   "per run, compare pages (each run against the baseline runs of its profile and "
                                   "precision) and a prediction browser per run and task.")
    p.add_argument("--runs", type=Path, default=Path("results"), help="folder of run folders")
    p.add_argument("--out", type=Path, default=Path("site"), help="where the site goes (default site/)")
    _add_run_filters(p)
    p.add_argument("--no-browser", action="store_true",
                   help="leave out the prediction browser (its pages copy every prompt and prediction); "
                        "run pages still link predictions.jsonl")


def _add_analyze(sub) -> None:
    what = "figures from a run record (heatmap, decisions, CKA, sharpness), written beside it"
    p = sub.add_parser("analyze", help=what, description=f"The {what}; with --against, its step time and peak "
                                                        f"memory against another run's.")
    p.add_argument("run_dir", type=Path, metavar="RUN_DIR")
    p.add_argument("--against", type=Path, metavar="OTHER_RUN",
                   help="also compare step time and peak memory with this run (cost-vs-<id>.json)")
    p.add_argument("--from-stage", type=_stage_number(1), metavar="N",
                   help="--against: compare stages N.. (numbered as `show` does, from 1, the default; 2 skips "
                        "a first task both train alike)")
    p.add_argument("--calibrate-stage", type=_stage_number(1), metavar="N",
                   help="--against: a stage both runs compute identically; ratios also divided by its "
                        "ratio, cancelling a difference in machine load")


def _add_score(sub) -> None:
    p = sub.add_parser("score", help="score predictions made elsewhere")
    p.add_argument("--task", required=True, help="task name, e.g. 20Minuten")
    p.add_argument("--benchmark", help="the task's benchmark (default trace) or a folder holding benchmark.yaml")
    p.add_argument("--predictions", type=Path, required=True,
                   help='JSONL, one {"prompt", "prediction", "answer"} per line')
    p.add_argument("--stage", type=_stage_number(0), metavar="N",
                   help="with cl-bench's predictions.jsonl: which stage, numbered as `show` numbers "
                        "its rows (1..T; 0: the zero-shot row)")


def _add_params(sub) -> None:
    p = sub.add_parser("params", help="parameter counts per stage of a method's schedule, no training")
    p.add_argument("--model", required=True, help="llama-3.2-1b | llama-3.2-3b | tiny-llama")
    p.add_argument("--method", required=True)
    p.add_argument("--tasks", type=int, required=True)
    p.add_argument("--method-arg", type=_kv, action="append", default=[], metavar="KEY=VALUE")
    grown = p.add_mutually_exclusive_group()
    grown.add_argument("--decisions", type=Path, metavar="FILE",
                       help="methods that decide Expand / Recycle (bilevel-cka): count this decision map, "
                            "JSON [task][layer][slot] of 0/1 for stages 2..T, or a run.json; default: "
                            "the upper bound, every decision Expand")
    grown.add_argument("--experts-per-layer", type=float, metavar="X",
                       help="as --decisions, from the mean experts per MoE layer after the last task "
                            "(e.g. a paper's 17.8), expansions spread evenly over tasks and layers")
    p.add_argument("--json", action="store_true")


def _add_campaign(sub) -> None:
    p = sub.add_parser("campaign", help="the runs of a plan file, each pinned to its commit, here or on Slurm",
                       description="Skips complete runs, resumes interrupted ones, starts the rest; prints each "
                                   "run's state (done, running, left) and estimated hours, then the total left. "
                                   "Plan lines: '<output dir>/<run id>: <cl-bench run flags>'.")
    p.add_argument("plan", type=Path, metavar="PLAN")
    p.add_argument("--status", action="store_true", help="show each run's state and hours; start nothing")
    p.add_argument("--dry-run", action="store_true",
                   help="as --status, and check that every run could start (precision, commit); start nothing")
    p.add_argument("--launcher", choices=["local", "slurm"], default="local",
                   help="local: --slots runs at a time on this machine (default); slurm: one job a run "
                        "through submitit, settings from --slurm")
    p.add_argument("--slots", type=int, default=2, help="local: runs at a time (default 2)")
    p.add_argument("--threads", type=int, default=1, help="local: OMP threads a run (default 1)")
    p.add_argument("--hours", type=float, metavar="H",
                   help="local: start a run only while its estimated hours fit in what is left of H hours "
                        "from now (a session, an allocation); the rest wait for the next campaign, and a "
                        "run without an estimate is not started")
    p.add_argument("--slurm", type=Path, metavar="YAML",
                   help="Slurm settings: partition, time_min, signal_delay_s, cpus_per_task, gpus_per_node, "
                        "mem_gb, max_requeues, executor (slurm|local|debug), additional")
    p.add_argument("--wait", action="store_true", help="slurm: wait for the jobs and report how each ended")
    p.add_argument("--allow-fp32", action="store_true",
                   help="on a CPU without native bf16, run auto-precision lines (they compute in fp32)")
    p.add_argument("--code", type=Path, help="run this checkout (its packages linked) instead of clones")
    p.add_argument("--records", type=Path, default=Path("results"),
                   help="committed run records the estimates learn from, relative to the root (default results)")
    p.add_argument("--root", type=Path, help="the repository the plan's paths start from (default: the git "
                                             "checkout holding the working directory)")


TUNE_ACTIONS = ("plan", "choose", "finals", "sensitivity", "leaderboard", "verdict")


def _add_tune(sub) -> None:
    p = sub.add_parser("tune", help="the tuning protocol: plan the tuning runs (eval split), apply the rule, "
                                    "plan the finals, the sensitivity view and the tuned leaderboard",
                       description="Every ranked method tuned by a rule written before the runs, on the eval "
                                   "split (docs/tuning.md). GRID is the grid file, configs/tuning/<profile>.yaml "
                                   "(another benchmark's: configs/tuning/<benchmark>/<profile>.yaml).")
    p.add_argument("action", choices=TUNE_ACTIONS)
    p.add_argument("grid", type=Path, metavar="GRID")
    p.add_argument("--records", type=Path, default=Path("results"),
                   help="the run records (relative to the working directory, the repository root; default results)")
    p.add_argument("--out", type=Path,
                   help="plan, finals: the plan file (default: print it); choose: the tuned file (default "
                        "the grid's benchmark's, configs/tuned/[<benchmark>/]<profile>.yaml); sensitivity: a "
                        "folder for sensitivity.md, .png, .json")
    p.add_argument("--view", choices=["tuned", "shared"], default="tuned",
                   help="leaderboard: the tuned rows (default) or each method at the arguments it has without any")
    p.add_argument("--exclude", action="append", default=[], metavar="GLOB",
                   help="finals, leaderboard, verdict: skip run folders matching GLOB, relative to --records, "
                        "beside the grid's finals.exclude (repeatable)")
    p.add_argument("--top", type=int, default=5, help="verdict: how many top rows' order to compare (default 5)")
    p.add_argument("--update-readme", type=Path, metavar="FILE",
                   help="leaderboard, sensitivity: also write the table between the section's markers of FILE")
    p.add_argument("--section", help="--update-readme's markers (default: tuned-leaderboard or shared-leaderboard "
                                     "by --view, sensitivity)")


def _add_perf(sub) -> None:
    p = sub.add_parser("perf", help="measure generation speed-up, harness overhead, MoE dispatch, "
                                    "the loss upcycling adds before training, deepspeed's per-step cost, fp32 against bf16, "
                                    "or a method's step against another's and the passes it needs")
    p.add_argument("what", choices=["generation", "harness", "moe", "upcycle-gap", "deepspeed", "precision", "step",
                                  "zero-shot", "eval-profile", "eval-speed", "train-step",
                                  "gen-throughput", "loss-path", "step-options"])
    p.add_argument("--method", help="harness, deepspeed, step: the method whose stage is timed (default: the baseline)")
    p.add_argument("--against", metavar="METHOD", help="step, zero-shot (required): the method it is timed against")
    p.add_argument("--methods", help="loss-path, step-options: the methods timed, comma-separated (default: the baseline)")
    p.add_argument("--before", action="store_true",
                   help="loss-path: the old side is the whole step before issue 53 (also AdamW's per-parameter loop)")
    p.add_argument("--method-arg", action="append", metavar="K=V",
                   help="step, deepspeed: an argument of --method (repeatable)")
    p.add_argument("--ranks", default="1", metavar="N[,N...]",
                   help="deepspeed: the rank counts to measure, e.g. 1,2 (default 1); N > 1 is started as "
                        "`cl-bench run --nproc N` starts its ranks")
    p.add_argument("--zero", type=int, choices=[2, 3], help="deepspeed: the ZeRO stage (default 2)")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--task", help="task(s) or order; default NumGLUE-ds (upcycle-gap: paper6; step, deepspeed: Py150,NumGLUE-ds)")
    p.add_argument("--n", "--items", type=int, default=32,
                   help="prompts (generation) or examples a task (harness, deepspeed)")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--benchmark", help="whose tasks --task names: trace (default) | long-sequence | a folder holding "
                                        "benchmark.yaml; another than trace needs --task")
    p.add_argument("--data-dir", help="the benchmark's data folder (default: its own, TRACE's $CL_BENCH_DATA)")
    p.add_argument("--precision", choices=["auto", "fp32", "bf16"],
                   help="eval-profile, eval-speed: the eval precision (default: the cpu profile's); "
                        "deepspeed: the training precision of both backends (default fp32); step-options: the "
                        "training precision (default: the cpu profile's)")
    p.add_argument("--baseline", choices=["plain", "growing-cache"], default="plain",
                   help="eval-speed: the decoder's baseline: the plain loop it replaced, or itself with "
                        "transformers' growing KV cache")
    p.add_argument("--output", type=Path, help="also write the result as JSON here")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cl-bench", description=DESCRIPTION)
    parser.add_argument("--debug", action="store_true", help="show tracebacks and debug logs")
    # `deepspeed script.py ARGS` passes --local_rank=N before ARGS; the rank comes from the environment
    parser.add_argument("--local_rank", "--local-rank", type=int, help=argparse.SUPPRESS)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_run(sub)
    _add_show(sub)
    _add_compare(sub)
    _add_claims(sub)
    _add_list(sub)
    _add_data(sub)
    _add_leaderboard(sub)
    _add_site(sub)
    _add_analyze(sub)
    _add_score(sub)
    _add_params(sub)
    _add_campaign(sub)
    _add_tune(sub)
    _add_perf(sub)
    return parser
