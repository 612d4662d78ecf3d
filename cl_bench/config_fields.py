"""The fields of a run's config: one dataclass per section (data, train, eval,
replay, general, deepspeed) and RunConfig over them, each field with its default
and its meaning; RunConfig checks the values together when it is built.

Reading a config (profile <- YAML file <- flags) is cl_bench/config.py's; turning
given text or YAML values into a field's type is cl_bench/config_values.py's. This
module imports neither, so the method contract (cl_bench/method.py) and the data
(cl_bench/data/) can use the fields without importing the registry.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import typing
from dataclasses import dataclass, field
from typing import Any

from cl_bench.benchmark import DEFAULT as DEFAULT_BENCHMARK
from cl_bench.errors import UserError, did_you_mean
from cl_bench.eval.vllm_generation import GENERATORS
from cl_bench.run.metric_log import KINDS as LOG_KINDS
from cl_bench.run.precision import CHOICES as PRECISIONS
from cl_bench.run.schedule import SCHEDULES

# the values of Method.lr_family: what a method trains, for train.lr_by_family
LR_FAMILIES = ("full", "adapter", "expert")


@dataclass
class DataConfig:
    benchmark: str = DEFAULT_BENCHMARK  # a registered benchmark (`cl-bench list --benchmarks`) or a folder holding
    #                          benchmark.yaml (cl_bench/benchmarks/folder.py); records before it: trace
    data_dir: str | None = None  # None: the benchmark's (TRACE: $CL_BENCH_DATA, then conventional places)
    order: str | list[str] | None = None  # named order or a list of task names; None: the benchmark's default
    n_train: int | None = None  # training examples per task (None: all)
    n_test: int | None = None  # test examples per task (None: all)
    n_train_per_task: dict[str, int] = field(default_factory=dict)  # overrides of n_train by task name
    n_test_per_task: dict[str, int] = field(default_factory=dict)  # overrides of n_test by task name
    test_split: str = "test"  # the split scored: test, or eval for model selection (sweeps); never
    #                           select on MeetingBank's eval split, which is its train copy in the 500 release

    def n_train_for(self, task: str) -> int | None:
        return self.n_train_per_task.get(task, self.n_train)


@dataclass
class TrainConfig:
    batch_size: int = 8  # examples per optimiser step
    micro_batch_size: int = 4  # examples per forward; accumulation = batch_size / micro_batch_size
    epochs: int = 1  # default epochs per task
    epochs_per_task: dict[str, int] = field(default_factory=dict)  # overrides by task name
    grad_clip: float = 1.0  # max global grad norm; 0 turns clipping off
    max_prompt_len: int = 512  # prompt tokens kept (special tokens included)
    max_answer_len: int = 256  # answer tokens kept, EOS included
    truncation: str = "head_tail"  # head_tail: keep instruction + cue; left: TRACE's cut
    truncation_head: int = 64  # head_tail: prompt tokens kept from the start
    precision: str = "fp32"  # fp32 | bf16 (autocast, fp32 master weights and optimiser) | auto
    #                          (bf16 where the device has native bf16 matrix support); cl_bench/run/precision.py.
    #                          The torch backend's; the deepspeed backend trains as deepspeed.bf16 says (it warns
    #                          where this asks for bf16 and that does not give it)
    lr_by_family: dict[str, float] = field(default_factory=dict)  # learning rate of each method family
    #   (Method.lr_family: full, adapter, expert) where the method's lr is not given as an argument
    lr_schedule: str | None = None  # constant | cosine, over each training phase (cl_bench/run/schedule.py);
    #                                 None: the method's (Method.lr_schedule); the run's config records it
    warmup_ratio: float | None = None  # share of a phase's steps with linear warm-up; None: the method's
    checkpoint_every_s: float | None = None  # also checkpoint inside a stage, at the first step boundary this
    #   many seconds of training after the last checkpoint (0: every step; None: at stage ends only), so a
    #   killed run loses at most this much training (plus one step); either backend (cl_bench/run/checkpoint.py)

    def epochs_for(self, task: str) -> int:
        return self.epochs_per_task.get(task, self.epochs)


@dataclass
class EvalConfig:
    batch_size: int = 16  # prompts per generation batch
    max_new_tokens_cap: int | None = None  # caps every task's max_new_tokens (None: task's own)
    eval_all: bool = False  # evaluate every task at every stage plus a zero-shot row (FWT)
    zero_shot: bool = False  # score every task before any training (the zero-shot row R0)
    next_task: bool = False  # also score, after each stage, the task the next stage trains (R[j-1][j],
    #                          for FWT with the zero-shot row)
    precision: str = "fp32"  # fp32 | bf16 | auto, as train.precision, for decoding
    generator: str = "hf"  # hf: cl_bench/eval/generation.py; vllm: a vLLM engine on CUDA (cl_bench/eval/vllm_generation.py)
    cka_probe: int = 0  # test examples per task whose per-layer CKA since the task was learned is
    #                     recorded after every stage (cl_bench/eval/probes/representation.py; `cl-bench analyze`); 0: off
    cka_probe_tokens: int = 512  # at most this many of their tokens
    routing_probe: int = 0  # test examples per task whose routed-expert distribution per MoE layer and its
    #                         JS divergence since the task was learned are recorded after every stage
    #                         (cl_bench/eval/probes/routing.py; `cl-bench analyze`); 0: off; dense models: nothing
    sharpness: int = 0  # test examples of the last task for expert sharpness after the last stage; 0: off
    sharpness_iters: int = 10  # Lanczos steps (Hessian-vector products) per expert
    sharpness_layers: list[int] | None = None  # decoder layer indices to probe (None: every MoE layer);
    #                                            cost ~ layers x experts x iters backward passes


@dataclass
class ReplayConfig:
    """The run's one replay budget (PROTOCOL.md, "Replay budget")."""

    fraction: float = 0.1  # of each finished task's training subset, at least 1 example
    per_task: int | None = None  # an absolute count instead of the fraction
    policy: str = "interleave"  # interleave: one replay micro-batch per step; epoch: TRACE's extra epoch
    lima: int = 0  # Lima examples in the buffer from the start (opt-in; TRACE uses all 1030)


