"""Run a campaign: the runs of a plan file, a few at a time, from a frozen copy of
the code, so that a campaign spread over several sessions ends with the records
one sitting would have written (not in CI; the runs take hours).

- A finished run (its run.json says complete) is skipped; one with a record that
  is not complete (interrupted, failed, or listed as running when its machine
  went away) is continued with `cl-bench run --resume` (which loses at most the
  stage in progress); the others are started.
- The code is a clone of the repository, made once per commit under
  `.campaign/code-<commit>`, run with `python -P` first on PYTHONPATH (the
  package folders pyproject.toml maps elsewhere, methods/ and benchmarks/, are
  linked into its cl_bench/), so editing the tree while a campaign runs changes
  nothing it imports, and the record's git_commit is the clone's. A new run
  takes HEAD (a tree with uncommitted changes is refused: the clone would not
  hold them); a resumed run takes the commit it started from, so that no run
  mixes two versions of the code (one started elsewhere, from a changed tree or
  an unknown commit, is refused: resume it by hand).
- A line whose run already has a record runs as recorded: where the line now
  asks for another method, profile, seed or method argument, the campaign says so.
- Precision: on a CPU without native bf16 (AVX-512 BF16 or AMX), a run whose
  train or eval precision is `auto` is refused (there it computes in fp32, whose
  scores cannot be pooled with the committed bf16 records; `--allow-fp32` runs
  it so), and one asking for `bf16` is refused (emulated, far slower than fp32).

Plan file: one run a line, `<output dir>/<run id>: <cl-bench run flags>` (without
--output-dir, --run-id or --no-progress, which the line gives), the flags split
as a shell splits them; `#` starts a comment; the order is the order of
starting. Logs: `.campaign/logs/<run id>.log`.

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
GIVEN_BY_LINE = ("--output-dir", "--run-id", "--no-progress", "--resume")


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

    @property
    def record(self) -> Path:
        return ROOT / self.run_dir / "run.json"


def read_plan(path: Path) -> list[Entry]:
    """The plan's entries; a malformed line is one message naming the file, the line and the fix."""
    entries, seen = [], set()
    for n, raw in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        text = raw.strip()
        if not text or text.startswith("#"):
            continue
        target, sep, rest = text.partition(":")
        target = target.strip()
        try:
            flags = shlex.split(rest, comments=True)
        except ValueError as e:
            raise CampaignError(f"{path}:{n}: cannot split the flags ({e}); check the quotes") from None
        if not sep or "/" not in target or "#" in target or not flags:
            raise CampaignError(f"{path}:{n}: write '<output dir>/<run id>: <cl-bench run flags>', "
                                f"got {raw.strip()!r}")
        given = sorted({f.split("=", 1)[0] for f in flags} & set(GIVEN_BY_LINE))
        if given:
            raise CampaignError(f"{path}:{n}: drop {', '.join(given)}: the line's '{target}:' gives the folder")
        if target in seen:
            raise CampaignError(f"{path}:{n}: {target} is planned twice; give each run its own id")
        seen.add(target)
        entries.append(Entry(Path(target), flags, n))
    return entries


def recorded(entry: Entry) -> dict | None:
    """The entry's run record (None: not started)."""
    if not entry.record.is_file():
        return None
    try:
        data = json.loads(entry.record.read_text(encoding="utf-8"))
        if not all(isinstance(data["config"][section]["precision"], str) for section in ("train", "eval")):
            raise KeyError("precision")
        return data
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise CampaignError(f"{entry.record}: not a readable run record ({type(e).__name__}: {e}); "
                            f"look at the run, then resume it by hand or take it out of the plan") from None


def action(record: dict | None) -> str:
    """done | resume | start."""
    if record is None:  # a folder holding only a lock counts as empty: `run` starts in it
        return "start"
    return "done" if record.get("status") == "complete" else "resume"


def planned(entry: Entry):
    """The RunConfig the line asks for, and its method's parsed arguments, checked as
    `cl-bench run` checks them (a UserError, or a CampaignError for flags `run` lacks)."""
    from cl_bench import config as cfg
    from cl_bench import registry
    from cl_bench.cli_parser import build_parser, run_overrides

    try:
        args = build_parser().parse_args(["run", *entry.flags])
    except SystemExit:  # argparse printed why
        raise CampaignError("these are not `cl-bench run` flags (the message above says which)") from None
    config = cfg.resolve("cpu", args.config, run_overrides(args))
    method = registry.get(config.method)
    return config, method.parse_args(method.args_for(config))


def drift(record: dict, config, method_args) -> list[str]:
    """What the plan line now asks for that its recorded run does not have."""
    import dataclasses

    out = [f"{key} {record.get(key)!r} -> {getattr(config, key)!r}" for key in ("method", "profile", "seed")
           if record.get(key) != getattr(config, key)]
    asked = dataclasses.asdict(method_args)
    ran = record.get("method_args") or {}
    out += [f"method_args.{k} {ran.get(k)!r} -> {v!r}" for k, v in sorted(asked.items()) if ran.get(k) != v]
    return out


def _git(*argv: str, cwd: Path = ROOT) -> str:
    return subprocess.run(["git", "-C", str(cwd), *argv], check=True, capture_output=True, text=True).stdout.strip()


def commit_of(entry: Entry, record: dict | None) -> str:
    """The commit whose code the entry runs (module docstring): HEAD for a new run,
    the commit it started from for one that has a record."""
    if record is not None:
        started = record.get("git_commit") or ""
        try:
            if started and "+" not in started:
                return _git("rev-parse", "--verify", "--quiet", f"{started}^{{commit}}")
        except subprocess.CalledProcessError:
            pass
        raise CampaignError(f"{entry.run_dir} started from {started or 'an unrecorded commit'}, which is not a "
                            f"commit of this repository; resume it by hand (cl-bench run --resume "
                            f"{entry.run_dir}) or take it out of the plan")
    if _git("status", "--porcelain", "--untracked-files=no"):
        raise CampaignError(f"{ROOT}: the tree has uncommitted changes; commit them (new runs run a clone of HEAD)")
    return _git("rev-parse", "HEAD")


