"""`cl-bench perf step-options`: the costs a training step pays besides its products,
each against its alternative, for each of `--methods` (issue 53, item 2): what pays if
the harness changes, measured apart from the rest of the step. (It measured the fused
AdamW the harness now runs, `method.fused_adamw`, and the cast that did not pay.)

- **The optimiser step.** torch's AdamW on the CPU runs its per-parameter loop unless
  told otherwise (`foreach=None` picks the loop for CPU tensors). Timed over the method's
  trainable parameters, with the gradients of one real step: the loop (what the harness
  ran before issue 53), `foreach=True` and `fused=True` (what it runs now); and how far the fused kernel's weights drift
  from the loop's after three steps from the same state (rounding: it fuses the update).
- **Frozen weights cast once.** Under bf16 autocast every linear casts its fp32 weight to
  bf16 at every forward; autocast keeps the cast across the forward only for weights that
  train. A method with a frozen base (adapters, frozen experts) recasts it each time.
  Timed: the step's task forward and backward as the harness runs it, against the same
  with the frozen linear weights (not the tied embedding, which the embedding lookup also
  reads) cast to bf16 once beforehand; the losses must agree exactly (the same rounding).
  Only in bf16 and only where the method freezes some linear weight.

Each timing is of the timed stage's first step (`--task A,B` as `perf step`, the `cpu`
profile's settings, `--n` items; `--precision` the training precision, default the
profile's), from a fresh copy with stage B begun, repeats
alternating the order; medians of wall seconds and of the process's CPU seconds
(the latter is what a shared machine's other work disturbs least). The share of each
option is against the step's forward, backward and optimiser step (loop), as measured.
Last, the step as the harness runs it (the task pass and its AdamW), after a first
step (so the optimiser's moments exist, as in mid-stage), once under torch.profiler: its operators' self CPU time in matrix products and attention against
the rest, and the top operators (`eval_profile.op_profile`).
"""
from __future__ import annotations

import statistics
import time

import torch

from cl_bench import registry
from cl_bench.data.encode import IGNORE, epoch_order, steps
from cl_bench.errors import UserError
from cl_bench.run import precision
from cl_bench.run.machine import machine
from cl_bench.tools.perf.eval_profile import op_profile
from cl_bench.tools.perf.step import begun, two_stages

