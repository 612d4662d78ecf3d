"""The deepspeed backend on 2 ranks (CPU, gloo): ZeRO-2 and ZeRO-3 runs of all 17
methods on the smoke profile agree with the torch backend, and so do these variants:
ZeRO-2 with the paper config's overlap_comm and contiguous_gradients (ewc, same: the
methods that edit a step's gradients), two micro-batches per rank (ogd at ZeRO-2, mofo
at ZeRO-3), upcycle's shared=add at ZeRO-3 (a one-value parameter, padded to one value
per rank), a model with tied embeddings (seqft at ZeRO-3, ewc at ZeRO-2), care at
ZeRO-3 with its small weights kept gathered (persistence threshold 5000: the anchor
pull written through that copy too; mutation caught: that copy left alone), care and
same at ZeRO-3 under hpZ (zero_hpz_partition_size=2: the forward gathers from
secondary copies of the partitions; mutation caught: those kept stale); under
deepspeed.bf16, ewc (ZeRO-3) and ogd (ZeRO-2) follow the torch backend's fp32 run;
resume works (the flagship at ZeRO-2, upcycle at ZeRO-3, the flagship in-stage at
ZeRO-3, where at the checkpoint rank 0 holds the weights and optimiser state whole and
rank 1 nothing more than its partitions); between phases at ZeRO-3 each rank keeps
only its own piece of the optimiser's moments (half of each tensor's values, rounded
up; ZeRO-2 all of them), and so does each rank once a resumed run has loaded its
checkpoint (zero_engine.load_held); mofo's kept final checkpoint, gathered from the
pieces onto rank 0, holds the torch backend's optimiser state (within rtol 1e-4)
(mutations caught: close() keeping the whole state, the held count; the loaded
checkpoint's state kept whole, the held count after the load (100,384 values on each
rank for 100,384); each rank's loaded piece cut from rank 0's values, the resumed
flagship differs from stage 3 on; the pieces not gathered for the checkpoint, the
resumed ZeRO-3 upcycle run fails; rank 0's piece cut again from rank 1's values after
a checkpoint, and a carried piece not set into the next phase's engine, losses differ
from stage 2 on); only rank 0 writes, logs and shows progress;
care and same on 3 ranks, one running a padding copy; mofo on 3 ranks at ZeRO-3, where
the ranks do not divide the weights' sizes, stopped with SIGTERM and resumed by the line
it printed (--nproc 3 carried; each rank's piece of the loaded moments padded); a rank
whose state parts from rank 0's stops the run where it differs exactly and is warned of
where a float drifts (Backend.same_on_every_rank; mutation caught: the comparison left
out, both fail); a rank killed (SIGKILL) stops the run in one line from rank 0 naming
what is saved and how to continue (Backend.lost_peer), and --resume finishes it.

Found by these runs: DeepSpeed's safe_set_full_fp32_param / _optimizer_state at ZeRO-3
(0.19.8) read past a value's end on the last rank wherever the ranks do not divide a
parameter's size, so the second phase of any such run failed (3 ranks; shared=add on
2); zero_engine's _set_full sets each rank's padded piece instead. Since the fp32 runs
carry their state between phases as pieces, only bf16's masters still take that path:
mutation caught (checked again): _set_full calling the safe_set_full_* functions at
ZeRO-3, the bf16 shared=add run fails ("start (1) + length (1) exceeds dimension size
(1)"); the 3-rank mofo run no longer shows it.
Also found by these runs: SAME's in-stage checkpoint on 2 ranks kept only rank 0's
covariance tokens since the last merge (each rank adds its own until a merge), so the
resumed run differed from stage 3 on (grad_norm 0.0235909 for 0.0235949); now every
rank sums them first (Method.before_checkpoint, InputCovariance.hold). Mutation caught:
the hook doing nothing (the run before the fix).

One launch (torchrun: the "launched from outside" path) runs every run of RUNS and an
interrupted-and-resumed one inside the same two processes, which saves a launch per
run; a second test starts its ranks itself with `cl-bench run --nproc 2`.

Tolerances: logged losses within rel 1e-5 of the torch backend's run (measured: at
most 6e-7 relative; the ranks add their gradients in another order), the R matrix and
every prediction equal. Dropout draws per micro-batch on both backends (loop.seeded),
so LoRA's runs compare with the torch backend too.

The flagship takes its outer step on every rank (Method.replay_on_every_rank): with
the replay micro-batch on one rank only, the mask logits part (expand 0.404 against
0.3125 at stage 1 step 1, checked by hand, ZeRO-2). The methods that change a step's
gradients (cl_bench/step_gradients.py) on their rank's fragments: ewc at λ = 1e6, so the penalty's gradient dominates the step
(grad_norm ~150 against ~2); skipping it on rank 1 gives grad_norm 111.5 against
148.5, and ogd without the all-reduce of its coefficients gives 0.6299 against
0.6350 (both checked by hand, ZeRO-2).

same (methods/same/): its experts freeze from a task's second smoke step on, and a
frozen expert (and the router of a linear with one expert left) takes no AdamW step on
either backend (Method.idle_parameters; zero_engine skips its DeepSpeed group). Checked
by hand at ZeRO-2: the skip removed gives grad_norm 0.021763 for 0.021698 at stage 2's
first step; the covariances not summed over the ranks 0.033450 for 0.033455 at its
second; usage and importance not summed, a usage of 0.0377907 for 0.0379047 in the
stage record (precondition=update, the fp32 weights changed in after_step, also agrees
at ZeRO-2 and ZeRO-3, run by hand).

mofo's optimiser picks the top-α entries of each matrix from its |momentum|
assembled over the ranks (methods/mofo.py): at α = 0.05 the filter shows (α = 1,
Adam, logs grad_norm 5.486 for 6.461 at stage 1's second step), and its final
weights are compared too (measured: within 1.2e-7). Checked by hand: the top-k of
each rank's slice of a matrix instead fails at ZeRO-3 (grad_norm 6.569 for 6.461)
and at ZeRO-2 on the weights only (ZeRO-2 cuts one matrix here, 32 of its 4096
values on rank 0: losses within 5.6e-6, 12 weights off by up to 2.6e-3); the
flat partition stepped as one 1-D tensor (plain Adam) fails at both (5.486).
"""
from __future__ import annotations

