"""The DeepSpeed backend: the same runs on ZeRO-2/3 over N ranks (data parallel).

Every rank runs the whole sequencer on the same data. Per optimiser step the step's
micro-batches (train.batch_size examples in all, whatever the number of ranks) and its
replay micro-batch are dealt out round-robin; a rank with fewer runs a weight-0 copy of
one so every rank makes the same number of backward passes (its loss hook runs, with
ctx.padding set: a method keeps what it needs of the step's data from
Method.step_batches, which every rank gets whole). A method whose replay_loss keeps
state (Method.replay_on_every_rank) gets the replay micro-batch on every rank, at weight
1/N. Each micro-batch loss is weighted by its share of the step's answer tokens times
the number of ranks (the engine averages over ranks), so the step's gradient is the
torch backend's, and dropout draws from a generator seeded by (seed, stage, epoch, step,
micro-batch): a run's numbers do not depend on how many ranks ran it, up to the order of
floating-point sums. Logged parts are summed over ranks. Clipping (train.grad_clip) is
the engine's.

The engine lives for one training phase (zero_engine.ZeroPhase): between phases
the model is an ordinary module with full weights on every rank, so hooks,
evaluation and checkpoints are the torch backend's (at ZeRO-3 each rank keeps only
its piece of the optimiser's moments, gathered onto rank 0 for a checkpoint and cut
again from one loaded on --resume).
Evaluation splits each task's generation batches over the ranks and gathers the
continuations.

Precision: bf16 on CUDA devices that support it, fp32 elsewhere, unless
deepspeed.bf16 says otherwise: the engine computes in bf16 with fp32 master
weights; between phases the model is fp32 again, its trained weights the masters.
Its frozen weights, which the engine holds in bf16 only (as DeepSpeed does), come
back as their bf16 rounding and stay so (keeping fp32 copies would cost a second copy
of the frozen model a rank): where they are read outside a bf16 product (experts
sliced from a frozen dense MLP, btx's router rows frozen for a branch phase, a frozen
norm) a bf16 run on this backend starts from values the torch backend's autocast
keeps in fp32 and rounds only inside products, a difference of bf16 rounding.
"""
from __future__ import annotations

import contextlib
import fcntl
import gc
import importlib
import json
import logging
import os
import socket
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch
import yaml

from cl_bench.backends.base import Backend
from cl_bench.step_gradients import Fragment, StepGradients
from cl_bench.backends.loop import Job, StepCallback, run_phase, seeded
from cl_bench.backends.zero_engine import ZERO_DIM, ZeroPhase, load_held, whole_state, zero_dim
from cl_bench.config import RunConfig
from cl_bench.errors import UserError
from cl_bench.eval.generation import greedy_generate
from cl_bench.method import Method, Stage
from cl_bench.run import agreement
from cl_bench.run.precision import native_bf16

log = logging.getLogger(__name__)

# the parity tests' bound on a logged number between one rank and N (tests/helpers.py LOSS_RTOL)
SPREAD_WARN = 1e-5

OFFLOAD = ("offload_optimizer", "offload_param")  # refused unless their device is "none" (ds_config)
REFUSED_SECTIONS = {"optimizer": "the method builds its optimiser (Method.make_optimizer)",
                    "scheduler": "methods keep a constant lr or schedule it themselves",
                    "fp16": "fp16 needs loss scaling, which the harness does not do; use bf16"}
# Settings that change what a run computes while its record would not say so: (why, when
# the value at that key turns it on), each refused where it is on.
def _is_set(v) -> bool:
    return v not in (None, False, {})


def _is_enabled(v) -> bool:  # a section switched by its "enabled" (DeepSpeed's default: off)
    return bool(v.get("enabled")) if isinstance(v, dict) else _is_set(v)


def _is_present(v) -> bool:  # a section, {} too: DeepSpeed turns it on with its defaults
    return v is not None and v is not False


def _not_mean(v) -> bool:  # DeepSpeed lowers the value first
    return v is not None and str(v).lower() != "mean"


def _above_one(v) -> bool:
    try:
        return v is not True and float(v) > 1
    except (TypeError, ValueError):
        return v is not None


