"""`cl-bench campaign --launcher slurm`: jobs through submitit (a preempted run finished, nothing
rerun) and the sbatch script's settings."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from cl_bench.run import checkpoint
from cl_bench.tools.campaign import launch
from campaign_setup import ROOT, table_rows


def _preempt_when_checkpointed(run_dir: Path, done: threading.Event) -> None:
    """Once `run_dir` has an in-stage checkpoint, send SIGUSR2 (Slurm's preemption
    signal as submitit sets it up) to the job process running it: the parent of its
    `cl-bench run` process."""
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and not done.is_set():
        if checkpoint.has_checkpoint(run_dir, checkpoint.STEP_CHECKPOINT_DIR):
            for proc in Path("/proc").glob("[0-9]*"):
                try:
                    argv = (proc / "cmdline").read_bytes().split(b"\0")
                    parent = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
                except (OSError, ValueError, IndexError):
                    continue
                if b"cl_bench.cli" in argv and str(run_dir.name).encode() in argv:
                    os.kill(parent, signal.SIGUSR2)
                    return
        time.sleep(0.1)


def _campaign_process(*argv, root: Path) -> subprocess.CompletedProcess:
    """The command in its own process: submitit's executors log to the stderr they
    first see, which in pytest's process is a capture that closes after the test."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "cl_bench.cli", "campaign", *map(str, argv), "--root", str(root)],
                          env=env, capture_output=True, text=True, timeout=900)


@pytest.mark.slow
def test_slurm_jobs_through_submitit_finish_a_preempted_run_and_rerun_nothing(trace_dir, tmp_path):
    """Two smoke runs as jobs of submitit's local executor (real processes under its
    controller, which requeues a job that asks for it). The first job is preempted
    (SIGUSR2, as Slurm signals it) once its run has an in-stage checkpoint: it stops
    the run (SIGTERM: the record says interrupted) and is requeued, and the requeued
    job resumes the run from that checkpoint. Then the campaign again says both are
    done and submits nothing. Mutations caught: a job that is not requeued
    (checkpoint() missing: the run stays interrupted and the job fails), a requeued
    job that starts the run afresh (no in-stage resume in its record), a job whose run
    is not given the campaign's records (its estimate reads its code's checkout's)."""
    out = tmp_path / "out"
    base = f"--profile smoke --data-dir {trace_dir} --method seqft --method-arg lr=1e-3"
    long = "--set train.epochs=30 --set train.checkpoint_every_s=0"
    path = tmp_path / "plan.txt"
    path.write_text(f"{out}/long: {base} {long}\n{out}/short: {base}\n")
    settings = tmp_path / "slurm.yaml"
    settings.write_text("executor: local\ntime_min: 20\nmax_requeues: 2\ncpus_per_task: 1\n")
    args = [str(path), "--launcher", "slurm", "--slurm", str(settings), "--code", str(ROOT)]
    done = threading.Event()
    preempt = threading.Thread(target=_preempt_when_checkpointed, args=(out / "long", done))
    preempt.start()
    try:
        first = _campaign_process(*args, "--wait", root=tmp_path)
    finally:
        done.set()
        preempt.join()
    assert first.returncode == 0, first.stderr[-3000:]
    said = first.stdout
    assert said.count("submitted") == 2 and said.count("finished") == 2, said
    long_run = json.loads((out / "long" / "run.json").read_text())
    short_run = json.loads((out / "short" / "run.json").read_text())
    assert long_run["status"] == short_run["status"] == "complete"
    assert [list(r) for r in long_run["resumes"]] and any("at_step" in r for r in long_run["resumes"]), long_run
    assert not short_run.get("resumes")
    (log,) = (tmp_path / ".campaign" / "logs").glob("*short.log")
    assert f"under {(tmp_path / 'results').resolve()})" in log.read_text()  # the campaign's records: none here
    assert "preempted" in "".join(p.read_text() for p in (tmp_path / ".campaign" / "slurm").glob("*_log.err"))

    before = {name: (out / name / "run.json").read_bytes() for name in ("long", "short")}
    second = _campaign_process(*args, "--wait", root=tmp_path)
    assert second.returncode == 0, second.stderr[-3000:]
    again = second.stdout
    assert "submitted" not in again and [r[0] for r in table_rows(again)] == ["done", "done"]
    assert {name: (out / name / "run.json").read_bytes() for name in ("long", "short")} == before


def test_the_sbatch_script_carries_the_settings(tmp_path):
    """What Slurm would be given (submitit writes the script; no sbatch is called)."""
    settings = tmp_path / "slurm.yaml"
    settings.write_text("partition: cpu\ntime_min: 90\nsignal_delay_s: 60\ncpus_per_task: 2\nmem_gb: 24\n"
                        "additional: {account: lab}\n")
    from submitit.slurm.slurm import _make_sbatch_string

    params = launch.sbatch_parameters(launch.SlurmSettings.load(settings))
    script = _make_sbatch_string(command="python -m x", folder=tmp_path, **params)
    for line in ("--partition=cpu", "--time=90", "--signal=USR2@60", "--cpus-per-task=2", "--mem=24GB",
                 "--account=lab"):
        assert f"#SBATCH {line}" in script, (line, script)
