"""The harness's own costs, on the `cpu` profile's settings.

generation: batched greedy decoding (left padding, KV cache) against the same
    prompts decoded one at a time; reports both times, the speed-up and how many
    outputs are identical.
zero-shot:  the zero-shot row of `--method` (its model after setup) against
    `--against`'s on the profile's eval settings.
harness:    a training stage of `--method` (default: the baseline method, full
    fine-tuning) through cl-bench's backend (method hooks, token-weighted
    accumulation, clipping, a progress bar and the step log) against a bare
    PyTorch loop over the same batches and trainable weights; the time ratio.
(deepspeed, the stage on the deepspeed backend against the torch backend: zero_cost.py)
Repeats alternate which side runs first and report medians.
"""
from __future__ import annotations

import copy
import statistics
import time

import torch
from tqdm import tqdm

from cl_bench import registry
from cl_bench.run import precision
from cl_bench.backends.torch_backend import TorchBackend
from cl_bench.eval.evaluation import evaluate_task
from cl_bench.config import build
from cl_bench.data.encode import IGNORE, Encoder, epoch_order, steps, tokenize_train
from cl_bench.losses import lm_loss
from cl_bench.eval.generation import greedy_generate
from cl_bench.method import MethodContext, Stage
from cl_bench.models.loading import load
from cl_bench.profiles import PROFILES
from cl_bench.tools.perf import data


def cpu_setup(args):
    """(config, loaded model, encoder, tasks): the `cpu` profile for `args.model`, and the
    tasks of `args.task` (comma-separated) with `args.n` training and test items each."""
    config = build({**PROFILES["cpu"], "profile": "cpu", "model": args.model}, "perf")
    loaded = load(args.model, config.seed)
    tasks = [data.load_task(args, name, args.n, args.n, config.seed) for name in args.task.split(",")]
    return config, loaded, Encoder.from_config(loaded.tokenizer, config.train), tasks


def generation(args) -> dict:
    config, loaded, encoder, tasks = cpu_setup(args)
    tok = loaded.tokenizer
    prompts = [encoder.prompt_ids(e.prompt) for t in tasks for e in t.test][: args.n]

    def decode(batch_size: int):
        t0 = time.perf_counter()
        out = greedy_generate(loaded.model, prompts, args.max_new_tokens, tok.eos_token_id,
                              tok.pad_token_id, batch_size)
        return time.perf_counter() - t0, out

    times = {"batched": [], "single": []}
    for _ in range(args.repeats):
        t_b, batched = decode(args.batch_size)
        t_s, single = decode(1)
        times["batched"].append(t_b)
        times["single"].append(t_s)
    same = sum(a == b for a, b in zip(batched, single))
    tb, ts = statistics.median(times["batched"]), statistics.median(times["single"])
    return {"what": "generation", "model": args.model, "tasks": args.task, "prompts": len(prompts),
            "batch_size": args.batch_size, "max_new_tokens": args.max_new_tokens,
            "prompt_tokens_mean": sum(map(len, prompts)) / len(prompts),
            "new_tokens_total": sum(map(len, batched)),
            "batched_s": times["batched"], "single_s": times["single"],
            "median_batched_s": tb, "median_single_s": ts, "speedup": ts / tb,
            "identical_outputs": same, "torch_threads": torch.get_num_threads()}


def default_method(args, config, device, tokenizer):
    """`--method` with its own default arguments."""
    cls = registry.get(args.method)
    return cls(cls.parse_args({}), MethodContext(config, device, tokenizer))


