"""MoE dispatch cost against the number of experts (`cl-bench perf moe`).

One UpcycledMoE layer at SmolLM2-135M's width (d 576, FFN 1536: slices of 192),
fp32 on the CPU, forward + backward over `tokens` tokens, for each expert count
E in `experts` (groups of 8). As in upcycle's task t, only the newest group
trains (`all_trainable=True`: every group, the harder case: frozen experts skip
their weight gradients) and routing is top-2 with new-row router init (near-uniform, so the
tokens spread over all E experts); the routed scale is 1 so every path carries
gradient. Because dispatch groups tokens by expert, the routed work is 2
experts per token whatever E is: the time at E = 48 should stay within 1.25x of
E = 8. The dense MLP alone is timed too, to show the routed share of the layer.
Dense routing (top-k = E, every expert on every token: cluster-upcycle's EESD
teacher) is timed as that teacher runs, a forward without gradient at the
training precision (bf16 autocast on a CPU with native bf16), through
`every_expert` (one SwiGLU a group) against `dispatch` (sorted by expert). Its
work grows with E, as E/K dense MLPs. Repeats are interleaved over E and the
paths, and the median is reported.
"""
from __future__ import annotations

import logging
import statistics
import time

import torch
from torch import nn

from cl_bench.losses import lm_loss
from cl_bench.run import precision
from cl_bench.models.balancing import balancing_losses
from cl_bench.models.moe import UpcycledMoE

log = logging.getLogger(__name__)

DENSE_PATHS = ("every_expert", "dispatch")


def _dense_mlp(d: int, H: int) -> nn.Module:
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    return LlamaMLP(LlamaConfig(hidden_size=d, intermediate_size=H))


def _layer(dense: nn.Module, n_experts: int, k: int, all_trainable: bool) -> UpcycledMoE:
    layer = UpcycledMoE(dense, k=k)
    while layer.n_experts < n_experts:
        for group in layer.groups:
            group.requires_grad_(all_trainable)
        layer.add_group()
    return layer.train()


def _fwd_bwd(module: nn.Module, x: torch.Tensor, grad: torch.Tensor) -> float:
    x = x.detach().requires_grad_()  # the residual stream carries gradient past the layer
    t0 = time.perf_counter()
    with balancing_losses():  # a training forward computes its balancing term, as in a method's loss
        module(x).backward(grad)
    return time.perf_counter() - t0


def _dense_routing(layer: UpcycledMoE, x: torch.Tensor, autocast: bool, path: str) -> float:
    """Seconds of a no-gradient forward with every expert routed, through `path`."""
    flat = x.reshape(-1, x.shape[-1])
    t0 = time.perf_counter()
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        probs, weights, indices = layer.route(flat)
        if path == "every_expert":
            layer.every_expert(flat, probs, list(layer.groups))
        else:
            layer.dispatch(flat, weights, indices)
    return time.perf_counter() - t0


def moe_benchmark(d: int = 576, H: int = 1536, tokens: int = 4096, experts=(8, 16, 48), k: int = 2,
                  repeats: int = 5, all_trainable: bool = False) -> dict:
    """Median seconds of one forward+backward per expert count, and ratios to the first."""
    torch.manual_seed(0)
    dense = _dense_mlp(d, H)
    layers = {E: _layer(dense, E, k, all_trainable) for E in experts}
    x = torch.randn(1, tokens, d)  # (B, T, d)
    grad = torch.randn_like(x)
    times: dict[str, list[float]] = {"dense": [], **{str(E): [] for E in experts}}
    for layer in layers.values():  # warm-up: allocator and first-call costs
        _fwd_bwd(layer, x, grad)
    for _ in range(repeats):
        times["dense"].append(_fwd_bwd(dense, x, grad))
        for E, layer in layers.items():
            times[str(E)].append(_fwd_bwd(layer, x, grad))
            layer.zero_grad(set_to_none=True)
    autocast = precision.resolve("auto", torch.device("cpu")) == "bf16"
    dense_routing = {f"{E} {path}": [] for E in experts for path in DENSE_PATHS}
    for _ in range(repeats):
        for E, layer in layers.items():
            routed, layer.k = layer.k, E
            for path in DENSE_PATHS:
                dense_routing[f"{E} {path}"].append(_dense_routing(layer, x, autocast, path))
            layer.k = routed
    dense_median = {key: statistics.median(v) for key, v in dense_routing.items()}
    dense_speedup = {str(E): dense_median[f"{E} dispatch"] / dense_median[f"{E} every_expert"] for E in experts}
    for E in experts:
        log.info("dense routing, E=%d: every_expert %.3fs, dispatch %.3fs (x%.2f)", E,
                 dense_median[f"{E} every_expert"], dense_median[f"{E} dispatch"], dense_speedup[str(E)])
    median = {key: statistics.median(v) for key, v in times.items()}
    base = str(experts[0])
    ratio = {str(E): median[str(E)] / median[base] for E in experts}
    routed = {str(E): median[str(E)] - median["dense"] for E in experts}
    routed_ratio = {str(E): routed[str(E)] / routed[base] for E in experts}
    for E in experts:
        log.info("E=%d: %.3fs (x%.2f vs E=%s; routed part %.3fs, x%.2f)", E, median[str(E)],
                 ratio[str(E)], base, routed[str(E)], routed_ratio[str(E)])
    return {"what": "moe", "d": d, "H": H, "tokens": tokens, "k": k, "experts": list(experts),
            "repeats": repeats, "all_trainable": all_trainable, "seconds": times, "median_s": median, "ratio_vs_first": ratio,
            "routed_s": routed, "routed_ratio_vs_first": routed_ratio,
            "within_1_25x": ratio[str(experts[-1])] <= 1.25,
            "dense_routing": {"precision": "bf16" if autocast else "fp32", "seconds": dense_routing,
                              "median_s": dense_median, "dispatch_over_every_expert": dense_speedup},
            "torch_threads": torch.get_num_threads()}