REFUSED_SWITCHES = {
    "torch_autocast": ("the run's precision is deepspeed.bf16 (recorded); autocast would compute in bf16 "
                       "under a record that says fp32", _is_enabled),
    "zero_optimization.cpu_offload": ("the old name of offload_optimizer.device=cpu, not supported (below)", _is_set),
    "zero_optimization.cpu_offload_param": ("the old name of offload_param.device=cpu, not supported", _is_set),
    "zero_optimization.zero_quantized_weights": ("ZeRO++ quantises the weights it gathers (lossy)", _is_set),
    "zero_optimization.zero_quantized_nontrainable_weights": ("ZeRO++ quantises the frozen weights (lossy)", _is_set),
    "zero_optimization.zero_quantized_gradients": ("ZeRO++ quantises the gradients it reduces (lossy)", _is_set),
    "zero_optimization.zenflow": ("ZenFlow updates some gradients asynchronously, after the step that made "
                                  "them", _is_present),
    "data_types": ("gradients accumulate in the dtype DeepSpeed chooses for the training precision; another is "
                   "untested with the methods' gradient edits (the ZeRO-2 gradient fragments)", _is_set),
    # what the harness checked in DeepSpeed 0.19.8 beside these: MiCS (mics_*) is gone from it (its config
    # refuses the keys); hpZ (zero_hpz_partition_size) keeps the optimiser state cut over every rank, as
    # zero_engine's pieces assume, and remakes the trained weights' secondary copies from the primary
    # partitions after each step (ZeroGradients.set_weights writes those; tests/backends/
    # test_deepspeed_ranks.py's hpz runs); the bucket, prefetch and sub-group sizes change no partition
    "gradient_allreduce_op": ("'sum' adds the ranks' gradients where the harness's loss weights expect their "
                              "mean: every gradient N times larger on N ranks (ZeRO-2)", _not_mean),
    "bfloat16": ("the old name of the bf16 section, which DeepSpeed reads only where bf16 is absent (never: the "
                 "harness writes bf16), so it would be ignored; write it as bf16", _is_present),
    "bf16.bf16_master_weights_and_grads": ("keeps the master weights and gradients in bf16, not fp32 (lossy, "
                                           "and not what the record's bf16 means)", _is_set),
    "bf16.bf16_optimizer_states": ("keeps Adam's moments in bf16, not fp32 (lossy)", _is_set),
    "fp16.fp16_master_weights_and_grads": ("keeps the master weights and gradients in fp16, not fp32 (lossy; "
                                           "DeepSpeed also asks for ZeRO-Offload, not supported here)", _is_set),
    "fp16.auto_cast": ("casts the inputs of the forward to fp16, fp16 off or not", _is_set),
    "expert_parallel": ("AutoEP replaces the MoE layers it detects with its own and cuts their experts over a "
                        "group of ranks, under the methods' expert hooks", _is_enabled),
    "tensor_parallel.autotp_size": ("AutoTP shards each layer's weights over a group of ranks, under the "
                                    "methods' hooks, which read whole weights", _above_one),
    "hybrid_engine": ("the RLHF engine swaps the forward for generation and shares rank 0's random state with "
                      "every rank; untested here", _is_enabled),
    "autotuning": ("the autotuner ends the process after a few profiled steps, exit code 0, the run unfinished",
                   _is_enabled),
}


# What a collective's error says when a peer went away (lower case; DeepSpeedBackend.lost_peer)
LOST_PEER = ("connection reset by peer", "connection closed by peer", "broken pipe", "timed out",
             "remote process exited", "communicator was aborted")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init_distributed(deepspeed, timeout: timedelta) -> None:
    """Join the launcher's process group (deepspeed, torchrun: RANK etc. in the
    environment), or make a one-rank group for this process."""
    if torch.distributed.is_initialized():
        if torch.distributed.get_world_size() == 1:  # a one-rank group made earlier in this process
            os.environ.setdefault("LOCAL_RANK", "0")  # the engine asserts it is set
        return
    _build_cpu_comm_op()
    if "RANK" in os.environ:
        deepspeed.init_distributed(timeout=timeout)
        _unlink_shm_buffer()
    else:
        os.environ.setdefault("LOCAL_RANK", "0")  # the engine asserts it is set
        deepspeed.init_distributed(auto_mpi_discovery=False, init_method=f"tcp://127.0.0.1:{free_port()}",
                                   rank=0, world_size=1, timeout=timeout)