import contextlib
import json
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from cl_bench.backends.deepspeed_backend import DeepSpeedBackend
from cl_bench.backends.zero_engine import Piece, ZeroPhase
from cl_bench.run import checkpoint
from helpers import (assert_follows_fp32, assert_same_run, deepspeed_args, interrupted_ds_run, launch_env, make_trace,
                     only_run, run_cli, signal_once_saved, smoke_args, small_buckets, tied_tiny_llama)

# two-rank launches, about a minute each; one at a time under xdist (pyproject.toml's markers)
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("deepspeed-ranks")]

# (method, ZeRO stage, variant): every method at both stages, then the variants
# replay: 2 micro-batches and a replay one per step, so one rank also runs a padding copy
RUNS = [(method, zero, "") for method in ("seqft", "lora", "upcycle", "ewc", "ogd", "care", "mofo", "same", "lwf",
                                         "drop-upcycle", "btx", "multitask", "individual", "bilevel-cka",
                                         "cluster-upcycle", "replay", "olora")
        for zero in (2, 3)] + [("ewc", 2, "overlap"), ("same", 2, "overlap"), ("ogd", 2, "acc2"),
                               ("mofo", 3, "acc2"), ("upcycle", 3, "add"), ("seqft", 3, "tied"),
                               ("ewc", 2, "tied"), ("ewc", 3, "bf16"), ("ogd", 2, "bf16"), ("same", 2, "norefresh"),
                               ("care", 3, "persist"), ("upcycle", 3, "bf16add"), ("care", 3, "hpz"),
                               ("same", 3, "hpz")]
# (method, ZeRO stage, variant, step): interrupted in stage 2 and resumed: as it starts
# (step None), the flagship (mask logits, its outer optimiser) at ZeRO-2 and upcycle at
# ZeRO-3 (its added experts partitioned); or after its first step, checkpointed in-stage
# at every step (DeepSpeedBackend.whole: rank 0's clock decides, every rank gathers),
# resumed at its second step: the flagship at ZeRO-3, and same with the covariance
# tokens each rank added since the last merge (all of the task's so far, norefresh)
# summed into the checkpoint (Method.before_checkpoint)
RESUMED = [("bilevel-cka", 2, "", None), ("upcycle", 3, "", None), ("bilevel-cka", 3, "", 0),
           ("same", 2, "norefresh", 0)]
