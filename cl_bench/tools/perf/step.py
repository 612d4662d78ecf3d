"""`cl-bench perf step`: one optimiser step of `--method` in its second stage against
`--against`'s, and the passes that step needs, each timed alone on the same batches.

`--task A,B`: A is stage 0 (its hooks run, nothing trains: the step's cost does not
depend on the trained values) and fills the replay buffer as the harness does
(its budget of A's items); B is the timed stage, on the `cpu` profile's settings
(batch sizes, lengths, precision) with `--n` items a task. A side's stage runs
through the torch backend, from a fresh copy of the model each repeat; each step's
time comes from the step log's timestamps (the first step from the stage's start).
Passes: on the same steps' batches (the same replay draws as the backend's), from a
fresh copy with stage B begun: the task micro-batches' forward and backward
(`method.loss`), the optimiser step with clipping, and the method's own
`step_passes` (e.g. a replay forward and backward). Repeats alternate the sides;
medians over repeats and steps.
"""
from __future__ import annotations

import copy
import statistics
import time

import torch

from cl_bench import registry
from cl_bench.run import precision
from cl_bench.backends.loop import step_key
from cl_bench.backends.torch_backend import TorchBackend
from cl_bench.data.encode import IGNORE, collate, epoch_order, steps, tokenize_train
from cl_bench.errors import UserError
from cl_bench.method import MethodContext
from cl_bench.tools.perf.harness import cpu_setup
from cl_bench.data.replay import ReplayBuffer, sample_rows


def begun(name: str, config, loaded, tasks: list, encoder, method_args: dict):
    """`name` on a fresh copy of `loaded.model` (its `method_args` over the profile's),
    stage 0's hooks run, stage 1 begun: (method, its optimiser, stage 1)."""
    cls = registry.get(name)
    ctx = MethodContext(config, torch.device("cpu"), loaded.tokenizer, all_tasks=tasks, encoder=encoder)
    method = cls(cls.parse_args(cls.args_for(config) | method_args), ctx)
    method.setup(copy.deepcopy(loaded.model))
    stages = method.plan(tasks)
    ctx.n_stages = len(stages)
    method.before_task(stages[0])
    method.after_task(stages[0])
    method.before_task(stages[1])
    return method, method.optimizer_for_stage(stages[1], None), stages[1]


def two_stages(args, what: str):
    """What `perf step` and `perf loss-path` set up alike: the `cpu` config, the model and
    the two tasks of --task (stage 0, then the timed stage), the timed stage's tokenised
    rows, the replay rows stage 0 leaves, and a torch backend on the CPU."""
    config, loaded, encoder, tasks = cpu_setup(args)
    if len(tasks) != 2:
        raise UserError(f"perf {what}: --task A,B (stage 0, then the timed stage), not {args.task!r}")
    rows = list(tokenize_train(encoder, tasks[1].train, None))
    buffer = ReplayBuffer(config.replay, config.seed)
    buffer.add_task(tasks[0])
    replay_rows = list(tokenize_train(encoder, buffer.examples(), None))
    return config, loaded, encoder, tasks, rows, replay_rows, TorchBackend(config, torch.device("cpu"))


def step(args) -> dict:
    config, loaded, encoder, tasks, rows, replay_rows, backend = two_stages(args, "step")
    device, pad = torch.device("cpu"), loaded.tokenizer.pad_token_id
    t = config.train
    method_args = dict(a.split("=", 1) for a in args.method_arg or [])

    def begun_(name: str):
        return begun(name, config, loaded, tasks, encoder, method_args if name == args.method else {})

    def stage_steps(name: str) -> tuple[list[float], list[bool]]:
        method, optimizer, stage = begun_(name)
        marks, outer = [], []

        def on_step(s, parts):
            marks.append(time.perf_counter())
            outer.append(any(k.startswith("replay_mask_") for k in parts))

        t0 = time.perf_counter()
        backend.train_stage(method, optimizer, stage, [rows], pad, on_step,
                            replay_rows if method.uses_replay else None)
        return [b - a for a, b in zip([t0, *marks], marks)], outer

    def passes() -> dict[str, list[float]]:
        """Each pass alone, once per step, on that step's batches."""
        method, optimizer, stage = begun_(args.method)
        model = method.model
        model.train()
        params = [p for g in optimizer.param_groups for p in g["params"]]
        out: dict[str, list[float]] = {}

        def timed(name, fn):
            model.zero_grad(set_to_none=True)
            with precision.autocast(backend.train_precision, device):
                t0 = time.perf_counter()
                fn()
                out.setdefault(name, []).append(time.perf_counter() - t0)

        order = epoch_order(len(rows), config.seed, stage.label, 0)
        for i, batch in enumerate(steps(rows, order, t.batch_size, t.micro_batch_size, pad)):
            micros = batch.micro_batches

            def task_pass():
                for micro in micros:
                    loss, _ = method.loss(micro, i)
                    (loss * int((micro["labels"] != IGNORE).sum()) / max(batch.n_tokens, 1)).backward()

            replay = None
            if method.uses_replay and replay_rows:
                replay = collate(sample_rows(replay_rows, t.micro_batch_size, step_key(config.seed, stage, 0, i)), pad)
            timed("task forward and backward", task_pass)
            own = method.step_passes(micros, replay, i)
            for name, fn in own.items():  # a first call outside the clock: the reference cache, say
                with precision.autocast(backend.train_precision, device):
                    fn()
            for name, fn in own.items():
                timed(name, fn)
            task_pass()

            def optimiser_step():
                torch.nn.utils.clip_grad_norm_(params, t.grad_clip)
                optimizer.step()

            t0 = time.perf_counter()
            optimiser_step()
            out.setdefault("optimiser step and clipping", []).append(time.perf_counter() - t0)
        return out

    sides = (args.method, args.against)
    stage_steps(args.against)  # warm-up: allocator, first-call costs
    runs: dict[str, list] = {s: [] for s in sides}
    pass_runs: list[dict[str, list[float]]] = []
    for r in range(args.repeats):  # alternate which side goes first
        for side in (sides if r % 2 == 0 else sides[::-1]):
            runs[side].append(stage_steps(side))
        pass_runs.append(passes())
    n_steps = len(runs[args.method][0][0])
    outer = runs[args.method][0][1]
    median_step = {s: [statistics.median(r[0][k] for r in runs[s]) for k in range(n_steps)] for s in sides}
    median_pass = {name: [statistics.median(p[name][k] for p in pass_runs) for k in range(n_steps)]
                   for name in pass_runs[0]}
    needed = [sum(median_pass[n][k] for n in median_pass
                  if n != "reference forward of one row" and (n != "outer step" or outer[k])) for k in range(n_steps)]
    return {
        "what": "step", "model": args.model, "profile": "cpu", "precision": backend.train_precision,
        "method": args.method, "against": args.against, "method_args": method_args,
        "tasks": [x.name for x in tasks], "items_per_task": args.n, "timed_stage": tasks[1].name,
        "steps": n_steps, "batch_size": t.batch_size, "micro_batch_size": t.micro_batch_size,
        "replay_rows": len(replay_rows), "outer_step": outer,
        "step_s": {s: [r[0] for r in runs[s]] for s in sides},
        "pass_s": {name: [p[name] for p in pass_runs] for name in pass_runs[0]},
        "median_step_s": median_step, "median_pass_s": median_pass, "needed_s": needed,
        "step_over_needed": [m / n for m, n in zip(median_step[args.method], needed)],
        "step_over_against": [m / u for m, u in zip(median_step[args.method], median_step[args.against])],
        "torch_threads": torch.get_num_threads(),
    }
