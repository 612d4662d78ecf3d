"""Where a campaign's runs go: `local` (this machine, N slots of M threads) or
`slurm` (one job a run through submitit; a preempted or timed-out job stops its
run with SIGTERM, which saves the record, and is requeued, and the requeued job
resumes the run from its last checkpoint, in-stage ones included).

Each run is `python -P -m cl_bench.cli run ...` from the repository root with the
clone of its commit first on PYTHONPATH (-P: the working directory, the live
tree, does not go first on sys.path); logs go to .campaign/logs/<run folder, '/' as '__'>.log.
"""
from __future__ import annotations

import fcntl
import json
import math
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from cl_bench.record import io as results
from cl_bench.record.io import is_running
from cl_bench.tools.campaign import estimate
from cl_bench.tools.campaign.plan import Entry, action, recorded
from cl_bench.errors import UserError, launch_flags

POLL_S = 2.0


def command(entry: Entry, resume: bool) -> list[str]:
    cli = [sys.executable, "-P", "-m", "cl_bench.cli", "run"]
    if resume:  # with the line's --nproc and --keep-checkpoint, which the record does not keep
        return [*cli, "--resume", str(entry.run_dir), *launch_flags(entry.flags), "--no-progress"]
    return [*cli, *entry.flags, "--output-dir", str(entry.run_dir.parent), "--run-id", entry.run_id, "--no-progress"]


