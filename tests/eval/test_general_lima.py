"""The Lima held-out probe (cl_bench/eval/general/lima.py): its items, its NLL, ΔLima
and its interval, and the probe inside a smoke run (show, compare, leaderboard)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from cl_bench.record import io as results
from cl_bench.benchmarks.trace.loader import Example
from cl_bench.data.encode import Encoder, collate
from cl_bench.eval.general import lima
from cl_bench.report.general import compare_general, format_general
from cl_bench.models.loading import tiny_llama
from helpers import only_run, run_cli, smoke_args


def point(nll, tokens, items=None) -> dict:
    return {"items": items or list(range(len(nll))), "tokens": tokens, "nll": nll, "mean": 0.0, "seconds": 0.0}


def test_delta_is_the_token_weighted_loss_minus_zero_shot():
    # zero-shot: (2 + 4) / (1 + 3) = 1.5 nats/token; after stage 0: (3 + 5) / 4 = 2.0; after stage 1: (4 + 6) / 4 = 2.5
    points = {"-1": point([2.0, 4.0], [1, 3]), "0": point([3.0, 5.0], [1, 3]), "1": point([4.0, 6.0], [1, 3])}
    d = lima.deltas(points)
    assert d["0"]["value"] == pytest.approx(0.5)  # a mean of per-item means would give 0.667
    assert d["1"]["value"] == pytest.approx(1.0)  # against zero-shot, not the previous stage (0.5)
    lo, hi = d["1"]["ci"]
    assert lo <= 1.0 <= hi
    assert lima.final_delta({"lima": {"delta": d}}) == {"stage": 1, **d["1"]}


def test_delta_interval_is_paired_over_items():
    # every item's loss rises by 0.1 nats/token while the items differ widely: paired, the interval is tight
    tokens = [10, 10, 10, 10]
    points = {"-1": point([10.0, 50.0, 20.0, 80.0], tokens), "0": point([11.0, 51.0, 21.0, 81.0], tokens)}
    lo, hi = lima.deltas(points)["0"]["ci"]
    assert (lo, hi) == pytest.approx((0.1, 0.1))  # unpaired, the means' spread is several nats wide


def test_replicates_are_ratios_of_sums_over_the_drawn_items():
    # items of 1 and 9 tokens, 2 and 9 nats: drawn once each, 11 / 10; the second twice, 18 / 18
    reps = lima.ratio_replicates(np.array([2.0, 9.0]), np.array([1.0, 9.0]), np.array([[0, 1], [1, 1]]))
    assert reps.tolist() == pytest.approx([1.1, 1.0])  # a mean of per-item ratios would give 1.5 first


def test_delta_fails_when_the_items_change_between_stages():
    points = {"-1": point([2.0, 4.0], [1, 3], items=[5, 9]), "0": point([3.0, 5.0], [1, 3], items=[5, 10])}
    with pytest.raises(ValueError, match="other items"):
        lima.deltas(points)
    retokenised = {"-1": point([2.0, 4.0], [1, 3]), "0": point([3.0, 5.0], [1, 4])}
    with pytest.raises(ValueError, match="other items"):
        lima.deltas(retokenised)


def test_probe_items_are_fixed_nested_and_in_file_order():
    examples = [Example(f"p{i}", f"a{i}", i) for i in range(100)]
    a, b = lima.probe_items(examples, 10), lima.probe_items(list(examples), 10)
    assert [e.index for e in a] == [e.index for e in b]
    assert [e.index for e in a] == sorted(e.index for e in a) != list(range(10))
    assert {e.index for e in a} <= {e.index for e in lima.probe_items(examples, 20)}


def nll_rows(encoder):
    # shortest first, and the longest prompt in the middle row, so sorting by length and
    # projecting from the batch's first answer position both matter
    return [encoder.train_example("2 plus 3?", "5"),
            encoder.train_example("Say hello in German, please, in a friendly way, to a friend.", "Hallo!"),
            encoder.train_example("Name a colour.", "Blue, like the sky on a clear day in summer.")]


def test_answer_nll_is_the_models_own_loss():
    # catches: the rows' results returned in the sorted (longest first) order, not the input's;
    # the LM head kept from a later position than the batch's first answer token; an answer
    # token dropped or a prompt token counted
    model, tokenizer, _ = tiny_llama(0)
    encoder = Encoder(tokenizer, 64, 16, "head_tail", 8)
    rows = nll_rows(encoder)
    assert len({len(r["input_ids"]) for r in rows}) == 3
    sums, counts = lima.answer_nll(model, rows, tokenizer.pad_token_id, batch_size=2)
    for row, s, n in zip(rows, sums, counts):
        batch = collate([row], tokenizer.pad_token_id)
        with torch.no_grad():
            loss = model(**batch).loss  # mean over the row's labelled tokens, HF's own shift
        assert n == sum(label != -100 for label in row["labels"])  # every answer token and EOS
        assert s / n == pytest.approx(float(loss), rel=1e-5)


def test_answer_nll_with_a_forward_that_keeps_every_logit():
    # a model whose forward ignores logits_to_keep (a plugin's wrapper) gets the same losses
    model, tokenizer, _ = tiny_llama(0)
    encoder = Encoder(tokenizer, 64, 16, "head_tail", 8)

    class KeepsAll(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = model

        def forward(self, logits_to_keep=None, **kwargs):
            return self.inner(**kwargs)

    rows = nll_rows(encoder)
    expected = lima.answer_nll(model, rows, tokenizer.pad_token_id, batch_size=3)
    got = lima.answer_nll(KeepsAll(), rows, tokenizer.pad_token_id, batch_size=3)
    assert got[1] == expected[1] and got[0] == pytest.approx(expected[0], rel=1e-6)


def write_lima(trace_dir: Path, n: int = 30) -> None:
    folder = trace_dir / "Lima"
    folder.mkdir()
    rows = [{"prompt": f"Write a line about the number {i}.", "answer": f"The number {i} is a fine number."}
            for i in range(n)]
    (folder / "train.json").write_text(json.dumps(rows))


@pytest.mark.slow
def test_smoke_run_records_the_probe_at_every_point(trace_dir, tmp_path, capsys):
    write_lima(trace_dir)
    out = tmp_path / "runs"
    assert run_cli(*smoke_args(trace_dir, out, "--set", "general.lima=6", "--set", "replay.lima=30",
                            "--method", "replay")) == 0
    run_dir = only_run(out)
    record = results.read_record(run_dir)
    probe = record.general["lima"]
    assert set(probe["points"]) == {"-1", "0", "1", "2"}  # zero-shot and after every stage
    items = [p["items"] for p in probe["points"].values()]
    assert all(i == items[0] for i in items) and len(items[0]) == 6
    expected = [e.index for e in lima.probe_items([Example("", "", i) for i in range(30)], 6)]
    assert items[0] == expected
    assert set(probe["delta"]) == {"0", "1", "2"}
    zero = probe["points"]["-1"]
    last = probe["points"]["2"]
    assert probe["delta"]["2"]["value"] == pytest.approx(
        (sum(last["nll"]) - sum(zero["nll"])) / sum(zero["tokens"]), abs=1e-5)
    assert record.replay["stored"]["Lima"] == 30 - 6  # replay.lima=30 drew the rest: the probe's items held out
    capsys.readouterr()
    assert run_cli("show", run_dir) == 0
    assert "ΔLima" in capsys.readouterr().out
    assert run_cli("leaderboard", "--runs", out) == 0
    assert "ΔLima" in capsys.readouterr().out


def test_compare_pairs_the_final_delta_over_the_same_items():
    tokens = [10, 10, 10]
    a = {"lima": {"points": {"-1": point([10.0, 20.0, 30.0], tokens), "2": point([12.0, 22.0, 32.0], tokens)}}}
    b = {"lima": {"points": {"-1": point([10.0, 20.0, 30.0], tokens), "2": point([11.0, 21.0, 31.0], tokens)}}}
    for g in (a, b):
        g["lima"]["delta"] = lima.deltas(g["lima"]["points"])
    row = compare_general(a, b)["ΔLima"]
    assert (row["run"], row["baseline"], row["diff"]) == pytest.approx((0.2, 0.1, 0.1))
    assert row["ci"] == pytest.approx((0.1, 0.1))
    other = {"lima": {**b["lima"], "points": {k: {**v, "items": [7, 8, 9]} for k, v in b["lima"]["points"].items()}}}
    assert compare_general(a, other) == {}  # other items: not paired
    assert format_general(None, []) is None
