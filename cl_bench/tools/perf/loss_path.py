"""`cl-bench perf loss-path`: training steps with vocabulary logits at the answer
positions only (cl_bench/losses.py, issue 53) against the path before (logits at every
position, `losses.all_positions()`), on the same batches, for each of `--methods`
(comma-separated; default the baseline: the core names no method, so the figures'
command names them, e.g. `--methods seqft,lora,upcycle,bilevel-cka`). `--before`: the
old side is the whole step before issue 53, AdamW's per-parameter loop too
(`method.per_parameter_adamw()`) where the new side runs the fused kernel.

`--task A,B` as `perf step`: A is stage 0 (its hooks run, nothing trains) and fills the
replay buffer; B is the timed stage, on the `cpu` profile's settings (batch sizes,
lengths, train precision) with `--n` items. Each side runs stage B through the torch
backend from a fresh copy of the model (`perf step`'s `begun`), so both sides see the
same batches, replay draws and weights; each step's time comes from the step log's
timestamps (the first from the stage's start), and so does its CPU time (the
process's, all its threads: what a shared machine's other work disturbs least).
Repeats alternate which side goes first; medians over repeats and steps, and new over
old as a ratio of medians (below 1: the new path is faster), of wall seconds and of
CPU seconds.

Peak memory: on CUDA the allocator's peak; on the CPU the process's resident set
sampled every 10 ms during the side's stage, above its level at the start (freed heap
returned to the system first, glibc's malloc_trim), so the logits' share shows.
The record names the machine (cl_bench/run/machine.py) and its load average before and
after: on a shared machine the times carry the other work's noise.
"""
from __future__ import annotations

import contextlib
import ctypes
import statistics
import threading
import time
from pathlib import Path

import torch

from cl_bench import losses, registry
from cl_bench.data.encode import IGNORE, epoch_order, steps
from cl_bench.method import per_parameter_adamw
from cl_bench.run.machine import machine
from cl_bench.tools.perf.step import begun, two_stages

SIDES = ("old", "new")  # old: all_positions(); new: answer positions only


def _rss() -> int:
    """Resident bytes of this process (Linux), else 0."""
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * 4096
    except OSError:
        return 0


def _trim() -> None:
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class PeakMemory:
    """The peak memory above the start while the block runs (module docstring), bytes."""

    def __init__(self, device: torch.device):
        self.device, self.peak = device, 0

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self.start = torch.cuda.memory_allocated(self.device)
            return self
        _trim()
        self.start, self.high, self.stop = _rss(), _rss(), threading.Event()

        def sample():
            while not self.stop.wait(0.01):
                self.high = max(self.high, _rss())

        self.thread = threading.Thread(target=sample, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            self.peak = torch.cuda.max_memory_allocated(self.device) - self.start
        else:
            self.stop.set()
            self.thread.join()
            self.peak = max(self.high, _rss()) - self.start


def loss_path(args) -> dict:
    methods = [m for m in (args.methods or registry.baseline()).split(",") if m]
    for name in methods:
        registry.get(name)  # an unknown name fails here, in one line
    config, loaded, encoder, tasks, rows, replay_rows, backend = two_stages(args, "loss-path")
    device, pad = torch.device("cpu"), loaded.tokenizer.pad_token_id
    t = config.train
    order = epoch_order(len(rows), config.seed, tasks[1].name, 0)
    micro = [m for b in steps(rows, order, t.batch_size, t.micro_batch_size, pad) for m in b.micro_batches]
    tokens = sum(int(m["attention_mask"].sum()) for m in micro)
    answer = sum(int((m["labels"][:, 1:] != IGNORE).sum()) for m in micro)
    padded = sum(m["input_ids"].numel() for m in micro)

    def stage(name: str, side: str) -> tuple[list[float], int, list[float], list[float]]:
        torch.manual_seed(config.seed)  # what setup and the hooks draw (router rows ...): the same on both sides
        old = side == "old"
        with per_parameter_adamw() if old and args.before else contextlib.nullcontext():
            method, optimizer, st = begun(name, config, loaded, tasks, encoder, {})
            marks, cpu, lm = [], [], []

            def on_step(s, parts):
                marks.append(time.perf_counter())
                cpu.append(time.process_time())
                lm.append(parts.get("lm"))

            with losses.all_positions() if old else contextlib.nullcontext(), PeakMemory(device) as peak:
                t0, c0 = time.perf_counter(), time.process_time()
                backend.train_stage(method, optimizer, st, [rows], pad, on_step,
                                    replay_rows if method.uses_replay else None)
        return ([b - a for a, b in zip([t0, *marks], marks)], peak.peak, lm,
                [b - a for a, b in zip([c0, *cpu], cpu)])

    before = machine()
    out: dict[str, dict] = {}
    for name in methods:
        stage(name, "new")  # warm-up: allocator, first-call costs
        runs: dict[str, list] = {s: [] for s in SIDES}
        for r in range(args.repeats):  # alternate which side goes first
            for side in (SIDES if r % 2 == 0 else SIDES[::-1]):
                runs[side].append(stage(name, side))
        median = {s: statistics.median(x for run in runs[s] for x in run[0]) for s in SIDES}
        median_cpu = {s: statistics.median(x for run in runs[s] for x in run[3]) for s in SIDES}
        peak = {s: max(run[1] for run in runs[s]) for s in SIDES}
        lm = {s: runs[s][0][2] for s in SIDES}
        out[name] = {
            "step_s": {s: [run[0] for run in runs[s]] for s in SIDES},
            "median_step_s": median, "new_over_old": median["new"] / median["old"],
            "speed_up": median["old"] / median["new"],
            "cpu_step_s": {s: [run[3] for run in runs[s]] for s in SIDES},
            "median_cpu_step_s": median_cpu, "cpu_speed_up": median_cpu["old"] / median_cpu["new"],
            "peak_memory_mib": {s: round(peak[s] / 2**20, 1) for s in SIDES},
            "lm_per_step": lm,
            "lm_max_rel_diff": max((abs(a - b) / max(abs(a), 1e-30) for a, b in zip(lm["old"], lm["new"])
                                    if a is not None and b is not None), default=None),
        }
        print(f"{name}: old {median['old']:.3f} s, new {median['new']:.3f} s a step "
              f"({median['old'] / median['new']:.3f}x; CPU {median_cpu['old'] / median_cpu['new']:.3f}x)", flush=True)
    return {
        "what": "loss-path", "model": args.model,
        "old": "every position" + (", AdamW's per-parameter loop" if args.before else ""), "profile": "cpu", "precision": backend.train_precision,
        "tasks": [x.name for x in tasks], "items_per_task": args.n, "timed_stage": tasks[1].name,
        "steps": len(out[methods[0]]["step_s"]["old"][0]), "repeats": args.repeats,
        "batch_size": t.batch_size, "micro_batch_size": t.micro_batch_size,
        "tokens": tokens, "padded_tokens": padded, "answer_positions": answer,
        "answer_share": answer / max(tokens, 1),
        "methods": out, "machine": {**before, "loadavg_after": machine()["loadavg"]},
        "torch_threads": torch.get_num_threads(),
        "peak_memory": "CUDA: allocator peak above the start; CPU: resident set sampled every 10 ms above the "
                       "start (after malloc_trim)",
    }