def _count_local_ranks() -> None:
    """LOCAL_SIZE, the ranks on this machine, as DeepSpeed's own launcher sets it: torchrun's
    LOCAL_WORLD_SIZE, 1 for a one-rank group, else the launcher's. Without it DeepSpeed's
    CPU accelerator counts its devices by running `numactl --hardware`, at every ZeRO-3
    gradient reduction: 252 processes started in a smoke run. Set after the process
    group exists: the CPU all-reduce op reads it once, at init, to choose its
    shared-memory path, and that choice stays the launcher's."""
    if torch.cuda.is_available():
        return
    local = os.environ.get("LOCAL_WORLD_SIZE") or ("1" if torch.distributed.get_world_size() == 1 else None)
    if local is not None:
        os.environ["LOCAL_SIZE"] = local


def _freeze_what_lives() -> None:
    """Set what this process holds now (the modules torch, transformers and DeepSpeed
    imported: hundreds of thousands of objects) aside from the cyclic garbage
    collector, once the garbage is gone. Every phase ends with a full collection
    (ZeroPhase.close: the engine's buffers sit in reference cycles) and ZeRO-3's engine
    starts with one (DeepSpeed's defragment), and each walked all of them: 0.6 s a
    collection, half of a smoke run's time. Called before data and model load, so
    neither is set aside: a model sits in reference cycles too, and a module a method
    replaces must still be freed."""
    with contextlib.suppress(ImportError):  # what every engine's start imports (torch.compile's stack), first
        importlib.import_module("deepspeed.runtime.zero.muon.muon_optimizer")
    gc.collect()
    gc.freeze()


CPU_COMM_OP = "ShareMemCommBuilder"  # DeepSpeed's CPU all-reduce, built at its TorchBackend's init
BUILD_LOCK = "cl-bench.lock"  # beside torch's `lock`, in the op's build folder


def _build_cpu_comm_op(builder=None) -> None:
    """Build (or load) DeepSpeed's CPU shared-memory all-reduce op before
    deepspeed.init_distributed does. DeepSpeed compiles it on a machine's first run
    (torch.utils.cpp_extension, into the torch extensions folder), behind a lock
    *file* that torch removes when the build ends: a build killed midway (Ctrl-C in
    the first DeepSpeed run, a test's time-out) leaves the file, and every later run
    on the machine then waits on it forever, printing nothing. Here the build runs
    under a lock the kernel drops when its holder dies (flock), taken by every
    cl-bench process that builds it; whoever holds it and finds torch's file knows no
    live cl-bench build owns that file, and removes it. (A build by another program at
    that very moment would lose its file: it would then build twice, not hang.)"""
    if torch.cuda.is_available():
        return
    if builder is None:
        from deepspeed.accelerator import get_accelerator
        from deepspeed.ops import __compatible_ops__

        builder = get_accelerator().create_op_builder(CPU_COMM_OP)
        if builder is None or not __compatible_ops__.get(builder.NAME, False):
            return  # DeepSpeed falls back to gloo's all-reduce
    from torch.utils.cpp_extension import _get_build_directory  # where torch's load() builds it

    folder = Path(_get_build_directory(builder.name, verbose=False))
    with open(folder / BUILD_LOCK, "a") as held:
        try:
            fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("waiting for another process's build of DeepSpeed's CPU all-reduce op (%s)", folder)
            fcntl.flock(held, fcntl.LOCK_EX)
        stale = folder / "lock"
        if stale.exists():
            log.warning("%s: removed the lock file of an interrupted build of DeepSpeed's CPU all-reduce op", stale)
            stale.unlink(missing_ok=True)
        if not any(folder.glob("*.so")):
            log.info("building DeepSpeed's CPU all-reduce op, once for this machine (a minute or two) in %s", folder)
        builder.load(verbose=False)


