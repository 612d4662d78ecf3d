"""What CaRE writes into the run record per stage (run.json "params"; schema in
docs/methods/care.md, "Records"), besides the pseudo-label sizes and the shared
adapter's drift:

    perceiver_uniform: |CE_end - ln G| <= UNIFORM_CE_TOL * ln G,  CE_end = mean perceiver CE
                       over the last 10% of the stage's steps
    task_id_acc_l = share of test sequences whose lowest-entropy perceiver in layer l is their task's
    oracle_gap = mean over tasks of CE(entropy routing) - CE(the task's own router forced)

Source: none (cl-bench's own diagnostics; CaRE, ICML 2026, arXiv 2602.03473,
reports task-ID accuracy only at the classifier).
"""
from __future__ import annotations

import logging
import math
from typing import Any, Callable

import torch

from cl_bench.data.encode import IGNORE, collate
from cl_bench.method import Stage
from cl_bench.record.schema import rounded

from .args import UNIFORM_CE_TOL

log = logging.getLogger("cl_bench.methods.care")


def uniformity(perceiver_ce: dict[int, list[float]], pseudo_classes: int, stage: Stage) -> dict[str, Any]:
    """perceiver_ce_end, perceiver_uniform and warnings of the stage, from the perceiver
    CE of each step's micro-batches (step -> values)."""
    steps = sorted(perceiver_ce)
    if not steps:
        return {"perceiver_ce_end": None, "perceiver_uniform": None, "warnings": []}
    tail = [ce for s in steps[-math.ceil(0.1 * len(steps)):] for ce in perceiver_ce[s]]
    ce_end, uniform_ce = sum(tail) / len(tail), math.log(pseudo_classes)
    uniform = abs(ce_end - uniform_ce) <= UNIFORM_CE_TOL * uniform_ce
    warnings = []
    if uniform:
        warnings.append(f"stage {stage.index} ({stage.label}): the perceivers' cross-entropy at the "
                        f"stage's end, {ce_end:.4f}, is within {UNIFORM_CE_TOL:.0%} of ln G = "
                        f"{uniform_ce:.4f} (uniform): they did not learn the pseudo-classes, so "
                        f"entropy routing cannot tell this task apart")
        log.warning("care: %s", warnings[-1])
    return {"perceiver_ce_end": rounded(ce_end), "perceiver_uniform": uniform, "warnings": warnings}


@torch.no_grad()
def diagnostics(forward: Callable, examples: list[tuple[str, list[dict]]], n_layers: int, pad: int,
                size: int, device: torch.device) -> dict[str, Any]:
    """Per-layer task-ID accuracy and the oracle gap over `examples` (task j: its name
    and train-form rows, the j-th triplet's), in micro-batches of `size`; `forward(batch,
    forced)` -> (output, per-layer routing records), as CaRE._forward."""
    hits_all, seen = torch.zeros(n_layers), 0
    by_task, ce_entropy, ce_oracle, counts = {}, {}, {}, {}
    for j, (name, rows) in enumerate(examples):
        hits, sums, tokens = torch.zeros(n_layers), [0.0, 0.0], 0
        for start in range(0, len(rows), size):
            b = {k: v.to(device) for k, v in collate(rows[start:start + size], pad).items()}
            n_tok = int((b["labels"][:, 1:] != IGNORE).sum())
            out, records = forward(b, None)
            hits += torch.stack([(r["entropy"].argmin(dim=1) == j).float().sum() for r in records]).cpu()
            sums[0] += out.loss.item() * n_tok
            sums[1] += forward(b, j)[0].loss.item() * n_tok
            tokens += n_tok
        if not rows:
            continue
        counts[name] = len(rows)
        by_task[name] = [rounded(h / len(rows)) for h in hits.tolist()]
        ce_entropy[name] = rounded(sums[0] / max(tokens, 1))
        ce_oracle[name] = rounded(sums[1] / max(tokens, 1))
        hits_all += hits
        seen += len(rows)
    if not seen:
        return {}
    gaps = [ce_entropy[k] - ce_oracle[k] for k in ce_entropy]
    return {"diag_n": counts,
            "task_id_acc": [rounded(h / seen) for h in hits_all.tolist()],
            "task_id_acc_by_task": by_task, "answer_ce": ce_entropy, "answer_ce_oracle": ce_oracle,
            "oracle_gap": rounded(sum(gaps) / len(gaps))}


def relative_change(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x - ref).norm() / ref.norm().clamp(min=1e-12))
