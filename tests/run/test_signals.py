"""SIGINT and SIGTERM stop a run with one consistent record (cl_bench/run/signals.py).

- in the process that trains: the first signal raises KeyboardInterrupt, later ones
  are ignored (mutation caught: a handler that raises every time, or none at all);
- an interrupt that a finaliser swallows (`__del__`, run by the garbage collector) is
  not printed, and stops training at the next step and evaluation at the next batch
  (mutations caught: no unraisable hook; no check after a step, or after a batch);
- `cl-bench run` stopped at any moment of its start (after its module is imported,
  before main; while main parses flags and imports datasets, torch and transformers)
  ends with exit 130 and one line that says nothing was written and gives the command
  to start it again, no traceback (mutations caught: no early handler; the guard
  installed only in cmd_run, after those imports; a bare "interrupted" from main's
  handler);
- `cl-bench run` stopped with SIGTERM (what kill and timeout send) records
  "interrupted" and resumes to the uninterrupted run's results;
- `wait_forwarding`: the launcher's whole group gets the signal and the command
  returns only when its last process has exited (mutations caught: signal only the
  launcher; return when the launcher returns);
- `cl-bench run --backend deepspeed --nproc 2` stopped with SIGTERM: no rank outlives
  the command, the record says "interrupted" and stays so, and resume finishes it.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from cl_bench.run import signals
from helpers import (assert_same_run, deepspeed_args, launch_env, make_trace, only_run, run_cli, signal_once_saved,
                     smoke_args)

LONG = ["--set", "train.epochs=20"]  # stages of a few seconds, so a signal lands inside one


def test_first_signal_interrupts_and_later_ones_are_ignored():
    before = signal.getsignal(signal.SIGTERM)
    with signals.interrupt_on_signals() as stop:
        with pytest.raises(KeyboardInterrupt, match="SIGTERM"):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler runs at once; never reached
        os.kill(os.getpid(), signal.SIGINT)  # e.g. DeepSpeed's launcher, after the terminal's Ctrl-C
        time.sleep(0.01)  # the record is being written: nothing may cut it
    assert stop.signals == [signal.SIGTERM, signal.SIGINT] and stop.names == "SIGTERM, SIGINT"
    assert signal.getsignal(signal.SIGTERM) is before


class _SignalsWhenCollected:
    """An object whose finaliser receives `sig`: its KeyboardInterrupt cannot propagate."""

    def __init__(self, sig: int, error: type | None = None):
        self.sig, self.error = sig, error

    def __del__(self):
        os.kill(os.getpid(), self.sig)
        for _ in range(1000):  # the handler runs here, inside the finaliser
            pass
        if self.error is not None:
            raise self.error("a finaliser's own error")


def test_an_interrupt_a_finaliser_swallows_is_not_printed_and_check_raises_it(monkeypatch):
    seen = []
    monkeypatch.setattr(sys, "unraisablehook", seen.append)
    with signals.interrupt_on_signals() as stop:
        _SignalsWhenCollected(signal.SIGTERM)  # collected at once: the interrupt is swallowed
        assert stop.fired and seen == []
        with pytest.raises(KeyboardInterrupt, match="SIGTERM"):
            stop.check()
        _SignalsWhenCollected(signal.SIGINT, ValueError)  # ignored signal; the error is not ours
    assert [type(u.exc_value) for u in seen] == [ValueError]
    assert sys.unraisablehook == seen.append


def _swallowed_in(monkeypatch, trace_dir, tmp_path, where: str) -> tuple[object, int]:
    """A smoke run whose first stage has its interrupt swallowed at the first training
    step's loss or the first evaluation batch; returns its record and how many steps
    (or batches) ran after that one."""
    from cl_bench.config import resolve
    from cl_bench.methods.seqft import SeqFT
    from cl_bench.run.checks import check_config
    from cl_bench.run.prepare import prepare
    from cl_bench.run import sequencer

    stop, after = signals.Stop(), []

    def swallow(step: int = 0):  # step: the optimiser step (several micro-batches may share one)
        if stop.fired and step > 0:
            after.append(step)
        stop.signals.append(signal.SIGTERM)  # what the handler records before its raise is lost

    if where == "train":
        real_loss = SeqFT.loss
        monkeypatch.setattr(SeqFT, "loss", lambda self, batch, step: (swallow(step), real_loss(self, batch, step))[1])
    else:
        real_eval = sequencer.evaluate_task

        def evaluate(model, encoder, task, cfg, on_batch, generate):
            def batch(n):
                swallow(1)
                on_batch(n)
            return real_eval(model, encoder, task, cfg, batch, generate)
        monkeypatch.setattr(sequencer, "evaluate_task", evaluate)
    config = resolve("smoke", None, {"method_args": {"lr": "1e-3"}, "data": {"data_dir": str(trace_dir)},
                                     "output_dir": str(tmp_path / "runs"), "eval": {"batch_size": "2"}})
    run = prepare(check_config(config), progress=False)
    with pytest.raises(KeyboardInterrupt, match="SIGTERM"):
        sequencer.execute(run, stop=stop)
    return run.record, len(after)


@pytest.mark.parametrize("where", ["train", "eval"])
def test_a_swallowed_interrupt_stops_at_the_next_step_or_batch(monkeypatch, trace_dir, tmp_path, where):
    record, after = _swallowed_in(monkeypatch, trace_dir, tmp_path, where)
    assert record.status == "interrupted" and record.stages_done == 0
    assert after == 0  # nothing ran after the step or batch in which the signal came


def _start(argv: list) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "cl_bench.cli", *map(str, argv)], env=launch_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _record(run_dir: Path) -> dict:
    try:
        return json.loads((run_dir / "run.json").read_text())
    except (OSError, ValueError):
        return {}


_STARTING = """
import os, signal, sys, threading
sig, delay = getattr(signal, sys.argv[1]), float(sys.argv[2])
sys.argv = ["cl-bench", *sys.argv[3:]]  # as the console script runs it
import cl_bench.cli as cli
if delay < 0:  # between the import and main()
    os.kill(os.getpid(), sig)
