"""What the sequencer needs from a backend besides `train_stage`: which rank this
process is, running what only one rank may do (files, progress), agreeing on
values across ranks, and generating for evaluation. The defaults are one process;
the deepspeed backend overrides them for N ranks.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, TypeVar

import torch

from cl_bench.config import RunConfig
from cl_bench.errors import UserError
from cl_bench.eval.generation import greedy_generate
from cl_bench.run import precision
from cl_bench.eval.vllm_generation import vllm_generator

T = TypeVar("T")


class Backend:
    name = ""

    def __init__(self, config: RunConfig, device: torch.device):
        self.config = config
        self.device = device
        self.rank = 0
        self.world_size = 1
        self.eval_precision = precision.resolve(config.eval.precision, device)
        self._vllm = vllm_generator() if config.eval.generator == "vllm" else None

    @property
    def train_precision(self) -> str:
        """'bf16' or 'fp32': what train_stage computes in (cl_bench/run/precision.py)."""
        return precision.resolve(self.config.train.precision, self.device)

    @property
    def is_main(self) -> bool:
        """Rank 0: the only one that writes records, logs, checkpoints and progress."""
        return self.rank == 0

    def on_main(self, fn: Callable[[], T]) -> T:
        """fn() on rank 0 only; its value (or its UserError) reaches every rank."""
        return fn()

    def barrier(self) -> None:
        """Wait until every rank gets here."""

    def whole(self, optimizer: torch.optim.Optimizer | None) -> contextlib.AbstractContextManager:
        """Inside, between two steps of a phase or between phases: on rank 0 the method's
        model and `optimizer` (the run's) hold whole weights and state, as the
        checkpoint rank 0 writes there reads them. Every rank enters it together. In one
        process they are whole already."""
        return contextlib.nullcontext()

    def check_model(self, model: torch.nn.Module) -> None:
        """Refuse, as the run starts, a model this backend cannot train (UserError)."""

    def lost_peer(self, exc: BaseException) -> bool:
        """Whether `exc`, which ended a run, came from a collective that failed for want
        of another rank (its process ended or stopped answering): no fault of this
        process, and the run goes on with --resume. In one process, never."""
        return False

    def load_optimizer(self, optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> None:
        """A checkpoint's optimiser state into the run's `optimizer` (--resume, between
        phases), held as this backend holds it there; in one process, torch's
        load_state_dict: each tensor beside its parameter."""
        optimizer.load_state_dict(state_dict)

    def same_on_every_rank(self, label: str, fingerprint: Callable[[], dict]) -> None:
        """On N ranks: stop the run where a rank's model or method state (`fingerprint()`,
        cl_bench/run/agreement.py) differs from rank 0's other than by float rounding,
        and warn where the float values drift apart; in one process there is nothing
        to compare."""

    def generate(self, model, prompts: list[list[int]], max_new_tokens: int, eos_id: int, pad_id: int,
                 batch_size: int, on_batch: Callable[[int], None] | None = None) -> list[list[int]]:
        """Greedy continuations of every prompt (eval.generator: cl_bench.eval.generation, or
        cl_bench.eval.vllm_generation), on every rank."""
        if self._vllm is not None:
            return self._vllm(model, prompts, max_new_tokens, eos_id, pad_id, batch_size, on_batch)
        return greedy_generate(model, prompts, max_new_tokens, eos_id, pad_id, batch_size, on_batch)

    def describe(self) -> dict[str, Any]:
        """What the run record states about how the run was trained."""
        return {"name": self.name, "world_size": self.world_size,
                "precision": {"train": self.train_precision, "eval": self.eval_precision},
                "generator": self.config.eval.generator}


def check_support(method_cls, config: RunConfig) -> None:
    """Refuse, before anything loads, a method that declares it cannot run on the
    chosen backend (Method.zero_unsupported)."""
    if config.backend != "deepspeed":
        return
    reason = method_cls.zero_unsupported.get(config.deepspeed.zero)
    if reason:
        raise UserError(f"method '{method_cls.name}' cannot run on the deepspeed backend with "
                        f"ZeRO-{config.deepspeed.zero}: {reason}; run it with --backend torch")
