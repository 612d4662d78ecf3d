"""Helpers shared by the method tests: a tiny task and a method set up on the
tiny random Llama (2 layers, width 64)."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from cl_bench import registry
from cl_bench.benchmarks.trace.loader import Example
from cl_bench.config import RunConfig, TrainConfig
from cl_bench.data import Encoder
from cl_bench.method import MethodContext
from cl_bench.models.loading import tiny_llama


def make_task(name: str, n: int = 8, offset: int = 0) -> SimpleNamespace:
    """`n` arithmetic examples, numbered from `offset` (other offsets: other examples)."""
    train = [Example(f"Question: {i} plus {i + 1}? Answer:", f"{2 * i + 1} apples", i)
             for i in range(offset, offset + n)]
    return SimpleNamespace(name=name, train=train)


def make_method(name: str, seed: int = 0, **args):
    """The registered method `name` with `args`, set up on a seeded tiny Llama."""
    model, tokenizer, _ = tiny_llama(seed)
    config = RunConfig(model="tiny-llama", seed=seed,
                       train=TrainConfig(max_prompt_len=96, max_answer_len=16, truncation_head=16))
    cls = registry.get(name)
    ctx = MethodContext(config, torch.device("cpu"), tokenizer,
                        encoder=Encoder.from_config(tokenizer, config.train))
    method = cls(cls.parse_args(args), ctx)
    torch.manual_seed(seed)
    method.setup(model)
    return method