else:
    threading.Timer(delay, os.kill, (os.getpid(), sig)).start()
sys.exit(cli.main())
"""


@pytest.mark.parametrize("sig, delay", [("SIGINT", -1), ("SIGTERM", -1), ("SIGINT", 0.0), ("SIGTERM", 0.0),
                                        ("SIGTERM", 0.3), ("SIGINT", 1.0)])
@pytest.mark.slow
def test_a_signal_while_run_starts_ends_it_with_130_and_one_line(trace_dir, tmp_path, sig, delay):
    argv = smoke_args(trace_dir, tmp_path / "runs", "--run-id", "r")
    done = subprocess.run([sys.executable, "-c", _STARTING, sig, str(delay), *map(str, argv)], env=launch_env(),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 130, (done.returncode, done.stderr[-3000:])
    last = done.stderr.strip().splitlines()[-1]
    assert "Traceback" not in done.stderr and re.fullmatch(
        r"interrupted before the run folder was made; nothing was written; start it again with: \S*cl-bench run "
        r"--profile smoke .* --run-id r", last), last  # the same command


@pytest.mark.slow
def test_sigterm_records_interrupted_and_resume_finishes(trace_dir, tmp_path):
    run_dir = tmp_path / "runs" / "r"
    code, out = signal_once_saved(_start(smoke_args(trace_dir, tmp_path / "runs", "--run-id", "r", *LONG)),
                                   run_dir, signal.SIGTERM)
    assert code == 130, out[-3000:]
    record = _record(run_dir)
    assert record["status"] == "interrupted" and "SIGTERM" in record["error"]
    assert record["stages_done"] in (1, 2)
    assert "Traceback" not in out and f"continue with: cl-bench run --resume {run_dir}" in out
    assert run_cli("run", "--resume", run_dir, "--no-progress") == 0
    assert run_cli(*smoke_args(trace_dir, tmp_path / "once", *LONG)) == 0
    assert_same_run(only_run(tmp_path / "once"), run_dir)


FAKE_LAUNCHER = """
import subprocess, sys
subprocess.Popen([sys.executable, sys.argv[1], sys.argv[2]]).wait()  # dies on SIGTERM, as DeepSpeed's runner
"""
FAKE_RANK = """
import signal, sys, time
from pathlib import Path
stop = []
signal.signal(signal.SIGTERM, lambda *a: stop.append(1))
Path(sys.argv[1], "ready").touch()
while not stop:
    time.sleep(0.01)
