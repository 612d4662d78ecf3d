"""Parameter accounting (PROTOCOL.md, "Parameter accounting").

total: every parameter held (tied weights once); trainable: requires_grad now;
active_per_token: what one token touches at inference: everything except, in
each MoE layer, the experts outside its top-k (the shared dense path, the whole
router and k experts count); deployed: what an exported model needs; for an
upcycled model that is all of it, as any expert may be routed to.

`schedule_report` gives these per stage of a method's growth schedule without
training or weights: on the meta device for the known configurations, through
the method's classmethod `param_schedule(model, n_tasks, args)` (Method's runs
its setup and per-stage hooks and reports after each). A method whose growth
depends on decisions made in training (bilevel-cka's Expand / Recycle) takes
them as keyword arguments of its param_schedule: `decisions` (a map
[task][layer][slot] of 0/1 for tasks 1..T-1, as its run records hold) or
`experts_per_layer` (a mean count after the last task, e.g. a paper's figure);
without them it reports its upper bound.
"""
from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Any

from torch import nn

from cl_bench.errors import UserError
from cl_bench.models.moe import experts_per_layer, moe_layers


def count(model: nn.Module) -> dict[str, Any]:
    """total, trainable, active_per_token, deployed, experts_per_layer of `model`."""
    params = list(model.parameters())  # deduplicated: tied embeddings count once
    total = sum(p.numel() for p in params)
    trainable = sum(p.numel() for p in params if p.requires_grad)
    idle = 0  # expert parameters a token does not touch
    for layer in moe_layers(model):
        per_expert = 3 * layer.h * layer.d  # gate + up + down of one slice
        idle += max(layer.n_experts - layer.k, 0) * per_expert
    return {"total": total, "trainable": trainable, "active_per_token": total - idle,
            "deployed": total, "experts_per_layer": experts_per_layer(model)}


def _model(spec: str | nn.Module) -> nn.Module:
    if isinstance(spec, nn.Module):
        return spec
    from cl_bench.models.loading import TINY, meta_model, tiny_llama

    if spec == TINY:
        return tiny_llama(0)[0]
    return meta_model(spec)  # UserError listing the known names otherwise


def schedule_report(model: str | nn.Module, method: str, n_tasks: int,
                    method_args: dict[str, Any] | None = None, *,
                    decisions: list | None = None,
                    experts_per_layer: float | None = None) -> list[dict[str, Any]]:
    """One row per stage ({"stage": t, **count}) of `method`'s growth over
    `n_tasks` tasks. `model`: a known configuration name (built on the meta
    device), 'tiny-llama', or a model (modified in place by the schedule).
    `decisions` / `experts_per_layer`: passed to the method's param_schedule,
    for methods that take them (module docstring)."""
    from cl_bench import registry

    if n_tasks < 1:
        raise UserError(f"--tasks {n_tasks}: give at least 1 task")
    cls = registry.get(method)
    args = cls.parse_args(method_args or {})
    given = {k: v for k, v in (("decisions", decisions), ("experts_per_layer", experts_per_layer))
             if v is not None}
    for key in given:
        if key not in inspect.signature(cls.param_schedule).parameters:
            takers = sorted(name for name, c in registry.available().items()
                            if key in inspect.signature(c.param_schedule).parameters)
            raise UserError(f"--{key.replace('_', '-')}: method '{cls.name}' makes no Expand / Recycle "
                            f"decisions, its growth is fixed; methods that take it: {', '.join(takers) or 'none'}")
    return cls.param_schedule(_model(model), n_tasks, args, **given)


def load_decisions(path: str | Path) -> list:
    """`--decisions`: a decision map [task][layer][slot] of 0/1 for tasks 1..T-1 (a
    leading null for task 0 may stand first), from a JSON file of it, or from a run
    record, its folder or its run.json, read by the one reader (record/io.read_record):
    each stage's diagnostics "decisions". A JSON object without a schema version is
    read as a record whose params hold each stage's `decisions`."""
    from cl_bench.record.io import RUN_FILE, read_record

    path = Path(path)
    if path.is_dir():
        return _decided([p.diagnostics.get("decisions") for p in read_record(path).params], path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise UserError(f"--decisions {path}: cannot read it as JSON ({exc})") from None
    if isinstance(data, dict) and "schema_version" in data and path.name == RUN_FILE:
        return _decided([p.diagnostics.get("decisions") for p in read_record(path.parent).params], path)
    if isinstance(data, dict):
        if not isinstance(data.get("params"), list):
            raise UserError(f"--decisions {path}: a JSON object must be a run record with 'params'; "
                            f"otherwise give a list [task][layer][slot] of 0/1")
        data = _decided([row.get("decisions") for row in data["params"]], path)
    if not isinstance(data, list):
        raise UserError(f"--decisions {path}: expected a list [task][layer][slot] of 0/1")
    return data


def _decided(decisions: list, path: Path) -> list:
    """A record's decisions, stage by stage: every stage after the first has some."""
    if any(d is None for d in decisions[1:]):
        raise UserError(f"--decisions {path}: the record has stages without decisions "
                        f"(its method records no Expand / Recycle decisions?)")
    return decisions


def params_command(model: str, method: str, tasks: int,
                   method_args: dict[str, Any] | None = None, *,
                   decisions: list | None = None,
                   experts_per_layer: float | None = None) -> list[dict[str, Any]]:
    """What `cl-bench params --model M --method X --tasks N [--decisions FILE |
    --experts-per-layer X]` reports: schedule_report's rows, each `stage` numbered as
    `show` and the site's parameter table number it (1..N; the record's `params` keep
    the 0-based index, record/io.stage_number)."""
    from cl_bench.record.io import stage_number

    rows = schedule_report(model, method, tasks, method_args, decisions=decisions,
                           experts_per_layer=experts_per_layer)
    return [{**r, "stage": stage_number(r["stage"])} for r in rows]


def format_schedule(rows: list[dict[str, Any]]) -> str:
    """A plain-text table of `schedule_report` rows, counts in one unit for the whole
    table (B, M or K: the largest the largest total reaches, so a small model's
    counts do not read 0.000B); experts per layer as one number where every layer
    has it, else their mean and the list. The last row's `bound` (what the counts
    assume), if any, closes it."""
    largest = max((r["total"] for r in rows), default=0)
    scale, unit = next(((s, u) for s, u in ((1e9, "B"), (1e6, "M"), (1e3, "K")) if largest >= s), (1, ""))
    lines = [f"{'stage':>5}  {'total':>9}  {'trainable':>9}  {'active/tok':>10}  {'deployed':>9}  experts/layer"]
    for r in rows:
        experts = r.get("experts_per_layer")
        shown = "-" if experts is None else (
            str(experts[0]) if len(set(experts)) == 1
            else f"mean {sum(experts) / len(experts):.2f} ({','.join(map(str, experts))})")
        cells = [f"{r[key] / scale:>{width}.3f}{unit}" for key, width in
                 (("total", 8), ("trainable", 8), ("active_per_token", 9), ("deployed", 8))]
        lines.append(f"{r['stage']:>5}  {'  '.join(cells)}  {shown}")
    if rows and rows[-1].get("bound"):
        lines.append(f"({rows[-1]['bound']})")
    return "\n".join(lines)
