"""Run a campaign: the runs of a plan file, a few at a time, from a frozen copy of
the code, so that a campaign spread over several sessions ends with the records
one sitting would have written (not in CI; the runs take hours).

- A finished run (its run.json says complete) is skipped; one that was
  interrupted, failed or is still listed as running is continued with
  `cl-bench run --resume` (which loses at most the stage in progress); the
  others are started.
- The code is a clone of the repository, made once per commit under
  `.campaign/code-<commit>` and put first on PYTHONPATH: editing the tree while
  a campaign runs changes nothing it imports. A new run takes HEAD (a tree with
  uncommitted changes is refused: the clone would not hold them); a resumed run
  takes the commit it started from (its record's git_commit), so that no run
  mixes two versions of the code.
- Precision: a run whose train or eval precision is `auto` or `bf16` is refused on
  a CPU without native bf16 (AVX-512 BF16 or AMX): there `auto` computes in fp32,
  whose scores cannot be pooled with the committed bf16 records, and `bf16` is
  emulated. `--allow-fp32` runs such plans anyway (an all-fp32 campaign).

Plan file: one run a line, `<output dir>/<run id>: <cl-bench run flags>` (without
--output-dir, --run-id or --no-progress, which the line gives); `#` starts a
comment; the order is the order of starting. Logs: `.campaign/logs/<run id>.log`.

    python scripts/campaign.py scripts/campaigns/issue15.txt --dry-run
    python scripts/campaign.py scripts/campaigns/issue15.txt --slots 2 --threads 1
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
POLL_S = 2.0


class CampaignError(Exception):
    """One line for the user (exit 2)."""


@dataclass
class Entry:
    run_dir: Path  # relative to the repository root, as written in the plan
    flags: list[str]
    line: int

    @property
    def run_id(self) -> str:
        return self.run_dir.name


def read_plan(path: Path) -> list[Entry]:
    """The plan's entries; a malformed line is one message naming the file, the line and the fix."""
    entries, seen = [], set()
    for n, raw in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        text = raw.split("#", 1)[0].strip()
        if not text:
            continue
        target, sep, flags = text.partition(":")
        target = target.strip()
        if not sep or "/" not in target or not flags.strip():
            raise CampaignError(f"{path}:{n}: write '<output dir>/<run id>: <cl-bench run flags>', "
                                f"got {raw.strip()!r}")
        given = [f for f in ("--output-dir", "--run-id", "--no-progress", "--resume") if f in flags.split()]
        if given:
            raise CampaignError(f"{path}:{n}: drop {', '.join(given)}: the line's '{target}:' gives the folder")
        if target in seen:
            raise CampaignError(f"{path}:{n}: {target} is planned twice; give each run its own id")
        seen.add(target)
        entries.append(Entry(Path(target), shlex.split(flags), n))
    return entries


def status(entry: Entry) -> str | None:
    """The recorded status of the entry's run (None: not started)."""
    record = ROOT / entry.run_dir / "run.json"
    if not record.is_file():
        return None
    try:
        return json.loads(record.read_text(encoding="utf-8")).get("status") or "unknown"
    except json.JSONDecodeError:
        return "unreadable"


def action(entry: Entry) -> str:
    """done | resume | start."""
    state = status(entry)
    if state == "complete":
        return "done"
    return "start" if state is None and not (ROOT / entry.run_dir).exists() else "resume"


def precisions(entry: Entry, todo: str) -> tuple[str, str]:
    """The (train, eval) precision the entry asks for (`auto`, `fp32` or `bf16`); a
    new run's flags, method and method arguments checked as `cl-bench run` would
    (a UserError)."""
    if todo == "resume" and status(entry) is not None:
        config = json.loads((ROOT / entry.run_dir / "run.json").read_text(encoding="utf-8"))["config"]
        return config["train"]["precision"], config["eval"]["precision"]
    from cl_bench import config as cfg
    from cl_bench import registry
    from cl_bench.cli_parser import build_parser, run_overrides

    args = build_parser().parse_args(["run", *entry.flags])
    config = cfg.resolve("cpu", args.config, run_overrides(args))
    method = registry.get(config.method)
    method.parse_args(method.args_for(config))
    return config.train.precision, config.eval.precision


def _git(*argv: str) -> str:
    return subprocess.run(["git", "-C", str(ROOT), *argv], check=True, capture_output=True, text=True).stdout.strip()


def commit_of(entry: Entry, todo: str) -> str:
    """The commit whose code the entry runs: a new run HEAD's (refused while the tree
    has changes, which a clone would not hold), a resumed one the commit it started
    from, so that no run mixes two versions of the code (HEAD's where the record
    names none, or a changed tree)."""
    if todo == "resume" and status(entry) is not None:
        started = json.loads((ROOT / entry.run_dir / "run.json").read_text(encoding="utf-8")).get("git_commit")
        if started and "+" not in started:
            try:
                return _git("rev-parse", "--verify", "--quiet", f"{started}^{{commit}}")
            except subprocess.CalledProcessError:
                pass
    if _git("status", "--porcelain", "--untracked-files=no"):
        raise CampaignError(f"{ROOT}: the tree has uncommitted changes; commit them (new runs run a clone of HEAD)")
    return _git("rev-parse", "HEAD")