time.sleep(1.5)  # writes its record
Path(sys.argv[1], "done").touch()
"""
DRIVER = """
import json, os, signal, sys, threading, time
from pathlib import Path
from cl_bench.record import io as results
from cl_bench.run import signals
d = Path(sys.argv[1])
proc = signals.start_group([sys.executable, str(d / "launcher.py"), str(d / "rank.py"), str(d)], dict(os.environ))
while not (d / "ready").exists():
    time.sleep(0.01)
threading.Timer(0.1, os.kill, (os.getpid(), signal.SIGTERM)).start()
t0 = time.monotonic()
code, stop = signals.wait_forwarding(proc, grace=30)
print(json.dumps({"done": (d / "done").exists(), "fired": stop.fired, "waited_s": time.monotonic() - t0}))
"""


@pytest.mark.slow
def test_the_launchers_group_gets_the_signal_and_is_waited_for(tmp_path):
    for name, text in (("launcher.py", FAKE_LAUNCHER), ("rank.py", FAKE_RANK), ("driver.py", DRIVER)):
        (tmp_path / name).write_text(textwrap.dedent(text))
    done = subprocess.run([sys.executable, str(tmp_path / "driver.py"), str(tmp_path)], env=launch_env(),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.splitlines()[-1])
    assert report.pop("waited_s") < 30  # waited for the rank, not for the grace period
    assert report == {"done": True, "fired": True}


def _processes_naming(text: str) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if text in (entry / "cmdline").read_bytes().decode(errors="replace"):
                    stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                    if stat[0] != "Z":
                        pids.append(int(entry.name))
            except OSError:
                pass
    return pids


@pytest.mark.slow
@pytest.mark.xdist_group("deepspeed-ranks")  # as tests/backends/test_deepspeed_ranks.py
def test_sigterm_to_a_deepspeed_launch_stops_every_rank_with_one_record(tmp_path):
    trace = make_trace(tmp_path / "trace")
    out = tmp_path / "ds-runs"
    run_dir = out / "r"
    argv = smoke_args(trace, out, "--nproc", "2", "--run-id", "r", *LONG, *deepspeed_args(tmp_path, 2))
    code, text = signal_once_saved(_start(argv), run_dir, signal.SIGTERM)
    assert code == 130, text[-3000:]
    assert _processes_naming(str(out)) == []  # no launcher, no rank left
    record = _record(run_dir)
    assert record["status"] == "interrupted" and record["stages_done"] in (1, 2), text[-3000:]
    time.sleep(2)
    assert _record(run_dir) == record  # nothing wrote "complete" afterwards
    resumed = subprocess.run([sys.executable, "-m", "cl_bench.cli", "run", "--resume", str(run_dir),
                              "--nproc", "2", "--no-progress"], env=launch_env(), capture_output=True, text=True,
                             timeout=400)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert _record(run_dir)["status"] == "complete"


def test_a_signal_swallowed_while_the_model_loads_still_interrupts(trace_dir, tmp_path, monkeypatch):
    """transformers' lazy imports swallow a KeyboardInterrupt raised inside them; the
    run must stop anyway, before its first stage (mutation caught: no check of the
    signal after preparing)."""
    from cl_bench.run import prepare

    real = prepare.load

    def load_swallowing(*args, **kwargs):
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)  # never reached: the handler raises at once
        except KeyboardInterrupt:
            pass  # as import_utils does
        return real(*args, **kwargs)

    monkeypatch.setattr(prepare, "load", load_swallowing)
    assert run_cli(*smoke_args(trace_dir, tmp_path / "runs", "--run-id", "r")) == 130
    record = _record(tmp_path / "runs" / "r")
    assert record["status"] == "interrupted" and record["stages_done"] == 0 and "SIGINT" in record["error"]
