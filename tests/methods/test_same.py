"""SAME on the tiny Llama (2 layers, width 64, FFN 128): the routed LoRA mixture,
prompt routing and its KV-cache reuse, the spectral router projection, the
curvature map, adaptive expert activation (and its degenerate case), and
end-to-end runs.

Sizes: E = 3 experts of rank 8 per linear; gate and up are 64 -> 128, down
128 -> 64, so each linear holds 3·8·(64+128) = 4608 expert parameters plus a
router of 3·d_in (192 for gate/up, 384 for down): 14592 per layer, 29184 in all.
"""
from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import pytest
import torch

from cl_bench import registry
from cl_bench.record import io as results
from cl_bench.config import RunConfig, TrainConfig
from cl_bench.errors import UserError
from cl_bench.eval.generation import greedy_generate
from cl_bench.method import MethodContext, Stage
from cl_bench.methods.same import SAMEArgs, activation_schedule, activation_scores
from cl_bench.models.loading import tiny_llama
from cl_bench.models.params import schedule_report
from cl_bench.methods.same.subspace import Subspace, damped_inverse, energy_rank, spectral_projection, top_subspace
from helpers import (assert_decodes_as_the_plain_loop, flat_params, interrupted_run, make_method, only_run,
                     random_batch, run_cli, smoke_args)

E = 3
SIZE = 2 * (3 * E * 8 * (64 + 128) + E * (64 + 64 + 128))  # 29184


def make(context=None, **args):
    """SAME set up on the tiny Llama, with its experts and routers moved off their
    init (a trained look: B != 0, so experts and routing matter)."""
    method = make_method("same", context=context or MethodContext.for_shapes(E), **{"n_experts": E, **args})
    model = method.model
    with torch.no_grad():
        g = torch.Generator().manual_seed(1)
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.add_(0.1 * torch.randn(p.shape, generator=g))
            elif "router" in name:
                p.mul_(4)  # sharper routing
    return method, model


def batch(seed=0, prompt=6, length=12):
    """Two rows: prompt tokens labelled -100, the second row right-padded."""
    return random_batch(seed, length, prompt)


def step(method, optimizer, b, i):
    """One optimiser step in the backend's hook order."""
    optimizer.zero_grad(set_to_none=True)
    loss, parts = method.loss(b, i)
    loss.backward()
    method.before_step(i)
    optimizer.step()
    method.after_step(i)
    return parts


def train_task(method, t, n_steps, seed=0, optimizer=None):
    stage = Stage(t, [], f"task {t}")
    method.before_task(stage)
    optimizer = method.optimizer_for_stage(stage, optimizer)
    for i in range(n_steps):
        step(method, optimizer, batch(seed + i), i)
    method.after_task(stage)
    return optimizer


def weights(method):
    """(layer, proj) -> the last forward's routing weights (B, E)."""
    return {(l, p): lin.weights.clone() for l, p, lin in method._wrappers()}


# ---- architecture ------------------------------------------------------------------------

def test_wraps_every_ffn_linear_and_starts_as_the_dense_model():
    method = make_method("same", context=MethodContext.for_shapes(3), n_experts=E)
    model = method.model
    dense, _, _ = tiny_llama(0)
    ids = torch.randint(3, 259, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, dense(input_ids=ids).logits, rtol=0, atol=0)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {f"model.layers.{l}.mlp.{p}.{w}" for l in range(2) for p in ("gate_proj", "up_proj", "down_proj")
                         for w in ["router"] + [f"lora_{ab}.{i}" for ab in "AB" for i in range(E)]}
    report = method.param_report()
    assert report["trainable"] == SIZE and report["experts_per_layer"] == [E, E]
    assert report["total"] == sum(p.numel() for p in dense.parameters()) + SIZE == report["deployed"]