IN_STAGE = ["--set", "train.checkpoint_every_s=0"]
ARGS = {"ewc": ["--method-arg", "lambda_ewc=1e6"],  # the penalty's gradient dominates: a rank skipping it shows
        "mofo": ["--method-arg", "alpha=0.05", "--keep-checkpoint"]}  # the filter shows; weights compared too
# overlap: ZeRO-2 with the knobs of configs/deepspeed/paper.json (gradients reduced
# bucket by bucket during the backward pass, into one contiguous buffer; ZeRO-3
# overlaps by default); acc2: 8 examples a step, two micro-batches on each rank, so
# each rank accumulates before the reduction (the torch reference runs the same); add:
# the routed sum added to the dense path, scaled by a trained one-value parameter per
# layer, which ZeRO-3 pads to one value per rank (zero_engine's _set_full).
# tied: a tiny Llama whose head is its embedding matrix (tie_word_embeddings, as
# Llama-3.2 and SmolLM2; written below): one weight with two readers, trained whole
# (seqft, ZeRO-3) and its gradient edited on the ranks' fragments (ewc, ZeRO-2).
# persist: ZeRO-3 keeps the weights of up to 5000 values gathered on every rank (the
# norms, the attention's k and v: configs/deepspeed/paper.json keeps those up to 1e5),
# so care's anchor pull on the masters reaches them through that copy too
# (ZeroGradients.set_weights).
# bf16: deepspeed.bf16 (DS_ONLY: the torch reference is the fp32 run), the gradient
# edits on bf16 gradients split over the ranks; it follows the fp32 run within
# helpers.assert_follows_fp32's bounds. bf16add: add, in bf16: the engine's fp32 masters
# start from the model's fp32 weights (ZeroPhase's masters), set whole, which at ZeRO-3
# _set_full cuts into padded pieces itself: the one-value scale is where DeepSpeed's
# safe_set_full_fp32_param read past its end on rank 1 (mutation caught: _set_full
# calling it at ZeRO-3, "exceeds dimension size"); the fp32 runs carry only pieces.
# hpz: ZeRO++'s hpZ (zero_hpz_partition_size=2): each rank also keeps a secondary
# partition of the weights, from which the forward gathers them; DeepSpeed drops the
# trained ones' at each step's end and makes them again from the primary partitions at
# the next gather, so the weights care's anchor pull writes there after a step
# (ZeroGradients.set_weights) reach the next forward; same edits its gradients on the
# primary partitions (ZeroGradients.write). Mutation caught (checked by hand): the
# secondary partitions kept across a step (DeepSpeed's invalidate_secondary_tensor a
# no-op), the care run parts from the torch backend's. (2 ranks in one group: each
# secondary partition is the primary's range, a copy of its own; the by-hand runs on 4
# ranks in 2 groups of 2, docs/running.md.)
VARIANTS = {"": [], "overlap": [], "acc2": ["--set", "train.batch_size=8"], "add": ["--method-arg", "shared=add"],
            "tied": ["--model", "{out}/tied"], "bf16": [], "norefresh": ["--method-arg", "spectral_routing=false"],
            "persist": [], "bf16add": ["--method-arg", "shared=add"], "hpz": []}
DS_ONLY = {"bf16": ["--set", "deepspeed.bf16=true"], "bf16add": ["--set", "deepspeed.bf16=true"]}
# bf16add's losses only: with the upcycled model's router in bf16, its last step's
# grad_norm came 3.3% off the fp32 run's (0.0809 for 0.0783; AVX2, bf16 emulated) while
# every loss stayed within 3e-5 relative, and a router's top-k may turn on a rounding
# elsewhere; the losses show the masters it sets
CONFIGS = {"overlap": "overlap.json", "persist": "persist.json", "hpz": "hpz.json"}  # written below; else small.json
# 4 test examples per task in generation batches of 3 and 1: rank 0 decodes the first
# batch, rank 1 the second, and both get all predictions back.
EVAL = ["--set", "eval.batch_size=3"]


def _name(method: str, zero: int, variant: str) -> str:
    return f"{method}-z{zero}" + (f"-{variant}" if variant else "")


