"""Evaluate a model on one task: generate greedily, strip, score (0-100)."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Callable

from torch import nn

from cl_bench.config_fields import EvalConfig
from cl_bench.data.encode import Encoder
from cl_bench.eval.generation import greedy_generate
from cl_bench.metrics import scorers
from cl_bench.metrics.answer_form import majority_answer

# Tasks whose answers are labels (exact match or first character): these get a
# majority-class level beside their scores.
LABEL_METRICS = ("accuracy", "exact_match", "first_char_accuracy")


@dataclass
class TaskEval:
    score: float
    details: dict  # metric, n, max_new_tokens, extra metrics
    rows: list[dict]  # one per test example: prompt, prediction, answer, score


def max_new_tokens(spec, cfg: EvalConfig) -> int:
    cap = cfg.max_new_tokens_cap
    return spec.max_new_tokens if cap is None else min(spec.max_new_tokens, cap)


def evaluate_task(model: nn.Module, encoder: Encoder, task, cfg: EvalConfig,
                  on_batch: Callable[[int], None] | None = None,
                  generate: Callable[..., list[list[int]]] = greedy_generate) -> TaskEval:
    """`generate`: greedy_generate's signature; the deepspeed backend's splits the
    prompts over the ranks and returns every continuation on every rank."""
    tok = encoder.tokenizer
    prompts = [e.prompt for e in task.test]
    answers = [e.answer for e in task.test]
    budget = max_new_tokens(task.spec, cfg)
    generated = generate(model, [encoder.prompt_ids(p) for p in prompts], budget,
                         tok.eos_token_id, tok.pad_token_id, cfg.batch_size, on_batch)
    predictions = [tok.decode(g, skip_special_tokens=True).strip() for g in generated]
    item_scores = scorers.per_item_scores(task.spec.metric, predictions, answers, prompts)
    score = sum(item_scores) / len(item_scores)  # = scorers.score (a mean of item scores)
    extras = {name: fn(predictions, answers)
              for name, fn in scorers.EXTRA_METRICS.get(task.spec.metric, {}).items()}
    details = {"metric": task.spec.metric, "score": score, "n": len(predictions),
               "max_new_tokens": budget, "empty_predictions": sum(not p for p in predictions),
               "extra": extras}
    rows = [{"task": task.name, "index": e.index,
             "prompt_sha256": hashlib.sha256(e.prompt.encode()).hexdigest()[:16],
             "prompt": e.prompt, "prediction": pred, "answer": e.answer, "score": s}
            for e, pred, s in zip(task.test, predictions, item_scores)]
    return TaskEval(score, details, rows)


def majority_level(task) -> dict | None:
    """For a label task, the score of always answering the most frequent answer of
    the run's training subset (a reader's check that a method learned the content,
    not only the form); None for generation tasks."""
    metric = task.spec.metric
    if metric not in LABEL_METRICS:
        return None
    answer = majority_answer([e.answer for e in task.train], first_char=metric == "first_char_accuracy")
    answers = [e.answer for e in task.test]
    return {"answer": answer, "score": scorers.score(metric, [answer] * len(answers), answers)}