def test_one_expert_per_task_is_required():
    cls = registry.get("same")
    context = MethodContext(RunConfig(), torch.device("cpu"), None, all_tasks=[object()] * 4)
    with pytest.raises(UserError, match="4 tasks but method_args.n_experts=3"):
        cls(cls.parse_args({"n_experts": 3}), context).setup(tiny_llama(0)[0])
    method = cls(cls.parse_args({}), context)  # E = T by default
    method.setup(tiny_llama(0)[0])
    assert method.n_experts == 4
    with pytest.raises(UserError, match="precondition"):
        cls.parse_args({"precondition": "adam"})
    with pytest.raises(UserError, match="importance"):
        SAMEArgs(importance="now")


def test_params_schedule_has_every_expert_from_the_start():
    rows = schedule_report("tiny-llama", "same", 3)
    assert [r["experts_per_layer"] for r in rows] == [[3, 3]] * 3
    assert {r["trainable"] for r in rows} == {SIZE}
    top2 = schedule_report("tiny-llama", "same", 3, {"infer_top_k": 2})
    # a token touches 2 of the 3 experts of each linear: one rank-8 expert less per linear
    assert top2[0]["total"] - top2[0]["active_per_token"] == 2 * 3 * 8 * (64 + 128)
    assert schedule_report("llama-3.2-1b", "same", 6)[0]["experts_per_layer"] == [6] * 16


# ---- routing per sequence over the prompt ------------------------------------------------------

def test_prompt_pooling_excludes_answer_tokens_and_padding():
    method, model = make()
    model.eval()  # no dropout: layer 1's inputs depend on layer 0's experts
    method.before_task(Stage(0, [], "task 0"))
    b = batch(0)
    method.loss(b, 0)
    first = weights(method)
    changed = {k: v.clone() for k, v in b.items()}
    answer = b["labels"] != -100
    changed["input_ids"][answer] = (changed["input_ids"][answer] + 7 - 3) % 256 + 3
    changed["labels"][answer] = changed["input_ids"][answer]
    method.loss(changed, 0)
    for key, w in weights(method).items():
        torch.testing.assert_close(w, first[key], rtol=0, atol=1e-6)  # answers never enter the pool
    assert torch.allclose(w.sum(-1), torch.ones(2))
    prompt = changed["input_ids"].clone()
    prompt[0, 2] = (prompt[0, 2] + 1 - 3) % 256 + 3
    method.loss({**changed, "input_ids": prompt}, 0)
    assert not torch.allclose(method.linears[0]["gate_proj"].weights[0], first[0, "gate_proj"][0])
    # statistics: every non-pad token but each row's first; up shares gate's input
    covs = method.covs[0]
    n = int(b["attention_mask"].sum()) - 2
    assert covs["x"].count == covs["h"].count == 3 * n

    # generation's prefill: left padding leaves a row's weights as they are alone
    ids = b["input_ids"][1, :5]
    with torch.no_grad():
        model(input_ids=ids[None])
        alone = weights(method)
        padded = torch.cat([torch.zeros(4, dtype=torch.long), ids])[None]
        model(input_ids=padded, attention_mask=(torch.arange(9) >= 4).long()[None])
    for key, w in weights(method).items():
        torch.testing.assert_close(w, alone[key], rtol=0, atol=1e-6)