def _ranks_main(out: Path) -> int:
    """Each rank of the torchrun launch: every run of RUNS, then each of RESUMED again,
    interrupted in stage 2 and resumed, all through the CLI in this process."""
    trace = out / "trace"
    ds = lambda zero, variant="": [*EVAL, *_variant(variant, out), *DS_ONLY.get(variant, []), "--backend",
                                   "deepspeed", "--zero", str(zero), "--set",
                                   f"deepspeed.config={out / CONFIGS.get(variant, 'small.json')}"]
    real_close = ZeroPhase.close
    for method, zero, variant in RUNS:
        name = _name(method, zero, variant)
        ZeroPhase.close = _noting_state(real_close, out / f"state-{name}")
        try:
            code = run_cli(*smoke_args(trace, out / name, "--method", method, *ARGS.get(method, []),
                                       *ds(zero, variant)))
        finally:
            ZeroPhase.close = real_close
        if code:
            return code

    class Patch:  # the slice of pytest's monkeypatch interrupted_ds_run uses
        def setattr(self, obj, name, value):
            setattr(obj, name, value)

    real_whole, real_load = ZeroPhase.whole, DeepSpeedBackend.load_optimizer
    for method, zero, variant, step in RESUMED:
        name = _name(method, zero, variant)
        if step is not None:
            ZeroPhase.whole = _holding(real_whole, out / f"held-{name}")
        try:
            run_dir = interrupted_ds_run(Patch(), *smoke_args(trace, out / f"resumed-{name}", "--method",
                                                              method, *ARGS.get(method, []), *ds(zero, variant),
                                                              *(IN_STAGE if step is not None else [])),
                                         at_stage=1, after_step=step)
        finally:
            ZeroPhase.whole = real_whole
        DeepSpeedBackend.load_optimizer = _noting_load(real_load, out / f"loaded-{name}")
        try:
            code = run_cli("run", "--resume", run_dir, "--no-progress")
        finally:
            DeepSpeedBackend.load_optimizer = real_load
        if code:
            return code
    return _parted(trace, out, ds)


def _parted(trace: Path, out: Path, ds) -> int:
    """seqft's state (empty) given one more value at each stage's end, other on rank 1:
    apart, an integer (the run stops at stage 1's end); drift, a float 1e-3 off (a
    warning; the run goes on)."""
    from cl_bench import registry

    seqft = registry.get("seqft")
    real = seqft.state_dict
    values = {"apart": lambda r: torch.tensor([r]), "drift": lambda r: torch.tensor([1.0 + 1e-3 * r])}
    for kind, value in values.items():
        seqft.state_dict = lambda self, value=value: {**real(self), "x": value(torch.distributed.get_rank())}
        try:
            code = run_cli(*smoke_args(trace, out / f"parted-{kind}", "--method", "seqft", *ds(2)))
        finally:
            seqft.state_dict = real
        if code != (2 if kind == "apart" else 0):
            return 100 + code
    return 0


def _variant(variant: str, out: Path) -> list[str]:
    return [arg.format(out=out) for arg in VARIANTS[variant]]


def _holding(whole, folder: Path):
    """ZeroPhase.whole, noting what this rank's model and optimiser hold inside (at each
    in-stage checkpoint; the last one's note stays) in folder/rank<r>.json."""

    @contextlib.contextmanager
    def noting(phase, keep):
        with whole(phase, keep):
            folder.mkdir(parents=True, exist_ok=True)
            (folder / f"rank{torch.distributed.get_rank()}.json").write_text(json.dumps({
                "whole": [list(p.shape) == list(shape) for p, shape in zip(phase._params, phase._shapes)],
                "state": len(phase.optimizer.state)}))
            yield
    return noting


def _noting_state(close, folder: Path):
    """ZeroPhase.close, noting after each phase what this rank holds of the optimiser
    state (_note_held)."""

    def noting(phase):
        close(phase)
        _note_held(phase.optimizer, folder)
    return noting


def _noting_load(load, folder: Path):
    """DeepSpeedBackend.load_optimizer, noting what this rank holds of the optimiser
    state once a checkpoint's is loaded (_note_held)."""

    def noting(backend, optimizer, state_dict):
        load(backend, optimizer, state_dict)
        _note_held(optimizer, folder)
    return noting


