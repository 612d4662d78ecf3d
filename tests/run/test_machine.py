"""The machine calibration (cl_bench/run/machine.py): its rate says how fast the machine
is, not how busy it is."""
import os
import subprocess
import sys
import time

import pytest
import torch

from cl_bench.run.machine import matmul_rate


@pytest.fixture
def one_cpu_one_thread():
    """This process on one CPU at one torch thread; both restored afterwards."""
    if not hasattr(os, "sched_setaffinity"):
        pytest.skip("needs os.sched_setaffinity (Linux)")
    cpus, threads = os.sched_getaffinity(0), torch.get_num_threads()
    cpu = min(cpus)
    os.sched_setaffinity(0, {cpu})
    torch.set_num_threads(1)
    yield cpu
    os.sched_setaffinity(0, cpus)
    torch.set_num_threads(threads)


def test_rate_at_one_thread_does_not_count_a_competing_process(one_cpu_one_thread):
    # Mutation caught: timing the product by the wall clock (time.perf_counter) at one
    # thread. A busy process on the same CPU then takes about half of its time, and the
    # wall-clock rate about halves; the thread's CPU time does not see it.
    alone = matmul_rate("fp32", 1024, repeats=7)
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"],
                            preexec_fn=lambda: os.sched_setaffinity(0, {one_cpu_one_thread}))
    try:
        time.sleep(0.3)  # the competitor is running
        shared = matmul_rate("fp32", 1024, repeats=7)
    finally:
        busy.kill()
        busy.wait()
    assert shared > 0.7 * alone, (alone, shared)