def checkout(commit: str) -> Path:
    """A clone of the repository at `commit`, made once under .campaign/."""
    code = ROOT / ".campaign" / f"code-{commit[:12]}"
    if not code.is_dir():
        subprocess.run(["git", "clone", "--quiet", "--no-checkout", str(ROOT), str(code)], check=True)
        subprocess.run(["git", "-C", str(code), "checkout", "--quiet", commit], check=True)
    return code


def command(entry: Entry, todo: str) -> list[str]:
    cli = [sys.executable, "-m", "cl_bench.cli", "run"]
    if todo == "resume":
        return [*cli, "--resume", str(entry.run_dir), "--no-progress"]
    return [*cli, *entry.flags, "--output-dir", str(entry.run_dir.parent), "--run-id", entry.run_id,
            "--no-progress"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("plan", type=Path)
    p.add_argument("--slots", type=int, default=2, help="runs at a time (default 2)")
    p.add_argument("--threads", type=int, default=1, help="OMP threads a run (default 1)")
    p.add_argument("--allow-fp32", action="store_true",
                   help="run auto-precision runs on a CPU without native bf16 (they compute in fp32)")
    p.add_argument("--dry-run", action="store_true", help="say what each run would do; start nothing")
    p.add_argument("--code", type=Path, help="run this checkout as it is instead of a clone of HEAD")
    args = p.parse_args(argv)
    if not args.plan.is_file():
        print(f"{args.plan}: no such plan file", file=sys.stderr)
        return 2
    try:
        entries = read_plan(args.plan)
    except CampaignError as e:
        print(e, file=sys.stderr)
        return 2

    import torch

    from cl_bench.errors import UserError
    from cl_bench.precision import native_bf16

    native = native_bf16(torch.device("cpu"))
    todo = [(e, action(e)) for e in entries]
    refused, code = [], {}
    try:
        for entry, what in todo:
            asked = precisions(entry, what) if what != "done" else ()
            if not native and not args.allow_fp32 and set(asked) & {"auto", "bf16"}:
                refused.append(str(entry.line))
            if what != "done":
                code[entry.run_dir] = args.code.resolve() if args.code else commit_of(entry, what)
            where = code.get(entry.run_dir)
            label = where[:12] if isinstance(where, str) else str(where)
            print(f"{what:6s} {entry.run_dir}" + (f"  (precision {'/'.join(asked)}, code {label})" if asked else ""),
                  flush=True)
    except (UserError, CampaignError) as e:
        print(f"{args.plan}:{entry.line}: {e}", file=sys.stderr)
        return 2
    if refused:
        print(f"{args.plan}: lines {', '.join(refused)} ask for precision auto or bf16, but this CPU has no "
              f"native bf16 (AVX-512 BF16 or AMX): auto would compute in fp32, not poolable with the committed "
              f"bf16 records, and bf16 is emulated; run the campaign on such a CPU, or pass --allow-fp32",
              file=sys.stderr)
        return 2
    if args.dry_run:
        return 0

    logs = ROOT / ".campaign" / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    envs = {}
    for run_dir, where in code.items():
        path = where if args.code else checkout(where)
        envs[run_dir] = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads),
                         "PYTHONPATH": os.pathsep.join(filter(None, [str(path), os.environ.get("PYTHONPATH")]))}
    queue = [(e, w) for e, w in todo if w != "done"]
    running: dict[subprocess.Popen, tuple[Entry, float]] = {}
    failed = 0
    try:
        while queue or running:
            while queue and len(running) < args.slots:
                entry, what = queue.pop(0)
                with open(logs / f"{entry.run_id}.log", "a", encoding="utf-8") as log:
                    # its own session: a Ctrl-C reaches the campaign, which passes one SIGINT on
                    proc = subprocess.Popen(command(entry, what), cwd=ROOT, env=envs[entry.run_dir], stdout=log,
                                            stderr=subprocess.STDOUT, start_new_session=True)
                running[proc] = (entry, time.monotonic())
                print(f"{time.strftime('%H:%M:%S')} {what} {entry.run_dir} (log {logs / entry.run_id}.log)",
                      flush=True)
            time.sleep(POLL_S)
            for proc in [q for q in running if q.poll() is not None]:
                entry, start = running.pop(proc)
                failed += proc.returncode != 0
                print(f"{time.strftime('%H:%M:%S')} {'finished' if proc.returncode == 0 else 'FAILED'} "
                      f"{entry.run_dir}: rc {proc.returncode}, {(time.monotonic() - start) / 60:.1f} min",
                      flush=True)
    except KeyboardInterrupt:
        for proc in running:  # each run saves its finished stages and stops; --resume continues it
            proc.send_signal(signal.SIGINT)
        for proc in running:
            proc.wait()
        print("interrupted: run the same command again to continue", file=sys.stderr)
        return 130
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
