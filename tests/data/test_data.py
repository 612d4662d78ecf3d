"""Tokenisation: answer-only labels, truncation, collation, accumulation."""
from __future__ import annotations

import torch

from cl_bench.data.encode import IGNORE, Encoder, collate, epoch_members, epoch_order, phase_steps, steps
from cl_bench.models.loading import byte_tokenizer

TOK = byte_tokenizer()


def enc(**kw) -> Encoder:
    args = dict(max_prompt_len=20, max_answer_len=6, truncation="head_tail", truncation_head=5)
    args.update(kw)
    return Encoder(TOK, **args)


def text(ids) -> str:
    return TOK.decode(ids)


def test_labels_cover_answer_and_eos_only():
    row = enc().train_example("Q: 1+1?\nA:", "2")
    n_prompt = len("Q: 1+1?\nA:")  # byte tokenizer: one token per byte, no BOS
    assert row["labels"][:n_prompt] == [IGNORE] * n_prompt
    assert row["labels"][n_prompt:] == [TOK.convert_tokens_to_ids("2"), TOK.eos_token_id]
    assert row["input_ids"][n_prompt:] == row["labels"][n_prompt:]


def test_head_tail_truncation_keeps_instruction_and_cue():
    prompt = "INSTR" + "x" * 100 + "CUE:"
    ids = enc().prompt_ids(prompt)
    assert len(ids) == 20
    assert text(ids) == "INSTR" + "x" * 11 + "CUE:"


def test_left_truncation_is_traces_cut():
    prompt = "INSTR" + "x" * 100 + "CUE:"
    ids = enc(truncation="left").prompt_ids(prompt)
    assert text(ids) == "x" * 16 + "CUE:"


def test_short_prompts_are_untouched_and_answers_capped_with_eos():
    e = enc()
    assert text(e.prompt_ids("short")) == "short"
    answer = e.answer_ids("abcdefghij")
    assert len(answer) == 6 and answer[-1] == TOK.eos_token_id and text(answer[:-1]) == "abcde"


def test_collate_right_pads_to_multiple_of_8():
    rows = [{"input_ids": [5, 6, 7], "labels": [IGNORE, 6, 7]}, {"input_ids": [5] * 9, "labels": [5] * 9}]
    batch = collate(rows, pad_id=0)
    assert batch["input_ids"].shape == (2, 16)
    assert batch["attention_mask"][0].tolist() == [1] * 3 + [0] * 13
    assert batch["labels"][0, 3:].eq(IGNORE).all()


def test_epoch_order_depends_only_on_seed_stage_epoch():
    assert epoch_order(50, 1, "FOMC", 3) == epoch_order(50, 1, "FOMC", 3)
    assert epoch_order(50, 1, "FOMC", 3) != epoch_order(50, 1, "FOMC", 4)
    assert epoch_order(50, 1, "FOMC", 3) != epoch_order(50, 2, "FOMC", 3)
    assert sorted(epoch_order(50, 1, "FOMC", 3)) == list(range(50))


def test_phase_steps_count_the_steps_batching_makes():
    """phase_steps is the number of Steps `steps` yields over the epochs: each
    epoch's last step may be short (5 rows at batch 2: 3 steps), an empty epoch
    takes none."""
    rows = [enc().train_example("p", "a")] * 5
    sizes = [5, 4, 0, 1]
    made = sum(len(list(steps(rows[:n], list(range(n)), 2, 1, 0))) for n in sizes)
    assert phase_steps(sizes, 2) == made == 3 + 2 + 0 + 1
    assert phase_steps(iter(sizes), 4) == 2 + 1 + 0 + 1 and phase_steps([], 2) == 0


def test_epoch_members_keep_a_task_while_its_epochs_last():
    assert epoch_members([2, 1, 3]) == [[0, 1, 2], [0, 2], [2]]
    assert epoch_members([1]) == [[0]] and epoch_members([]) == []


def test_step_gradient_does_not_depend_on_micro_batching():
    """Token-weighted accumulation: one step over 4 examples gives the same gradient
    whether it runs as 1, 2 or 4 micro-batches."""
    from cl_bench.models.loading import tiny_llama

    model, tok, _ = tiny_llama(0)
    e = Encoder(tok, 32, 8, "head_tail", 8)
    rows = [e.train_example(f"prompt {i} " * (i + 1), "ans" * (i + 1)) for i in range(4)]
    grads = []
    for micro in (1, 2, 4):
        model.zero_grad()
        (step,) = steps(rows, [0, 1, 2, 3], 4, micro, tok.pad_token_id)
        for mb in step.micro_batches:
            w = int((mb["labels"] != IGNORE).sum()) / step.n_tokens
            (model(**mb).loss * w).backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    assert torch.allclose(grads[0], grads[1], atol=1e-6) and torch.allclose(grads[0], grads[2], atol=1e-6)
