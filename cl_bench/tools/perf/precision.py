"""`cl-bench perf precision`: fp32 against bf16 autocast (cl_bench/run/precision.py) on
the `cpu` profile's lengths and test prompts.

training: the same optimiser steps of full fine-tuning (every weight trained, as
    the base Method does) over `--n` training examples of each task, timed under
    each precision; repeats alternate which precision goes first; tokens/s counts
    the non-padding tokens of the steps; medians.
decoding: every test prompt of the profile (its tasks, test sizes and decoding
    budgets) generated greedily once under each precision from the pretrained
    weights, before any training (the scores are the zero-shot row's): tokens/s,
    how many outputs are identical, and each task's score under both.
"""
from __future__ import annotations

import statistics
import time

import torch

from cl_bench.run import precision
from cl_bench.backends.torch_backend import TorchBackend
from cl_bench.benchmark import DEFAULT as DEFAULT_BENCHMARK
from cl_bench.config import resolve
from cl_bench.data.encode import Encoder, tokenize_train
from cl_bench.eval.evaluation import evaluate_task
from cl_bench.eval.generation import greedy_generate
from cl_bench.method import Method, MethodArgs, MethodContext, Stage
from cl_bench.models.loading import load
from cl_bench.tools.perf import data

SIDES = ("fp32", "bf16")


def precision_benchmark(args) -> dict:
    bench = data.benchmark(args)
    own = {} if bench.name == DEFAULT_BENCHMARK else {"data": {"benchmark": bench.name}}  # its own profile fields
    config = resolve("cpu", None, {"model": args.model, **own})
    d = config.data
    tasks = data.load_tasks(args, d.order, d.n_train, d.n_test, config.seed, n_train_per_task=d.n_train_per_task,
                            n_test_per_task=d.n_test_per_task)
    loaded = load(args.model, config.seed)
    encoder = Encoder.from_config(loaded.tokenizer, config.train)
    device = torch.device("cpu")
    method = Method(MethodArgs(), MethodContext(config, device, loaded.tokenizer))
    method.setup(loaded.model)
    pad = loaded.tokenizer.pad_token_id

    # decoding first, on the pretrained weights (the zero-shot model); training then moves them
    warm = [encoder.prompt_ids(t.test[0].prompt) for t in tasks]
    for side in SIDES:  # warm-up: first-call costs of both precisions' kernels
        with precision.autocast(side, device):
            greedy_generate(loaded.model, warm, 8, loaded.tokenizer.eos_token_id, pad, len(warm))
    decoded: dict[str, dict] = {}
    for side in SIDES:
        new_tokens = [0]

        def counting(*a, **k):
            out = greedy_generate(*a, **k)
            new_tokens[0] += sum(map(len, out))
            return out

        t0 = time.perf_counter()
        with precision.autocast(side, device):
            evals = {t.name: evaluate_task(loaded.model, encoder, t, config.eval, generate=counting)
                     for t in tasks}
        seconds = time.perf_counter() - t0
        decoded[side] = {"seconds": seconds, "new_tokens": new_tokens[0], "tokens_per_s": new_tokens[0] / seconds,
                         "scores": {n: e.score for n, e in evals.items()},
                         "predictions": {n: [r["prediction"] for r in e.rows] for n, e in evals.items()}}

    rows = [r for t in tasks for r in list(tokenize_train(encoder, t.train[:args.n], None))]
    stage = Stage(0, tasks, "precision")
    n_tokens = sum(len(r["input_ids"]) for r in rows)

    def train(side: str) -> float:
        config.train.precision = side
        backend = TorchBackend(config, device)
        optimizer = method.optimizer_for_stage(stage, None)
        t0 = time.perf_counter()
        backend.train_stage(method, optimizer, stage, [rows], pad)
        return time.perf_counter() - t0

    train("bf16")  # warm-up: allocator, first-call costs, the bf16 kernels
    times: dict[str, list[float]] = {s: [] for s in SIDES}
    for i in range(args.repeats):  # alternate which precision goes first
        for side in (SIDES if i % 2 == 0 else SIDES[::-1]):
            times[side].append(train(side))
    medians = {s: statistics.median(v) for s, v in times.items()}

    agree = {n: sum(a == b for a, b in zip(decoded["fp32"]["predictions"][n], decoded["bf16"]["predictions"][n]))
             for n in decoded["fp32"]["predictions"]}
    per_task = {t.name: {"prompts": len(t.test), "identical": agree[t.name],
                         "score_fp32": decoded["fp32"]["scores"][t.name],
                         "score_bf16": decoded["bf16"]["scores"][t.name],
                         "score_diff": decoded["bf16"]["scores"][t.name] - decoded["fp32"]["scores"][t.name]}
                for t in tasks}
    return {
        "what": "precision", "model": args.model, "profile": "cpu", "tasks": [t.name for t in tasks],
        "training": {"examples": len(rows), "tokens_per_pass": n_tokens,
                     "batch_size": config.train.batch_size, "micro_batch_size": config.train.micro_batch_size,
                     "max_prompt_len": config.train.max_prompt_len, "max_answer_len": config.train.max_answer_len,
                     "seconds": times, "median_s": medians,
                     "tokens_per_s": {s: n_tokens / m for s, m in medians.items()},
                     "speedup_bf16": medians["fp32"] / medians["bf16"]},
        "decoding": {"prompts": sum(len(t.test) for t in tasks), "batch_size": config.eval.batch_size,
                     **{s: {k: v for k, v in decoded[s].items() if k not in ("predictions", "scores")}
                        for s in SIDES},
                     "speedup_bf16": decoded["fp32"]["seconds"] / decoded["bf16"]["seconds"],
                     "identical_outputs": sum(agree.values()), "per_task": per_task},
        "native_bf16": precision.native_bf16(device), "torch_threads": torch.get_num_threads(),
    }
