"""`cl-bench campaign PLAN`: the runs of a plan file, each pinned to its commit, on
this machine or on a Slurm cluster, with what is done, running and left and its
estimated hours.

- A complete run is skipped; one with a record that is not complete (interrupted,
  failed, or running when its machine went away) is continued with `cl-bench run
  --resume` (which loses at most the last checkpoint interval), unless its folder
  lacks the checkpoint of its finished stages (copied without the git-ignored
  checkpoint folders: run.resume.stranded), which is shown `stuck`, left out of the
  total and not launched, since `run --resume` refuses it (the campaign then exits
  1 once the others end); one whose folder's
  lock is held, or whose Slurm job is still queued or running, is left alone (a
  local one holds one of --slots while it runs); the others are started. A run is
  claimed (launch._claim) and looked at again as it is launched: one that another
  campaign over the clone has claimed, started or finished since is skipped (so a
  second campaign adds slots).
- Each run imports a clone of its commit (cl_bench/tools/campaign/code.py): HEAD for a new
  run, the commit it started from for a resumed one.
- Precision: on a CPU without native bf16 (AVX-512 BF16 or AMX), a run whose train or
  eval precision is `auto` is refused (there it computes in fp32, whose scores cannot
  be pooled with the committed bf16 records; `--allow-fp32` runs it so), and one asking
  for `bf16` is refused (emulated, far slower than fp32).
- `--hours H` (local): a run is started only while its estimated hours, with 15% to
  spare, fit in what is left of H hours from the campaign's start, the plan's later runs tried when an
  earlier one does not fit; the rest wait for the next campaign (a session's or an
  allocation's window, so no run starts that the window's end would cut).
- A tuning plan (a line `#! tuning: eval split only`; cl_bench/tools/tuning/plan.py writes
  them) is refused whole when one of its lines would score the test split.
- `--dry-run` and `--status` print each run's state and hours (cl_bench/tools/campaign/
  estimate.py: from the committed records' per-step and per-token timings of the same
  method and step shape, scaled to this machine by the ratio of a short matrix-product
  calibration here, at one thread, to the one in each record; `~` marks an estimate scaled
  between shapes or methods, or from records that name no machine, used unscaled), a
  line saying the scale (this machine's rates; how many records were scaled, by how
  much, and how many not), and the total left.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

from cl_bench.tools.campaign import code as pinning
from cl_bench.tools.campaign import estimate
from cl_bench.tools.campaign import launch
from cl_bench.tools.campaign.plan import (Entry, action, drift, is_tuning_plan, launch_drift, planned, read_plan,
                                          recorded, refuse_test_split)
from cl_bench.record.io import is_running
from cl_bench.run.resume import stranded
from cl_bench.errors import UserError


def _hours(entry: Entry, record: dict | None, config, method_args,
           timings: estimate.Timings) -> tuple[float | None, str, bool]:
    """Hours left for the run at one thread, where the figure comes from, and whether
    it is marked `~` (Rates.rough)."""
    if record is not None and record.get("status") == "complete":
        return (record.get("timing") or {}).get("total_s", 0.0) / 3600, "took", False
    try:
        work = estimate.planned_work(config, method_args)
    except UserError as e:
        return None, f"no estimate: {e}", False
    rates = timings.rates(config.method, work.at)
    if rates is None:
        return None, f"no estimate: no complete record at this step shape ({work.at[0]}, {work.at[1]}, {work.at[-1]})", False
    done = record.get("stages_done", 0) if record else 0
    zero_done = bool(record and record.get("zero_shot") is not None)
    return work.seconds(rates, done, zero_done) / 3600, rates.source, rates.rough


def survey(plan: Path, entries: list[Entry], root: Path, args, native: bool):
    """Per entry: its state and what to launch; prints the table; returns (to launch,
    lines refused for their precision, folders running elsewhere, hours left per run
    folder as the plan names it)."""
    timings = estimate.Timings(root / args.records, root)
    queued = launch.queued(root)
    todo, refused, elsewhere, left_h, unknown, n_left, n_stuck = [], [], [], 0.0, 0, 0, 0
    estimates: dict[Path, float | None] = {}
    if not native:  # its one warning (precision._warn_once) before the table, not inside it
        from cl_bench.run.precision import resolve

        resolve("auto", torch.device("cpu"))
    print(f"{'state':8s} {'hours':>7s}  run  (precision, code; estimate from)", flush=True)
    for entry in entries:
        try:
            record = recorded(entry, root)
            what = action(record)
            config = method_args = None
            if what != "done":
                config, method_args = planned(entry)
                if record is not None:
                    changed = drift(record, config, method_args)
                    if changed:
                        print(f"{plan}:{entry.line}: {entry.run_dir} is resumed as recorded, though the line now "
                              f"asks for {'; '.join(changed)}", file=sys.stderr)
                    moved = launch_drift(record, entry)
                    if moved:
                        print(f"{plan}:{entry.line}: {entry.run_dir}: {moved}", file=sys.stderr)
            hours, source, rough = _hours(entry, record, config, method_args, timings)
            if what == "done":
                print(f"{'done':8s} {hours:7.2f}  {entry.run_dir}  (took)", flush=True)
                continue
            asked = ((record["config"]["train"]["precision"], record["config"]["eval"]["precision"]) if record
                     else (config.train.precision, config.eval.precision))
            busy = is_running(entry.folder(root)) or str(entry.run_dir) in queued
            why = None if busy or record is None else stranded(entry.folder(root), record.get("stages_done", 0))
            if why:
                print(f"{plan}:{entry.line}: {why}", file=sys.stderr, flush=True)
            if args.code:
                code = args.code.resolve()
            elif why:  # not launched: its commit does not matter
                code = "–"
            elif args.status and record is None:  # only a label: a dirty tree is no reason to stop
                code = pinning.git(root, "rev-parse", "HEAD")
            else:
                code = pinning.commit_of(entry, record, root)
        except UserError as e:
            raise UserError(f"{plan}:{entry.line}: {e}") from None
        state = "running" if busy else "stuck" if why else "left"
        label = code[:12] if isinstance(code, str) else str(code)
        shown = "      ?" if hours is None else f"{'~' if rough else ' '}{hours:6.2f}"
        how = "not launched: its stage checkpoint is missing (above)" if why else what
        print(f"{state:8s} {shown}  {entry.run_dir}  ({how}, precision {'/'.join(asked)}, code {label}; "
              f"{source})", flush=True)
        if why:  # apart from the total: nothing runs it until someone acts
            n_stuck += 1
            continue
        estimates[entry.run_dir] = hours
        if not native and ("bf16" in asked or ("auto" in asked and not args.allow_fp32)):
            refused.append(str(entry.line))
        n_left += 1
        if hours is None:
            unknown += 1
        else:
            left_h += hours
        if not busy:
            todo.append((entry, what, code))
        elif is_running(entry.folder(root)):
            elsewhere.append(entry.folder(root))
    slots = args.slots
    print(timings.scale_line(), flush=True)
    print(f"total left: {n_left} runs, {left_h:.1f} h at one thread a run ({left_h / slots:.1f} h on {slots} "
          f"slot{'s' if slots != 1 else ''}){f'; {unknown} without an estimate' if unknown else ''}"
          f"{f'; and {n_stuck} stuck, not launched' if n_stuck else ''}", flush=True)
    return todo, refused, elsewhere, estimates, n_stuck


def main(args) -> int:
    start = launch.clock()  # --hours counts from here
    root = (args.root or pinning.repository_root(Path.cwd())).resolve()
    if not args.plan.is_file():
        raise UserError(f"{args.plan}: no such plan file")
    if args.slots < 1 or args.threads < 1:
        raise UserError("--slots and --threads must be at least 1")
    if args.hours is not None and not args.hours > 0:
        raise UserError(f"--hours {args.hours:g} must be a number of hours > 0, e.g. --hours 2.5")
    if args.hours is not None and args.launcher == "slurm":
        raise UserError("--hours is for the local launcher; on Slurm each job has its own limit (time_min)")
    from cl_bench.run.precision import native_bf16

    entries = read_plan(args.plan)
    if is_tuning_plan(args.plan):
        refuse_test_split(args.plan, entries)
    settings = launch.SlurmSettings.load(args.slurm) if args.launcher == "slurm" and args.slurm else None
    if args.launcher == "slurm" and settings is None:
        raise UserError("--launcher slurm needs --slurm FILE: the Slurm settings (partition, time_min, "
                        "cpus_per_task, gpus_per_node; see `cl-bench campaign --help`)")
    todo, refused, elsewhere, estimates, stuck = survey(args.plan, entries, root, args,
                                                        native_bf16(torch.device("cpu")))
    if args.status:
        return 0
    if refused:
        raise UserError(f"{args.plan}: lines {', '.join(refused)} ask for precision auto or bf16, but this CPU has "
                        f"no native bf16 (AVX-512 BF16 or AMX): auto would compute in fp32, not poolable with the "
                        f"committed bf16 records (--allow-fp32 runs it so), and bf16 is emulated; run the campaign "
                        f"on such a CPU")
    if args.dry_run or not todo:
        return 1 if stuck and not args.dry_run else 0
    if args.code:
        pinning.link_packages(args.code.resolve())
    paths = {c: c if args.code else pinning.checkout(root, c) for _, _, c in todo}
    todo = [(entry, what, paths[c]) for entry, what, c in todo]
    if settings is not None:
        ended = launch.run_slurm(todo, root, settings, args.wait, root / args.records)
    else:
        budget = None if args.hours is None else launch.Budget(args.hours, estimates, start)
        ended = launch.run_local(todo, root, args.slots, args.threads, elsewhere, budget,
                                 root / args.records)
    return max(ended, 1 if stuck else 0)  # a stuck run needs a hand
