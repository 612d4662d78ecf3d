"""MoFO: the momentum-filtered Adam step by hand, and a CLI run."""
from __future__ import annotations

import math
import threading

import pytest
import torch

from helpers import only_run, record, run_cli, smoke_args


def mofo_optimizer(params, **kw):
    from cl_bench.methods.mofo import MomentumFilteredAdam

    return MomentumFilteredAdam(params, **kw)


def fresh_params(seed: int = 0) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    shapes = [(7, 13), (3, 5, 4), (11,)]
    return [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]


def set_grads(params, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)


def test_mofo_moves_exactly_floor_alpha_entries_of_each_matrix():
    params = fresh_params()
    opt = mofo_optimizer(params, lr=1e-2, alpha=0.15)
    for step in range(3):
        before = [p.detach().clone() for p in params]
        set_grads(params, seed=step)
        opt.step()
        moved = [int((p.detach() != b).sum()) for p, b in zip(params, before)]
        assert moved == [math.floor(0.15 * 91), math.floor(0.15 * 60), 11]
        for p in params:  # moments updated everywhere, not only where weights moved
            assert (opt.state[p]["exp_avg"] != 0).all() and (opt.state[p]["exp_avg_sq"] != 0).all()
    # After one step m = (1 − β1)·g, so the moved entries are those of largest |g|.
    params = fresh_params()
    opt = mofo_optimizer(params, lr=1e-2, alpha=0.15)
    before = params[0].detach().clone()
    set_grads(params, seed=7)
    top = params[0].grad.abs().flatten().topk(13).indices
    opt.step()
    moved = (params[0].detach() != before).flatten().nonzero().flatten()
    assert sorted(moved.tolist()) == sorted(top.tolist())


def test_mofo_ties_at_the_threshold_move_no_more_than_the_fraction():
    params = fresh_params()
    opt = mofo_optimizer(params, lr=1e-2, alpha=0.15)
    before = [p.detach().clone() for p in params]
    for p in params:
        p.grad = torch.ones_like(p)  # every |m| ties
    opt.step()
    assert [int((p.detach() != b).sum()) for p, b in zip(params, before)] == [13, 9, 11]


def test_mofo_with_alpha_one_is_adam_exactly():
    ours, ref = fresh_params(), fresh_params()
    opt = mofo_optimizer(ours, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, alpha=1.0)
    adam = torch.optim.Adam(ref, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, foreach=False)
    for step in range(5):
        set_grads(ours, step)
        set_grads(ref, step)
        opt.step()
        adam.step()
        for a, b in zip(ours, ref):
            assert torch.equal(a, b)
            assert torch.equal(opt.state[a]["exp_avg_sq"], adam.state[b]["exp_avg_sq"])
    assert not torch.equal(ours[0], fresh_params()[0])


def test_mofo_state_round_trips_through_state_dict(tmp_path):
    params = fresh_params()
    opt = mofo_optimizer(params, lr=1e-2, alpha=0.3)
    for step in range(2):
        set_grads(params, step)
        opt.step()
    torch.save(opt.state_dict(), tmp_path / "opt.pt")
    twin = [torch.nn.Parameter(p.detach().clone()) for p in params]
    restored = mofo_optimizer(twin, lr=1.0, alpha=0.9)  # hyperparameters come back too
    restored.load_state_dict(torch.load(tmp_path / "opt.pt", weights_only=False))
    assert restored.param_groups[0]["alpha"] == 0.3 and restored.param_groups[0]["lr"] == 1e-2
    set_grads(params, 9)
    set_grads(twin, 9)
    opt.step()
    restored.step()
    for a, b in zip(params, twin):
        assert torch.equal(a, b)
        assert restored.state[b]["step"] == 3


class ThreadRanks:
    """`n` ranks as threads of this process: all_reduce(t) of rank r sums every
    rank's t (in rank order) into its own, as torch.distributed.all_reduce does; a
    rank calling it out of step with the others breaks the barrier (no hang)."""

    def __init__(self, n: int):
        self.barrier, self.parts = threading.Barrier(n, timeout=30), [None] * n

    def all_reduce_of(self, rank: int):
        def all_reduce(t: torch.Tensor) -> None:
            self.parts[rank] = t.clone()
            self.barrier.wait()
            total = sum(self.parts[1:], self.parts[0].clone())
            self.barrier.wait()
            t.copy_(total)
        return all_reduce