@dataclass
class GeneralConfig:
    """General ability and instruction drift, measured in the run (cl_bench/eval/general/)."""

    lima: int = 0  # held-out Lima items whose mean answer NLL per token is recorded at the zero-shot point
    #                and after every stage, with ΔLima (cl_bench/eval/general/lima.py); 0: off
    tasks: list[str] = field(default_factory=list)  # lm-eval task names or local task YAML paths, scored at the
    #   zero-shot point and after the last stage with ΔG (cl_bench/eval/general/lm_eval_tasks.py; needs cl-bench[general])
    limit: int | None = None  # items per task (lm-eval's --limit: the first N); None: all
    every_stage: bool = False  # score the general tasks after every stage, not only the last


@dataclass
class DeepSpeedConfig:
    """The deepspeed backend (`backend: deepspeed`); ignored by `torch`. Batch sizes,
    accumulation and clipping come from `train`, the optimiser from the method."""

    zero: int = 2  # ZeRO stage: 2 partitions optimiser state and gradients; 3 also the weights
    bf16: bool | None = None  # None: bf16 on CUDA devices that support it, else fp32
    config: str | None = None  # a DeepSpeed JSON/YAML for everything else (buckets, overlap; no offload);
    #                            a relative path in a --config file is relative to that file


@dataclass
class RunConfig:
    method: str = ""  # "": the baseline method (registry.baseline(): full fine-tuning)
    method_args: dict[str, Any] = field(default_factory=dict)
    model: str = "smollm2-135m"
    profile: str = "cpu"
    seed: int = 1234
    output_dir: str = "runs"
    run_id: str | None = None  # None: <method>-<timestamp>-<random>
    backend: str = "torch"  # torch: one process; deepspeed: ZeRO-2/3 over any number of ranks
    log: str = "none"  # per-step metrics also to: none | tensorboard | wandb (cl_bench/run/metric_log.py)
    tuned: str | None = None  # `--tuned`: the tuned file the method's arguments came from, @ its commit
    #                           (cl_bench/config_tuned.py); None: not tuned
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    replay: ReplayConfig = field(default_factory=ReplayConfig)
    general: GeneralConfig = field(default_factory=GeneralConfig)
    deepspeed: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)

    def __post_init__(self) -> None:
        for name in ("cka_probe", "cka_probe_tokens", "routing_probe", "sharpness", "sharpness_iters"):
            if getattr(self.eval, name) < 0:
                raise UserError(f"eval.{name}={getattr(self.eval, name)} must be >= 0 (0 turns it off)")
        if any(i < 0 for i in self.eval.sharpness_layers or []):
            raise UserError(f"eval.sharpness_layers={self.eval.sharpness_layers}: decoder layer indices are "
                            f"0-based and >= 0")
        t = self.train
        if t.batch_size % t.micro_batch_size:
            raise UserError(
                f"train.batch_size={t.batch_size} is not a multiple of train.micro_batch_size="
                f"{t.micro_batch_size}; set them so micro batches divide the step")
        if t.truncation not in ("head_tail", "left"):
            raise UserError(f"train.truncation={t.truncation!r} must be 'head_tail' or 'left'")
        if t.truncation == "head_tail" and not 0 <= t.truncation_head < t.max_prompt_len:
            raise UserError(
                f"train.truncation_head={t.truncation_head} must be in [0, max_prompt_len="
                f"{t.max_prompt_len})")
        for name in ("batch_size", "micro_batch_size", "epochs", "max_prompt_len", "max_answer_len"):
            if getattr(t, name) < 1:
                raise UserError(f"train.{name}={getattr(t, name)} must be at least 1")
        for name in ("n_train", "n_test"):  # checked here, before a run folder is made
            n = getattr(self.data, name)
            if n is not None and n < 1:
                raise UserError(f"data.{name}={n} must be at least 1, or null for the whole split "
                                f"(--{name.replace('_', '-')} on the command line)")
        if not (math.isfinite(t.grad_clip) and t.grad_clip >= 0):  # NaN or < 0 would turn clipping off
            raise UserError(f"train.grad_clip={t.grad_clip} must be a finite number >= 0 (0 turns clipping off)")
        cap = self.eval.max_new_tokens_cap
        if cap is not None and cap < 1:
            raise UserError(f"eval.max_new_tokens_cap={cap} must be at least 1, or null for each task's own")
        rid = self.run_id
        if rid is not None and (rid in ("", ".", "..") or "/" in rid or "\\" in rid
                                or any(not c.isprintable() for c in rid)):
            raise UserError(f"run_id={rid!r} must be one plain folder name (no '/', no newline or other "
                            f"control character, not '.' or '..'); use --output-dir for where run folders go")
        if self.eval.generator not in GENERATORS:
            raise UserError(f"eval.generator={self.eval.generator!r} must be one of {', '.join(GENERATORS)}")
        if self.eval.generator == "vllm" and self.backend == "deepspeed":
            raise UserError("eval.generator=vllm runs with --backend torch; the deepspeed backend decodes with hf")
        for where, value in (("train.precision", t.precision), ("eval.precision", self.eval.precision)):
            if value not in PRECISIONS:
                raise UserError(f"{where}={value!r} must be one of {', '.join(PRECISIONS)}")
        if t.lr_schedule is not None and t.lr_schedule not in SCHEDULES:
            raise UserError(f"train.lr_schedule={t.lr_schedule!r}: {did_you_mean(t.lr_schedule, SCHEDULES)}"
                            f"choose one of {', '.join(SCHEDULES)}")
        if t.warmup_ratio is not None and not 0 <= t.warmup_ratio < 1:
            raise UserError(f"train.warmup_ratio={t.warmup_ratio} must be in [0, 1), e.g. 0.03")
        if t.checkpoint_every_s is not None and not (math.isfinite(t.checkpoint_every_s)
                                                     and t.checkpoint_every_s >= 0):
            raise UserError(f"train.checkpoint_every_s={t.checkpoint_every_s} must be a number of seconds >= 0 "
                            f"(0: every step), or null for checkpoints at stage ends only, e.g. 600")
        for family, lr in t.lr_by_family.items():
            if family not in LR_FAMILIES:
                raise UserError(f"train.lr_by_family: '{family}' is not a method family; "
                                f"{did_you_mean(str(family), LR_FAMILIES)}choose among {', '.join(LR_FAMILIES)}")
            if not (isinstance(lr, (int, float)) and math.isfinite(lr) and lr > 0):
                raise UserError(f"train.lr_by_family.{family}={lr!r} must be a positive number")
        if self.data.test_split not in ("test", "eval"):
            raise UserError(f"data.test_split={self.data.test_split!r} must be 'test' or 'eval'")
        if self.eval.batch_size < 1:
            raise UserError(f"eval.batch_size={self.eval.batch_size} must be at least 1")
        r = self.replay
        if r.policy not in ("interleave", "epoch"):
            raise UserError(f"replay.policy={r.policy!r} must be 'interleave' or 'epoch'")
        if not 0 < r.fraction <= 1:
            raise UserError(f"replay.fraction={r.fraction} must be in (0, 1]")
        if r.per_task is not None and r.per_task < 1 or r.lima < 0:
            raise UserError("replay.per_task must be at least 1 (or null) and replay.lima at least 0")
        if self.general.lima < 0:
            raise UserError(f"general.lima={self.general.lima} must be >= 0 (0 turns the Lima probe off)")
        if self.general.limit is not None and self.general.limit < 1:
            raise UserError(f"general.limit={self.general.limit} must be at least 1, or null for every item")
        if self.general.tasks and self.backend == "deepspeed":
            raise UserError("general.tasks runs lm-eval on one process and is refused with backend deepspeed; "
                            "run it with --backend torch, or leave general.tasks empty")
        if self.backend not in ("torch", "deepspeed"):
            raise UserError(f"backend={self.backend!r} is not available; choose 'torch' or 'deepspeed'")
        if self.log not in LOG_KINDS:
            raise UserError(f"log={self.log!r}: {did_you_mean(self.log, LOG_KINDS)}choose one of "
                            f"{', '.join(LOG_KINDS)}")
        if self.deepspeed.zero not in (2, 3):
            raise UserError(f"deepspeed.zero={self.deepspeed.zero} must be 2 or 3")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def check_per_task(config: RunConfig, tasks: list[str], title: str) -> None:
    """The per-task mappings name tasks of the run's benchmark (`title`; `tasks`: every
    task name; a profile's mapping may name tasks a shorter order leaves out) and hold
    counts >= 1; checked before any data or model loads."""
    for where, mapping in (("train.epochs_per_task", config.train.epochs_per_task),
                           ("data.n_train_per_task", config.data.n_train_per_task),
                           ("data.n_test_per_task", config.data.n_test_per_task)):
        for task, value in mapping.items():
            if task not in tasks:
                raise UserError(f"{where}: '{task}' is not a {title} task; {did_you_mean(str(task), tasks)}"
                                f"tasks: {', '.join(tasks)}")
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise UserError(f"{where}.{task}={value!r} must be a whole number >= 1")


def field_types(cls: type) -> dict[str, Any]:
    """Field name -> its type (the annotations resolved), of a config dataclass."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def field_hint(key: str) -> str:
    """For a name given as a method argument that is a field of a config section (or
    close to one): "'epochs' is a config field: --set train.epochs=VALUE; ", else ""."""
    fields = {f.name: f"{section.name}.{f.name}" for section in dataclasses.fields(RunConfig)
              if dataclasses.is_dataclass(section.default_factory) for f in dataclasses.fields(section.default_factory)}
    close = difflib.get_close_matches(key, fields, n=1, cutoff=0.8) if key not in fields else [key]
    return f"'{close[0]}' is a config field: --set {fields[close[0]]}=VALUE; " if close else ""