def environment(code: Path, threads: int, records: Path | None = None) -> dict[str, str]:
    """A run's environment: `threads` threads, the code of its commit first on the path,
    and the campaign's records (`records`, where given) for the estimate it prints at its
    start (estimate.for_run), not those of its commit's clone, which lack every run
    committed since."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(code), os.environ.get("PYTHONPATH")]))}
    if records is not None:
        env[estimate.RECORDS_ENV] = str(records.resolve())
    return env


def _now() -> str:
    return time.strftime("%H:%M:%S")


def _claim(entry: Entry, root: Path):
    """The run's claim (Entry.claim_path), an exclusive flock held open until its process
    ends; None when another campaign holds it. Taken before the folder is looked at, so
    two campaigns that look at once do not both launch the run (its own lock, run.lock,
    is taken only once the launched process has started up)."""
    path = entry.claim_path(root)
    path.parent.mkdir(parents=True, exist_ok=True)
    fh = open(path, "a")
    try:
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        fh.close()
        return None
    return fh


def _taken(entry: Entry, what: str, root: Path) -> str | None:
    """Why a run the survey found to start or resume, and that no process runs now, is
    no longer this campaign's to launch: another campaign over the same clone (started
    to add slots) finished it or started it since; None when it is as surveyed."""
    now = action(recorded(entry, root))
    if now == what:
        return None
    if now == "done":
        return "finished by another campaign"
    return "started by another campaign since this one's survey; run the campaign again to resume it"


@dataclass
class Budget:
    """--hours: runs start only while their estimated hours left (`estimates`, by the
    plan's run folder; None: no estimate), with MARGIN to spare (the estimates leave
    out loading the model, and a scaled one is a guess), fit in what is left of
    `hours` from when the campaign started: a run the window's end cuts loses its
    git-ignored checkpoints, so the whole run."""

    MARGIN = 1.15

    hours: float
    estimates: dict[Path, float | None]
    start: float = field(default_factory=lambda: clock())

    def left(self) -> float:
        return self.hours - (clock() - self.start) / 3600

    def fits(self, entry: Entry) -> bool:
        need = self.estimates.get(entry.run_dir)
        return need is not None and need * self.MARGIN <= self.left()

    def why_not(self, entry: Entry) -> str:
        need = self.estimates.get(entry.run_dir)
        return (("no estimate" if need is None else f"needs {need:.2f} h, {need * self.MARGIN:.2f} h with the margin")
                + f"; {max(self.left(), 0):.2f} h left")


def clock() -> float:
    return time.monotonic()


def run_local(todo: list[tuple[Entry, str, Path]], root: Path, slots: int, threads: int,
              elsewhere: list[Path] = (), budget: Budget | None = None, records: Path | None = None) -> int:
    """Run (entry, action, code) `slots` at a time; 0 when every run it started
    finished (with `budget`, some may be left unstarted, and listed), 1 when one
    failed, 130 on Ctrl-C (each run saves what it has and stops; run the same
    command again to continue). `elsewhere`: folders of the plan's runs that another
    process is running (an earlier campaign's): each holds a slot while its lock is held.
    With `budget`, the first run in plan order that fits what is left of it takes a
    free slot; once none does and none of these runs is running, the rest are listed
    and left for the next campaign. `records`: the campaign's (`environment`)."""
    running: dict[subprocess.Popen, tuple[Entry, float, Any]] = {}  # entry, start, its claim
    failed = 0

    def startable() -> int | None:
        return next((i for i, (entry, _, _) in enumerate(todo) if budget is None or budget.fits(entry)), None)

    try:
        while running or startable() is not None:
            busy = sum(1 for folder in elsewhere if is_running(folder))
            while len(running) + busy < slots and (i := startable()) is not None:
                entry, what, code = todo.pop(i)
                claim = _claim(entry, root)
                if claim is None or is_running(entry.folder(root)):  # another campaign launched it since the survey
                    if claim is not None:
                        claim.close()
                    print(f"{_now()} skip {entry.run_dir}: running in another campaign (its slot counts against "
                          f"--slots)", flush=True)
                    elsewhere, busy = [*elsewhere, entry.folder(root)], busy + 1
                    continue
                if taken := _taken(entry, what, root):
                    claim.close()
                    print(f"{_now()} skip {entry.run_dir}: {taken}", flush=True)
                    continue
                entry.log_path(root).parent.mkdir(parents=True, exist_ok=True)
                with open(entry.log_path(root), "a", encoding="utf-8") as log:
                    # its own session: a Ctrl-C reaches the campaign, which passes one SIGINT on
                    proc = subprocess.Popen(command(entry, what == "resume"), cwd=root,
                                            env=environment(code, threads, records), stdout=log,
                                            stderr=subprocess.STDOUT, start_new_session=True)
                running[proc] = (entry, time.monotonic(), claim)
                print(f"{_now()} {what} {entry.run_dir} (log {entry.log_path(root)})", flush=True)
            time.sleep(POLL_S)
            for proc in [q for q in running if q.poll() is not None]:
                entry, start, claim = running.pop(proc)
                claim.close()
                failed += proc.returncode != 0
                print(f"{_now()} {'finished' if proc.returncode == 0 else 'FAILED'} {entry.run_dir}: "
                      f"rc {proc.returncode}, {(time.monotonic() - start) / 60:.1f} min", flush=True)
    except KeyboardInterrupt:
        for proc in running:  # each run saves its finished stages and stops; --resume continues it
            proc.send_signal(signal.SIGINT)
        for proc in running:
            proc.wait()
        print("interrupted: run the same command again to continue", file=sys.stderr)
        return 130
    for entry, _, _ in todo:  # only with a budget: none of them fits what is left
        print(f"{_now()} not started {entry.run_dir} ({budget.why_not(entry)} of --hours {budget.hours:g}); "
              f"the next campaign takes it", flush=True)
    return 1 if failed else 0


# ---- Slurm ------------------------------------------------------------------------------

@dataclass
class SlurmSettings:
    """The Slurm settings file (YAML), e.g.

        partition: cpu          # sbatch --partition
        time_min: 720           # a job's time limit; a run that needs longer is requeued and resumes
        signal_delay_s: 120     # the job is told to stop (USR2) this long before its limit
        cpus_per_task: 1        # also the run's OMP threads
        gpus_per_node: 0
        mem_gb: 24
        max_requeues: 10        # requeues after a timeout (preemptions do not count)
        executor: slurm         # slurm; local (this machine, for tests) or debug (in-process)
        additional: {}          # any other sbatch setting submitit passes on (slurm_additional_parameters)
    """

    partition: str | None = None
    time_min: float = 720
    signal_delay_s: int = 120
    cpus_per_task: int = 1
    gpus_per_node: int = 0
    mem_gb: float | None = None
    max_requeues: int = 10
    executor: str = "slurm"
    additional: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def load(cls, path: Path) -> SlurmSettings:
        try:
            raw = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        except (OSError, yaml.YAMLError) as e:
            raise UserError(f"{path}: cannot read the Slurm settings ({type(e).__name__}); give a YAML file "
                            f"like docs/slurm.example.yaml") from None
        names = {f for f in cls.__dataclass_fields__}
        if not isinstance(raw, dict) or set(raw) - names:
            bad = sorted(set(raw) - names) if isinstance(raw, dict) else raw
            raise UserError(f"{path}: unknown Slurm setting(s) {bad}; the settings are {', '.join(sorted(names))}")
        settings = cls(**raw)
        if settings.executor not in ("slurm", "local", "debug"):
            raise UserError(f"{path}: executor={settings.executor!r} must be slurm, local or debug")
        for name, kind in (("time_min", (int, float)), ("signal_delay_s", int), ("cpus_per_task", int),
                           ("gpus_per_node", int), ("max_requeues", int)):
            value = getattr(settings, name)
            low = 1 if name == "cpus_per_task" else 0
            if isinstance(value, bool) or not isinstance(value, kind) or value < low or (name == "time_min"
                                                                                         and value <= 0):
                raise UserError(f"{path}: {name}={value!r} must be a {'number > 0' if name == 'time_min' else f'whole number >= {low}'}")
        return settings


class RunJob:
    """One run as a Slurm job (submitit calls it; on a preemption or timeout signal
    submitit calls `checkpoint`, which stops the run and has the job requeued)."""

    def __init__(self, entry: Entry, root: Path, code: Path, threads: int, records: Path | None = None):
        self.entry, self.root, self.code, self.threads, self.records = entry, root, code, threads, records
        self._proc: subprocess.Popen | None = None

    def __call__(self) -> int:
        record = self.entry.record_path(self.root)
        resume = record.is_file()  # decided now: a requeued job continues its run
        if resume and json.loads(record.read_text(encoding="utf-8")).get("status") == "complete":
            return 0
        log_path = self.entry.log_path(self.root)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "a", encoding="utf-8") as log:
            # the run ignores the preemption signals: the job stops it with SIGTERM (checkpoint)
            self._proc = subprocess.Popen(command(self.entry, resume), cwd=self.root,
                                          env=environment(self.code, self.threads, self.records), stdout=log,
                                          stderr=subprocess.STDOUT, preexec_fn=_ignore_preemption)
            while self._proc.poll() is None:  # not wait(): the signal handler (checkpoint) reaps it
                time.sleep(POLL_S)
            rc = self._proc.returncode
        if rc != 0:
            raise RuntimeError(f"{self.entry.run_dir}: cl-bench run exited {rc}; see {log_path}")
        return rc

    def checkpoint(self, *args, **kwargs):
        import submitit

        if self._proc is not None and self._proc.returncode is None:
            _stop(self._proc.pid)
        self._proc = None
        return submitit.helpers.DelayedSubmission(RunJob(self.entry, self.root, self.code, self.threads,
                                                            self.records))

    def __getstate__(self):
        return {**self.__dict__, "_proc": None}


