"""The causal-LM losses of the harness and the methods, from vocabulary logits at the
answer positions only.

A training batch labels its prompt (and padding) -100 (cl_bench/data/encode.py); position
i's logits predict token i+1, so only the positions whose *next* label is not -100 enter a
loss ("answer positions": the answer's tokens but its last, and the one before the answer).
Projecting the other positions through the vocabulary head (49,152 wide for SmolLM2,
128,256 for Llama-3) is wasted work and memory, so every loss here asks the model for
logits at the answer positions alone (transformers' `logits_to_keep` as a boolean (B, T)
mask: the body runs on every position, the head on the kept ones, flattened to (N, V) in
row-major order, the order of `labels[:, 1:][answer]`).

The model is always called at the top level, with the batch's `labels`: forward
pre-hooks that read them (cl_bench/models/prompt_pool.py: CaRE's and SAME's prompt
pooling) see the same call as before, DeepSpeed's ZeRO-3 gathers the head's weight as it
gathers every leaf module's, and a head tied to the embeddings stays tied. The loss is
transformers' own causal-LM loss (upcast to fp32, cross-entropy with ignore_index -100,
mean over the answer positions), handed the kept positions' targets as `shift_labels`.

`all_positions()`: the path before (logits at every position, the loss from `labels`,
answer rows picked afterwards), for `cl-bench perf loss-path` and the tests
that compare the two.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F

from cl_bench.data.encode import IGNORE

_ALL_POSITIONS = False  # all_positions(): the path before, vocabulary logits at every position


@contextlib.contextmanager
def all_positions() -> Iterator[None]:
    """Within: every loss here computes vocabulary logits at every position and keeps
    the answer rows afterwards (the arithmetic before issue 53), to compare against."""
    global _ALL_POSITIONS
    was, _ALL_POSITIONS = _ALL_POSITIONS, True
    try:
        yield
    finally:
        _ALL_POSITIONS = was


def answer_positions(labels: torch.Tensor) -> torch.Tensor:
    """(B, T) bool: the positions whose next token's label is not -100 (the last position
    predicts nothing)."""
    keep = torch.zeros_like(labels, dtype=torch.bool)
    keep[:, :-1] = labels[:, 1:] != IGNORE
    return keep


@dataclass
class AnswerOutput:
    """A model's forward on a training batch, with vocabulary logits at the answer
    positions only. loss: the mean cross-entropy over them (fp32, 0-dim); logits: (N, V)
    in the model's output dtype, N answer positions in row-major order; targets: (N,) the
    token each predicts; output: the model's own output (its `logits` are (N, V), or
    (B, T, V) under all_positions())."""

    loss: torch.Tensor
    logits: torch.Tensor
    targets: torch.Tensor
    output: Any


def answer_forward(model: Callable[..., Any], batch: dict[str, torch.Tensor]) -> AnswerOutput:
    """`model` (the top-level causal LM, or a callable taking its keyword arguments) on
    `batch`, its labels passed, logits projected at the answer positions only (module
    docstring)."""
    labels = batch["labels"]
    keep = answer_positions(labels)
    targets = labels[:, 1:][keep[:, :-1]]  # (N,), row-major as hidden_states[keep]
    kwargs = dict(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=labels,
                  use_cache=False)
    if _ALL_POSITIONS:
        out = model(**kwargs)
        return AnswerOutput(out.loss, out.logits[keep], targets, out)
    out = model(**kwargs, logits_to_keep=keep, shift_labels=targets)
    if out.logits.dim() != 2:
        raise RuntimeError(f"{type(model).__name__} ignored logits_to_keep (a boolean (B, T) mask): its "
                           f"logits are {tuple(out.logits.shape)}; the harness needs transformers' "
                           f"causal LMs (slice_logits_to_keep)")
    return AnswerOutput(out.loss, out.logits, targets, out)


def lm_loss(model: Callable[..., Any], batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Causal-LM cross-entropy, mean over the tokens whose label is not -100 (answer +
    EOS), from logits at those tokens' positions only."""
    return answer_forward(model, batch).loss


def answer_logits(model: Callable[..., Any], batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """(N, V): `model`'s logits at the answer positions of `batch`, called without labels
    (a teacher: LwF's previous model, cluster-upcycle's EMA; `model` may be a callable
    taking the model's keyword arguments)."""
    keep = answer_positions(batch["labels"])
    kwargs = dict(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False)
    if not _ALL_POSITIONS:
        kwargs["logits_to_keep"] = keep
    logits = model(**kwargs).logits
    return logits[keep] if logits.dim() == 3 else logits


def summed_nll(out: AnswerOutput) -> torch.Tensor:
    """Σ over the answer positions of −log p(target), in fp32 (0-dim)."""
    return F.cross_entropy(out.logits.float(), out.targets, reduction="sum")


def distillation_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor,
                    labels: torch.Tensor | None, temperature: float) -> torch.Tensor:
    """Knowledge distillation on answer tokens, shared by the methods that distil a
    teacher into the model being trained (LwF: the previous model; cluster-upcycle: an
    EMA of the MoE under dense routing): T² · KL(softmax(teacher/T) ‖ softmax(student/T)),
    summed over the vocabulary and averaged over the answer positions, in fp32.

    student_logits, teacher_logits: (N, V) at the same answer positions
    (AnswerOutput.logits, answer_logits) with labels None; or (B, L, V) at every
    position with labels (B, L), IGNORE off the answer (the form before issue 53, for
    plugins: the answer rows are picked here)."""
    if labels is not None:
        answer = answer_positions(labels)  # (B, L): position i predicts token i+1
        student_logits, teacher_logits = student_logits[answer], teacher_logits[answer]
    new = student_logits.float() / temperature  # (N, V)
    old = teacher_logits.float() / temperature  # (N, V)
    # kl_div(input, target) = Σ target·(log target − input) = KL(target ‖ input)
    kl = F.kl_div(F.log_softmax(new, dim=-1), F.log_softmax(old, dim=-1), log_target=True,
                  reduction="sum")
    return temperature ** 2 * kl / max(new.shape[0], 1)
