"""SAME on the tiny Llama (2 layers, width 64, FFN 128): the routed LoRA mixture,
prompt routing and its KV-cache reuse, the spectral router projection, the
curvature map (adaptive expert activation, runs and the routing-drift probe:
test_same_activation.py).

Sizes: E = 3 experts of rank 8 per linear; gate and up are 64 -> 128, down
128 -> 64, so each linear holds 3·8·(64+128) = 4608 expert parameters plus a
router of 3·d_in (192 for gate/up, 384 for down): 14592 per layer, 29184 in all.
"""
from __future__ import annotations

import pytest
import torch

from cl_bench import registry
from cl_bench.config import RunConfig
from cl_bench.errors import UserError
from cl_bench.eval.generation import greedy_generate
from cl_bench.method import MethodContext, Stage
from cl_bench.methods.same import SAMEArgs
from cl_bench.models.loading import tiny_llama
from cl_bench.models.params import schedule_report
from cl_bench.methods.same.subspace import (InputCovariance, Subspace, damped_inverse, energy_rank,
                                           spectral_projection, top_subspace)
from helpers import make_method
from same_setup import E, SIZE, batch, make, train_task, weights


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


def test_an_in_stage_checkpoint_on_two_ranks_keeps_both_ranks_unmerged_tokens():
    """Two ranks' covariances, each with its own tokens since the last merge: hold sums
    them (the all-reduce simulated), rank 0 keeps the sum for its checkpoint and rank 1
    nothing; a run resumed from it, on any number of ranks, has every token in its
    covariance, as one process adding them all would; the held sum goes at the next
    add. Mutations caught: the unmerged sum not loaded (rank 1's tokens and rank 0's
    lost), every rank keeping it, held kept past the next add."""
    torch.manual_seed(0)
    xs = [torch.randn(5, 4), torch.randn(3, 4)]
    ranks = [InputCovariance(4), InputCovariance(4)]
    for cov, x in zip(ranks, xs):
        cov.add(x, shared=True)
    part = [torch.cat([c.fresh.reshape(-1), c.fresh.new_tensor([float(c.fresh_count)])]) for c in ranks]
    for r, cov in enumerate(ranks):
        cov.hold(lambda t, r=r: t.add_(part[1 - r]), torch.device("cpu"), keep=r == 0)
    assert "unmerged" not in ranks[1].state_dict() and ranks[0].held[0].device.type == "cpu"
    resumed = InputCovariance(4)
    resumed.load_state_dict(ranks[0].state_dict())
    one = InputCovariance(4)
    for x in xs:
        one.add(x)
    assert resumed.count == one.count == 8 and torch.allclose(resumed.sum, one.sum, atol=1e-6)
    ranks[0].add(torch.randn(2, 4), shared=True)
    assert ranks[0].held is None and "unmerged" not in ranks[0].state_dict()