def _unlink_shm_buffer() -> None:
    """DeepSpeed's CPU shared-memory all-reduce (ranks on one machine, LOCAL_SIZE set
    by its launcher) creates /dev/shm/deepspeed_allreduce_buffer_<uid>_<addr>_<port>_<rank>
    (~66 MB) per rank at init and never unlinks it, so every multi-rank CPU run would
    leave them behind. Once every rank has passed the barrier, every rank has mapped
    every buffer; each then unlinks its own name (the mappings stay valid)."""
    if torch.cuda.is_available():
        return
    name = Path("/dev/shm") / (f"deepspeed_allreduce_buffer_{os.getuid()}_{os.environ.get('MASTER_ADDR', '')}_"
                               f"{os.environ.get('MASTER_PORT', '')}_{torch.distributed.get_rank()}")
    torch.distributed.barrier()
    name.unlink(missing_ok=True)


def load_ds_file(path: str) -> dict[str, Any]:
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise UserError(f"{path}: cannot read the DeepSpeed config ({exc.strerror}); check deepspeed.config")
    try:
        data = yaml.safe_load(text) if Path(path).suffix in (".yaml", ".yml") else json.loads(text)
    except (ValueError, yaml.YAMLError) as exc:
        raise UserError(f"{path}: not valid JSON/YAML ({exc}); fix the file") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: a DeepSpeed config must be a mapping of settings")
    return data


