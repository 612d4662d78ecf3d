"""Where a method's stage-1 step goes (issue 24): torch.profiler over the stage of
`cl-bench perf step`'s setting (the `cpu` profile, `--task A,B`, `--n` items a
task; stage 0's hooks only, stage B trained through the torch backend), the
method's hooks marked as regions (forwards; "backward": the backend's backward of each
micro-batch loss; replay_loss holds _inner_replay and, on its steps, the outer step). Writes a small JSON summary: the regions' times
and the top operators by self CPU time.

    python scripts/profile_step.py --method bilevel-cka --method-arg min_mask_updates=1 \
        --output results/perf/step-profile-bilevel-cka-smollm2.json
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from types import SimpleNamespace

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from cl_bench.backends.torch_backend import TorchBackend
from cl_bench.data.encode import tokenize_train
from cl_bench.tools.perf import harness
from cl_bench.tools.perf import step as perf_step
from cl_bench.data.replay import ReplayBuffer


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--method", default="bilevel-cka")
    p.add_argument("--method-arg", action="append", default=[])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--task", default="Py150,NumGLUE-ds")
    p.add_argument("--n", type=int, default=16)
    p.add_argument("--top", type=int, default=20)
    p.add_argument("--data-dir")
    p.add_argument("--output", required=True)
    args = p.parse_args(argv)
    ns = SimpleNamespace(model=args.model, task=args.task, n=args.n, data_dir=args.data_dir)
    config, loaded, encoder, tasks = harness._setup(ns)
    rows = list(tokenize_train(encoder, tasks[1].train, None))
    buffer = ReplayBuffer(config.replay, config.seed)
    buffer.add_task(tasks[0])
    replay_rows = list(tokenize_train(encoder, buffer.examples(), None))
    method, optimizer, stage = perf_step.begun(args.method, config, loaded, tasks, encoder,
                                               dict(a.split("=", 1) for a in args.method_arg))
    for hook in ("loss", "replay_loss", "_inner_replay", "before_step"):  # the method's parts as regions
        if hasattr(method, hook):
            inner = getattr(method, hook)
            setattr(method, hook, lambda *a, _f=inner, _n=hook, **k: _region(_n, _f, *a, **k))
    backward = torch.Tensor.backward  # the backend's backward of each micro-batch loss
    torch.Tensor.backward = lambda self, *a, **k: _region("backward", backward, self, *a, **k)
    step_fn = optimizer.step
    optimizer.step = lambda *a, **k: _region("optimizer.step", step_fn, *a, **k)
    backend = TorchBackend(config, torch.device("cpu"))
    marks = []
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        backend.train_stage(method, optimizer, stage, [rows], loaded.tokenizer.pad_token_id,
                            lambda s, parts: marks.append(time.perf_counter()),
                            replay_rows if method.uses_replay else None)
    wall = time.perf_counter() - t0
    events = prof.key_averages()
    regions = {e.key: round(e.cpu_time_total / 1e6, 3) for e in events if e.key.startswith("method.")}
    ops = sorted((e for e in events if not e.key.startswith("method.")), key=lambda e: -e.self_cpu_time_total)
    total_self = sum(e.self_cpu_time_total for e in events)
    out = {"command": "python " + " ".join(sys.argv), "method": args.method, "model": args.model,
           "tasks": args.task, "items_per_task": args.n, "precision": backend.train_precision,
           "steps": len(marks), "wall_s_profiled": round(wall, 2),
           "step_s_profiled": [round(b - a, 2) for a, b in zip([t0, *marks], marks)],
           "regions_s": regions,
           "top_ops_by_self_cpu": [{"op": e.key, "self_s": round(e.self_cpu_time_total / 1e6, 3),
                                    "share": round(e.self_cpu_time_total / total_self, 4), "calls": e.count}
                                   for e in ops[:args.top]],
           "torch_threads": torch.get_num_threads()}
    with open(args.output, "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")
    print(json.dumps(out, indent=1))
    return 0


def _region(name, fn, *args, **kwargs):
    with record_function(f"method.{name}"):
        return fn(*args, **kwargs)


if __name__ == "__main__":
    sys.exit(main())