def harness(args) -> dict:
    config, loaded, encoder, tasks = cpu_setup(args)
    model, pad = loaded.model, loaded.tokenizer.pad_token_id
    rows = list(tokenize_train(encoder, tasks[0].train, None))
    stage = Stage(0, tasks[:1], tasks[0].name)
    t = config.train
    batches = list(steps(rows, epoch_order(len(rows), config.seed, stage.label, 0), t.batch_size,
                         t.micro_batch_size, pad))
    method = default_method(args, config, torch.device("cpu"), loaded.tokenizer)
    method.setup(model)
    backend = TorchBackend(config, torch.device("cpu"))

    def through_harness() -> float:
        optimizer = method.optimizer_for_stage(stage, None)
        t0 = time.perf_counter()
        with tqdm(total=len(batches), desc="harness", leave=False) as bar:
            log = []
            backend.train_stage(method, optimizer, stage, [rows], pad,
                                lambda s, parts: (log.append(parts), bar.update()))
        return time.perf_counter() - t0

    def bare_loop() -> float:
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=1e-5, betas=(0.9, 0.95), weight_decay=0.0)
        model.train()
        t0 = time.perf_counter()
        for batch in batches:
            optimizer.zero_grad(set_to_none=True)
            for micro in batch.micro_batches:
                w = int((micro["labels"] != IGNORE).sum()) / batch.n_tokens
                (lm_loss(model, micro) * w).backward()
            torch.nn.utils.clip_grad_norm_(params, t.grad_clip)
            optimizer.step()
        return time.perf_counter() - t0

    bare_loop()  # warm-up: allocator, first-call costs
    times = {"harness": [], "bare": []}
    for i in range(args.repeats):  # alternate which side goes first
        if i % 2:
            times["bare"].append(bare_loop())
            times["harness"].append(through_harness())
        else:
            times["harness"].append(through_harness())
            times["bare"].append(bare_loop())
    ratios = [h / b for h, b in zip(times["harness"], times["bare"])]
    return {"what": "harness", "model": args.model, "method": args.method,
            "trainable_params": sum(p.numel() for p in model.parameters() if p.requires_grad), "task": tasks[0].name, "examples": len(rows),
            "steps": len(batches), "batch_size": t.batch_size, "micro_batch_size": t.micro_batch_size,
            "harness_s": times["harness"], "bare_s": times["bare"], "ratios": ratios,
            "median_ratio": statistics.median(ratios), "torch_threads": torch.get_num_threads()}


def zero_shot(args) -> dict:
    """The zero-shot row (every task of `--task`, `--n` test items each, the `cpu`
    profile's eval settings and precision) through `--method`'s model after its setup,
    as the sequencer evaluates it before any training, against `--against`'s;
    repeats alternate the sides; medians, and how many predictions are identical."""
    config = build({**PROFILES["cpu"], "profile": "cpu", "model": args.model}, "perf")
    loaded = load(args.model, config.seed)
    tasks = [data.load_task(args, name, 1, args.n, config.seed) for name in data.order(args)]
    encoder = Encoder.from_config(loaded.tokenizer, config.train)
    backend = TorchBackend(config, torch.device("cpu"))
    models = {}
    for name in (args.method, args.against):
        cls = registry.get(name)
        method = cls(cls.parse_args(cls.args_for(config)), MethodContext(config, backend.device, loaded.tokenizer,
                                                                         all_tasks=tasks, encoder=encoder))
        method.setup(copy.deepcopy(loaded.model))
        models[name] = method.model.eval()

    def row(name: str) -> tuple[float, list]:
        t0 = time.perf_counter()
        with precision.evaluation(backend.eval_precision, backend.device, models[name]):
            evals = [evaluate_task(models[name], encoder, t, config.eval, generate=backend.generate) for t in tasks]
        return time.perf_counter() - t0, [r["prediction"] for e in evals for r in e.rows]

    sides = (args.method, args.against)
    times: dict[str, list[float]] = {s: [] for s in sides}
    preds = {}
    for i in range(args.repeats):  # alternate which side goes first
        for side in (sides if i % 2 == 0 else sides[::-1]):
            seconds, preds[side] = row(side)
            times[side].append(seconds)
    median = {s: statistics.median(v) for s, v in times.items()}
    return {"what": "zero-shot", "model": args.model, "profile": "cpu", "precision": backend.eval_precision,
            "method": args.method, "against": args.against, "tasks": names, "test_items_per_task": args.n,
            "eval_batch_size": config.eval.batch_size, "max_new_tokens_cap": config.eval.max_new_tokens_cap,
            "seconds": times, "median_s": median, "ratio": median[args.method] / median[args.against],
            "identical_predictions": sum(a == b for a, b in zip(preds[args.method], preds[args.against])),
            "predictions": len(preds[args.method]), "torch_threads": torch.get_num_threads()}