@pytest.mark.parametrize("ranks", [2, 3])
def test_mofo_on_zero_partitions_steps_as_on_whole_parameters(ranks):
    """Catches: the top-k taken per rank's slice of a matrix (each rank's fragment of
    (7, 13) differs), or a flat partition stepped as one 1-D tensor (plain Adam).

    ZeRO-2's layout by hand: the parameters end to end plus padding, cut into equal
    flat partitions ((7, 13) is cut; (3, 5, 4) is held whole by rank 1 of 2, cut over
    ranks 1 and 2 of 3), each stepped by its own optimiser (a rank per thread,
    ThreadRanks) with its ZeroLayout; after every step the partitions put together
    equal the whole-parameter optimiser's weights and moments bit for bit."""
    from cl_bench.step_gradients import Segment, ZeroLayout

    params = fresh_params()
    whole = mofo_optimizer(params, lr=1e-2, alpha=0.15)
    total = sum(p.numel() for p in params)
    size = -(-(total + 5) // ranks)  # 5 values of padding, at least
    cat = lambda tensors: torch.cat([t.detach().flatten() for t in tensors] + [torch.zeros(size * ranks - total)])
    starts = [sum(p.numel() for p in params[:i]) for i in range(len(params))]

    def segment(p, at, r):
        bounds = [(max(at, q * size), min(at + p.numel(), (q + 1) * size)) for q in range(ranks)]
        (lo, hi), held = bounds[r], sum(lo < hi for lo, hi in bounds)
        return Segment(p, p.shape, *((lo - r * size, lo - at, hi - lo) if lo < hi else (0, 0, 0)), held)

    flats = [torch.nn.Parameter(cat(params)[r * size:(r + 1) * size].clone()) for r in range(ranks)]
    shared = ThreadRanks(ranks)
    parts = [mofo_optimizer([flat], lr=1e-2, alpha=0.15) for flat in flats]
    for r, (flat, opt) in enumerate(zip(flats, parts)):
        opt.bind_zero_layout(ZeroLayout({flat: [segment(p, at, r) for p, at in zip(params, starts)]},
                                        shared.all_reduce_of(r)))
    held = [s.ranks for s in parts[0].zero_layout.segments[flats[0]]]
    assert held == ([2, 1, 1] if ranks == 2 else [2, 2, 1])  # rank 0 holds none of (3, 5, 4)
    done = []
    for step in range(3):
        set_grads(params, seed=step)
        grads = cat([p.grad for p in params])
        for r, flat in enumerate(flats):
            flat.grad = grads[r * size:(r + 1) * size].clone()
        threads = [threading.Thread(target=lambda o=opt: done.append(o.step())) for opt in parts]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(done) == ranks * (step + 1)  # every rank finished its step
        whole.step()
        assert torch.equal(torch.cat([f.detach() for f in flats]), cat(params))
        moments = torch.cat([opt.state[f]["exp_avg"] for opt, f in zip(parts, flats)])
        assert torch.equal(moments, cat([whole.state[p]["exp_avg"] for p in params]))
    assert not torch.equal(params[0], fresh_params()[0])


@pytest.mark.slow
def test_mofo_runs_end_to_end(trace_dir, tmp_path):
    out = tmp_path / "runs"
    assert run_cli(*smoke_args(trace_dir, out, "--method", "mofo")) == 0
    rec = record(only_run(out))
    assert rec["status"] == "complete"
    assert rec["method_args"]["alpha"] == 0.15 and rec["method_args"]["beta2"] == 0.999
    assert all(v is not None for b, row in enumerate(rec["matrix"]) for v in row[:b + 1])


def test_the_method_trains_with_the_filtered_optimiser():
    """Catches: MoFO.make_optimizer returning plain AdamW (the filtered optimiser,
    tested above on its own, then never used by the method).

    The registered method on the tiny Llama, through the harness's hooks
    (optimizer_for_stage, loss, step): in each real step every weight matrix moves
    in at most ⌊α·numel⌋ entries, and in some of them (Adam moves every entry with
    a gradient: all of them, for the non-embedding matrices); 1-D tensors (the
    norms) move fully."""
    from helpers import distinct_stages, encode, make_method, run_steps

    alpha = 0.1
    method = make_method("mofo", lr=1e-3, alpha=alpha)
    stage = distinct_stages(1)[0]
    named = [(n, p) for n, p in method.model.named_parameters() if p.requires_grad]
    before: dict[str, torch.Tensor] = {}
    moved_by_step: list[dict[str, int]] = []

    def snapshot(step, loss, parts):  # after backward, before the optimiser step
        if before:
            moved_by_step.append({n: int((p.detach() != before[n]).sum()) for n, p in named})
        before.update({n: p.detach().clone() for n, p in named})

    run_steps(method, stage, encode(method, stage.tasks[0].train[:4]), 4, on_step=snapshot)
    assert len(moved_by_step) == 3  # the moves of steps 0, 1 and 2
    for moved in moved_by_step:
        for n, p in named:
            if p.dim() >= 2:
                assert 0 < moved[n] <= math.floor(alpha * p.numel()), f"{n}: {moved[n]} of {p.numel()} moved"
            else:
                assert moved[n] == p.numel(), n
