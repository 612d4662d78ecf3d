"""Routing drift: whether an earlier task's tokens are still routed to the experts
they went to when the task was learned (the diagnosis of SAME, Stabilizing MoE).

After every stage the probe runs the model, teacher-forced, on a fixed probe set
of each task trained so far (the first `n_examples` test examples: prompt +
answer + EOS, as in training, non-pad tokens) and counts, for every routed MoE
layer l, the top-k assignments of those tokens per expert:

    p_l(task j, stage b)[e] = assignments to expert e / all assignments    (sums to 1)

The first time a task is probed (the stage that trained it), p_l becomes its
reference; at every later stage the probe records, per layer,

    JS_l(j, b) = JS(p_l(j, b) || p_l(j, j))
               = 1/2 KL(p || m) + 1/2 KL(q || m),  m = (p + q) / 2,  in bits (0..1)

Experts added after the reference get probability 0 in it. 0: the task's tokens
are routed exactly as when it was learned; 1: to disjoint experts. Together with
the CKA probe (cl_bench/eval/probes/representation.py: how far each layer's representation
of the task moved) it separates "routed elsewhere" (JS high) from "the experts
the task uses changed" (JS low, CKA falling).

Two kinds of routed layer are probed:
- token routing: a module with `route(x) -> (probs, weights, indices)` and
  `n_experts` (cl_bench.models.moe.UpcycledMoE and the layers built like it),
  counted as above;
- sequence routing: a module that weights its experts per sequence and exposes
  the weights of its last forward as `routing_weights` (B, E) (SAME's routed
  linears, CaRE's layers), whose share of expert e is its mean weight over the
  probe's sequences, p_l[e] = sum_b w_b[e] / sum_b sum_e' w_b[e']. Such layers
  pool the prompt: the probe's forward carries the labels, so the prompt is
  the part with label -100, as in training (cl_bench/models/prompt_pool.py);
  a forward that does not recompute the weights (a bypassed layer) counts nothing.
A model without either records nothing. The references live in the probe's state
(checkpointed with the run, so a resumed run keeps them); the record gets the JS
values and the distributions (rounded shares).
"""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from cl_bench.data.encode import Encoder, collate
from cl_bench.losses import answer_forward
from cl_bench.models.modes import device_of, eval_mode


def token_routed(module: nn.Module) -> bool:
    return callable(getattr(module, "route", None)) and hasattr(module, "n_experts")


def routed_layers(model: nn.Module) -> list[nn.Module]:
    """The model's routed layers of either kind (module docstring), in depth order."""
    return [m for m in model.modules() if token_routed(m) or hasattr(m, "routing_weights")]


def js_divergence(p: list[float], q: list[float]) -> float:
    """Jensen-Shannon divergence of two distributions over the same support, in bits;
    the shorter is padded with zeros (experts added later)."""
    n = max(len(p), len(q))
    p = list(p) + [0.0] * (n - len(p))
    q = list(q) + [0.0] * (n - len(q))

    def kl(a, m):
        return sum(x * math.log2(x / y) for x, y in zip(a, m) if x > 0)

    m = [(x + y) / 2 for x, y in zip(p, q)]
    return max(0.0, 0.5 * kl(p, m) + 0.5 * kl(q, m))


class RoutingProbe:
    def __init__(self, n_examples: int, batch_size: int = 4):
        if n_examples < 1:
            raise ValueError("n_examples must be >= 1")
        self.n_examples = n_examples
        self.batch_size = batch_size
        self.references: dict[str, list[list[float]]] = {}  # task -> per routed layer, shares

    @torch.no_grad()
    def distributions(self, model: nn.Module, encoder: Encoder, task) -> list[list[float]]:
        """Per routed layer, the share of the probe tokens' top-k assignments (token
        routing) or of the probe sequences' expert weights (sequence routing) per expert."""
        layers = routed_layers(model)
        if not layers:
            return []
        counts: list[torch.Tensor | None] = [None] * len(layers)  # (E,) per layer, float64
        keep: dict[str, torch.Tensor] = {}

        def add(i: int, per_expert: torch.Tensor) -> None:
            per_expert = per_expert.double().cpu()
            counts[i] = per_expert if counts[i] is None else counts[i] + per_expert

        def count(i):
            def pre(module, args):
                if token_routed(module):
                    x = args[0].reshape(-1, args[0].shape[-1])[keep["mask"]]
                    _, _, indices = module.route(x)
                    add(i, torch.bincount(indices.reshape(-1), minlength=module.n_experts))
                else:
                    keep[f"before{i}"] = module.routing_weights
            return pre

        def weighed(i):
            def post(module, args, output):
                if token_routed(module):
                    return
                w = module.routing_weights  # (B, E); the same object: this forward did not route
                if w is not None and w is not keep.pop(f"before{i}", None):
                    add(i, w.float().sum(dim=0))
            return post

        rows = [encoder.train_example(e.prompt, e.answer) for e in task.test[: self.n_examples]]
        device = device_of(model)
        handles = [h for i, layer in enumerate(layers)
                   for h in (layer.register_forward_pre_hook(count(i)), layer.register_forward_hook(weighed(i)))]
        try:
            with eval_mode(model):
                for start in range(0, len(rows), self.batch_size):
                    batch = collate(rows[start:start + self.batch_size], encoder.tokenizer.pad_token_id)
                    mask = batch["attention_mask"].bool().to(device)
                    keep["mask"] = mask.reshape(-1)
                    # labels: sequence-routed layers pool the prompt, as in training (the
                    # loss's forward: the head runs at the answer positions only)
                    answer_forward(model, {"input_ids": batch["input_ids"].to(device), "attention_mask": mask.long(),
                                           "labels": batch["labels"].to(device)})
        finally:
            for handle in handles:
                handle.remove()
        return [[] if c is None else (c / max(float(c.sum()), 1e-12)).tolist() for c in counts]

    def after_stage(self, model: nn.Module, encoder: Encoder, tasks: list) -> dict[str, dict[str, list]]:
        """Probe every task in `tasks` (those trained so far). A task seen for the
        first time stores its reference; every task gets its distributions and,
        from the stage after its own, the JS divergence per layer."""
        out: dict[str, dict[str, list]] = {}
        for task in tasks:
            shares = self.distributions(model, encoder, task)
            if not shares:
                continue
            ref = self.references.setdefault(task.name, shares)
            entry: dict[str, list] = {"shares": [[round(s, 5) for s in layer] for layer in shares]}
            if ref is not shares:
                entry["js"] = [round(js_divergence(p, q), 5) for p, q in zip(shares, ref)]
            out[task.name] = entry
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"references": self.references}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.references = dict(state["references"])