def _stop(pid: int, patience_s: float = 300.0) -> None:
    """SIGTERM to the run (it records "interrupted" and exits), reaped here; SIGKILL
    after `patience_s` (its last checkpoint is still there)."""
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + patience_s
    while time.monotonic() < deadline:
        try:
            if os.waitpid(pid, os.WNOHANG)[0] == pid:
                return
        except ChildProcessError:  # reaped already
            return
        time.sleep(0.2)
    os.kill(pid, signal.SIGKILL)


def _ignore_preemption() -> None:
    for sig in (signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_IGN)


def executor(settings: SlurmSettings, folder: Path):
    """submitit's executor for `settings`: Slurm's (sbatch), or its local one (real
    processes under a controller that enforces the time limit and requeues: tests),
    or its debug one (in this process)."""
    try:
        import submitit
    except ImportError:
        raise UserError("--launcher slurm needs submitit: pip install 'cl-bench[slurm]'") from None
    if settings.executor == "debug":
        return submitit.DebugExecutor(folder)
    if settings.executor == "local":
        ex = submitit.LocalExecutor(folder, max_num_timeout=settings.max_requeues)
        ex.update_parameters(timeout_min=settings.time_min, signal_delay_s=settings.signal_delay_s,
                             tasks_per_node=1, gpus_per_node=settings.gpus_per_node)
        return ex
    try:
        ex = submitit.SlurmExecutor(folder, max_num_timeout=settings.max_requeues)
    except RuntimeError as e:  # no srun: not a Slurm machine
        raise UserError(f"--launcher slurm: {e} (run from a Slurm login node, or set executor: local in the "
                        f"settings file to run the jobs on this machine)") from None
    ex.update_parameters(**sbatch_parameters(settings))
    return ex


