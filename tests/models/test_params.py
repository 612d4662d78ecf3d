"""Parameter accounting: the paper's 1.236B / 6.07B on the meta device, the
trainable set of upcycle on the tiny model, and bilevel-cka counted from decisions."""
from __future__ import annotations

import json

import pytest

from cl_bench import registry
from cl_bench.errors import UserError
from cl_bench.method import MethodContext, Stage
from cl_bench.models import moe
from cl_bench.models.loading import meta_model, tiny_llama
from cl_bench.models.params import count, format_schedule, load_decisions, params_command, schedule_report

L, d, H = 16, 2048, 8192  # Llama-3.2-1B
PER_EXPERT = 3 * d * (H // 8)  # 6,291,456
ROUTER_ROW = d + 1  # weight row + bias


def test_dense_llama_3_2_1b_is_1_236b():
    report = count(meta_model("llama-3.2-1b"))
    assert report["total"] == 1_235_814_400
    assert report["active_per_token"] == report["deployed"] == report["total"]
    assert report["experts_per_layer"] is None


def test_standard_upcycling_of_llama_3_2_1b_over_6_tasks_is_6_07b():
    rows = params_command("llama-3.2-1b", "upcycle", 6)
    assert [r["experts_per_layer"] for r in rows] == [[8 * (t + 1)] * L for t in range(6)]
    last = rows[-1]
    assert PER_EXPERT == 6_291_456
    # 768 experts + 48 router rows per layer
    assert last["total"] == 1_235_814_400 + 768 * PER_EXPERT + L * 48 * ROUTER_ROW
    assert last["total"] == pytest.approx(6.07e9, rel=5e-3)
    # a token touches the dense model, the whole router and 2 experts per layer: ~1.44B
    assert last["active_per_token"] == 1_235_814_400 + L * (2 * PER_EXPERT + 48 * ROUTER_ROW)
    for r in rows:
        assert r["active_per_token"] < r["total"] == r["deployed"]
        # trainable at every stage: the newest group and its router rows
        assert r["trainable"] == L * (8 * PER_EXPERT + 8 * ROUTER_ROW)
    assert "6.069B" in format_schedule(rows)


def test_dense_methods_report_the_same_every_stage():
    rows = schedule_report("llama-3.2-1b", "seqft", 3)
    assert len(rows) == 3 and len({r["total"] for r in rows}) == 1
    with pytest.raises(UserError, match="known: tiny-llama, llama-3.2-1b"):  # every name --model takes
        schedule_report("no-such-config", "upcycle", 2)
    with pytest.raises(UserError, match="at least 1"):
        schedule_report("llama-3.2-1b", "upcycle", 0)


def test_upcycle_stage_t_trains_the_new_group_and_its_router_rows_only():
    cls = registry.get("upcycle")
    method = cls(cls.parse_args({}), context=MethodContext.for_shapes(3))
    model, _, _ = tiny_llama(0)
    method.setup(model)
    for t in range(3):
        method.before_task(Stage(t, [], f"task {t}"))
        trainable = {n for n, p in model.named_parameters() if p.requires_grad}
        want = {f"model.layers.{i}.mlp.{name}" for i in range(2) for name in
                [f"groups.{t}.{p}" for p in ("gate", "up", "down", "router_weight", "router_bias")]}
        assert trainable == want
        report = method.param_report()
        group = 8 * 3 * 16 * 64 + 8 * 65  # 8 experts (3 * h * d) + 8 router rows (d + 1)
        assert report["trainable"] == 2 * group
        assert report["experts_per_layer"] == [8 * (t + 1)] * 2


def test_train_shared_also_trains_attention_but_never_the_dense_mlp():
    cls = registry.get("upcycle")
    method = cls(cls.parse_args({"train_shared": "true"}), context=MethodContext.for_shapes(3))
    model, _, _ = tiny_llama(0)
    method.setup(model)
    method.before_task(Stage(1, [], "task 1"))
    grad = {n: p.requires_grad for n, p in model.named_parameters()}
    assert grad["model.layers.0.self_attn.q_proj.weight"] and grad["model.embed_tokens.weight"]
    assert not grad["model.layers.0.mlp.dense.gate_proj.weight"]
    assert not grad["model.layers.0.mlp.groups.0.gate"] and grad["model.layers.0.mlp.groups.1.gate"]


def test_bad_upcycle_arguments_are_named():
    cls = registry.get("upcycle")
    with pytest.raises(UserError, match="top_k"):
        cls.parse_args({"top_k": "9"})
    with pytest.raises(UserError, match="drop_ratio"):
        registry.get("drop-upcycle").parse_args({"drop_ratio": "1.5"})


def test_active_params_count_top_k_experts_of_each_moe_layer():
    model, _, _ = tiny_llama(0)
    dense_total = count(model)["total"]
    moe.upcycle_model(model, layers=[1])
    moe.moe_layers(model)[0].add_group()
    report = count(model)
    expert = 3 * 16 * 64
    assert report["experts_per_layer"] == [0, 16]
    assert report["total"] == dense_total + 16 * expert + 16 * 65
    assert report["active_per_token"] == report["total"] - 14 * expert


def test_bilevel_cka_counts_given_decisions_and_the_papers_two_figures_disagree():
    """In the accounting that gives Standard upcycling 6.07B, the paper's 17.8 experts
    per layer (157 of 240 decisions Expand) are 3.03B, and its 2.46B are 12.2 experts
    per layer: the two cannot both hold."""
    per_expert = PER_EXPERT + ROUTER_ROW  # an expert and its router row, per layer
    base = 1_235_814_400 + L * 8 * per_expert  # task 0: 8 experts a layer
    high = params_command("llama-3.2-1b", "bilevel-cka", 6, experts_per_layer=17.8)
    low = params_command("llama-3.2-1b", "bilevel-cka", 6, experts_per_layer=12.2)
    assert sum(high[-1]["experts_per_layer"]) == 128 + 157 and max(high[-1]["experts_per_layer"]) == 18
    assert high[-1]["total"] == base + 157 * per_expert == 3_029_463_325
    assert sum(low[-1]["experts_per_layer"]) == 128 + 67
    assert low[-1]["total"] == base + 67 * per_expert == 2_463_047_875
    assert high[-1]["total"] == pytest.approx(3.03e9, rel=2e-3) and low[-1]["total"] == pytest.approx(2.46e9, rel=2e-3)
    for rows in (high, low):  # growth only where decided: stage by stage, never past the upper bound
        assert rows[0]["experts_per_layer"] == [8] * L
        totals = [r["total"] for r in rows]
        assert totals == sorted(totals) and totals[-1] < 6.0e9
        assert "spread evenly" in rows[-1]["bound"]
    assert "mean 17.81" in format_schedule(high) and "3.029B" in format_schedule(high)
    with pytest.raises(UserError, match="experts-per-layer 50: .* 8 .*Recycle.* to 48 experts.*Expand"):
        params_command("llama-3.2-1b", "bilevel-cka", 6, experts_per_layer=50)


def test_a_small_model_reads_in_a_unit_it_reaches():
    """The tiny model's 157,392 parameters read 157.392K, not 0.000B; one unit per
    table. Mutation caught: billions always."""
    table = format_schedule(params_command("tiny-llama", "upcycle", 2)).splitlines()
    assert table[1].split()[:2] == ["1", "157.392K"] and "B" not in "".join(table[1:])


def test_params_cli_reads_a_decision_map_or_a_run_record(tmp_path, capsys):
    from helpers import run_cli

    expert = 3 * 16 * 64 + 65  # tiny model: one slice expert (3 h d) and its router row (d + 1)
    maps = [[[1, 0, 0, 0, 0, 0, 0, 1], [0] * 8],  # task 1: two Expands in layer 0
            [[0] * 8, [1] * 8]]  # task 2: all of layer 1
    (tmp_path / "map.json").write_text(json.dumps(maps))
    (tmp_path / "run.json").write_text(json.dumps({"params": [{"decisions": None}] +
                                                   [{"decisions": m} for m in maps]}))
    upper = params_command("tiny-llama", "bilevel-cka", 3)
    for path in ("map.json", "run.json"):
        assert run_cli("params", "--model", "tiny-llama", "--method", "bilevel-cka", "--tasks", "3",
                       "--decisions", tmp_path / path, "--json") == 0
        rows = json.loads(capsys.readouterr().out)
        assert [r["experts_per_layer"] for r in rows] == [[8, 8], [10, 8], [10, 16]]
        assert [r["total"] - upper[0]["total"] for r in rows] == [0, 2 * expert, 10 * expert]
        assert rows[-1]["bound"] == "the given decisions" and rows[-1]["decisions"] == maps[1]
    assert upper[-1]["total"] - upper[0]["total"] == 32 * expert  # without a map: every decision Expand

    with pytest.raises(UserError, match="stage 3: expected 2 candidate layers x 8 slots"):
        params_command("tiny-llama", "bilevel-cka", 3, decisions=[maps[0], [[1] * 8]])
    with pytest.raises(UserError, match="1 tasks of decisions for --tasks 3"):
        params_command("tiny-llama", "bilevel-cka", 3, decisions=maps[:1])
    with pytest.raises(UserError, match="method 'upcycle' makes no Expand / Recycle.*bilevel-cka"):
        params_command("tiny-llama", "upcycle", 3, decisions=maps)
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(UserError, match="bad.json"):
        load_decisions(tmp_path / "bad.json")
