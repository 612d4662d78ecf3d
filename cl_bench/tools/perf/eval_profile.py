"""Where one evaluation pass spends its time, beside what the machine allows.

eval-profile: the zero-shot row (`--task`, `--n` test items a task, the `cpu`
    profile's eval settings; `--precision` overrides its eval precision) decoded
    once by `cl_bench.eval.generation`, every model call timed:
      prefill_s   the prompt passes (one a batch);
      decode_s    the one-token passes;
      overhead_s  the rest of the pass: building inputs, picking tokens, the loop,
                  decoding and scoring (pass time - prefill_s - decode_s);
    and once more under torch.profiler, the model's time split into matrix
    products (aten mm/addmm/bmm/linear, scaled dot-product attention) and every
    other operator (norms, rotary, activations, casts, cache copies, masks).
    The bounds: FLOPs / the matmul rate measured here at the same precision,
      prefill: 2 x linear weights x prompt tokens (pads included) + the LM head once a row
      decode:  2 x (linear weights + LM head) x rows a step, summed over steps,
    and for decode also the weights read once a step at the measured read rate
    (bytes of the weights at that precision / GB/s of a large tensor sum).
eval-speed: the same row decoded by cl_bench.eval.generation against `--baseline`:
    plain, the loop it replaced (cl_bench/tools/perf/plain_decoding.py), or
    growing-cache, itself with transformers' KV cache (concatenated a step) instead
    of the buffers reserved after the prefill; `--repeats` times each, alternating
    which goes first; medians, their ratio, and how many predictions are identical.
    Wall seconds, and this process's CPU seconds (user + system): on a shared machine
    the other processes' load stretches the wall time of a one-thread pass much more
    than its CPU time.
"""
from __future__ import annotations

import functools
import statistics
import time
from pathlib import Path

import torch
from torch import nn

from cl_bench.run import precision
from cl_bench.run.machine import machine, matmul_rate
from cl_bench.backends.torch_backend import TorchBackend
from cl_bench.config import build
from cl_bench.data.encode import Encoder
from cl_bench.eval.evaluation import evaluate_task
from cl_bench.eval.generation import greedy_generate
from cl_bench.models.loading import load
from cl_bench.tools.perf import data
from cl_bench.tools.perf.plain_decoding import plain_generate
from cl_bench.profiles import PROFILES

MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear",
              "aten::_scaled_dot_product_flash_attention_for_cpu",
              "aten::_scaled_dot_product_attention_math", "aten::scaled_dot_product_attention",
              "aten::_scaled_dot_product_flash_attention_for_cpu_backward")


# what eval-speed times the decoder against (module docstring)
BASELINES = {"plain": plain_generate, "growing-cache": functools.partial(greedy_generate, reserve_kv=False)}


def setup(args, precision_choice: str | None = None):
    """The `cpu` profile's config (eval precision overridden where given), the model, the
    encoder, the zero-shot row's tasks (`--n` test items each) and the torch backend."""
    eval_cfg = dict(PROFILES["cpu"]["eval"])
    if precision_choice:
        eval_cfg["precision"] = precision_choice
    config = build({**PROFILES["cpu"], "profile": "cpu", "model": args.model, "eval": eval_cfg}, "perf")
    loaded = load(args.model, config.seed)
    tasks = [data.load_task(args, name, 1, args.n, config.seed) for name in data.order(args)]
    encoder = Encoder.from_config(loaded.tokenizer, config.train)
    return config, loaded, encoder, tasks, TorchBackend(config, torch.device("cpu"))


class CallTimer:
    """Wraps `model.forward` (an instance attribute, so nn.Module.__call__ finds it):
    seconds and shapes of each call, split by whether it is a prompt pass (more than
    one input column) or a one-token step."""

    def __init__(self, model: nn.Module):
        self.model, self.prefill, self.decode = model, [], []  # (seconds, rows, columns)
        self._forward = model.forward

    def __enter__(self):
        def timed(*a, **k):
            ids = k["input_ids"]
            t0 = time.perf_counter()
            out = self._forward(*a, **k)
            (self.prefill if ids.shape[1] > 1 else self.decode).append(
                (time.perf_counter() - t0, ids.shape[0], ids.shape[1]))
            return out
        self.model.forward = timed
        return self

    def __exit__(self, *exc):
        del self.model.forward


def read_rate(mb: int = 256, repeats: int = 5) -> float:
    """GB/s of summing a large fp32 tensor (one read of each byte; median)."""
    x = torch.ones(mb * (1 << 20) // 4)
    x.sum()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - t0)
    return mb * (1 << 20) / statistics.median(times) / 1e9


def linear_weights(model: nn.Module) -> tuple[int, int]:
    """(weights of every nn.Linear but the LM head, the LM head's)."""
    head = model.get_output_embeddings()
    body = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear) and m is not head)
    return body, head.weight.numel()


