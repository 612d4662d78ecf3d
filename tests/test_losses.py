"""The causal-LM losses from vocabulary logits at the answer positions only
(cl_bench/losses.py, issue 53): the same numbers as the path before (logits at every
position, transformers' loss from `labels`), and no other position reaches the head in
any method's loss."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from cl_bench.losses import (AnswerOutput, all_positions, answer_forward, answer_logits, answer_positions,
                             distillation_kl, lm_loss, summed_nll)
from cl_bench.method import Stage
from cl_bench.models.loading import tiny_llama
from helpers import answer_ce, make_method, make_task, random_batch

IGNORE = -100


def test_answer_positions_are_those_whose_next_label_is_kept():
    """Mutations caught: no shift (labels != -100 themselves: the last answer token in,
    the position before the answer out), or the last position kept."""
    labels = torch.tensor([[IGNORE, IGNORE, 5, 6, IGNORE], [IGNORE, IGNORE, IGNORE, 7, 8]])
    want = torch.tensor([[False, True, True, False, False], [False, False, True, True, False]])
    assert torch.equal(answer_positions(labels), want)


def _grads(model: nn.Module, loss: torch.Tensor) -> dict[str, torch.Tensor]:
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    return dict(zip(params, torch.autograd.grad(loss, list(params.values()), allow_unused=True)))


def _close(new: torch.Tensor, old: torch.Tensor, rel: float = 1e-5) -> bool:
    """Within `rel` of old's norm (elementwise rtol fails on entries near 0 at float rounding)."""
    new, old = new.detach(), old.detach()
    return float((new - old).norm()) <= rel * max(float(old.norm()), 1e-30)


def test_loss_and_gradients_equal_the_path_before_in_fp32():
    """The tiny random Llama in fp32, a batch with a 5-token prompt and a padded row:
    the loss and every gradient of the answer-position path within 1e-5 relative of
    the path before (and of the cross-entropy by hand over all logits). Mutations
    caught: the mean over every attended position (or a sum), the targets unshifted."""
    model, _, _ = tiny_llama(0)
    batch = random_batch(0, length=16, prompt=5)
    new = lm_loss(model, batch)
    with all_positions():
        old = lm_loss(model, batch)
    by_hand = answer_ce(model, batch)
    assert _close(new, old) and _close(new, by_hand)
    g_new, g_old = _grads(model, lm_loss(model, batch)), None
    with all_positions():
        g_old = _grads(model, lm_loss(model, batch))
    assert g_new.keys() == g_old.keys()
    off = [n for n in g_new if not _close(g_new[n], g_old[n])]
    assert not off, f"gradients differ beyond 1e-5 relative: {off}"


def test_the_head_sees_only_answer_positions():
    """The head's input rows are the final norm's output at the answer positions, in
    row-major order, and the loss is their mean cross-entropy. Mutation caught: the
    path before (every position projected)."""
    model, _, _ = tiny_llama(0)
    batch = random_batch(1, length=12, prompt=4)
    seen = {}
    hooks = [model.model.norm.register_forward_hook(lambda m, a, out: seen.__setitem__("norm", out)),
             model.lm_head.register_forward_hook(lambda m, a, out: seen.__setitem__("head", a[0]))]
    try:
        out = answer_forward(model, batch)
    finally:
        for h in hooks:
            h.remove()
    keep = answer_positions(batch["labels"])
    assert torch.equal(seen["head"], seen["norm"][keep])
    assert out.logits.shape == (int(keep.sum()), model.config.vocab_size)
    assert torch.equal(out.targets, batch["labels"][:, 1:][keep[:, :-1]])
    torch.testing.assert_close(out.loss, nn.functional.cross_entropy(out.logits.float(), out.targets))
    torch.testing.assert_close(summed_nll(out), out.loss * len(out.targets))


