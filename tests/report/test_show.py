"""`cl-bench show` of a run that is not complete says so first, with where it stands
and what to do (mutation caught: the matrix alone, empty cells and no status, as a
running run used to show)."""
from __future__ import annotations

import json
import subprocess
import sys

from cl_bench.record import io as results
from helpers import interrupted_run, run_cli, smoke_args


def _show(capsys, run_dir) -> str:
    capsys.readouterr()
    assert run_cli("show", run_dir) == 0
    return capsys.readouterr().out.splitlines()[0]


def test_show_says_how_far_a_run_that_is_not_complete_is(trace_dir, tmp_path, monkeypatch, capsys):
    run_dir = interrupted_run(monkeypatch, *smoke_args(trace_dir, tmp_path / "runs"), at_stage=1)
    line = _show(capsys, run_dir)
    assert line.startswith("status: interrupted (KeyboardInterrupt") and line.endswith(
        f", 1 of 3 stages done; continue with: cl-bench run --resume {run_dir}"), line

    # the flags that say how it was launched, from its last launch (tests/test_cli_resume_flags.py;
    # mutation caught: status_line's `again` without them)
    record = json.loads((run_dir / results.RUN_FILE).read_text())
    edited = {**record, "command": "cl-bench run --backend deepspeed --nproc 4 --keep-checkpoint"}
    (run_dir / results.RUN_FILE).write_text(json.dumps(edited))
    assert _show(capsys, run_dir).endswith(f"--resume {run_dir} --nproc 4 --keep-checkpoint")
    (run_dir / results.RUN_FILE).write_text(json.dumps({**edited, "resumes": [
        {"at_stage": 1, "command": f"cl-bench run --resume {run_dir} --nproc 2"}]}))
    assert _show(capsys, run_dir).endswith(f"--resume {run_dir} --nproc 2")
    # ranks of an outer launcher (torchrun, deepspeed): no flag gives them, the line says how
    (run_dir / results.RUN_FILE).write_text(json.dumps({**record, "backend": {"name": "deepspeed", "world_size": 4}}))
    assert _show(capsys, run_dir).endswith(f"--resume {run_dir} (on the 4 ranks of an outer launcher, as it ran: "
                                           f"torchrun or deepspeed)")
    # a failed run goes on with --resume too (a rank's process killed, Backend.lost_peer; mutation
    # caught: no line for it)
    (run_dir / results.RUN_FILE).write_text(json.dumps({**record, "status": "failed", "error": "RuntimeError: x"}))
    assert _show(capsys, run_dir) == (f"status: failed (RuntimeError: x), 1 of 3 stages done; once its cause is "
                                      f"fixed, continue with: cl-bench run --resume {run_dir}")
    # but not one whose loss diverged: resumed, it would diverge again (its error says to start anew)
    (run_dir / results.RUN_FILE).write_text(json.dumps({**record, "status": "failed", "error": "lower the lr",
                                                        "failed_at": {"stage": 1, "step": 3}}))
    assert _show(capsys, run_dir) == "status: failed (lower the lr), 1 of 3 stages done"
    record["status"] = "running"
    (run_dir / results.RUN_FILE).write_text(json.dumps(record))
    assert _show(capsys, run_dir).startswith("status: stopped (running when its process ended: killed?), 1 of 3")

    code = ("import fcntl, os, sys, time; f = open(sys.argv[1], 'a+'); fcntl.flock(f, fcntl.LOCK_EX); "
            "f.truncate(0); f.write(str(os.getpid())); f.flush(); print('held', flush=True); time.sleep(60)")
    holder = subprocess.Popen([sys.executable, "-c", code, str(run_dir / results.LOCK_FILE)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert _show(capsys, run_dir) == (f"status: running (PID {holder.pid}), 1 of 3 stages done; the matrix "
                                          f"fills in as stages finish")
    finally:
        holder.kill()
        holder.wait()
