"""`cl-bench run --nproc N`: start N ranks of the same command through DeepSpeed's
launcher, after checking once what can be checked before N processes start.
Each rank sees RANK in its environment and runs the command as one rank of the
deepspeed backend; SIGINT or SIGTERM to the launching process stops the
launcher and every rank (cl_bench/run/signals.py).
"""
from __future__ import annotations

import os
import sys

from cl_bench.errors import PROGRAM_ENV, UserError, program


def must_launch(nproc: int, config) -> bool:
    """--nproc N: whether this process must start the N ranks (False: it is one of
    them). `config`: the run's (for --resume, the recorded one), which passed
    cl_bench/run/checks.py (the method's support of the backend included); what
    only the launch can check is checked here, once, before N processes start."""
    if nproc < 1:
        raise UserError(f"--nproc {nproc}: give at least 1 rank")
    if config.backend != "deepspeed":
        raise UserError(f"--nproc {nproc} starts ranks of the deepspeed backend, and this run's backend is "
                        f"{config.backend}: drop --nproc, or for a new run add --backend deepspeed")
    if "RANK" in os.environ:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world != nproc:
            raise UserError(f"--nproc {nproc} inside a launch of {world} ranks; drop --nproc "
                            f"or launch {nproc}")
        return False
    from cl_bench.backends.deepspeed_backend import ds_config

    ds_config(config, nproc, False)  # a conflicting DeepSpeed config file fails here, once
    return True


def launch(nproc: int, argv: list[str], command_line: str) -> tuple[int, bool]:
    """Start `nproc` ranks of this same command (`argv`, its arguments; `command_line`,
    the one the ranks record) through DeepSpeed's launcher; returns only when all
    have exited: (the launcher's exit code, whether a signal stopped them; the ranks
    said what the interrupt left)."""
    from cl_bench.run import signals
    from cl_bench.backends.deepspeed_backend import free_port

    launcher = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(nproc),
                "--master_port", str(free_port()), "--no_local_rank", "--module", "cl_bench.cli"]
    env = {**os.environ, "CL_BENCH_COMMAND": command_line, PROGRAM_ENV: program()}
    code, stop = signals.wait_forwarding(signals.start_group([*launcher, *argv], env))
    return code, stop.fired