def sbatch_parameters(settings: SlurmSettings) -> dict[str, Any]:
    """The settings as submitit's SlurmExecutor parameters (its #SBATCH lines)."""
    params: dict[str, Any] = {"time": math.ceil(settings.time_min), "cpus_per_task": settings.cpus_per_task,
                              "signal_delay_s": settings.signal_delay_s, "ntasks_per_node": 1, "nodes": 1}
    if settings.gpus_per_node:
        params["gpus_per_node"] = settings.gpus_per_node
    if settings.mem_gb is not None:
        params["mem"] = f"{math.ceil(settings.mem_gb)}GB"
    if settings.partition:
        params["partition"] = settings.partition
    if settings.additional:
        params["additional_parameters"] = dict(settings.additional)
    return params


def jobs_file(root: Path) -> Path:
    return root / ".campaign" / "jobs.json"


def queued(root: Path) -> dict[str, dict]:
    """Run folder -> its last submitted job (id, executor), for jobs still pending or
    running on Slurm (other executors' jobs are known by the run's lock only)."""
    path = jobs_file(root)
    if not path.is_file():
        return {}
    jobs = json.loads(path.read_text(encoding="utf-8"))
    live = {}
    for run_dir, job in jobs.items():
        if job.get("executor") != "slurm":
            continue
        try:
            import submitit

            state = submitit.SlurmJob(folder=job["folder"], job_id=job["id"]).state
        except Exception:  # noqa: BLE001 - no sacct here: say nothing of it
            continue
        if state in ("PENDING", "RUNNING", "REQUEUED", "CONFIGURING", "RESIZING", "SUSPENDED"):
            live[run_dir] = {**job, "state": state}
    return live


def run_slurm(todo: list[tuple[Entry, str, Path]], root: Path, settings: SlurmSettings, wait: bool,
              records: Path | None = None) -> int:
    """Submit one job a run; with `wait`, wait for every job and return 1 if one failed.
    `records`: the campaign's (`environment`)."""
    folder = root / ".campaign" / "slurm"
    ex = executor(settings, folder)
    jobs = []
    for entry, what, code in todo:
        job = ex.submit(RunJob(entry, root, code, settings.cpus_per_task, records))
        jobs.append((entry, job))
        print(f"{_now()} submitted {entry.run_dir} ({what}): job {job.job_id}", flush=True)
    known = json.loads(jobs_file(root).read_text(encoding="utf-8")) if jobs_file(root).is_file() else {}
    known.update({str(e.run_dir): {"id": str(j.job_id), "executor": settings.executor, "folder": str(folder)}
                  for e, j in jobs})
    jobs_file(root).parent.mkdir(parents=True, exist_ok=True)
    results.write_json(jobs_file(root), known)
    if not wait:
        return 0
    failed = 0
    for entry, job in jobs:
        try:
            job.result()
            print(f"{_now()} finished {entry.run_dir}", flush=True)
        except Exception as e:  # noqa: BLE001 - submitit re-raises the job's error
            failed += 1
            print(f"{_now()} FAILED {entry.run_dir}: {str(e).strip().splitlines()[-1]}", flush=True)
    return 1 if failed else 0
