"""Soak check of interrupt and resume (not in CI; a few minutes a run on 2 cores).

Starts smoke runs (tiny-llama on the TRACE data, methods and seeds in turn) until
`--runs` of them were stopped by SIGINT or SIGKILL at a random moment of their run
(one that finishes before its signal is reported and not counted), resumes
it with `cl-bench run --resume`, and compares the result with an uninterrupted
twin of the same configuration: predictions.jsonl and metrics.jsonl byte for
byte, and the record's results (matrix, zero-shot row, summary, intervals, task
metrics, parameter rows). Writes a JSON report (its command line inside) and
prints how many runs resumed to identical results and which folders could not be
resumed. The goal is all of them.

    python scripts/soak_interrupts.py --runs 50 --report results/soak/interrupts.json
    python scripts/soak_interrupts.py --runs 20 --in-stages --report results/soak/interrupts-in-stages.json
    python scripts/soak_interrupts.py --runs 20 --in-zero-shot --report results/soak/interrupts-zero-shot.json
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

RESULT_KEYS = ("matrix", "zero_shot", "summary", "intervals", "task_metrics", "params", "status")
SAME_FILES = ("predictions.jsonl", "metrics.jsonl")
SIGNALS = {"SIGINT": signal.SIGINT, "SIGKILL": signal.SIGKILL}


def cl_bench(*argv: str) -> list[str]:
    return [sys.executable, "-m", "cl_bench.cli", *argv]


# --in-zero-shot: every run scores the zero-shot row, on 32 test items a task (a row long enough to land in)
ZERO_SHOT_ARGS = ("--set", "eval.zero_shot=true", "--set", "data.n_test=32")


def run_args(method: str, seed: int, out: Path, run_id: str, epochs: int, extra=()) -> list[str]:
    return ["run", "--profile", "smoke", "--method", method, "--seed", str(seed), "--output-dir", str(out),
            "--run-id", run_id, "--no-progress", "--set", f"train.epochs={epochs}", *extra]


def _stopped_in(run_dir: Path) -> str:
    """Where the stop left the run: no record, the zero-shot row (scores kept of all),
    or stages done."""
    if not (run_dir / "run.json").exists():
        return "no record"
    record = json.loads((run_dir / "run.json").read_text())
    zero = record.get("zero_shot")
    if zero is not None and None in zero or zero is None and record.get("stages_done") == 0:
        return f"zero-shot row, {sum(v is not None for v in zero or [])} of {len(record['tasks'])} kept"
    return f"{record.get('stages_done')} stages done"


def _wait_for_record(proc: subprocess.Popen, run_dir: Path) -> float:
    """When run.json first appeared in `run_dir` (or the process ended), monotonic."""
    while not (run_dir / "run.json").exists() and proc.poll() is None:
        time.sleep(0.02)
    return time.monotonic()


def same_results(a: Path, b: Path) -> list[str]:
    """What differs between two finished run folders (empty: identical results)."""
    diffs = [name for name in SAME_FILES if (a / name).read_bytes() != (b / name).read_bytes()]
    ra, rb = (json.loads((d / "run.json").read_text()) for d in (a, b))
    return diffs + [f"run.json:{key}" for key in RESULT_KEYS if ra.get(key) != rb.get(key)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=50)
    p.add_argument("--methods", default="seqft,lora,replay,upcycle,ewc")
    p.add_argument("--seeds", default="1,2")
    p.add_argument("--epochs", type=int, default=12, help="epochs a task (longer stages: more places to land)")
    p.add_argument("--out", type=Path, default=Path("soak-runs"), help="a new or empty folder for this soak's runs")
    p.add_argument("--seed", type=int, default=0, help="draws of the signals and their moments")
    p.add_argument("--report", type=Path, default=None)
    moments = p.add_mutually_exclusive_group()
    moments.add_argument("--in-stages", action="store_true",
                         help="draw each moment after the run's record appears (its stages), not over the whole "
                              "process, whose start-up dominates a smoke run")
    moments.add_argument("--in-zero-shot", action="store_true",
                         help="runs with a zero-shot row (eval.zero_shot, 32 test items a task); draw each moment "
                              "inside it: from the record's first write over the twin's zero_shot_s")
    args = p.parse_args(argv)
    if args.out.exists() and any(args.out.iterdir()):
        print(f"soak_interrupts: --out {args.out} already holds an earlier soak's runs (their ids would collide); "
              "give a new --out or remove that folder", file=sys.stderr)
        return 2
    extra = ZERO_SHOT_ARGS if args.in_zero_shot else ()
    rng = random.Random(args.seed)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    configs = [(m, int(s)) for s in args.seeds.split(",") for m in args.methods.split(",")]

    twins: dict[tuple[str, int], tuple[Path, float, float, float]] = {}
    for method, seed in configs:
        run_dir = args.out / "twins" / f"{method}-{seed}"
        t0 = time.monotonic()
        proc = subprocess.Popen(cl_bench(*run_args(method, seed, args.out / "twins", f"{method}-{seed}",
                                                   args.epochs, extra)), env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        record_at = _wait_for_record(proc, run_dir) - t0
        if proc.wait() != 0:
            raise SystemExit(f"twin {method} seed {seed} failed")
        zero_s = json.loads((run_dir / "run.json").read_text())["timing"].get("zero_shot_s") or 0.0
        twins[(method, seed)] = (run_dir, time.monotonic() - t0, record_at, zero_s)
        print(f"twin {method} seed {seed}: {twins[(method, seed)][1]:.1f}s (record after {record_at:.1f}s)",
              flush=True)

    rows, i = [], 0
    while sum(r["landed"] for r in rows) < args.runs and i < 3 * args.runs:  # a run may finish first
        method, seed = configs[i % len(configs)]
        twin, seconds, record_at, zero_s = twins[(method, seed)]
        run_id, sig_name = f"run-{i:02d}", rng.choice(sorted(SIGNALS))
        run_dir = args.out / "soak" / run_id
        proc = subprocess.Popen(cl_bench(*run_args(method, seed, args.out / "soak", run_id, args.epochs, extra)),
                                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if args.in_stages:  # the moment drawn from the run's own stages, after its record appeared
            start = _wait_for_record(proc, run_dir)
            at = rng.uniform(0.0, max(seconds - record_at, 0.1))
        elif args.in_zero_shot:  # inside the zero-shot row, which starts right after the record's first write
            start = _wait_for_record(proc, run_dir)
            at = rng.uniform(0.0, max(zero_s, 0.1))
        else:  # from the whole process, start-up and loading included
            start, at = time.monotonic(), rng.uniform(0.5, seconds)
        try:
            proc.wait(timeout=max(start + at - time.monotonic(), 0.0))
            landed = False  # it finished first
        except subprocess.TimeoutExpired:
            proc.send_signal(SIGNALS[sig_name])
            proc.wait()
            landed = True
        run_dir = args.out / "soak" / run_id
        before = json.loads((run_dir / "run.json").read_text()).get("status") if (run_dir / "run.json").exists() \
            else None
        stopped_in = _stopped_in(run_dir)
        # no record yet (stopped while loading): the same command starts it again in its folder
        again = ("run", "--resume", str(run_dir), "--no-progress") if before is not None else \
            run_args(method, seed, args.out / "soak", run_id, args.epochs, extra)
        resumed = subprocess.run(cl_bench(*again), env=env, capture_output=True, text=True)
        if resumed.returncode != 0 and before == "complete":
            resumed_ok, why = True, "finished before the signal"
        else:
            resumed_ok, why = resumed.returncode == 0, (resumed.stderr.strip().splitlines() or [""])[-1]
        diffs = same_results(twin, run_dir) if resumed_ok else ["not resumed"]
        rows.append({"run": run_id, "method": method, "seed": seed, "signal": sig_name, "at_s": round(at, 2),
                     "landed": landed, "status_before": before, "stopped_in": stopped_in,
                     "restarted": before is None,
                     "resume_exit": resumed.returncode,
                     "resumable": resumed_ok, "identical": not diffs, "differs": diffs,
                     "note": why if not resumed_ok or resumed.returncode else ""})
        print(f"{run_id} {method:8s} seed {seed} {sig_name:7s} at {at:5.1f}s"
              f"{'' if landed else ' (finished first)'}, status {before} ({stopped_in}): "
              f"{'identical' if not diffs else 'DIFFERS ' + ', '.join(diffs)}", flush=True)
        i += 1

    landed = [r for r in rows if r["landed"]]
    identical = sum(r["identical"] for r in landed)
    unresumable = [r["run"] for r in rows if not r["resumable"]]
    report = {"command": shlex.join(["python", "scripts/soak_interrupts.py", *(argv or sys.argv[1:])]),
              "moments": "after the record appeared (the stages)" if args.in_stages else
                         "inside the zero-shot row (from the record's first write)" if args.in_zero_shot else
                         "the whole process",
              "status_before": {str(k): sum(r["status_before"] == k for r in landed)
                                for k in sorted({r["status_before"] for r in landed}, key=str)},
              "runs": len(landed), "identical": identical, "unresumable": unresumable,
              "finished_before_the_signal": len(rows) - len(landed),
              "stopped_in": {k: sum(r["stopped_in"] == k for r in landed)
                             for k in sorted({r["stopped_in"] for r in landed})},
              "restarted_before_a_record": sum(r["restarted"] for r in landed),
              "by_signal": {s: sum(r["signal"] == s and r["landed"] for r in rows) for s in SIGNALS},
              "rows": rows}
    print(f"{identical}/{len(landed)} interrupted runs resumed to results identical to their twins "
          f"({len(rows) - len(landed)} more finished before their signal); "
          f"unresumable folders: {', '.join(unresumable) or 'none'}")
    if args.report:
        args.report.parent.mkdir(parents=True, exist_ok=True)
        args.report.write_text(json.dumps(report, indent=1) + "\n")
    return 0 if identical == len(landed) and not unresumable else 1


if __name__ == "__main__":
    sys.exit(main())
