"""The Lima held-out probe: the loss on held-out general instruction data.

A proxy for TRACE's instruction-following delta, not TRACE's GPT-4 judgement: at
the zero-shot point and after every stage, the model is run teacher-forced on a
fixed set of Lima examples (prompt + answer + EOS, tokenised and cut as in
training) and the probe records, per item i, the summed negative log-likelihood
of its answer tokens s_i (nats) and their count n_i. The point's score is the
mean answer NLL per token over all the items' answer tokens,

    L_b = sum_i s_{b,i} / sum_i n_i,

and the drift after stage b is ΔLima_b = L_b - L_zs (> 0: the loss on general
instruction data rose). Its 95% interval is a paired percentile bootstrap over
items (cl_bench/metrics/bootstrap.py): one draw of item indices, applied to both
points, L recomputed as a ratio on each replicate.

Items: TRACE's Lima test split holds prompts without answers (all 300 answers are
empty in the 500 release), so the probe's items are a fixed seeded subset of
Lima's train split (1030 examples), the same for every run and seed (the key does
not involve the run seed), and `replay.lima` draws from the rest of that split
while the probe is on: the items stay held out. Shapes: N probe items, B batch, T
tokens, V vocabulary.
"""
from __future__ import annotations

import hashlib
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from cl_bench.benchmarks.trace.loader import Example, file_sha256, load_split
from cl_bench.data.encode import IGNORE, Encoder, collate
from cl_bench.errors import UserError
from cl_bench.metrics import bootstrap
from cl_bench.models.modes import device_of, eval_mode

TASK = "Lima"
SPLIT = "train"  # the test split has no answers (see above)
SEED = 0  # the bootstrap's own seed, as cl_bench/metrics/intervals.py's
ZERO_SHOT = "-1"  # the key of the zero-shot point (results.ZERO_SHOT_STAGE)
LABEL = ("ΔLima: mean answer NLL per token (nats) on held-out Lima instruction data, minus zero-shot; "
         "a proxy (loss), not TRACE's GPT-4 judgement")


def probe_items(examples: list[Example], n: int) -> list[Example]:
    """A fixed subset of n examples in file order; the order of one seeded shuffle,
    keyed through sha256, so it is the same in every process, for every run and
    seed, and n=32 is a subset of n=64."""
    key = hashlib.sha256(b"cl-bench/general/lima-probe").digest()
    order = list(range(len(examples)))
    random.Random(int.from_bytes(key[:8], "big")).shuffle(order)
    return [examples[i] for i in sorted(order[:n])]


@torch.no_grad()
def answer_nll(model: nn.Module, rows: list[dict], pad_id: int, batch_size: int) -> tuple[list[float], list[int]]:
    """Per row, in input order, the summed NLL (nats) of its labelled tokens and their count.

    Rows run longest first, so a batch pads little, and the LM head projects only the
    positions from the batch's first labelled one on (`logits_to_keep`, a 1D tensor of
    positions, as transformers' LlamaForCausalLM takes it since 4.56): the logits of a
    prompt are never computed. The labelled positions' logits, picked as contiguous
    rows, go through one cross-entropy (docs/protocol.md, "The Lima probe")."""
    sums, counts = [0.0] * len(rows), [0] * len(rows)
    order = sorted(range(len(rows)), key=lambda i: -len(rows[i]["input_ids"]))
    device = device_of(model)
    with eval_mode(model):
        for start in range(0, len(order), batch_size):
            index = order[start:start + batch_size]
            batch = collate([rows[i] for i in index], pad_id)
            targets = batch["labels"][:, 1:].to(device)  # (B, T-1): position t predicts token t+1
            scored = targets != IGNORE  # (B, T-1)
            if not bool(scored.any()):
                continue
            first = int(scored.any(dim=0).nonzero()[0])
            keep = torch.arange(first, targets.shape[1], device=device)  # (K,)
            out = model(input_ids=batch["input_ids"].to(device), attention_mask=batch["attention_mask"].to(device),
                        use_cache=False, logits_to_keep=keep)
            logits = out.logits  # (B, K, V)
            if logits.shape[1] != len(keep):  # a forward that ignores logits_to_keep: every position's
                logits = logits[:, keep]
            picked = scored[:, first:]  # (B, K)
            nll = F.cross_entropy(logits[picked].float(), targets[:, first:][picked], reduction="none")  # (n,)
            row = picked.nonzero()[:, 0]  # (n,) the batch row of each scored token
            per_row = torch.zeros(len(index), dtype=nll.dtype, device=device).index_add_(0, row, nll)
            for b, i in enumerate(index):
                sums[i], counts[i] = float(per_row[b]), int(picked[b].sum())
    return sums, counts