def _answer_loss(model: nn.Module, rows: list[dict], pad_id: int, batch_size: int) -> float:
    """Token-weighted mean cross-entropy over the answer tokens (+ EOS) of `rows`."""
    from cl_bench.data.encode import IGNORE, collate

    total = tokens = 0.0
    model.eval()
    with torch.no_grad():
        for start in range(0, len(rows), batch_size):
            batch = collate(rows[start:start + batch_size], pad_id)
            n = int((batch["labels"] != IGNORE).sum())
            total += float(lm_loss(model, batch)) * n
            tokens += n
    return total / tokens


UPCYCLED_VARIANTS = {
    # name: upcycle_model keyword arguments (besides init)
    "swap": {"shared": "swap"},
    "add s=1 (paper code)": {"shared": "add", "routed_scale_init": 1.0},
}


def upcycle_gap(args) -> dict:
    """How far upcycling moves the model before any training (METHODS.md: more than
    2% needs a function-preserving mechanism): the answer-token loss of the dense
    model and of each upcycled variant (all layers, 8 slices, top-2, router rows
    N(0, 0.02) from seed 0) on held-out test examples of each task, and the
    relative change. Drop-Upcycling (half of each expert re-drawn) is measured too:
    it changes the function by design."""
    import copy

    from cl_bench.config import PROFILES, build
    from cl_bench.data.encode import Encoder, tokenize_train
    from cl_bench.models.loading import load
    from cl_bench.models.expert_init import drop_upcycle_init, slice_experts
    from cl_bench.models.moe import upcycle_model
    from cl_bench.tools.perf import data

    config = build({**PROFILES["cpu"], "profile": "cpu", "model": args.model}, "perf")
    loaded = load(args.model, config.seed)
    encoder = Encoder.from_config(loaded.tokenizer, config.train)
    tasks = data.load_tasks(args, args.task, n_train=1, n_test=args.n,
                           seed=config.seed)
    rows = {t.name: list(tokenize_train(encoder, t.test, None)) for t in tasks}
    pad = loaded.tokenizer.pad_token_id
    variants = {name: (kw, slice_experts) for name, kw in UPCYCLED_VARIANTS.items()}
    variants["drop-upcycle swap"] = ({"shared": "swap"}, drop_upcycle_init(0.5))
    loss = {"dense": {name: _answer_loss(loaded.model, r, pad, args.batch_size) for name, r in rows.items()}}
    for name, (kwargs, init) in variants.items():
        torch.manual_seed(0)
        model = copy.deepcopy(loaded.model)
        upcycle_model(model, init=init, **kwargs)
        loss[name] = {task: _answer_loss(model, r, pad, args.batch_size) for task, r in rows.items()}
        log.info("%s: %s", name, {t: round(v, 4) for t, v in loss[name].items()})
    change = {name: {t: 100 * (v / loss["dense"][t] - 1) for t, v in per_task.items()}
              for name, per_task in loss.items() if name != "dense"}
    mean_change = {name: statistics.mean(per_task.values()) for name, per_task in change.items()}
    return {"what": "upcycle-gap", "model": args.model, "tasks": [t.name for t in tasks],
            "examples_per_task": args.n, "split": "test", "loss": loss, "change_pct": change,
            "mean_change_pct": mean_change,
            "within_2pct": {name: max(abs(v) for v in c.values()) <= 2.0 for name, c in change.items()}}