OPTIMISERS = {"loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}


def _timed(fn) -> tuple[float, float]:
    """(wall s, this process's CPU s) of fn()."""
    w, c = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - w, time.process_time() - c


def _medians(samples: list[tuple[float, float]]) -> dict[str, float]:
    return {"wall_s": statistics.median(w for w, _ in samples), "cpu_s": statistics.median(c for _, c in samples)}


def _optimiser(optimizer: torch.optim.Optimizer, kind: str) -> torch.optim.AdamW:
    """An AdamW over `optimizer`'s groups and hyper-parameters, implemented as `kind`."""
    groups = [{k: v for k, v in g.items() if k not in ("foreach", "fused", "differentiable", "capturable")}
              for g in optimizer.param_groups]
    return torch.optim.AdamW(groups, **OPTIMISERS[kind])


def _frozen_linears(model: torch.nn.Module) -> list[torch.nn.Linear]:
    tied = {id(p) for p in model.get_input_embeddings().parameters()}
    return [m for m in model.modules() if isinstance(m, torch.nn.Linear)
            and not m.weight.requires_grad and id(m.weight) not in tied]


def step_options(args) -> dict:
    methods = [m for m in (args.methods or registry.baseline()).split(",") if m]
    for name in methods:
        registry.get(name)
    if args.repeats < 1:
        raise UserError("perf step-options: --repeats must be at least 1")
    config, loaded, encoder, tasks, rows, _, _ = two_stages(args, "step-options")
    device, pad, t = torch.device("cpu"), loaded.tokenizer.pad_token_id, config.train
    trained_in = precision.resolve(args.precision or t.precision, device)  # --precision pins it
    order = epoch_order(len(rows), config.seed, tasks[1].name, 0)
    first = next(iter(steps(rows, order, t.batch_size, t.micro_batch_size, pad)))
    bf16 = trained_in == "bf16"

    def fresh(name: str, cast: bool):
        torch.manual_seed(config.seed)
        method, optimizer, _ = begun(name, config, loaded, tasks, encoder, {})
        method.model.train()
        if cast:
            for m in _frozen_linears(method.model):
                m.weight.data = m.weight.data.to(torch.bfloat16)
        return method, optimizer

    def task_pass(method) -> float:
        """The first step's task micro-batches, forward and backward, as the backend weighs them."""
        total = 0.0
        with precision.autocast(trained_in, device):
            for micro in first.micro_batches:
                loss, _ = method.loss(micro, 0)
                weighted = loss * int((micro["labels"] != IGNORE).sum()) / max(first.n_tokens, 1)
                weighted.backward()
                total += weighted.item()
        return total

    before = machine()
    out: dict[str, dict] = {}
    for name in methods:
        method, optimizer = fresh(name, cast=False)
        n_frozen = sum(m.weight.numel() for m in _frozen_linears(method.model))
        n_trainable = sum(p.numel() for g in optimizer.param_groups for p in g["params"])
        del method, optimizer  # one copy at a time from here: SmolLM2's weights, gradients and moments
        casting = bf16 and n_frozen > 0
        sides = ("autocast", "cast once") if casting else ("autocast",)
        passes: dict[str, list] = {s: [] for s in sides}
        losses: dict[str, float] = {}
        opt: dict[str, list] = {k: [] for k in OPTIMISERS}
        for r in range(args.repeats + 1):  # the first round warms up, unrecorded
            for side in (sides if r % 2 == 0 else sides[::-1]):
                m, o = fresh(name, cast=side == "cast once")
                box = {}
                timing = _timed(lambda: box.setdefault("loss", task_pass(m)))
                losses[side] = box["loss"]
                if r:
                    passes[side].append(timing)
                if side == "autocast":
                    params = [p for g in o.param_groups for p in g["params"]]
                    kinds = list(OPTIMISERS) if r % 2 == 0 else list(OPTIMISERS)[::-1]
                    for kind in kinds:
                        saved = [p.detach().clone() for p in params]
                        o2 = _optimiser(o, kind)
                        o2.step()  # its state, outside the clock
                        timing = _timed(o2.step)
                        if r:
                            opt[kind].append(timing)
                        with torch.no_grad():
                            for p, s in zip(params, saved):
                                p.copy_(s)
                        del o2
                del m, o
        drift = _fused_drift(fresh(name, cast=False), task_pass)
        m, o = fresh(name, cast=False)
        task_pass(m), o.step(), m.model.zero_grad(set_to_none=True)  # a first step: the moments exist, as mid-stage
        profiled = op_profile(lambda: _timed(lambda: (task_pass(m), o.step()))[1])  # the step as the harness runs it
        del m, o
        step = {s: _medians(v) for s, v in passes.items()}
        optim = {k: _medians(v) for k, v in opt.items()}
        whole = {u: step["autocast"][u] + optim["loop"][u] for u in ("wall_s", "cpu_s")}
        entry = {
            "trainable_params": n_trainable,
            "task_pass": step, "optimiser_step": optim,
            "step_as_run": whole,
            "fused_over_loop": {u: optim["fused"][u] / optim["loop"][u] for u in whole},
            "fused_saves_share_of_step": {u: (optim["loop"][u] - optim["fused"][u]) / whole[u] for u in whole},
            "fused_max_rel_drift_3_steps": drift,
            "frozen_linear_params": n_frozen,
            "profiled_step": profiled,
        }
        if casting:
            entry["cast_once_over_autocast"] = {u: step["cast once"][u] / step["autocast"][u] for u in whole}
            entry["cast_once_losses_equal"] = losses["cast once"] == losses["autocast"]
        out[name] = entry
        print(f"{name}: optimiser step loop {optim['loop']['cpu_s']:.3f} / fused {optim['fused']['cpu_s']:.3f} "
              f"CPU s of a {whole['cpu_s']:.2f} s step"
              + (f"; frozen cast once {entry['cast_once_over_autocast']['cpu_s']:.3f}x the pass" if casting else ""),
              flush=True)
    return {
        "what": "step-options", "model": args.model, "profile": "cpu", "precision": trained_in,
        "tasks": [x.name for x in tasks], "items_per_task": args.n, "timed_stage": tasks[1].name,
        "batch_size": t.batch_size, "micro_batch_size": t.micro_batch_size, "repeats": args.repeats,
        "tokens": int(sum(int(m["attention_mask"].sum()) for m in first.micro_batches)),
        "methods": out, "machine": {**before, "loadavg_after": machine()["loadavg"]},
        "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
    }


def _fused_drift(begun_pair, task_pass) -> float:
    """The largest relative difference between weights after three AdamW steps from the
    same state and gradients: the loop against the fused kernel."""
    method, optimizer = begun_pair
    task_pass(method)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    start = [p.detach().clone() for p in params]
    grads = [p.grad.detach().clone() if p.grad is not None else None for p in params]
    ends = {}
    for kind in ("loop", "fused"):
        with torch.no_grad():
            for p, s, g in zip(params, start, grads):
                p.copy_(s)
                p.grad = None if g is None else g.clone()
        o = _optimiser(optimizer, kind)
        for _ in range(3):
            o.step()
        ends[kind] = [p.detach().clone() for p in params]
    return max(((a - b).abs().max() / a.abs().max().clamp_min(1e-30)).item()
               for a, b in zip(ends["loop"], ends["fused"]) if a.numel())