@dataclass
class LimaProbe:
    """The probe of one run: its items, and what it records at each point."""

    items: list[Example]
    sha256: str  # of the Lima split file the items come from
    batch_size: int = 4

    @classmethod
    def load(cls, data_dir: Path, n: int) -> LimaProbe:
        path = Path(data_dir) / TASK / f"{SPLIT}.json"
        if Path(data_dir).is_dir() and not path.exists():  # on in the cpu and paper profiles
            raise UserError(f"general.lima={n}: the Lima probe reads {path}, which does not exist; add TRACE's "
                            f"Lima folder there, or set general.lima=0 to run without the probe")
        examples = load_split(data_dir, TASK, SPLIT)
        if n > len(examples):
            raise UserError(f"general.lima={n}: Lima's {SPLIT} split has {len(examples)} examples; "
                            f"set general.lima to at most {len(examples)}")
        return cls(probe_items(examples, n), file_sha256(Path(data_dir) / TASK / f"{SPLIT}.json"))

    @property
    def indices(self) -> set[int]:
        return {e.index for e in self.items}

    def measure(self, model: nn.Module, encoder: Encoder) -> dict[str, Any]:
        """One point: {"items", "tokens", "nll" (per item sums, nats), "mean", "seconds"}."""
        t0 = time.perf_counter()
        rows = [encoder.train_example(e.prompt, e.answer) for e in self.items]
        sums, counts = answer_nll(model, rows, encoder.tokenizer.pad_token_id, self.batch_size)
        return {"items": [e.index for e in self.items], "tokens": counts, "nll": [round(s, 4) for s in sums],
                "mean": round(sum(sums) / sum(counts), 5), "seconds": round(time.perf_counter() - t0, 2)}

    def record(self, general: dict | None, point: str, model: nn.Module, encoder: Encoder) -> dict:
        """`general` (the record's field) with this point measured and the deltas updated."""
        general = dict(general or {})
        lima = dict(general.get("lima") or {"label": LABEL, "split": SPLIT, "sha256": self.sha256, "points": {}})
        if lima["sha256"] != self.sha256:
            raise UserError(f"{TASK}/{SPLIT}.json changed since the run started (sha256 differs); the Lima probe "
                            f"pairs the same items at every point: resume with the original data")
        lima["points"] = {**lima["points"], point: self.measure(model, encoder)}
        lima["delta"] = deltas(lima["points"])
        general["lima"] = lima
        return general


def _same_items(a: dict, b: dict, where: str) -> None:
    """Paired over items only where both points scored the same items, tokenised alike."""
    if a["items"] != b["items"] or a["tokens"] != b["tokens"]:
        raise ValueError(f"Lima probe: point {where} scored other items (or other tokens) than zero-shot; "
                         f"ΔLima is paired over the same items")


def ratio_replicates(nll: np.ndarray, tokens: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """(R,) replicates of sum(nll) / sum(tokens) over the item draws idx (R, N)."""
    return nll[idx].sum(axis=1) / tokens[idx].sum(axis=1)


def delta_replicates(points: dict[str, dict], point: str,
                     resamples: int = bootstrap.RESAMPLES) -> tuple[float, np.ndarray]:
    """ΔLima at `point`, L_point - L_zs, and its (R,) paired bootstrap replicates. The draws depend
    only on the item count, so two runs over the same items are resampled alike (compare pairs them)."""
    zero, p = points[ZERO_SHOT], points[point]
    _same_items(p, zero, point)
    tokens = np.asarray(zero["tokens"], float)
    idx = bootstrap.draws([len(tokens)], resamples, SEED)[0]  # (R, N)
    nll, nll0 = np.asarray(p["nll"], float), np.asarray(zero["nll"], float)
    reps = ratio_replicates(nll, tokens, idx) - ratio_replicates(nll0, tokens, idx)
    return float((nll.sum() - nll0.sum()) / tokens.sum()), reps


def deltas(points: dict[str, dict]) -> dict[str, dict]:
    """Per stage point b, {"value": ΔLima_b, "ci": its 95% interval}; {} without a zero-shot point."""
    if ZERO_SHOT not in points:
        return {}
    out = {}
    for b in sorted((k for k in points if k != ZERO_SHOT), key=int):
        value, reps = delta_replicates(points, b)
        out[b] = {"value": round(value, 5), "ci": [round(v, 5) for v in bootstrap.interval(reps)]}
    return out


def measured(general: dict | None, point: str) -> bool:
    """Whether the record's `general` field holds the Lima probe at `point`."""
    return point in ((general or {}).get("lima") or {}).get("points", {})


def final_delta(general: dict | None) -> dict | None:
    """ΔLima after the last stage probed ({"stage", "value", "ci"}), or None."""
    delta = ((general or {}).get("lima") or {}).get("delta") or {}
    if not delta:
        return None
    last = max(delta, key=int)
    return {"stage": int(last), **delta[last]}
