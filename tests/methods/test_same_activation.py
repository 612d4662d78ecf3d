"""SAME on the tiny Llama: adaptive expert activation (and its degenerate case), end-to-end
runs, and the routing-drift probe."""
from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import pytest
import torch

from cl_bench.record import io as results
from cl_bench.config import RunConfig, TrainConfig
from cl_bench.errors import UserError
from cl_bench.method import MethodContext, Stage
from cl_bench.methods.same import SAMEArgs, activation_schedule, activation_scores
from cl_bench.models.loading import tiny_llama
from helpers import assert_decodes_as_the_plain_loop, flat_params, interrupted_run, only_run, run_cli, smoke_args
from same_setup import E, batch, make, step, train_task


# ---- adaptive expert activation -------------------------------------------------------------

def test_scores_freeze_little_used_but_important_experts_never_the_current_one():
    usage = torch.tensor([0.1, 0.5, 0.4])
    importance = torch.tensor([1.0, 0.0, 0.2])
    torch.testing.assert_close(activation_scores(usage, importance), torch.tensor([-1.0, 1.0, 0.55]))
    assert torch.equal(activation_scores(torch.ones(3), torch.zeros(3)), torch.zeros(3))  # minmax(const) = 0

    method, model = make(freeze_warmup=0)
    method.before_task(Stage(1, [], "task 1"))
    for _, _, lin in method._wrappers():
        lin.usage.copy_(usage)
        lin.importance_ref.copy_(importance)
        method._update_masks(lin, 1)
        assert lin.frozen.tolist() == [True, False, False]
        lin.usage.copy_(torch.tensor([0.5, 0.0, 0.5]))  # the current expert scores lowest: still trains
        lin.importance_ref.zero_()
        method._update_masks(lin, 1)
        assert lin.frozen.tolist() == [False, False, False]
        lin.frozen.copy_(torch.tensor([True, False, False]))
    optimizer = method.optimizer_for_stage(Stage(1, [], "task 1"), None)
    optimizer.zero_grad(set_to_none=True)
    loss, parts = method.loss(batch(3), 0)
    loss.backward()
    assert parts["frozen"] == 0.5  # expert 0 of the two others, in every linear
    for l, p, lin in method._wrappers():
        assert lin.lora_A[0].grad is None and lin.lora_B[0].grad is None  # not computed
        assert lin.lora_B[2].grad is not None and lin.router.grad.abs().sum() > 0
        assert (lin.weights[:, 0] == 0).all() and torch.allclose(lin.weights.sum(-1), torch.ones(2))


def test_masks_wait_for_the_warm_up():
    method, _ = make(freeze_warmup=3)
    method.before_task(Stage(0, [], "task 0"))
    optimizer = method.optimizer_for_stage(Stage(0, [], "task 0"), None)
    frozen = [step(method, optimizer, batch(i), i)["frozen"] for i in range(5)]
    assert frozen[:3] == [0.0] * 3 and max(frozen[3:]) > 0  # masks from step 3 on


