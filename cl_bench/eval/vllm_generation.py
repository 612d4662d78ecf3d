"""`eval.generator: vllm`: greedy decoding by a vLLM engine on a CUDA device, behind
the signature of cl_bench.eval.generation.greedy_generate (the `hf` generator).

At every evaluation the engine gets the weights the model has now (after the
stage just trained): the model's tensors under the base architecture's names,
with a peft LoRA adapter merged out of place (W + its delta, the model itself
untouched). A model with tensors the base architecture lacks (an upcycled MoE,
a method's own wrappers) is refused in one line: decode it with `hf`.

The engine is made once per run, with dummy weights, from the model's config
(no weights written to disk), without prefix caching (a cached prompt would keep
the previous stage's keys and values), in bf16, eager. vLLM computes in bf16
throughout (not autocast over fp32 weights), so its predictions are not the `hf`
generator's: the record names the generator and `compare` refuses to pair runs
decoded by different ones.

The engine is reached through two calls, `load_weights(named tensors)` and
`generate(prompts, max_new_tokens, eos_id) -> token ids a prompt, in order`;
the tests drive this seam with a fake engine (tests/test_vllm_generation.py).
vLLM is an optional extra: `pip install -e '.[vllm]'`.
"""
from __future__ import annotations

import importlib.util
import os
import tempfile
from typing import Callable, Iterator, Protocol

import torch
from torch import nn

from cl_bench.errors import UserError

GENERATORS = ("hf", "vllm")


class Engine(Protocol):
    def load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> None: ...

    def generate(self, prompts: list[list[int]], max_new_tokens: int, eos_id: int) -> list[list[int]]: ...


def check_available() -> None:
    """One line (UserError) where the vllm generator cannot run here."""
    if importlib.util.find_spec("vllm") is None:
        raise UserError("eval.generator=vllm needs the vllm package (pip install -e '.[vllm]'); "
                        "or set eval.generator=hf")
    if not torch.cuda.is_available():
        raise UserError("eval.generator=vllm needs a CUDA device and none is visible; set eval.generator=hf")


def plain_weights(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The model's tensors under the base model's names: peft's wrapping names removed
    (`base_model.model.` and `.base_layer`) and each LoRA layer's adapter merged out
    of place (base weight + `get_delta_weight`), its factors left out."""
    merged: dict[str, torch.Tensor] = {}
    for name, module in model.named_modules():
        if hasattr(module, "get_delta_weight") and hasattr(module, "base_layer"):
            delta = sum(module.get_delta_weight(a) for a in module.active_adapters)
            merged[_base_name(name) + ".weight"] = module.base_layer.weight.detach() + delta
    for name, tensor in model.state_dict().items():
        if ".lora_" in name:
            continue
        base = _base_name(name)
        yield base, merged.pop(base, tensor.detach())


def _base_name(name: str) -> str:
    return name.removeprefix("base_model.model.").replace(".base_layer", "")


class VllmGenerator:
    """greedy_generate's signature over an engine made on first use by `make_engine(model)`."""

    def __init__(self, make_engine: Callable[[nn.Module], Engine]):
        self.make_engine = make_engine
        self.engine: Engine | None = None
        self.expected: set[str] | None = None

    def __call__(self, model: nn.Module, prompts: list[list[int]], max_new_tokens: int, eos_id: int,
                 pad_id: int, batch_size: int, on_batch: Callable[[int], None] | None = None) -> list[list[int]]:
        weights = list(plain_weights(model))
        if self.expected is None:
            self.expected = base_names(model)
        unknown = [n for n, _ in weights if n not in self.expected]
        if unknown:
            raise UserError(f"eval.generator=vllm decodes the base architecture only; this model has "
                            f"{len(unknown)} tensors it lacks (e.g. {unknown[0]}): set eval.generator=hf")
        if self.engine is None:
            self.engine = self.make_engine(model)
        self.engine.load_weights(weights)
        outputs = self.engine.generate(prompts, max_new_tokens, eos_id)
        if len(outputs) != len(prompts):
            raise RuntimeError(f"the vllm engine returned {len(outputs)} outputs for {len(prompts)} prompts")
        if on_batch is not None:
            on_batch(len(prompts))
        return [out[:out.index(eos_id)] if eos_id in out else list(out) for out in outputs]


def base_names(model: nn.Module) -> set[str]:
    """The tensor names of the plain model of `model.config` (built on the meta device)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(model.config)
    return set(plain.state_dict())


class VllmEngine:
    """The Engine over vllm.LLM (module docstring)."""

    def __init__(self, model: nn.Module, gpu_memory_utilization: float = 0.4):
        # the model runs in this process, so load_weights can reach it (vLLM V1)
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # apply_model's function
        from vllm import LLM

        self.folder = tempfile.TemporaryDirectory(prefix="cl-bench-vllm-")
        model.config.save_pretrained(self.folder.name)
        self.llm = LLM(model=self.folder.name, load_format="dummy", dtype="bfloat16", enforce_eager=True,
                       enable_prefix_caching=False, skip_tokenizer_init=True, seed=0,
                       gpu_memory_utilization=gpu_memory_utilization)

    def load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        if hasattr(self.llm, "apply_model"):
            self.llm.apply_model(lambda m: m.load_weights(iter(weights)))
        else:  # vLLM before apply_model
            self.llm.llm_engine.model_executor.driver_worker.model_runner.model.load_weights(iter(weights))

    def generate(self, prompts: list[list[int]], max_new_tokens: int, eos_id: int) -> list[list[int]]:
        from vllm import SamplingParams
        try:
            from vllm import TokensPrompt
        except ImportError:  # vLLM releases that export it from vllm.inputs only
            from vllm.inputs import TokensPrompt

        params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens, stop_token_ids=[eos_id],
                                detokenize=False)
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]


def vllm_generator() -> VllmGenerator:
    """The `vllm` generator of a run (check_available first)."""
    check_available()
    return VllmGenerator(VllmEngine)
