"""Prompt/answer tokenisation, truncation, collation and batching.

Training sequence = prompt tokens (the model's own special prefix, e.g. BOS, kept)
+ answer tokens + EOS; labels are -100 on the prompt, so the loss covers the
answer and EOS only (TRACE's collator). Long prompts are cut in the middle by
default, keeping the head (the instruction) and the tail (the answer cue);
`truncation=left` restores TRACE's left cut, which deletes MeetingBank's
instruction.

Tokenised splits are `datasets.Dataset`s, cached on disk under the run's cache
directory, keyed by the data, the tokenizer and the lengths.
"""
from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Iterable, Iterator

import torch

from cl_bench.config_fields import TrainConfig

IGNORE = -100


@dataclass(frozen=True)
class Encoder:
    """Turns {prompt, answer} strings into token ids under one TrainConfig."""

    tokenizer: object
    max_prompt_len: int
    max_answer_len: int
    truncation: str
    truncation_head: int

    @classmethod
    def from_config(cls, tokenizer, train: TrainConfig) -> "Encoder":
        return cls(tokenizer, train.max_prompt_len, train.max_answer_len, train.truncation,
                   train.truncation_head)

    @cached_property
    def special_prefix(self) -> list[int]:
        """The ids the tokenizer puts before any text (BOS for Llama-3; none for SmolLM2)."""
        with_special = self.tokenizer("a").input_ids
        without = self.tokenizer("a", add_special_tokens=False).input_ids
        return with_special[: len(with_special) - len(without)]

    def prompt_ids(self, prompt: str) -> list[int]:
        prefix = self.special_prefix
        ids = self.tokenizer(prompt, add_special_tokens=False).input_ids
        budget = self.max_prompt_len - len(prefix)
        if len(ids) > budget:
            if self.truncation == "left":
                ids = ids[len(ids) - budget:]
            else:
                head = min(self.truncation_head, budget)
                ids = ids[:head] + ids[len(ids) - (budget - head):]
        return prefix + ids

    def answer_ids(self, answer: str) -> list[int]:
        ids = self.tokenizer(answer, add_special_tokens=False).input_ids
        return ids[: self.max_answer_len - 1] + [self.tokenizer.eos_token_id]

    def train_example(self, prompt: str, answer: str) -> dict[str, list[int]]:
        p, a = self.prompt_ids(prompt), self.answer_ids(answer)
        return {"input_ids": p + a, "labels": [IGNORE] * len(p) + a}

    def fingerprint(self) -> str:
        tok = self.tokenizer
        vocab_sha = hashlib.sha256(json.dumps(sorted(tok.get_vocab().items())).encode()).hexdigest()
        key = [type(tok).__name__, vocab_sha, tok.eos_token_id, self.max_prompt_len,
               self.max_answer_len, self.truncation, self.truncation_head]
        return hashlib.sha256(json.dumps(key).encode()).hexdigest()[:16]


def tokenize_train(encoder: Encoder, examples: list, cache_dir: Path | None):
    """A datasets.Dataset of {input_ids, labels}, cached on disk when cache_dir is set."""
    import datasets

    records = [{"prompt": e.prompt, "answer": e.answer} for e in examples]
    ds = datasets.Dataset.from_list(records)
    kwargs = {}
    if cache_dir is not None:
        content = hashlib.sha256(json.dumps(records).encode()).hexdigest()[:16]
        cache_dir.mkdir(parents=True, exist_ok=True)
        kwargs["cache_file_name"] = str(cache_dir / f"train-{content}-{encoder.fingerprint()}.arrow")
    return ds.map(lambda r: encoder.train_example(r["prompt"], r["answer"]),
                  remove_columns=["prompt", "answer"], desc="tokenising", **kwargs)


def collate(rows: list[dict[str, list[int]]], pad_id: int, multiple: int = 8) -> dict[str, torch.Tensor]:
    """Right-pad a micro-batch to its longest row, rounded up to `multiple`."""
    longest = max(len(r["input_ids"]) for r in rows)
    width = -(-longest // multiple) * multiple
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        n = len(r["input_ids"])
        ids[i, :n] = torch.tensor(r["input_ids"])
        labels[i, :n] = torch.tensor(r["labels"])
        mask[i, :n] = 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


@dataclass
class Step:
    """One optimiser step: its micro-batches and the answer tokens they hold."""

    micro_batches: list[dict[str, torch.Tensor]]
    n_tokens: int  # label tokens in the whole step (for token-weighted accumulation)


def epoch_order(n: int, seed: int, stage: str, epoch: int) -> list[int]:
    """A shuffled order that depends only on (seed, stage label, epoch): resumable,
    and a task's order is the same whatever comes before it in the sequence."""
    order = list(range(n))
    random.Random(f"{seed}/{stage}/{epoch}").shuffle(order)
    return order


def epoch_members(n_epochs: list[int]) -> list[list[int]]:
    """Which tasks each epoch of a stage holds: task i, trained for n_epochs[i]
    epochs, is in epoch e while e < n_epochs[i] (the longest sets the epoch count)."""
    return [[i for i, n in enumerate(n_epochs) if e < n] for e in range(max(n_epochs, default=0))]


def phase_steps(epoch_sizes: Iterable[int], batch_size: int) -> int:
    """Optimiser steps of a phase whose epoch e has epoch_sizes[e] rows, as `steps`
    batches them (each epoch's last step may be short): sum_e ceil(n_e / batch_size)."""
    return sum(-(-n // batch_size) for n in epoch_sizes)


def steps(rows, order: list[int], batch_size: int, micro_batch_size: int,
          pad_id: int) -> Iterator[Step]:
    """Group `rows` (in `order`) into optimiser steps of micro-batches; the last
    step may be short."""
    for start in range(0, len(order), batch_size):
        chunk = [rows[i] for i in order[start:start + batch_size]]
        micro = [collate(chunk[j:j + micro_batch_size], pad_id)
                 for j in range(0, len(chunk), micro_batch_size)]
        n_tokens = sum(int((m["labels"] != IGNORE).sum()) for m in micro)
        yield Step(micro, n_tokens)