def test_a_short_task_fits_the_warm_up_and_refreshes_to_its_length():
    """The paper's warm-up 50 and refresh 20 exceed a cpu task's 8-32 steps (the
    committed run never froze an expert). Fitted to the task's n steps: W =
    min(50, floor(n / 4)), R = max(1, min(20, n // 4)); as given when the task is
    long enough or n is unknown. On an 8-step task (16 examples, batch 2) with the
    default arguments, masks fire from step 2 and the subspace refreshes 4 times."""
    a = SAMEArgs()
    assert activation_schedule(8, a) == (2, 2) and activation_schedule(32, a) == (8, 8)
    assert activation_schedule(3, a) == (0, 1)
    assert activation_schedule(1000, a) == (50, 20) and activation_schedule(None, a) == (50, 20)
    assert activation_schedule(8, SAMEArgs(warmup_share=1.0, min_refreshes=0)) == (8, 20)
    with pytest.raises(UserError, match="warmup_share"):
        SAMEArgs(warmup_share=1.5)

    tasks = [SimpleNamespace(name=f"t{i}", train=[None] * 16) for i in range(E)]
    context = MethodContext(RunConfig(train=TrainConfig(batch_size=2, micro_batch_size=2)), torch.device("cpu"),
                            None, all_tasks=tasks)
    method, _ = make(context)  # freeze_warmup 50, refresh_every 20: the defaults
    optimizer = None
    for t in range(2):
        stage = Stage(t, [tasks[t]], f"t{t}")
        assert method.ctx.stage_steps(stage) == 8
        ref = {(l, p): lin.importance_ref.clone() for l, p, lin in method._wrappers()}
        method.before_task(stage)
        optimizer = method.optimizer_for_stage(stage, optimizer)
        frozen = [step(method, optimizer, batch(10 * t + i), i)["frozen"] for i in range(8)]
        method.after_task(stage)
        rec = method.param_report()
        assert rec["activation_schedule"] == {"steps": 8, "freeze_warmup": 2, "refresh_every": 2, "refreshes": 4}
        assert frozen[:2] == [0.0, 0.0] and min(frozen[2:]) > 0  # masks from step 2 on
        if t == 1:
            # where the mechanism must freeze: the expert with the largest F_ref (not the
            # task's own) scores minmax(U) - 1 <= 0 < tau_score, so it is frozen for the
            # 6 steps after the warm-up: share 6 / 8
            checked = 0
            for (l, p), f_ref in ref.items():
                j = int(f_ref.argmax())
                if j != t:
                    assert rec["freeze_share"][p][l][j] == 0.75, (l, p, j)
                    checked += 1
            assert checked >= 3


def test_an_expert_important_before_stays_protected_in_later_tasks():
    """F_ref is the running max of F over the ends of earlier tasks. Expert 0
    carries task 0 (F = 4x every expert's sum), so task 1 freezes it from its first
    mask update; frozen, its w is 0 and its F decays (ema^n) below task 1's own
    expert's. F_ref still remembers task 0: in task 2 expert 0 is still the most
    important and frozen from step 1 on in every linear. (With F_ref = F at the
    end of task 1, the code's carried EMA, it is the least important one.)"""
    n = 20
    method, model = make(freeze_warmup=0, ema=0.8)
    stage = Stage(0, [], "task 0")
    method.before_task(stage)
    optimizer = method.optimizer_for_stage(stage, None)
    for i in range(n):
        step(method, optimizer, batch(i), i)
    with torch.no_grad():
        for _, _, lin in method._wrappers():
            lin.importance.copy_(torch.tensor([4.0, 0.0, 0.0]) * lin.importance.sum())
    carried = {(l, p): lin.importance[0].item() for l, p, lin in method._wrappers()}
    method.after_task(stage)
    optimizer = train_task(method, 1, n, seed=100, optimizer=optimizer)
    rec = method.param_report()
    for l, p, lin in method._wrappers():
        assert rec["freeze_share"][p][l][0] == (n - 1) / n  # protected in task 1
        assert lin.importance[0] < 0.02 * carried[l, p]  # ... so its F decayed (0.8^20 = 0.012)
        assert lin.importance[0] < lin.importance[1]  # below the expert task 1 trained
    # the memory survives a checkpoint
    resumed, _ = make(freeze_warmup=0, ema=0.8)
    resumed.load_state_dict(method.state_dict())
    for (l, p, lin), (_, _, other) in zip(method._wrappers(), resumed._wrappers()):
        assert torch.equal(other.importance_ref, lin.importance_ref)
        assert torch.equal(other.importance, lin.importance)
    train_task(method, 2, n, seed=200, optimizer=optimizer)
    rec = method.param_report()
    for l, p, lin in method._wrappers():
        assert rec["freeze_share"][p][l][0] == (n - 1) / n, (l, p)  # still protected in task 2
        assert lin.importance_ref[0].item() == carried[l, p]  # remembered through tasks 1 and 2