@pytest.mark.parametrize("top_k", [0, 2])
def test_cached_decoding_equals_the_full_forward(top_k):
    """Prefill + one-token steps through the KV cache (cl_bench.eval.generation, left
    padded batch) give the logits of one full forward over prompt + generated
    tokens with labels -100 on the prompt (the prompt alone is pooled)."""
    method, model = make(infer_top_k=top_k)
    model.eval()  # the full forwards below: no dropout, as generation
    tok = tiny_llama(0)[1]
    texts = ["Solve: 3 + 4 =", "hi there", "A much longer prompt with many more tokens", "Py: def f(x):"]
    prompts = [tok(t).input_ids for t in texts]
    seen = []
    handle = model.register_forward_hook(lambda m, a, out: seen.append(out.logits[:, -1].clone()))
    out = greedy_generate(model, prompts, 6, eos_id=-1, pad_id=tok.pad_token_id, batch_size=4)
    handle.remove()
    decoded = weights(method)  # as the last decoding step left them
    assert len(seen) == 6 and all(len(g) == 6 for g in out)
    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))  # generation's batch order
    teeth = 0.0
    for row, i in enumerate(order):
        p, g = prompts[i], out[i]
        ids = torch.tensor([p + g])
        labels = torch.tensor([[-100] * len(p) + g])
        with torch.no_grad():
            full = model(input_ids=ids, labels=labels).logits[0, len(p) - 1:-1]  # (6, V)
            pooled_all = model(input_ids=ids).logits[0, len(p) - 1:-1]
        cached = torch.stack([s[row] for s in seen])
        torch.testing.assert_close(cached, full, rtol=1e-4, atol=1e-4)
        teeth = max(teeth, float((pooled_all - full).abs().max()))
    assert teeth > 1e-3  # the check has teeth: pooling the generated tokens too moves the logits
    # the decoding steps reused the prefill's weights: a fresh prefill gives the same
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(prompts[i])) + prompts[i] for i in order])
    mask = torch.tensor([[0] * (width - len(prompts[i])) + [1] * len(prompts[i]) for i in order])
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
    for key, w in weights(method).items():
        torch.testing.assert_close(decoded[key], w, rtol=0, atol=1e-6)
    if top_k:
        w = method.linears[0]["gate_proj"].weights
        assert ((w > 0).sum(-1) == 2).all() and torch.allclose(w.sum(-1), torch.ones(len(prompts)))


