"""The deepspeed backend on 2 ranks (CPU, gloo): ZeRO-2 and ZeRO-3 runs of seqft,
lora, upcycle, ewc, ogd, care, mofo, same, lwf, drop-upcycle, btx, multitask,
individual, bilevel-cka and cluster-upcycle (and replay and olora on ZeRO-2): all 17
methods, on the smoke profile, agree with the torch backend, resume
works, and only rank 0 writes, logs and shows progress; care and same on 3 ranks, one
running a padding copy.

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

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cl_bench.run import checkpoint
from helpers import (assert_same_run, deepspeed_args, interrupted_ds_run, make_trace, only_run, run_cli, smoke_args,
                     small_buckets)

# two-rank launches, about a minute each; one at a time under xdist (pyproject.toml's markers)
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("deepspeed-ranks")]

# replay: 2 micro-batches and a replay one per step, so one rank also runs a padding copy
RUNS = [(method, zero) for method in ("seqft", "lora", "upcycle", "ewc", "ogd", "care", "mofo", "same", "lwf",
                                     "drop-upcycle", "btx", "multitask", "individual", "bilevel-cka",
                                     "cluster-upcycle")
        for zero in (2, 3)] + [("replay", 2), ("olora", 2)]
RESUMED = ("upcycle", 3)
ARGS = {"ewc": ["--method-arg", "lambda_ewc=1e6"],  # the penalty's gradient dominates: a rank skipping it shows
        "mofo": ["--method-arg", "alpha=0.05", "--keep-checkpoint"]}  # the filter shows; weights compared too
# 4 test examples per task in generation batches of 3 and 1: rank 0 decodes the first
# batch, rank 1 the second, and both get all predictions back.
EVAL = ["--set", "eval.batch_size=3"]


def _ranks_main(out: Path) -> int:
    """Each rank of the torchrun launch: every run of RUNS, then RESUMED again,
    interrupted in stage 2 and resumed, all through the CLI in this process."""
    trace = out / "trace"
    ds = lambda zero: [*EVAL, "--backend", "deepspeed", "--zero", str(zero), "--set",
                       f"deepspeed.config={out / 'small.json'}"]  # written by the test, before the launch
    for method, zero in RUNS:
        code = run_cli(*smoke_args(trace, out / f"{method}-z{zero}", "--method", method, *ARGS.get(method, []),
                                   *ds(zero)))
        if code:
            return code
    method, zero = RESUMED

    class Patch:  # the slice of pytest's monkeypatch interrupted_ds_run uses
        def setattr(self, obj, name, value):
            setattr(obj, name, value)

    run_dir = interrupted_ds_run(Patch(), *smoke_args(trace, out / "resumed", "--method", method, *ds(zero)),
                                 at_stage=1)
    return run_cli("run", "--resume", run_dir, "--no-progress")


def _launch_env() -> dict:
    here = Path(__file__).parents  # tests/ (helpers) and this checkout's cl_bench, not the installed one's
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(map(str, (here[1], here[2]))),
           "CL_BENCH_DIST_TIMEOUT_MIN": "3"}  # a hung collective fails the test instead of the CI run
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)  # this process is not a rank
    return env


def _shm_buffers() -> set[Path]:
    """DeepSpeed's CPU all-reduce buffers; the backend unlinks each rank's own."""
    return set(Path("/dev/shm").glob("deepspeed_allreduce_buffer_*"))


def test_two_ranks_agree_with_one(tmp_path):
    out = tmp_path / "ranks"
    make_trace(out / "trace")
    small_buckets(out)
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                           "--master_port", str(_port()), __file__, str(out)],
                          env=_launch_env(), capture_output=True, text=True, timeout=800)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    one = tmp_path / "one"
    references = {}
    for method, zero in RUNS:
        if method not in references:  # the torch backend
            assert run_cli(*smoke_args(out / "trace", one / method, "--method", method, *ARGS.get(method, []),
                                       *EVAL)) == 0
            references[method] = only_run(one / method)
        two = only_run(out / f"{method}-z{zero}")
        assert_same_run(references[method], two)
        if "--keep-checkpoint" in ARGS.get(method, []):  # and the final weights
            weights = [checkpoint.load_checkpoint(d)["model"] for d in (references[method], two)]
            for name, value in weights[0].items():
                assert torch.allclose(weights[1][name], value, rtol=0, atol=1e-5), (method, zero, name)
        record = json.loads((two / "run.json").read_text())
        assert record["backend"]["world_size"] == 2 and record["backend"]["zero"] == zero
    resumed = json.loads((only_run(out / "resumed") / "run.json").read_text())
    assert resumed["status"] == "complete" and resumed["resumes"][0]["at_stage"] == 1
    assert_same_run(only_run(out / "{}-z{}".format(*RESUMED)), only_run(out / "resumed"))


def test_cli_starts_its_ranks_and_only_rank_zero_speaks(trace_dir, tmp_path):
    """`cl-bench run --backend deepspeed --nproc 2`: one log line per stage, one progress
    bar per phase, one record; the experts each stage added were trained (ZeRO-3: read
    back from the checkpoint, whose weights were gathered from both ranks)."""
    out = tmp_path / "runs"
    argv = [a for a in smoke_args(trace_dir, out, "--method", "upcycle", "--nproc", "2", "--run-id", "r",
                                  "--keep-checkpoint", *deepspeed_args(tmp_path, 3)) if a != "--no-progress"]
    before = _shm_buffers()
    done = subprocess.run([sys.executable, "-m", "cl_bench.cli", *map(str, argv)], env=_launch_env(),
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
    done = subprocess.run([sys.executable, "-m", "cl_bench.cli", *map(str, argv)], env=_launch_env(),
                          capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert json.loads((only_run(three) / "run.json").read_text())["backend"]["world_size"] == 3
    assert_same_run(only_run(one), only_run(three))


def _port() -> int:
    from cl_bench.backends.deepspeed_backend import free_port

    return free_port()


if __name__ == "__main__":  # a rank of test_two_ranks_agree_with_one's launch
    torch.set_num_threads(1)
    sys.exit(_ranks_main(Path(sys.argv[1])))

