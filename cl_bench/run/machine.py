"""The machine a run or a measurement ran on, as its record states it.

`machine()`: the CPU's name, its logical cores, which bf16-relevant instruction sets it
has (from /proc/cpuinfo where there is one) and the load average now (1, 5, 15 min).

`matmul_rate(precision, m)`: GFLOP/s of an (m, 576) @ (576, 1536) product (the `cpu`
profile's SmolLM2 shape) under that precision's autocast, at the torch threads set now;
the median of `repeats`. At one torch thread (the campaign's calibration, and its
runs') each product is timed in the calling thread's CPU time (time.thread_time), where
it runs, not by the wall clock: on a machine whose other jobs outnumber its cores the
wall clock also counts the time the OS gives them (about half of it with one busy
process on the same core: tests/run/test_machine.py), and the rate is to say how fast
the machine is, not how busy. At more threads the
product is spread over threads whose CPU time one thread's clock does not see, so
there it is the wall clock.

`calibration(precision)`: what a run record keeps under `machine`: the above, the torch
threads, and `matmul_gflops` at the run's training precision (m = 1024, about 0.1 s on a
Zen 4 core). The campaign's estimate scales a record's seconds by the ratio of this
machine's rate to the record's (cl_bench/tools/campaign/estimate.py).
"""
from __future__ import annotations

import os
import platform
import statistics
import time
from pathlib import Path

import torch

from cl_bench.run import precision as run_precision

# the product's shape: rows (tokens) x hidden x SmolLM2's MLP width
CALIBRATION_SHAPE = (1024, 576, 1536)


def machine() -> dict:
    """The CPU (its name, logical cores, which of the bf16-relevant instruction sets it
    has, from /proc/cpuinfo where there is one) and the load average now (1, 5, 15 min)."""
    info = Path("/proc/cpuinfo")
    text = info.read_text() if info.exists() else ""
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    flags = set(fields.get("flags", "").split())
    return {"cpu": fields.get("model name") or platform.processor(), "logical_cores": os.cpu_count(),
            "isa": [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags],
            "loadavg": [round(x, 2) for x in os.getloadavg()]}


def matmul_rate(precision_name: str, m: int, k: int = 576, n: int = 1536, repeats: int = 5) -> float:
    """GFLOP/s of an (m, k) @ (k, n) product under the precision's autocast (the median
    of `repeats`; at one torch thread in that thread's CPU time, so what other processes
    take of the core does not count, else, or where that clock is coarse, by the wall
    clock)."""
    one_thread = torch.get_num_threads() == 1 and time.get_clock_info("thread_time").resolution <= 1e-6
    clock = time.thread_time if one_thread else time.perf_counter
    gen = torch.Generator().manual_seed(0)
    a, w = torch.randn(m, k, generator=gen), torch.randn(k, n, generator=gen)
    with run_precision.autocast(precision_name, torch.device("cpu")):
        wc = w.to(torch.bfloat16) if precision_name == "bf16" else w  # weights are cast once
        a @ wc
        times = []
        for _ in range(repeats):
            t0 = clock()
            a @ wc
            times.append(clock() - t0)
    return 2 * m * k * n / statistics.median(times) / 1e9


def calibration(precision_name: str) -> dict:
    """The run record's `machine`: machine(), the torch threads, and the matmul rate
    of CALIBRATION_SHAPE at `precision_name` (GFLOP/s, 1 decimal)."""
    m, k, n = CALIBRATION_SHAPE
    return {**machine(), "threads": torch.get_num_threads(),
            "matmul": {"precision": precision_name, "shape": [m, k, n],
                       "gflops": round(matmul_rate(precision_name, m, k, n), 1)}}
