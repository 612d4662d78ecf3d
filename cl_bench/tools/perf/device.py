"""Measurements on whatever device the machine has (CUDA where visible, else the CPU),
for scripts/device_check.sh.

train-step:     optimiser steps of `--method` (default the baseline) on `--task`
    through the torch backend, at the `cpu` profile's batch sizes and lengths and
    the train precision `auto` picks there (bf16 on a GPU that has it); the median
    step (the first, warm-up, left out) and its MFU:
      MFU = 6 x linear weights x tokens a step (pads included) / step seconds / peak,
    the peak being the device's dense bf16 (or fp32) rate from its data sheet
    (PEAK_TFLOPS; null for a device not listed).
gen-throughput: `--n` test prompts of `--task` decoded greedily (`--max-new-tokens`,
    `--batch-size`) by each generator installed here (hf; vllm where it can run),
    the eval precision `auto` picks: tokens a second (the median of `--repeats`
    after one warm-up call) and how many outputs agree with hf's.
"""
from __future__ import annotations

import statistics
import time

import torch

from cl_bench.run import precision
from cl_bench.backends.torch_backend import TorchBackend
from cl_bench.config import build
from cl_bench.data.encode import Encoder, tokenize_train
from cl_bench.errors import UserError
from cl_bench.eval.generation import greedy_generate
from cl_bench.method import Stage
from cl_bench.models.loading import load
from cl_bench.tools.perf import data
from cl_bench.tools.perf.eval_profile import linear_weights
from cl_bench.tools.perf.harness import default_method
from cl_bench.profiles import PROFILES

# Dense (no sparsity) peak TFLOP/s from the vendors' data sheets: (bf16, fp32 on tensor cores or not).
PEAK_TFLOPS = {"H100 PCIe": (756.0, 51.0), "H100": (989.4, 67.0), "H200": (989.4, 67.0),
               "A100": (312.0, 19.5), "L40S": (362.0, 91.6), "L4": (121.0, 30.3)}


def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def peak_tflops(dev: torch.device, prec: str) -> tuple[str, float | None]:
    """(the device's name, its dense peak TFLOP/s at `prec`, or None where not listed)."""
    if dev.type != "cuda":
        return "cpu", None
    name = torch.cuda.get_device_name(dev)
    for key, (bf16, fp32) in PEAK_TFLOPS.items():  # "H100 PCIe" before "H100"
        if key in name:
            return name, bf16 if prec == "bf16" else fp32
    return name, None


def _setup(args, dev: torch.device):
    config = build({**PROFILES["cpu"], "profile": "cpu", "model": args.model,
                    "train": {**PROFILES["cpu"]["train"], "precision": "auto"},
                    "eval": {**PROFILES["cpu"]["eval"], "precision": "auto"}}, "perf")
    loaded = load(args.model, config.seed)
    loaded.model.to(dev)
    task = data.load_task(args, args.task, args.n, args.n, config.seed)
    return config, loaded, Encoder.from_config(loaded.tokenizer, config.train), task


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def train_step(args) -> dict:
    dev = device()
    config, loaded, encoder, task = _setup(args, dev)
    backend = TorchBackend(config, dev)
    rows = list(tokenize_train(encoder, task.train, None))
    if len(rows) < 2 * config.train.batch_size:
        raise UserError(f"perf train-step: --n {args.n} gives {len(rows)} examples; it needs at least "
                        f"{2 * config.train.batch_size} (two steps of {config.train.batch_size})")
    method = default_method(args, config, dev, loaded.tokenizer)
    method.setup(loaded.model)
    stage = Stage(0, [task], task.name)
    marks: list[float] = []
    seen: list[int] = []  # input tokens of each forward, pads included

    def on_step(step, parts):
        _sync(dev)
        marks.append(time.perf_counter())

    handle = method.model.register_forward_pre_hook(
        lambda module, a, kwargs: seen.append(kwargs["input_ids"].numel()), with_kwargs=True)
    optimizer = method.optimizer_for_stage(stage, None)
    _sync(dev)
    t0 = time.perf_counter()
    try:
        backend.train_stage(method, optimizer, stage, [rows], loaded.tokenizer.pad_token_id, on_step)
    finally:
        handle.remove()
    steps_s = [b - a for a, b in zip([t0, *marks], marks)][1:]  # the first step warms up
    n_steps = len(marks)
    tokens = sum(seen) / n_steps  # pads included: the products run over them
    step_s = statistics.median(steps_s)
    body, head = linear_weights(method.model)
    flop = 6 * (body + head) * tokens
    name, peak = peak_tflops(dev, backend.train_precision)
    return {"what": "train-step", "model": args.model, "method": args.method, "task": task.name,
            "device": name, "precision": backend.train_precision, "steps": n_steps,
            "batch_size": config.train.batch_size, "micro_batch_size": config.train.micro_batch_size,
            "tokens_per_step": tokens, "step_s": steps_s, "median_step_s": step_s,
            "tflops": flop / step_s / 1e12, "peak_tflops": peak,
            "mfu": None if peak is None else flop / step_s / 1e12 / peak,
            "peak_memory_gib": torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda" else None}


def gen_throughput(args) -> dict:
    from cl_bench.eval.vllm_generation import VllmEngine, VllmGenerator, check_available

    dev = device()
    config, loaded, encoder, task = _setup(args, dev)
    model, tok = loaded.model.eval(), loaded.tokenizer
    prec = precision.resolve(config.eval.precision, dev)
    prompts = [encoder.prompt_ids(e.prompt) for e in task.test][: args.n]
    generators = {"hf": greedy_generate}
    skipped = {}
    try:
        check_available()
        generators["vllm"] = VllmGenerator(VllmEngine)
    except UserError as exc:
        skipped["vllm"] = str(exc)
    out: dict[str, dict] = {}
    outputs = {}
    for name, generate in generators.items():
        times = []
        with precision.evaluation(prec, dev, model):
            for i in range(args.repeats + 1):  # the first call warms up (vllm: makes the engine)
                _sync(dev)
                t0 = time.perf_counter()
                outputs[name] = generate(model, prompts, args.max_new_tokens, tok.eos_token_id, tok.pad_token_id,
                                         args.batch_size)
                _sync(dev)
                if i:
                    times.append(time.perf_counter() - t0)
        new_tokens = sum(map(len, outputs[name]))
        out[name] = {"seconds": times, "median_s": statistics.median(times), "new_tokens": new_tokens,
                     "tokens_per_s": new_tokens / statistics.median(times),
                     "identical_to_hf": sum(a == b for a, b in zip(outputs[name], outputs["hf"]))}
    return {"what": "gen-throughput", "model": args.model, "task": task.name, "device": peak_tflops(dev, prec)[0],
            "precision": prec, "prompts": len(prompts), "batch_size": args.batch_size,
            "max_new_tokens": args.max_new_tokens, "generators": out, "not_run": skipped}