def _note_held(optimizer, folder: Path) -> None:
    """How many optimiser-state values this rank holds, how many the parameters they are
    state of hold, and how many tensors they are, [held, whole, tensors], added to
    folder/rank<r>.json."""
    held = whole = tensors = 0
    for p, state in optimizer.state.items():
        for v in state.values():
            if isinstance(v, Piece) or (torch.is_tensor(v) and v.shape == p.shape):
                held += v.value.numel() if isinstance(v, Piece) else v.numel()
                whole += p.numel()
                tensors += 1
    path = folder / f"rank{torch.distributed.get_rank()}.json"
    folder.mkdir(parents=True, exist_ok=True)
    notes = json.loads(path.read_text()) if path.exists() else []
    path.write_text(json.dumps([*notes, [held, whole, tensors]]))


def _assert_held(folder: Path, zero: int, what) -> None:
    """Each note of both ranks (_note_held): at ZeRO-3 each rank held its own piece of
    each moment (half of each tensor's values, rounded up), at ZeRO-2 all of them."""
    held = [json.loads((folder / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert len(held[0]) == len(held[1]) > 0 and any(whole for _, whole, _ in held[0]), (what, held)
    for (h0, w0, n), (h1, w1, _) in zip(*held):
        assert w0 == w1, (what, held)
        if zero == 3:
            assert h0 + h1 >= w0 and max(h0, h1) <= (w0 + n) / 2, (what, held)
        else:
            assert h0 == h1 == w0, (what, held)


def _optimizer_state(run_dir: Path) -> dict[str, dict[str, torch.Tensor]]:
    """The kept checkpoint's per-value optimiser state, by parameter name."""
    saved = checkpoint.load_checkpoint(run_dir)["optimizer"]
    names = [n for group in saved["groups"] for n in group]
    state = saved["state"]["state"]
    return {names[i]: {k: v for k, v in s.items() if k != "step"} for i, s in state.items()}


def _shm_buffers() -> set[Path]:
    """DeepSpeed's CPU all-reduce buffers; the backend unlinks each rank's own."""
    return set(Path("/dev/shm").glob("deepspeed_allreduce_buffer_*"))


def test_two_ranks_agree_with_one(tmp_path):
    out = tmp_path / "ranks"
    make_trace(out / "trace")
    small = json.loads(small_buckets(out).read_text())
    small["zero_optimization"].update(overlap_comm=True, contiguous_gradients=True)
    (out / "overlap.json").write_text(json.dumps(small))
    persist = json.loads(small_buckets(out).read_text())
    persist["zero_optimization"]["stage3_param_persistence_threshold"] = 5000
    (out / "persist.json").write_text(json.dumps(persist))
    hpz = json.loads(small_buckets(out).read_text())
    hpz["zero_optimization"]["zero_hpz_partition_size"] = 2
    (out / "hpz.json").write_text(json.dumps(hpz))
    tied_tiny_llama(out / "tied")
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                           "--master_port", str(_port()), __file__, str(out)],
                          env=launch_env(), capture_output=True, text=True, timeout=800)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    one = tmp_path / "one"
    references = {}
    for method, zero, variant in RUNS:
        key = (method, tuple(VARIANTS[variant]))
        if key not in references:  # the torch backend
            folder = one / _name(method, 0, variant)
            assert run_cli(*smoke_args(out / "trace", folder, "--method", method, *ARGS.get(method, []),
                                       *EVAL, *_variant(variant, out))) == 0
            references[key] = only_run(folder)
        two = only_run(out / _name(method, zero, variant))
        if variant in DS_ONLY:
            assert json.loads((two / "run.json").read_text())["backend"]["bf16"] is True
            assert_follows_fp32(references[key], two, grad_norm=variant != "bf16add")
            continue
        assert_same_run(references[key], two)
        if "--keep-checkpoint" in ARGS.get(method, []):  # and the final weights and optimiser state
            weights = [checkpoint.load_checkpoint(d)["model"] for d in (references[key], two)]
            for name, value in weights[0].items():
                assert torch.allclose(weights[1][name], value, rtol=0, atol=1e-5), (method, zero, variant, name)
            moments = [_optimizer_state(d) for d in (references[key], two)]
            assert moments[0].keys() == moments[1].keys() and moments[0], (method, zero, variant)
            for name, state in moments[0].items():
                for k, value in state.items():
                    assert torch.allclose(moments[1][name][k], value, rtol=1e-4, atol=1e-9), (method, zero, name, k)
        _assert_held(out / f"state-{_name(method, zero, variant)}", zero, (method, variant))  # after each phase
        record = json.loads((two / "run.json").read_text())
        assert record["backend"]["world_size"] == 2 and record["backend"]["zero"] == zero
        zero_config = record["backend"].get("deepspeed_config", {}).get("zero_optimization", {})
        assert zero_config.get("overlap_comm", zero == 3) == (variant == "overlap" or zero == 3), zero_config
    for method, zero, variant, step in RESUMED:
        name = _name(method, zero, variant)
        resumed = only_run(out / f"resumed-{name}")
        record = json.loads((resumed / "run.json").read_text())
        assert record["status"] == "complete" and record["resumes"][0]["at_stage"] == 1
        assert record["resumes"][0].get("at_step") == (None if step is None else {"phase": 0, "step": step + 1})
        assert_same_run(only_run(out / name), resumed)
        _assert_held(out / f"loaded-{name}", zero, ("resumed", method))  # the checkpoint's, as loaded
        if step is not None:  # inside whole(): rank 0 held the weights and state whole, rank 1 no state
            held = [json.loads((out / f"held-{name}" / f"rank{r}.json").read_text()) for r in (0, 1)]
            assert all(held[0]["whole"]) and held[0]["state"] > 0, held[0]
            assert held[1]["state"] == 0, held[1]
            if zero == 3:  # and only its partitions (ZeRO-2 keeps every weight whole on every rank)
                assert not any(held[1]["whole"]), held[1]
    # a rank whose state parts from rank 0's (_parted): stopped where it differs exactly,
    # warned where a float drifts (Backend.same_on_every_rank, cl_bench/run/agreement.py)
    apart = json.loads((only_run(out / "parted-apart") / "run.json").read_text())
    assert apart["status"] == "failed" and apart["stages_done"] == 0, apart["status"]
    assert "stage 1/3 [NumGLUE-cm]: the ranks' states differ (rank 1: method.x)" in apart["error"], apart["error"]
    drift = json.loads((only_run(out / "parted-drift") / "run.json").read_text())
    assert drift["status"] == "complete"
    assert (done.stdout + done.stderr).count("the ranks' float state differs by up to 1.0e-03 relative") == 3


def test_cli_starts_its_ranks_and_only_rank_zero_speaks(trace_dir, tmp_path):
    """`cl-bench run --backend deepspeed --nproc 2`: one log line per stage, one progress
    bar per phase, one record; the experts each stage added were trained (ZeRO-3: read
    back from the checkpoint, whose weights were gathered from both ranks)."""
    out = tmp_path / "runs"
    argv = [a for a in smoke_args(trace_dir, out, "--method", "upcycle", "--nproc", "2", "--run-id", "r",
                                  "--keep-checkpoint", *deepspeed_args(tmp_path, 3)) if a != "--no-progress"]
    before = _shm_buffers()
    done = subprocess.run([sys.executable, "-m", "cl_bench.cli", *map(str, argv)], env=launch_env(),
                          capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert _shm_buffers() <= before  # no shared-memory buffer left behind
    text = done.stdout + done.stderr
    for b, task in enumerate(["NumGLUE-cm", "Py150", "20Minuten"]):
        assert text.count(f"stage {b + 1}/3 [{task}] done in") == 1
        assert text.count(f"stage {b + 1}/3 [{task}] train:   0%|          | 0/2 [00:00<?, ?step/s]") == 1
        # ^ the bar's first draw (before any step's postfix): one bar, drawn by rank 0
    assert text.count("Last Acc") == 1
    record = json.loads((out / "r" / "run.json").read_text())
    assert record["backend"]["world_size"] == 2 and "--nproc 2" in record["command"]
    state = checkpoint.load_checkpoint(out / "r")["model"]
    for layer in range(2):
        prefix = f"model.layers.{layer}.mlp"
        dense = state[f"{prefix}.dense.gate_proj.weight"]  # (H, d): slice c is rows c*h .. (c+1)*h
        for g in range(3):
            gate = state[f"{prefix}.groups.{g}.gate"]  # (8, h, d), expert i stands in for slice i
            assert not torch.allclose(gate, dense.reshape(gate.shape)), (layer, g)


@pytest.mark.parametrize("method", ["care", "same"])
def test_three_ranks_the_padding_copy_feeds_no_statistic(trace_dir, tmp_path, method):
    """At ZeRO-2 on 3 ranks: a step's 2 task micro-batches leave rank 2 a weight-0 copy
    of the first; its loss runs (every rank makes as many backward passes) but what it
    computes stays out of the method's statistics (ctx.padding): CaRE's perceiver CE,
    SAME's usage, importance and covariances; CaRE's anchor pull lands on the fp32
    masters: each run is the torch backend's. Mutations caught (checked by hand): care:
    the copy's CE kept (perceiver_ce_end differs), the statistics not gathered in
    before_step, the pull applied to the working copy; same: the copy's statistics kept."""
    one, three = tmp_path / "one", tmp_path / "three"
    assert run_cli(*smoke_args(trace_dir, one, "--method", method)) == 0
    argv = smoke_args(trace_dir, three, "--method", method, "--nproc", "3", *deepspeed_args(tmp_path, 2))
    done = subprocess.run([sys.executable, "-m", "cl_bench.cli", *map(str, argv)], env=launch_env(),
                          capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert json.loads((only_run(three) / "run.json").read_text())["backend"]["world_size"] == 3
    assert_same_run(only_run(one), only_run(three))


def test_three_ranks_zero3_where_the_ranks_do_not_divide_a_weight_stopped_and_resumed(trace_dir, tmp_path):
    """mofo (α 0.05) at ZeRO-3 on 3 ranks: the tiny model's sizes (16576 values, say) are
    not multiples of 3, so the last rank's partition of each is padded; mofo's top-α
    filter reads each matrix's |momentum| assembled over uneven pieces. The launch is
    stopped (SIGTERM) once stage 1 is saved and resumed by the line it printed (with
    --nproc 3 and --keep-checkpoint, errors.launch_flags): each rank's piece
    of the checkpoint's moments is cut as ZeRO-3 cuts them (load_held), set piece by piece
    (_set_full), and carried again into the next stage (close()). A copy of the stopped
    run goes on in one process instead (the rank count may change on --resume). Both runs
    and their final weights are the torch backend's. Mutation caught: load_held's piece size rounded
    down, not up (the resumed launch fails: a piece of 5525 values for ds_tensor's 5526)."""
    one, three = tmp_path / "one", tmp_path / "three"
    args = ["--method", "mofo", "--method-arg", "alpha=0.05", "--keep-checkpoint"]
    assert run_cli(*smoke_args(trace_dir, one, *args)) == 0
    argv = smoke_args(trace_dir, three, *args, "--nproc", "3", "--run-id", "r", *deepspeed_args(tmp_path, 3))
    proc = subprocess.Popen([sys.executable, "-m", "cl_bench.cli", *map(str, argv)], env=launch_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    code, out = signal_once_saved(proc, three / "r", signal.SIGTERM)
    assert code == 130, out[-3000:]
    assert json.loads((three / "r" / "run.json").read_text())["stages_done"] in (1, 2)
    moved = shutil.copytree(three / "r", tmp_path / "moved" / "r")  # to go on on another rank count
    line = next(line for line in out.splitlines() if "continue with: " in line)  # the line it printed
    said = shlex.split(line.split("continue with: ", 1)[1])
    assert said[1:] == ["run", "--resume", str(three / "r"), "--nproc", "3", "--keep-checkpoint"], said
    done = subprocess.run([sys.executable, "-m", "cl_bench.cli", *said[1:], "--no-progress"], env=launch_env(),
                          capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    record = json.loads((three / "r" / "run.json").read_text())
    assert record["backend"]["world_size"] == 3 and len(record["resumes"]) == 1
    assert_same_run(only_run(one), three / "r")
    # the same run when it goes on in one process (the whole checkpoint cut for 1 rank)
    assert run_cli("run", "--resume", moved, "--keep-checkpoint", "--no-progress") == 0  # here, 1 rank
    record = json.loads((moved / "run.json").read_text())
    assert record["backend"]["world_size"] == 3 and record["resumes"][0]["backend"]["world_size"] == 1
    assert_same_run(only_run(one), moved)
    weights = [checkpoint.load_checkpoint(d)["model"] for d in (only_run(one), three / "r", moved)]
    for name, value in weights[0].items():
        for other in weights[1:]:
            assert torch.allclose(other[name], value, rtol=0, atol=1e-5), name


def _port() -> int:
    from cl_bench.backends.deepspeed_backend import free_port

    return free_port()


def _kill_rank_once(argv: list[str], rank: int, ready) -> tuple[int, str]:
    """Launch `argv` (cl-bench run ... --nproc 2), SIGKILL rank `rank`'s process once
    `ready()` holds, and return the launch's exit code and output."""
    import psutil

    proc = subprocess.Popen([sys.executable, "-m", "cl_bench.cli", *map(str, argv)], env=launch_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 600
    while not ready():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-3000:]
        time.sleep(0.05)
    target = [p for p in psutil.Process(proc.pid).children(recursive=True)
              if p.environ().get("RANK") == str(rank) and "cl_bench.cli" in p.cmdline()]
    assert len(target) == 1
    target[0].kill()
    out, _ = proc.communicate(timeout=300)
    return proc.returncode, out


def test_a_rank_killed_stops_the_run_in_one_line_and_resume_goes_on(trace_dir, tmp_path):
    """A rank's process killed (SIGKILL: the out-of-memory killer, a node's fault): the
    other's next collective fails (gloo: "Connection reset by peer"), and the run stops
    in one line naming what is saved and the line that continues it (Backend.lost_peer),
    not a traceback; DeepSpeed's launcher ends the launch. Rank 1 killed once stage 1 is
    saved: rank 0 says it and records the run failed. Rank 0 killed in the resumed launch:
    its record stays `running`, and rank 1 says it (resume.stop_recorded), the launcher's
    SIGTERM not cutting it (Stop.settled). ZeRO-3: the failure surfaces in DeepSpeed's
    wait on a gather, not in torch.distributed. --resume then finishes the run as the
    torch backend's. Mutations caught: lost_peer always False (rank 0's traceback, no
    line); rank 1 silent (no line once rank 0 is gone); not settled (rank 1's line cut
    by the launcher's SIGTERM: "interrupted before the run folder was made")."""
    one, two = tmp_path / "one", tmp_path / "two"
    run_dir = two / "r"
    assert run_cli(*smoke_args(trace_dir, one, "--method", "seqft")) == 0
    argv = smoke_args(trace_dir, two, "--method", "seqft", "--nproc", "2", "--run-id", "r",
                      *deepspeed_args(tmp_path, 3))

    def said_once(out: str, who: str) -> str:
        lines = [line for line in out.splitlines() if "a collective between the ranks failed" in line]
        assert len(lines) == 1 and "Traceback" not in out, out[-3000:]
        assert lines[0].startswith(f"{run_dir}: a collective between the ranks failed (") and (
            f"{who} process ended or stopped answering" in lines[0]), lines[0]
        return lines[0]

    code, out = _kill_rank_once(argv, 1, lambda: checkpoint.has_checkpoint(run_dir))
    line = said_once(out, "another rank's")
    record = json.loads((run_dir / "run.json").read_text())
    assert code != 0 and record["status"] == "failed" and record["stages_done"] == 1  # stage 2 needs rank 1
    assert "the run stopped; 1 of 3 stages are saved" in line
    said = shlex.split(line.split("continue with: ", 1)[1])
    assert said[1:] == ["run", "--resume", str(run_dir), "--nproc", "2"], said

    def resumed() -> bool:  # the resumed launch has trained and recorded a stage: inside execute
        with contextlib.suppress(ValueError):
            return json.loads((run_dir / "run.json").read_text())["stages_done"] == record["stages_done"] + 1
        return False

    code, out = _kill_rank_once([*said[1:], "--no-progress"], 0, resumed)
    line = said_once(out, "rank 0's")
    assert code != 0 and json.loads((run_dir / "run.json").read_text())["status"] == "running"
    assert shlex.split(line.split("continue with: ", 1)[1])[1:] == said[1:]
    # that line, here in one process (the rank count may change on --resume; a launch costs ~40 s)
    assert run_cli(*said[1:4], "--no-progress") == 0
    assert json.loads((run_dir / "run.json").read_text())["status"] == "complete"
    assert_same_run(only_run(one), run_dir)


if __name__ == "__main__":  # a rank of test_two_ranks_agree_with_one's launch
    torch.set_num_threads(1)
    sys.exit(_ranks_main(Path(sys.argv[1])))