def test_live_importance_freezes_everything_and_the_record_says_so(caplog):
    """The code's live F on data where ||x||^2 is uncorrelated with routing (here:
    two identical rows, so F = U * const): Score = 0 everywhere, every other
    expert is frozen at the first update, the masks lock, and the routers get
    no gradient from then on. Recorded and warned, not silent."""
    method, model = make(importance="live", freeze_warmup=0)
    b = batch(0)
    b = {k: v[:1].repeat(2, 1) for k, v in b.items()}
    stage = Stage(0, [], "task 0")
    method.before_task(stage)
    optimizer = method.optimizer_for_stage(stage, None)
    for i in range(4):
        step(method, optimizer, b, i)
    with caplog.at_level(logging.WARNING, logger="cl_bench.methods.same"):
        method.after_task(stage)
    rec = method.param_report()
    assert rec["all_frozen"] and rec["all_frozen_step"] == 1
    assert rec["locked_at"] == {p: [1, 1] for p in ("gate_proj", "up_proj", "down_proj")}
    assert rec["freeze_masks"]["gate_proj"] == [[0, 1, 1], [0, 1, 1]]
    norms = rec["router_grad_norm"]["per_step"]
    assert norms[0] > 0 and norms[1:] == [0.0, 0.0, 0.0] and rec["router_grad_norm"]["zero_steps"] == 3
    assert rec["freeze_share"]["up_proj"][0] == [0.0, 0.75, 0.75]
    assert "every linear froze" in caplog.text
    # the paper's semantics (F from earlier tasks, 0 at task 0) on the same data: no lock-up
    method, _ = make(freeze_warmup=0)
    method.before_task(stage)
    optimizer = method.optimizer_for_stage(stage, None)
    for i in range(4):
        step(method, optimizer, b, i)
    method.after_task(stage)
    rec = method.param_report()
    assert not rec["all_frozen"] and rec["router_grad_norm"]["zero_steps"] == 0


def test_stage_record_logs_ranks_spectrum_and_masks():
    method, _ = make(freeze_warmup=1, refresh_every=2)
    train_task(method, 0, 3)
    rec = method.param_report()
    for key in ("x", "h"):
        assert all(1 <= k <= 64 for k in rec["router_rank"][key])
        assert all(lo <= k for lo, k in zip(rec["router_rank_min"][key], rec["router_rank"][key]))
        top, kth, trace = rec["spectrum"][key][0]
        assert trace > top >= kth > 0
    assert rec["spectrum"]["x"][0][2] == pytest.approx(64, rel=1e-2)  # RMS-normed x: ||x||^2 = d
    assert len(rec["router_grad_norm"]["per_step"]) == 3
    assert set(rec["freeze_masks"]) == {"gate_proj", "up_proj", "down_proj"}
    ranks = [prev["x"].k for prev in method._previous]  # C^0, used through task 1
    train_task(method, 1, 2, seed=10)
    rec = method.param_report()
    assert rec["curvature_rank"]["x"] == ranks and all(k > 0 for k in ranks)
    json.dumps(rec)  # lands in run.json


# ---- end to end ---------------------------------------------------------------------------------

@pytest.mark.slow
def test_smoke_run_and_resume(trace_dir, tmp_path, monkeypatch):
    extra = ("--method", "same", "--method-arg", "freeze_warmup=1")
    straight = tmp_path / "straight"
    assert run_cli(*smoke_args(trace_dir, straight, *extra)) == 0
    record = json.loads((only_run(straight) / "run.json").read_text())
    assert record["status"] == "complete"
    assert record["method_args"]["n_experts"] is None
    params = flat_params(record)
    assert [p["n_experts"] for p in params] == [3, 3, 3] and params[0]["curvature_rank"] is None
    assert all(len(p["curvature_rank"]["h"]) == 2 for p in params[1:])
    assert all(len(p["router_grad_norm"]["per_step"]) == 2 for p in params)
    rows = results.read_jsonl(only_run(straight) / "metrics.jsonl")
    assert {"lm", "frozen"} <= set(rows[0]) and rows[-1]["frozen"] > 0

    broken = tmp_path / "broken"
    run_dir = interrupted_run(monkeypatch, *smoke_args(trace_dir, broken, *extra), at_stage=2)
    assert run_cli("run", "--resume", run_dir, "--no-progress") == 0
    resumed = json.loads((run_dir / "run.json").read_text())
    assert resumed["matrix"] == record["matrix"] and resumed["params"] == record["params"]