def eval_profile(args) -> dict:
    config, loaded, encoder, tasks, backend = setup(args, args.precision)
    model, prec = loaded.model.eval(), backend.eval_precision

    def one_pass():
        t0 = time.perf_counter()
        with precision.evaluation(prec, backend.device, model):
            evals = [evaluate_task(model, encoder, t, config.eval, generate=backend.generate) for t in tasks]
        return time.perf_counter() - t0, evals

    before = machine()  # the record names its machine (and the load at the start)
    if args.repeats > 1:  # a warm-up pass (allocator, first calls) where --repeats allows
        one_pass()
    with CallTimer(model) as timer:
        seconds, evals = one_pass()
    prefill_s = sum(s for s, _, _ in timer.prefill)
    decode_s = sum(s for s, _, _ in timer.decode)

    profiled = op_profile(lambda: one_pass()[0])

    body, head = linear_weights(model)
    prompt_tokens = sum(rows * cols for _, rows, cols in timer.prefill)
    prefill_flop = 2 * body * prompt_tokens + 2 * head * sum(rows for _, rows, _ in timer.prefill)
    decode_rows = sum(rows for _, rows, _ in timer.decode)
    decode_flop = 2 * (body + head) * decode_rows
    bs = config.eval.batch_size
    rate_prefill = matmul_rate(prec, bs * 128)
    rate_decode = matmul_rate(prec, bs)
    gbs = read_rate()
    bytes_per_weight = 2 if prec == "bf16" else 4
    weight_read_s = (body + head) * bytes_per_weight / 1e9 / gbs * len(timer.decode)
    generated = [len(r["prediction"]) for e in evals for r in e.rows]
    return {
        "what": "eval-profile", "model": args.model, "profile": "cpu", "precision": prec, "machine": before,
        "tasks": [t.name for t in tasks], "test_items_per_task": args.n, "eval_batch_size": bs,
        "max_new_tokens_cap": config.eval.max_new_tokens_cap, "torch_threads": torch.get_num_threads(),
        "pass_s": seconds, "prefill_s": prefill_s, "decode_s": decode_s,
        "overhead_s": seconds - prefill_s - decode_s,
        "prefill_calls": len(timer.prefill), "prompt_tokens_with_pads": prompt_tokens,
        "decode_steps": len(timer.decode), "decode_rows": decode_rows,
        "decode_step_median_s": statistics.median(s for s, _, _ in timer.decode) if timer.decode else None,
        "prediction_chars_mean": sum(generated) / len(generated),
        "profiled_pass_s": profiled["seconds"], "profiled_op_self_s": profiled["op_self_s"],
        "profiled_top_ops": profiled["top_ops"],
        "linear_weights": body, "lm_head_weights": head,
        "matmul_gflops": {f"m={bs * 128}": rate_prefill, f"m={bs}": rate_decode}, "read_gb_s": gbs,
        "bound_s": {"prefill": prefill_flop / rate_prefill / 1e9, "decode_flop": decode_flop / rate_decode / 1e9,
                    "decode_weight_read": weight_read_s},
    }


def op_profile(fn, top: int = 15) -> dict:
    """`fn()` (returning its own seconds) once under torch.profiler: its seconds, the
    operators' self CPU time split into matrix products with attention (their oneDNN/MKL
    kernels counted as theirs) and the rest, and the `top` operators by self time."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        seconds = fn()
    events = prof.key_averages()
    total_self = sum(e.self_cpu_time_total for e in events) / 1e6
    matmul_self = sum(e.self_cpu_time_total for e in events if e.key in MATMUL_OPS) / 1e6
    kernel_self = sum(e.self_cpu_time_total for e in events
                      if e.key.startswith(("mkldnn", "aten::_mkldnn", "aten::mkldnn"))) / 1e6
    return {"seconds": seconds,
            "op_self_s": {"all": total_self, "matmul_and_attention": matmul_self + kernel_self,
                          "other": total_self - matmul_self - kernel_self},
            "top_ops": [{"op": e.key, "self_s": e.self_cpu_time_total / 1e6, "calls": e.count}
                        for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[:top]]}


def eval_speed(args) -> dict:
    config, loaded, encoder, tasks, backend = setup(args, args.precision)
    model, prec = loaded.model.eval(), backend.eval_precision
    generators = {"new": greedy_generate, args.baseline: BASELINES[args.baseline]}

    def row(side: str) -> tuple[float, float, list[str]]:
        t0, c0 = time.perf_counter(), time.process_time()
        with precision.evaluation(prec, backend.device, model):
            evals = [evaluate_task(model, encoder, t, config.eval, generate=generators[side]) for t in tasks]
        return (time.perf_counter() - t0, time.process_time() - c0,
                [r["prediction"] for e in evals for r in e.rows])

    times: dict[str, list[float]] = {side: [] for side in generators}
    cpu: dict[str, list[float]] = {side: [] for side in generators}
    preds: dict[str, list[str]] = {}
    before = machine()
    for i in range(args.repeats):  # alternate which side goes first
        for side in (("new", args.baseline) if i % 2 == 0 else (args.baseline, "new")):
            seconds, cpu_seconds, preds[side] = row(side)
            times[side].append(seconds)
            cpu[side].append(cpu_seconds)
    median = {side: statistics.median(v) for side, v in times.items()}
    median_cpu = {side: statistics.median(v) for side, v in cpu.items()}
    return {"what": "eval-speed", "model": args.model, "profile": "cpu", "precision": prec,
            "tasks": [t.name for t in tasks], "test_items_per_task": args.n,
            "eval_batch_size": config.eval.batch_size, "max_new_tokens_cap": config.eval.max_new_tokens_cap,
            "baseline": args.baseline, "seconds": times, "median_s": median,
            "speedup": median[args.baseline] / median["new"], "cpu_seconds": cpu, "median_cpu_s": median_cpu,
            "cpu_speedup": median_cpu[args.baseline] / median_cpu["new"],
            "identical_predictions": sum(a == b for a, b in zip(preds["new"], preds[args.baseline])),
            "predictions": len(preds["new"]), "torch_threads": torch.get_num_threads(),
            "machine": {**before, "loadavg": {"start": before["loadavg"], "end": machine()["loadavg"]}}}