def link_packages(code: Path) -> None:
    """Make `code` importable from PYTHONPATH as the editable install imports the
    tree: each package that pyproject.toml's package-dir maps to another folder
    (cl_bench.methods -> methods/) linked where the import system looks for it."""
    import tomllib

    mapping = tomllib.loads((code / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    for package, folder in sorted(mapping.items(), key=lambda kv: kv[0].count(".")):
        where = code / package.replace(".", "/")
        if "." in package and not where.exists():
            where.symlink_to(os.path.relpath(code / folder, where.parent), target_is_directory=True)


def checkout(commit: str) -> Path:
    """A clone of the repository at `commit` with its packages linked, made once under
    .campaign/ (built beside and renamed, so a failed clone leaves nothing behind)."""
    code = ROOT / ".campaign" / f"code-{commit[:12]}"
    if not code.is_dir():
        partial = code.with_name(code.name + ".partial")
        subprocess.run(["rm", "-rf", str(partial)], check=True)
        subprocess.run(["git", "clone", "--quiet", "--no-checkout", str(ROOT), str(partial)], check=True)
        _git("checkout", "--quiet", commit, cwd=partial)
        link_packages(partial)
        partial.rename(code)
    return code


def command(entry: Entry, todo: str) -> list[str]:
    # -P: the working directory (the live tree) does not go first on sys.path
    cli = [sys.executable, "-P", "-m", "cl_bench.cli", "run"]
    if todo == "resume":
        return [*cli, "--resume", str(entry.run_dir), "--no-progress"]
    return [*cli, *entry.flags, "--output-dir", str(entry.run_dir.parent), "--run-id", entry.run_id,
            "--no-progress"]


def survey(entries: list[Entry], args, native: bool) -> tuple[list[tuple[Entry, str, object]], list[str]]:
    """Per entry (action, the code it runs: a commit or --code), printed; and the
    lines refused for their precision."""
    from cl_bench.errors import UserError

    todo, refused = [], []
    for entry in entries:
        try:
            record = recorded(entry)
            what = action(record)
            if what == "done":
                print(f"done   {entry.run_dir}", flush=True)
                continue
            config, method_args = planned(entry)
            if record is not None:
                changed = drift(record, config, method_args)
                if changed:
                    print(f"{args.plan}:{entry.line}: {entry.run_dir} is resumed as recorded, though the line now "
                          f"asks for {'; '.join(changed)}", file=sys.stderr)
                asked = record["config"]["train"]["precision"], record["config"]["eval"]["precision"]
            else:
                asked = config.train.precision, config.eval.precision
            code = args.code.resolve() if args.code else commit_of(entry, record)
        except (UserError, CampaignError) as e:
            raise CampaignError(f"{args.plan}:{entry.line}: {e}") from None
        if not native and ("bf16" in asked or ("auto" in asked and not args.allow_fp32)):
            refused.append(str(entry.line))
        label = code[:12] if isinstance(code, str) else str(code)
        print(f"{what:6s} {entry.run_dir}  (precision {'/'.join(asked)}, code {label})", flush=True)
        todo.append((entry, what, code))
    return todo, refused


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("plan", type=Path)
    p.add_argument("--slots", type=int, default=2, help="runs at a time (default 2)")
    p.add_argument("--threads", type=int, default=1, help="OMP threads a run (default 1)")
    p.add_argument("--allow-fp32", action="store_true",
                   help="on a CPU without native bf16, run auto-precision lines (they compute in fp32)")
    p.add_argument("--dry-run", action="store_true", help="say what each run would do; start nothing")
    p.add_argument("--code", type=Path, help="run this checkout (its packages linked) instead of clones")
    args = p.parse_args(argv)
    if args.slots < 1 or args.threads < 1:
        print("--slots and --threads must be at least 1", file=sys.stderr)
        return 2
    if not args.plan.is_file():
        print(f"{args.plan}: no such plan file", file=sys.stderr)
        return 2

    import torch

    from cl_bench.precision import native_bf16

    try:
        todo, refused = survey(read_plan(args.plan), args, native_bf16(torch.device("cpu")))
    except CampaignError as e:
        print(e, file=sys.stderr)
        return 2
    if refused:
        print(f"{args.plan}: lines {', '.join(refused)} ask for precision auto or bf16, but this CPU has no "
              f"native bf16 (AVX-512 BF16 or AMX): auto would compute in fp32, not poolable with the committed "
              f"bf16 records (--allow-fp32 runs it so), and bf16 is emulated; run the campaign on such a CPU",
              file=sys.stderr)
        return 2
    if args.dry_run:
        return 0

    logs = ROOT / ".campaign" / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    if args.code:
        link_packages(args.code.resolve())
    paths = {code: code if args.code else checkout(code) for _, _, code in todo}
    running: dict[subprocess.Popen, tuple[Entry, float]] = {}
    failed = 0
    try:
        while todo or running:
            while todo and len(running) < args.slots:
                entry, what, code = todo.pop(0)
                env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads),
                       "PYTHONPATH": os.pathsep.join(filter(None, [str(paths[code]), os.environ.get("PYTHONPATH")]))}
                with open(logs / f"{entry.run_id}.log", "a", encoding="utf-8") as log:
                    # its own session: a Ctrl-C reaches the campaign, which passes one SIGINT on
                    proc = subprocess.Popen(command(entry, what), cwd=ROOT, env=env, stdout=log,
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
