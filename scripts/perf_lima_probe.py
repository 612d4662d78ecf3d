"""The Lima probe's cost beside a stage's evaluation, in one process on one machine.

Loads the `cpu` profile's model and test subsets (paper6) and times, alternating
`--repeats` times, (a) the Lima probe, then (b) the evaluation after the last stage (every task of the
order, as the `cpu` profile scores it then, each task's seconds logged as it ends), the probe with `--items` items
(cl_bench/eval/general/lima.py), both in `--precision` (fp32 where the CPU lacks native
bf16). Prints one JSON object: the seconds of each repeat, their medians, and the
ratio probe / evaluation. A ratio, not absolute seconds, is what carries to another
machine (and only roughly across precisions).

    PYTHONPATH=. OMP_NUM_THREADS=2 python scripts/perf_lima_probe.py --items 64 --repeats 3 \\
        --output results/perf/lima-probe-answer-positions-smollm2-fp32.json

The record also names the machine (cl_bench/run/machine.machine: the CPU, its
cores, which bf16 instruction sets it has, the load average when the record is written).
"""
from __future__ import annotations

import argparse
import json
import logging
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

from cl_bench.run import precision
from cl_bench.backends.torch_backend import TorchBackend
from cl_bench.benchmarks.trace import load_benchmark, resolve_data_dir
from cl_bench.config import resolve
from cl_bench.data.encode import Encoder
from cl_bench.eval.evaluation import evaluate_task
from cl_bench.eval.general.lima import LimaProbe
from cl_bench.models.loading import load
from cl_bench.run.machine import machine

log = logging.getLogger("perf_lima_probe")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--output", type=Path, default=None, help="also write the JSON here (a results/perf record)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", force=True)  # after imports that set handlers
    config = resolve("cpu", None, {"eval": {"precision": args.precision}})
    d = config.data
    tasks = load_benchmark(resolve_data_dir(None), d.order, d.n_train, d.n_test, config.seed, d.n_train_per_task,
                           d.n_test_per_task, d.test_split)
    loaded = load(config.model, config.seed, "cpu", progress=False)
    encoder = Encoder.from_config(loaded.tokenizer, config.train)
    backend = TorchBackend(config, torch.device("cpu"))
    probe = LimaProbe.load(resolve_data_dir(None), args.items)
    model = loaded.model
    times: dict[str, list[float]] = {"evaluation": [], "probe": []}
    for _ in range(args.repeats):
        with precision.evaluation(backend.eval_precision, backend.device, model):
            t0 = time.perf_counter()
            probe.measure(model, encoder)
            times["probe"].append(time.perf_counter() - t0)
            log.info("probe (%d items): %.1f s", args.items, times["probe"][-1])
            total = 0.0
            for task in tasks:  # each task's seconds as it ends: a partial sum bounds the ratio from above
                t0 = time.perf_counter()
                evaluate_task(model, encoder, task, config.eval, None, backend.generate)
                total += time.perf_counter() - t0
                log.info("evaluation of %s (%d items): %.1f s; so far %.1f s, probe / so far %.3f",
                         task.name, len(task.test), time.perf_counter() - t0, total, times["probe"][-1] / total)
            times["evaluation"].append(total)
    med = {k: statistics.median(v) for k, v in times.items()}
    text = json.dumps({"command": shlex.join(["python", "scripts/perf_lima_probe.py", *sys.argv[1:]]),
                       "machine": machine(), "threads": torch.get_num_threads(),
                       "precision": backend.eval_precision, "items": args.items,
                       "test_items": sum(len(t.test) for t in tasks), "seconds": times, "median_s": med,
                       "ratio_probe_to_evaluation": med["probe"] / med["evaluation"]}, indent=1)
    print(text)
    if args.output is not None:
        args.output.write_text(text + "\n")


if __name__ == "__main__":
    main()
