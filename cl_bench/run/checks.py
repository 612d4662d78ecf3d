"""The checks of a run's config that need neither data nor model, made once per
process before anything loads (`cl-bench run`: before --nproc starts ranks, and
for --resume on the recorded config; `cl-bench campaign`: for every line of its
plan). The method's class is looked up here, once, and handed on (Checked) to
cl_bench/run/prepare.py.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cl_bench import registry
from cl_bench.backends import check_support
from cl_bench.config import RunConfig, check_per_task
from cl_bench.errors import UserError, did_you_mean


@dataclass
class Checked:
    """A config that passed the checks, with what they found: the method's class
    and its parsed arguments."""

    config: RunConfig
    method_cls: type
    method_args: Any


def check_config(config: RunConfig) -> Checked:
    """The method, its arguments and backend, the benchmark and its order, the
    per-task fields, the model's name. Fills the config's lr schedule from the method's where the config
    leaves it unset (the schedule the run records)."""
    method_cls = _method_class(config.method)
    check_support(method_cls, config)
    t = config.train  # the lr schedule the run records: the config's, else the method's
    kind, warmup = method_cls.lr_schedule
    t.lr_schedule = kind if t.lr_schedule is None else t.lr_schedule
    t.warmup_ratio = warmup if t.warmup_ratio is None else t.warmup_ratio
    method_args = method_cls.parse_args(method_cls.args_for(config))
    method_cls.check_run(method_args, config)
    for key, lr in dataclasses.asdict(method_args).items():  # lr, and any other learning rate (*_lr)
        if (key == "lr" or key.endswith("_lr")) and isinstance(lr, float) and not (math.isfinite(lr) and lr > 0):
            raise UserError(f"method_args.{key}={lr} must be a finite number > 0, e.g. --method-arg {key}=3e-4")
    benchmark = registry.get_benchmark(config.data.benchmark)
    benchmark.resolve_order(config.data.order)
    check_per_task(config, list(benchmark.cl_tasks), benchmark.title)
    _check_model(config.model)
    return Checked(config, method_cls, method_args)


def _method_class(name: str) -> type:
    """registry.get, with a hint where only the case is wrong (method names are lower-case)."""
    try:
        return registry.get(name)
    except UserError:
        names = {key for cls in registry.available().values() for key in (cls.name, *cls.aliases)}
        if name.lower() == name or name.lower() not in names:
            raise
    raise UserError(f"unknown method '{name}'; did you mean '{name.lower()}'? method names are lower-case")


def _check_model(spec: str) -> None:
    """An unknown model name fails here, before any data loads, with the closest
    built-in name (case-insensitive); the rule is models.loading.load's."""
    from cl_bench.models.loading import builtin_names

    names = builtin_names()
    if (spec in names or Path(spec).expanduser().exists()
            or spec.count("/") == 1 and not spec.startswith((".", "/"))):
        return
    raise UserError(f"unknown model '{spec}'; {did_you_mean(spec.lower(), names)}not a built-in name "
                    f"({', '.join(names)}), an existing directory, or a hub id like 'org/name'")