# ---- the routing-drift probe ---------------------------------------------------------------

def test_the_routing_probe_reads_each_routed_linears_prompt_pooled_weights():
    """cl_bench/eval/probes/routing.py probes SAME's routed linears: per linear, the
    share of expert e is the probe sequences' mean weight w_b[e], the prompt pooled
    as in training. Mutations caught: no `routing_weights` (nothing probed), the
    probe's forward without labels (the answers pooled too)."""
    from cl_bench.eval.probes.routing import RoutingProbe, routed_layers
    from cl_bench.benchmarks.trace.loader import Example
    from cl_bench.data.encode import Encoder, collate
    from cl_bench.models.modes import eval_mode

    method, model = make()
    _, tokenizer, _ = tiny_llama(0)
    encoder = Encoder.from_config(tokenizer, TrainConfig(max_prompt_len=96, max_answer_len=16, truncation_head=16))
    examples = [Example(f"Question: {i} plus {i + 1}? Answer:", f"{2 * i + 1} apples and pears", i) for i in range(4)]
    task = SimpleNamespace(name="A", test=examples)
    shares = RoutingProbe(n_examples=4).distributions(model, encoder, task)

    layers = routed_layers(model)
    assert len(layers) == len(list(method._wrappers())) == len(shares)
    b = collate([encoder.train_example(e.prompt, e.answer) for e in examples], tokenizer.pad_token_id)
    with eval_mode(model), torch.no_grad():
        model(**b, use_cache=False)
    for got, layer in zip(shares, layers):
        mean = layer.weights.double().sum(0)
        assert got == pytest.approx((mean / mean.sum()).tolist(), abs=1e-6)  # summed in fp32
    assert len({tuple(round(v, 6) for v in s) for s in shares}) > 1  # the linears route differently


@pytest.mark.parametrize("top_k", [0, 2])
def test_rows_that_stop_leave_the_batch_with_their_routing(top_k):
    """A row that reaches EOS leaves the decoding batch (keep_rows); the others keep
    their prefill weights and, top-k, the experts the whole batch picked."""
    method, model = make(infer_top_k=top_k)
    model.eval()
    tok = tiny_llama(0)[1]
    texts = ["Solve: 3 + 4 =", "hi there", "A much longer prompt with many more tokens", "Py: def f(x):",
             "x = 1", "Summarise: the meeting was long"]
    assert_decodes_as_the_plain_loop(model, [tok(t).input_ids for t in texts], 8, tok.pad_token_id, 4)


def test_a_stopped_row_leaves_the_batch_its_experts():
    """After keep_rows, top-k decoding still multiplies the experts some row of the
    prefilled batch picked (the products keep their shapes, so the rows left compute
    as before); an expert only the stopped row picked enters with weight 0, which a
    NaN in it makes visible."""
    method, model = make(infer_top_k=1)
    lin = method.linears[0]["gate_proj"]
    lin.weights, lin.rows = torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 1.0]]), None  # rows 0, 1: experts 0, 2
    lin.routing.reuse, lin.routing.train = True, False
    lin.keep_rows(torch.tensor([0]))
    with torch.no_grad():
        lin.lora_B[2].fill_(float("nan"))
        out = lin(torch.randn(1, 1, lin.base.in_features))
    assert out.isnan().all()
    lin.keep_rows(torch.tensor([0]))  # rows of the rows left
    assert lin.rows.tolist() == [0]