def test_teacher_logits_and_kl_equal_the_path_before():
    """answer_logits without labels gives the rows answer_forward gives, and the KL
    from them equals the KL of the old (B, L, V) + labels form. Mutation caught:
    answer_logits keeping other positions than answer_forward (a shift off by one)."""
    student, _, _ = tiny_llama(0)
    teacher, _, _ = tiny_llama(1)
    batch = random_batch(2, length=12, prompt=4)
    with torch.no_grad():
        out = answer_forward(student, batch)
        t = answer_logits(teacher, batch)
        torch.testing.assert_close(answer_logits(student, batch), out.logits)
        with all_positions():
            s_all = student(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            t_all = teacher(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            torch.testing.assert_close(answer_logits(teacher, batch), t, rtol=1e-5, atol=1e-6)
    got = distillation_kl(out.logits, t, None, 2.0)
    want = distillation_kl(s_all, t_all, batch["labels"], 2.0)
    assert _close(got, want)


# ---- every method: equal losses and gradients on the two paths --------------------

def _begun(name: str):
    """`name` on the tiny Llama after stage 0 (untrained: its hooks only) with stage 1
    begun (teachers, Fisher, stored gradients, experts and adapters in place)."""
    tasks = [make_task("t0"), make_task("t1", offset=20)]
    for task in tasks:
        task.test = task.train[:4]  # CaRE's diagnostics read a few test items
    method = make_method(name, tasks=tasks, n_stages=2)
    method.before_task(Stage(0, [tasks[0]], "t0"))
    method.after_task(Stage(0, [tasks[0]], "t0"))
    method.before_task(Stage(1, [tasks[1]], "t1"))
    return method


@pytest.mark.parametrize("name", ["seqft", "lora", "upcycle", "same", "care", "cluster-upcycle", "olora", "mofo",
                                  "lwf", "ewc", "ogd"])
def test_method_loss_and_gradients_equal_the_path_before(name):
    """Wrapped models (LoRA, MoE layers, SAME's and CaRE's prompt-pooling hooks): the
    method's loss, its logged parts and its gradients on the same batch within 1e-5
    relative of the path before (fp32; the same global seed for each side's draws)."""
    method = _begun(name)
    batch = random_batch(3, length=16, prompt=6)
    method.model.train()

    def side():
        torch.manual_seed(7)
        loss, parts = method.loss(batch, 0)
        return loss, parts, _grads(method.model, loss)

    new = side()
    with all_positions():
        old = side()
    assert _close(new[0], old[0])
    for key, value in old[1].items():
        assert new[1][key] == pytest.approx(value, rel=1e-5, abs=1e-7), key
    off = [n for n in new[2] if (new[2][n] is None) != (old[2][n] is None)
           or new[2][n] is not None and not _close(new[2][n], old[2][n])]
    assert not off, f"{name}: gradients differ beyond 1e-5 relative: {off}"


# ---- every method's smoke run: no head call outside the answer positions ------------

class HeadRows:
    """Global forward hooks that check every projection through a causal LM's head on
    a training batch: the rows it gets are the final norm's output at the batch's
    answer positions, exactly. A labelled forward names its positions (the shifted
    labels) and records each row's tokens; an unlabelled forward (a teacher) is
    checked where every row's tokens are a labelled row's (a training example), and
    left alone otherwise (generation, probes of the layers' outputs)."""

    def __init__(self):
        self.norm = None
        self.rows: list[torch.Tensor] = []  # the head's inputs in the running forward
        self.known: dict[tuple, torch.Tensor] = {}  # a row's tokens -> its answer positions
        self.pending: list[tuple] = []  # unlabelled forwards: (ids, mask, norm output, head rows)
        self.checked = self.bad = self.unlabelled = 0
        self.errors: list[str] = []

    def __enter__(self):
        self.handle = nn.modules.module.register_module_forward_hook(self.hook, with_kwargs=True)
        return self

    def __exit__(self, *exc):
        self.handle.remove()

    def hook(self, module, args, kwargs, output):
        name = type(module).__name__
        if name.endswith("RMSNorm"):
            self.norm = output  # the last norm before the head is the final one
        elif isinstance(module, nn.Linear) and hasattr(self, "vocab") and module.out_features == self.vocab:
            self.rows.append((args[0] if args else kwargs["input"], self.norm))
        elif name.endswith("ForCausalLM"):
            self.vocab = module.config.vocab_size
            rows, self.rows = self.rows, []
            ids = kwargs.get("input_ids")
            if ids is None or not rows or isinstance(kwargs.get("logits_to_keep"), int) and kwargs["logits_to_keep"]:
                return
            mask = kwargs.get("attention_mask")
            mask = torch.ones_like(ids) if mask is None else mask
            if mask.shape != ids.shape:
                return  # a decoding step after a cache: generation
            head, norm = rows[-1]
            labels = kwargs.get("labels")
            if labels is None:
                self.pending.append((ids, mask, norm, head))
                return
            keep = answer_positions(labels)
            for i in range(ids.shape[0]):
                self.known[self._key(ids[i], mask[i])] = keep[i]
            self._check(norm, head, keep)

    @staticmethod
    def _key(ids, mask):
        return tuple(ids[mask.bool()].tolist())

    def _check(self, norm, head, keep):
        self.checked += 1
        if head.dim() != 2 or not torch.equal(head, norm[keep]):
            self.bad += 1
            self.errors.append(f"head rows {tuple(head.shape)}, answer positions {int(keep.sum())}")

    def finish(self):
        for ids, mask, norm, head in self.pending:
            keys = [self._key(ids[i], mask[i]) for i in range(ids.shape[0])]
            if all(k in self.known for k in keys):
                width = ids.shape[1]
                keep = torch.stack([nn.functional.pad(self.known[k], (0, width - len(self.known[k])))[:width]
                                    for k in keys])
                self._check(norm, head, keep)
                self.unlabelled += 1


# The methods named in issue 53 and those the perf figures time; the rest run the same loss
LOSS_METHODS = ["seqft", "replay", "lwf", "cluster-upcycle", "bilevel-cka", "ewc", "ogd", "care", "same", "lora",
                "upcycle"]


@pytest.mark.slow
@pytest.mark.parametrize("name", LOSS_METHODS)
def test_no_prompt_position_reaches_the_head_in_a_smoke_run(name, trace_dir, tmp_path):
    """A whole smoke run of `name` (fp32): every head projection on a training example
    (the task loss, replay, teachers, Fisher, per-example gradients, outer steps and
    probes that compute a loss) gets exactly the answer positions' rows. Mutations
    caught: answer_positions unshifted (a prompt position in, the last answer token's
    position counted instead of the one before the answer), all_positions() left on
    (every position projected), a teacher called for every position (LwF,
    cluster-upcycle) or EWC's Fisher from every position's logits."""
    from helpers import run_cli, smoke_args

    with HeadRows() as rows:
        assert run_cli(*smoke_args(trace_dir, tmp_path / "out"), "--method", name,
                       "--set", "train.precision=fp32", "--set", "eval.precision=fp32") == 0
    rows.finish()
    assert rows.checked > 0
    if name in ("lwf", "cluster-upcycle"):
        assert rows.unlabelled > 0  # the teachers' forwards were checked too
    assert rows.bad == 0, f"{name}: {rows.bad} of {rows.checked} head projections off the answer positions: " \
                          f"{rows.errors[:3]}"