@pytest.mark.parametrize("top_k", [0, 2])
def test_inference_weights_follow_the_formula(top_k):
    """w = mean over the prompt of softmax(W_G x) (soft), or of softmax(W_G x / E),
    top-k, renormalised (the code's inference rule)."""
    method, model = make(infer_top_k=top_k)
    model.eval()
    lin = method.linears[1]["down_proj"]
    seen = []
    handle = lin.register_forward_pre_hook(lambda m, args: seen.append(args[0]))
    ids = torch.randint(3, 259, (2, 7), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
    handle.remove()
    logits = seen[0] @ lin.router.T  # (B, T, E)
    probs = (logits / (E if top_k else 1)).softmax(-1)
    expected = torch.stack([probs[0, 3:].mean(0), probs[1].mean(0)])
    if top_k:
        top, index = expected.topk(top_k, -1)
        expected = torch.zeros_like(expected).scatter(-1, index, top / top.sum(-1, keepdim=True))
    torch.testing.assert_close(lin.weights, expected)
    with pytest.raises(RuntimeError, match="prefill"):  # a cached step of another batch
        lin.routing.reuse = True
        lin(torch.zeros(5, 1, 128))


# ---- the two gradient maps ------------------------------------------------------------------

def test_maps_are_the_identity_without_a_subspace():
    g = torch.randn(5, 16, generator=torch.Generator().manual_seed(0))
    empty = Subspace(torch.zeros(16, 0), torch.zeros(0), trace=1.0, top=1.0)
    torch.testing.assert_close(damped_inverse(g, empty, mu=1.0), g)  # P = I at k = 0, mu = 1
    torch.testing.assert_close(spectral_projection(g, empty, rho=0.2), g)
    assert spectral_projection(g, None, rho=0.2) is g
    # rho = 0: no direction shrinks, whatever the subspace
    x = torch.randn(200, 16, generator=torch.Generator().manual_seed(1))
    sub = top_subspace(x.T @ x / 200, delta=0.9, max_rank=16)
    torch.testing.assert_close(spectral_projection(g, sub, rho=0.0), g)
    assert energy_rank(torch.tensor([3.0, 1.0]), 4.0, 0.0) == 0
    assert energy_rank(torch.tensor([3.0, 1.0]), 4.0, 0.75) == 1
    assert energy_rank(torch.tensor([3.0, 1.0]), 10.0, 0.9) == 2  # short of delta: the cap


def test_wide_inputs_use_the_randomized_decomposition(monkeypatch):
    from cl_bench.methods.same import subspace

    gen = torch.Generator().manual_seed(0)
    basis = torch.linalg.qr(torch.randn(48, 5, generator=gen))[0]
    cov = basis @ torch.diag(torch.tensor([9.0, 5.0, 3.0, 2.0, 1.0])) @ basis.T + 1e-3 * torch.eye(48)
    exact = top_subspace(cov, delta=0.9, max_rank=16)
    monkeypatch.setattr(subspace, "EIGH_MAX_DIM", 8)
    fast = top_subspace(cov, delta=0.9, max_rank=16)
    assert fast.k == exact.k == 4 and fast.trace == pytest.approx(exact.trace)
    torch.testing.assert_close(fast.lam, exact.lam, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(fast.V @ fast.V.T, exact.V @ exact.V.T, rtol=0, atol=1e-4)


def test_damped_inverse_is_the_exact_inverse_of_a_rank_k_covariance():
    gen = torch.Generator().manual_seed(0)
    basis = torch.linalg.qr(torch.randn(16, 3, generator=gen, dtype=torch.float64))[0]  # (16, 3)
    cov = basis @ torch.diag(torch.tensor([5.0, 2.0, 0.5], dtype=torch.float64)) @ basis.T
    sub = top_subspace(cov.float(), delta=0.999, max_rank=8)
    assert sub.k == 3
    g = torch.randn(4, 16, generator=gen)
    mu = 0.9
    exact = g.double() @ torch.linalg.inv(cov + mu * torch.eye(16, dtype=torch.float64))
    torch.testing.assert_close(damped_inverse(g, sub, mu).double(), exact, rtol=1e-4, atol=1e-5)


def test_a_v_perp_router_update_keeps_old_logits_about_fixed():
    """Old inputs near a 4-dim subspace of R^64: a router update in V_perp barely
    moves their logits (and routing probabilities); the same-size update
    unprojected moves them a lot. The spectral map shrinks V_par by at most rho
    and passes V_perp unchanged."""
    gen = torch.Generator().manual_seed(0)
    basis = torch.linalg.qr(torch.randn(64, 4, generator=gen))[0]
    x_old = torch.randn(500, 4, generator=gen) @ basis.T + 0.001 * torch.randn(500, 64, generator=gen)
    sub = top_subspace(x_old.T @ x_old / 500, delta=0.99, max_rank=64)
    assert sub.k == 4
    router = torch.randn(E, 64, generator=gen)
    update = torch.randn(E, 64, generator=gen)
    perp = update - update @ sub.V @ sub.V.T
    perp = perp * update.norm() / perp.norm()  # same size
    assert (x_old @ perp.T).norm() < 0.02 * (x_old @ update.T).norm()  # logits
    before = (x_old @ router.T).softmax(-1)
    moved_perp = ((x_old @ (router + perp).T).softmax(-1) - before).abs().max()
    moved_full = ((x_old @ (router + update).T).softmax(-1) - before).abs().max()
    assert moved_perp < 0.02 and moved_full > 0.3
    mapped = spectral_projection(update, sub, rho=0.2)
    torch.testing.assert_close(mapped - mapped @ sub.V @ sub.V.T, update - update @ sub.V @ sub.V.T)
    ratio = (mapped @ sub.V).norm(dim=0) / (update @ sub.V).norm(dim=0)  # (k,) per direction
    assert ((ratio >= 0.8 - 1e-5) & (ratio <= 1 + 1e-5)).all() and ratio.min() < 0.95
    torch.testing.assert_close(ratio[-1], torch.tensor(1.0))  # the weakest kept direction is not shrunk


def raw_and_mapped(method, t, seed=50):
    """Gradients of one batch before and after before_step (step 0 of task t)."""
    optimizer = method.optimizer_for_stage(Stage(t, [], f"task {t}"), None)
    optimizer.zero_grad(set_to_none=True)
    loss, _ = method.loss(batch(seed), 0)
    loss.backward()
    raw = {n: p.grad.clone() for n, p in method.model.named_parameters() if p.grad is not None}
    method.before_step(0)
    return raw, {n: p.grad.clone() for n, p in method.model.named_parameters() if p.grad is not None}


def test_curvature_scales_every_a_from_task_1_and_routers_are_projected():
    method, model = make(adaptive_activation=False)
    method.before_task(Stage(0, [], "task 0"))
    raw, mapped = raw_and_mapped(method, 0)
    task = method._task
    for l, p, lin in method._wrappers():
        prefix = f"model.layers.{l}.mlp.{p}."
        sub = task.bases[l]["x" if p != "down_proj" else "h"]
        assert sub.k > 0
        torch.testing.assert_close(mapped[prefix + "router"], spectral_projection(raw[prefix + "router"], sub, 0.2))
        for i in range(E):  # task 0: no curvature map
            assert torch.equal(mapped[prefix + f"lora_A.{i}"], raw[prefix + f"lora_A.{i}"])
    method.after_task(Stage(0, [], "task 0"))
    assert method.param_report()["curvature_rank"] is None

    method.before_task(Stage(1, [], "task 1"))
    raw, mapped = raw_and_mapped(method, 1)
    for l, p, lin in method._wrappers():
        prefix = f"model.layers.{l}.mlp.{p}."
        sub = method._previous[l]["x" if p != "down_proj" else "h"]  # C^0, frozen at task 0's end
        for i in range(E):
            a = prefix + f"lora_A.{i}"
            torch.testing.assert_close(mapped[a], damped_inverse(raw[a], sub, 0.9))
            assert not torch.allclose(mapped[a], raw[a])
            assert torch.equal(mapped[prefix + f"lora_B.{i}"], raw[prefix + f"lora_B.{i}"])


def test_update_mode_maps_the_adamw_step_not_the_gradient():
    method, model = make(adaptive_activation=False, precondition="update", lr=1e-2)
    train_task(method, 0, 2)
    stage = Stage(1, [], "task 1")
    method.before_task(stage)
    optimizer = method.optimizer_for_stage(stage, None)
    optimizer.zero_grad(set_to_none=True)
    loss, _ = method.loss(batch(60), 0)
    loss.backward()
    raw = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    method.before_step(0)
    assert all(torch.equal(p.grad, raw[n]) for n, p in model.named_parameters() if p.grad is not None)
    optimizer.step()
    adam = {n: p.detach().clone() for n, p in model.named_parameters()}
    method.after_step(0)
    a = "model.layers.0.mlp.gate_proj.lora_A.1"
    sub = method._previous[0]["x"]
    torch.testing.assert_close(model.get_parameter(a) - before[a], damped_inverse(adam[a] - before[a], sub, 0.9))
    r = "model.layers.1.mlp.down_proj.router"
    torch.testing.assert_close(model.get_parameter(r) - before[r],
                               spectral_projection(adam[r] - before[r], method._task.bases[1]["h"], 0.2))
    b = "model.layers.0.mlp.gate_proj.lora_B.1"
    assert torch.equal(model.get_parameter(b), adam[b])


def test_all_mechanisms_off_leave_gradients_and_experts_alone():
    method, model = make(spectral_routing=False, curvature_scaling=False, adaptive_activation=False,
                         freeze_warmup=0)
    train_task(method, 0, 2)
    method.before_task(Stage(1, [], "task 1"))
    raw, mapped = raw_and_mapped(method, 1)
    assert raw.keys() == mapped.keys() and all(torch.equal(raw[n], mapped[n]) for n in raw)
    assert len(raw) == 2 * 3 * (1 + 2 * E)  # every expert and router has a gradient
    assert not any(lin.frozen.any() for _, _, lin in method._wrappers())


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
