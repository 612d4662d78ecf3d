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
the CKA probe (cl_bench/analysis/probes.py: how far each layer's representation
of the task moved) it separates "routed elsewhere" (JS high) from "the experts
the task uses changed" (JS low, CKA falling).

A routed layer is any module with `route(x) -> (probs, weights, indices)` and
`n_experts` (cl_bench.models.moe.UpcycledMoE and the layers built like it); a
model without one records nothing. The references live in the probe's state
(checkpointed with the run, so a resumed run keeps them); the record gets the JS
values and the distributions (rounded shares).
"""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from cl_bench.data import Encoder, collate
from cl_bench.models.modes import device_of, eval_mode


def routed_layers(model: nn.Module) -> list[nn.Module]:
    """The model's routed MoE layers, in depth order."""
    return [m for m in model.modules() if callable(getattr(m, "route", None)) and hasattr(m, "n_experts")]


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
        """Per routed layer, the share of the probe tokens' top-k assignments per expert."""
        layers = routed_layers(model)
        if not layers:
            return []
        counts = [torch.zeros(layer.n_experts, dtype=torch.long) for layer in layers]
        keep: dict[str, torch.Tensor] = {}

        def count(i):
            def pre(module, args):
                x = args[0].reshape(-1, args[0].shape[-1])[keep["mask"]]
                _, _, indices = module.route(x)
                counts[i] += torch.bincount(indices.reshape(-1).cpu(), minlength=module.n_experts)
            return pre

        rows = [encoder.train_example(e.prompt, e.answer) for e in task.test[: self.n_examples]]
        device = device_of(model)
        handles = [layer.register_forward_pre_hook(count(i)) for i, layer in enumerate(layers)]
        try:
            with eval_mode(model):
                for start in range(0, len(rows), self.batch_size):
                    batch = collate(rows[start:start + self.batch_size], encoder.tokenizer.pad_token_id)
                    mask = batch["attention_mask"].bool().to(device)
                    keep["mask"] = mask.reshape(-1)
                    model(input_ids=batch["input_ids"].to(device), attention_mask=mask.long(),
                          use_cache=False)
        finally:
            for handle in handles:
                handle.remove()
        return [(c.double() / max(int(c.sum()), 1)).tolist() for c in counts]

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