def ds_config(config: RunConfig, world_size: int, bf16: bool) -> dict[str, Any]:
    """The DeepSpeed config of a run: deepspeed.config's file (if any) under the
    settings the harness owns; a conflict names the file, the key and the fix."""
    t, d = config.train, config.deepspeed
    base = load_ds_file(d.config) if d.config else {}
    where = d.config or "deepspeed"
    for key, why in REFUSED_SECTIONS.items():
        if key in base and (key != "fp16" or base[key].get("enabled") not in (False, None)):
            raise UserError(f"{where}: remove the '{key}' section: {why}")
    for key, (why, on) in REFUSED_SWITCHES.items():
        value = base
        for part in key.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        if on(value):
            raise UserError(f"{where}: {key}={json.dumps(value)}: {why}; remove it")
    accumulation = max(1, -(-(t.batch_size // t.micro_batch_size) // world_size))
    # set by the harness from the run config; the file may repeat them only with the same value (or "auto")
    owned = {"train_micro_batch_size_per_gpu": t.micro_batch_size,
             "gradient_accumulation_steps": accumulation,
             "train_batch_size": t.micro_batch_size * accumulation * world_size,
             "gradient_clipping": t.grad_clip}
    source = {"train_micro_batch_size_per_gpu": "train.micro_batch_size",
              "gradient_accumulation_steps": "train.batch_size / train.micro_batch_size / ranks",
              "train_batch_size": "train.batch_size", "gradient_clipping": "train.grad_clip"}
    for key, value in owned.items():
        if key in base and base[key] != "auto" and base[key] != value:
            raise UserError(f"{where}: {key}={base[key]!r} but the run gives {value!r} (from {source[key]}); "
                            f"set it to \"auto\" or remove it, and set {source[key]} instead")
    zero = dict(base.get("zero_optimization", {}))
    for key in OFFLOAD:
        section = zero.get(key) or {}
        device = section.get("device", "none") if isinstance(section, dict) else section
        if device != "none":
            raise UserError(f"{where}: zero_optimization.{key}.device={device!r}: offload is not supported "
                            f"(untested here, and ZeRO-Offload clips by the gradient norm taken before a "
                            f"method edits the gradients: EWC, OGD, SAME); set it to \"none\" or remove it")
    if zero.get("stage", "auto") not in ("auto", d.zero):
        raise UserError(f"{where}: zero_optimization.stage={zero['stage']} but deepspeed.zero={d.zero}; "
                        f"remove the stage from the file and choose it with --zero")
    file_bf16 = base.get("bf16", {}).get("enabled", "auto")
    if d.bf16 is None and file_bf16 not in ("auto", bf16):
        bf16 = bool(file_bf16)
    comm = str(base.get("communication_data_type") or "").lower()
    if comm not in ("", "fp32", "bf16" if bf16 else "fp32"):
        raise UserError(f"{where}: communication_data_type={comm!r} reduces gradients in a precision below "
                        f"the run's ({'bf16' if bf16 else 'fp32'}); remove it")
    return {"steps_per_print": 2 ** 31, **base, **owned, "zero_optimization": {**zero, "stage": d.zero},
            "bf16": {**base.get("bf16", {}), "enabled": bf16}}


class DeepSpeedBackend(Backend):
    name = "deepspeed"
    _phase: ZeroPhase | None = None  # the phase training now, if any

    def __init__(self, config: RunConfig):
        import deepspeed  # only here: the torch backend never imports it

        logging.getLogger("DeepSpeed").setLevel(logging.WARNING)  # engine set-up is logged at INFO per phase
        # DeepSpeed's collectives call torch.distributed functions torch now marks deprecated
        warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")
        self.ds = deepspeed
        _init_distributed(deepspeed, timedelta(minutes=int(os.environ.get("CL_BENCH_DIST_TIMEOUT_MIN", 30))))
        _freeze_what_lives()
        _count_local_ranks()
        dist = torch.distributed
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        if torch.cuda.is_available():
            torch.cuda.set_device(local_rank)
            device = torch.device("cuda", local_rank)
        else:
            device = torch.device("cpu")
        super().__init__(config, device)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        wanted = config.deepspeed.bf16
        if wanted and not deepspeed.accelerator.get_accelerator().is_bf16_supported():
            raise UserError(f"deepspeed.bf16=true but this {device.type} device has no bf16 support; "
                            f"set deepspeed.bf16 to null (auto) or false")
        # auto: bf16 on GPUs that have it; a CPU computes bf16 slowly, so only when asked
        auto = device.type == "cuda" and torch.cuda.is_bf16_supported()
        self.ds_config = ds_config(config, self.world_size, auto if wanted is None else wanted)
        self.bf16 = self.ds_config["bf16"]["enabled"]
        asked = config.train.precision
        if not self.bf16 and self.rank == 0 and (asked == "bf16" or (asked == "auto" and native_bf16(device))):
            log.warning("train.precision=%s would train in bf16 here, but the deepspeed backend trains in what "
                        "deepspeed.bf16 says (left null: the bf16 section of deepspeed.config, else bf16 on "
                        "CUDA devices only): fp32 now; set deepspeed.bf16=true for bf16 (DeepSpeed's, the whole "
                        "model in bf16, docs/running.md)", asked)

    # ---- ranks ------------------------------------------------------------------
    def on_main(self, fn: Callable[[], Any]) -> Any:
        box: list[Any] = [None]
        if self.is_main:
            try:
                box[0] = ("ok", fn())
            except UserError as exc:
                box[0] = ("user", str(exc))
            except BaseException as exc:
                box[0] = ("crash", f"{type(exc).__name__}: {exc}")
                torch.distributed.broadcast_object_list(box, src=0)
                raise
        torch.distributed.broadcast_object_list(box, src=0)
        kind, value = box[0]
        if kind == "user":
            raise UserError(value)
        if kind == "crash":
            raise RuntimeError(f"rank 0 failed: {value}")
        return value

    def barrier(self) -> None:
        torch.distributed.barrier()

    def same_on_every_rank(self, label: str, fingerprint: Callable[[], dict]) -> None:
        prints: list = [None] * self.world_size
        torch.distributed.all_gather_object(prints, fingerprint())
        spread, differ = agreement.compare(prints)  # the same on every rank: all stop together
        if differ:
            shown = ", ".join(differ[:4]) + (f" and {len(differ) - 4} more" if len(differ) > 4 else "")
            raise UserError(f"{label}: the ranks' states differ ({shown}): they computed them apart (a "
                            f"nondeterministic kernel?) and would train different models from here, so the run "
                            f"stops; its last stage's checkpoint is kept")
        if spread > SPREAD_WARN and self.is_main:
            log.warning("%s: the ranks' float state differs by up to %.1e relative (a sum over one tensor); "
                        "beyond %.0e the ranks' runs may part", label, spread, SPREAD_WARN)

    @property
    def train_precision(self) -> str:
        """The engine's: deepspeed.bf16 (auto: bf16 on GPUs that have it) decides, not
        train.precision."""
        return "bf16" if self.bf16 else "fp32"

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "zero": self.config.deepspeed.zero,
                "bf16": self.bf16, "deepspeed_version": self.ds.__version__,
                "deepspeed_config": self.ds_config}

    # ---- evaluation -------------------------------------------------------------------
    def generate(self, model, prompts, max_new_tokens, eos_id, pad_id, batch_size, on_batch=None):
        """The batches greedy_generate would make (longest prompts first) are dealt
        out to the ranks whole, so each continuation is computed exactly as on one
        rank; every rank gets all of them back."""
        order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
        batches = [order[s:s + batch_size] for s in range(0, len(order), batch_size)]
        mine = [i for batch in batches[self.rank::self.world_size] for i in batch]
        local = (greedy_generate(model, [prompts[i] for i in mine], max_new_tokens, eos_id, pad_id,
                                 batch_size, on_batch) if mine else [])
        parts: list[Any] = [None] * self.world_size
        torch.distributed.all_gather_object(parts, list(zip(mine, local)))
        out: list[Any] = [None] * len(prompts)
        for part in parts:
            for i, generated in part:
                out[i] = generated
        if on_batch is not None and len(prompts) > len(mine):
            on_batch(len(prompts) - len(mine))  # the other ranks' share
        return out

    # ---- training -----------------------------------------------------------------------
    def train_stage(self, method: Method, optimizer: torch.optim.Optimizer, stage: Stage,
                    epochs: list[list[dict]], pad_id: int,
                    on_step: StepCallback | None = None,
                    replay_rows: list[dict] | None = None, start_step: int = 0) -> int:
        """As TorchBackend.train_stage (cl_bench/backends/loop.py), on one engine built
        for this phase."""
        if not any(len(rows) for rows in epochs):
            return 0
        clip = self.config.train.grad_clip
        method.model.train()
        phase = ZeroPhase(self.ds, method.model, optimizer, method.make_optimizer, self.ds_config,
                          self.config.deepspeed.zero, self.bf16, method.idle_units())
        engine = phase.engine
        self._phase = phase
        method.ctx.grads = ZeroGradients(self.ds, self.config.deepspeed.zero, phase.apart)

        def backward(jobs: list[Job], step: int, key: str) -> dict[str, float]:
            parts: dict[str, float] = {}
            mine = self._share(jobs, method.replay_on_every_rank)
            for i, (j, job) in enumerate(mine):
                engine.set_gradient_accumulation_boundary(i == len(mine) - 1)
                micro = {k: v.to(self.device) for k, v in job.micro.items()}
                method.ctx.padding = job.weight == 0.0 and job.prefix is None
                with seeded(f"{key}/{j}", self.device):
                    loss, named = engine(job.hook, micro, step)
                method.ctx.padding = False
                # the engine averages over ranks: the weights add up to 1 over all of them
                engine.backward(loss * (job.weight * self.world_size), scale_wrt_gas=False)
                job.log(parts, named)
            return self._sum_parts(parts)

        def update(parts: dict[str, float], idle: list[torch.nn.Parameter]) -> None:
            phase.sync_hyperparameters()
            phase.skip(idle)
            engine.step()
            if clip > 0:
                parts["grad_norm"] = float(engine.get_global_grad_norm())
            elif getattr(engine.optimizer, "overflow", False):
                # ZeRO (fp32) skips a step whose gradient is not finite, where torch's AdamW
                # writes NaN weights and the next loss stops the run: stop it here
                parts["grad_norm"] = float("inf")

        try:
            replayed = run_phase(method, stage, epochs, pad_id, self.config, backward, update, on_step,
                                 replay_rows, start_step)
        except BaseException:  # the process may go on (an interrupted run saving, a test): torch's F.linear back
            phase.restore_linear()
            raise
        finally:
            method.ctx.grads = StepGradients()
            self._phase = None
        phase.close()
        return replayed

    @contextlib.contextmanager
    def whole(self, optimizer: torch.optim.Optimizer | None):
        """The weights and optimiser state whole on rank 0, the rank that writes
        checkpoints; the other ranks only take part. Inside a phase, what the engine
        holds is gathered (ZeroPhase.whole). Between phases the model is whole already,
        but at ZeRO-3 the state is cut into Pieces: zero_engine.whole_state gathers
        those, in a phase too (a parameter outside it)."""
        with contextlib.ExitStack() as stack:
            if self._phase is not None:
                stack.enter_context(self._phase.whole(keep=self.is_main))
            if optimizer is not None:
                stack.enter_context(whole_state(optimizer, self.device, keep=self.is_main))
            yield

    def check_model(self, model: torch.nn.Module) -> None:
        name = zero_dim(model.named_parameters())
        if name is not None:
            raise UserError(f"{self.config.model}: parameter {name!r} is 0-dim: {ZERO_DIM}; run it with "
                            f"--backend torch")

    def lost_peer(self, exc: BaseException) -> bool:
        """On N ranks, a RuntimeError (torch's DistError is one) that says a peer went away:
        gloo's "Connection reset/closed by peer" or "Broken pipe" when another rank's
        process ended, a time-out when it hangs, NCCL's abort. By what it says, not where
        it was raised: ZeRO-3 waits on its gathers in DeepSpeed's code; and a collective
        called wrongly (sizes that differ, a rank that does not exist) says otherwise and
        keeps its traceback."""
        text = str(exc).lower()
        return self.world_size > 1 and isinstance(exc, RuntimeError) and any(s in text for s in LOST_PEER)

    def load_optimizer(self, optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> None:
        """Held as a phase's close() leaves it: in host memory, and at ZeRO-3 each rank
        only its Piece of each moment (zero_engine.load_held)."""
        load_held(optimizer, state_dict, self.config.deepspeed.zero, self.rank, self.world_size)

    def _share(self, jobs: list[Job], replay_everywhere: bool = False) -> list[tuple[int, Job]]:
        """This rank's (index, job) pairs: jobs r, r + N, ... of the step, padded with
        weight-0 copies of the first so that every rank runs as many backward passes.
        `replay_everywhere` (Method.replay_on_every_rank): the replay job, the last, runs
        on every rank at weight 1/N (the same gradient), its parts logged by rank 0."""
        replay = jobs[-1] if replay_everywhere and jobs[-1].prefix == "replay_" else None
        shared = jobs[:-1] if replay is not None else jobs
        n = -(-len(shared) // self.world_size) if shared else 0
        idle = Job(shared[0].micro, 0.0, shared[0].hook, None) if shared else None
        mine = [(j, shared[j] if j < len(shared) else idle) for j in range(self.rank, n * self.world_size,
                                                                         self.world_size)]
        if replay is not None:
            mine.append((len(shared), Job(replay.micro, replay.weight / self.world_size, replay.hook,
                                          replay.prefix if self.is_main else None)))
        return mine

    def _sum_parts(self, parts: dict[str, float]) -> dict[str, float]:
        """Each rank's token-weighted parts, summed (replay parts come from one rank)."""
        if self.world_size == 1:
            return parts
        gathered: list[Any] = [None] * self.world_size
        torch.distributed.all_gather_object(gathered, parts)
        total: dict[str, float] = {}
        for rank_parts in gathered:
            for key, value in rank_parts.items():
                total[key] = total.get(key, 0.0) + value
        return total


class ZeroGradients(StepGradients):
    """A step's gradients under ZeRO (cl_bench/step_gradients.py): each rank's fragment of a
    parameter is the slice its partition holds, read from the optimiser's buffers
    between the last backward and engine.step (DeepSpeed 0.19.x).
      ZeRO-2: the parameter's `_hp_mapping` (deepspeed.utils.tensor_fragment): the
        fp32 master slice, and the slice of the reduced gradient the step will flatten
        into its partition (a view: written in place); none where the partition holds
        no part of it.
      ZeRO-3: the local API (safe_get_local_grad / safe_get_local_fp32_param): the
        rank's padded partition of the flattened parameter, from rank x partition on;
        written back with safe_set_local_grad.
    `apart()` is the phase's (ZeroPhase.apart)."""

    def __init__(self, deepspeed, zero: int, apart):
        self.ds, self.zero, self.apart = deepspeed, zero, apart
        self.world_size = torch.distributed.get_world_size()
        self.rank = torch.distributed.get_rank()

    def fragments(self, params: list[torch.nn.Parameter], grad: bool = True) -> list[Fragment]:
        part = self._zero3 if self.zero == 3 else self._zero2
        return [f for f in (part(p, grad) for p in params) if f is not None]

    def _zero2(self, p, with_grad: bool) -> Fragment | None:
        mapping = getattr(p, "_hp_mapping", None)
        if mapping is None:
            return None
        where = mapping.lp_fragment_address
        grad = None
        if with_grad:
            grad = mapping.get_lp_grad_fragment(p._index_in_param_group).view(-1)
            if grad.numel() == p.numel() != where.numel:  # the whole parameter's gradient: its slice
                grad = grad.narrow(0, where.start, where.numel)
        return Fragment(p, where.start, where.numel, grad, mapping.get_hp_fragment().view(-1))

    def _zero3(self, p, with_grad: bool) -> Fragment | None:
        size = p.ds_tensor.ds_numel  # the padded partition
        start = torch.distributed.get_rank() * size
        numel = min(size, p.ds_numel - start)
        if numel <= 0:
            return None
        utils = self.ds.utils
        grad = utils.safe_get_local_grad(p).reshape(-1)[:numel].clone() if with_grad else None
        return Fragment(p, start, numel, grad, utils.safe_get_local_fp32_param(p).reshape(-1)[:numel], p.ds_shape)

    def write(self, fragments: list[Fragment]) -> None:
        if self.zero != 3:
            return  # views of the partition's gradient
        for f in fragments:
            padded = f.grad.new_zeros(f.param.ds_tensor.ds_numel)
            padded[:f.numel] = f.grad
            self.ds.utils.safe_set_local_grad(f.param, padded)

    def set_weights(self, params: list[torch.nn.Parameter], fragments: list[Fragment]) -> None:
        """The masters were written in place; the working copies follow them. ZeRO-2: each
        rank holds every weight whole, assembled from the ranks' fragments; ZeRO-3: this
        rank's partition, and the whole weight too where ZeRO-3 keeps it gathered (a
        parameter under stage3_param_persistence_threshold)."""
        with torch.no_grad():
            if self.zero == 3:
                for f in fragments:
                    f.param.ds_tensor.view(-1)[:f.numel].copy_(f.weight)
                params = [p for p in params if getattr(p, "ds_persist", False)]
            whole = self.assemble(params, fragments, {id(f.param): f.weight for f in fragments})
            for p in params:
                p.data.copy_(whole[id(p)].view_as(p))

    def assemble(self, params: list[torch.nn.Parameter], fragments: list[Fragment],
                 values: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """One all-reduce for all of `params` (the same list on every rank): a zero
        buffer with this rank's slice of each filled in (each value held by one rank, so
        the sum is exact)."""
        if not params:
            return {}
        where = {id(f.param): f for f in fragments}
        sizes = [getattr(p, "ds_numel", p.numel()) for p in params]
        flat = torch.zeros(sum(sizes), dtype=torch.float32, device=self.device_of(params[0]))
        out = dict(zip(map(id, params), flat.split(sizes)))
        for p in params:
            f = where.get(id(p))
            if f is not None:
                out[id(p)][f.start:f.stop] = values[id(p)]
        torch.distributed.all_reduce(flat)
        return out

    @staticmethod
    def device_of(p: torch.nn.Parameter) -> torch.device:
        return p.ds_tensor.device if hasattr(p, "ds_tensor") else p.device

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        torch.distributed.all_reduce(t)
        return t

    def all_gather(self, values: list) -> list:
        gathered: list = [None] * self.world_size
        torch.distributed.all_gather_object(gathered, list(values))
        return [v for part in gathered for v in part]
