"""The `vllm` generator's seam (cl_bench/eval/vllm_generation.py), against a fake engine:
the weights it is given, the prompts in order, the outputs mapped back; the
refusals where it cannot run. vLLM itself is never imported here."""
from __future__ import annotations

import importlib.util

import pytest
import torch
from torch import nn

from cl_bench.eval import vllm_generation
from cl_bench.config import resolve
from cl_bench.errors import UserError
from cl_bench.models.loading import tiny_llama
from cl_bench.models.lora_adapters import LoRAAdapterArgs, inject_lora
from cl_bench.eval.vllm_generation import VllmGenerator, plain_weights
from helpers import run_cli, smoke_args

EOS = 99


class FakeEngine:
    """Records what it is given; prompt i continues with [len(p), i, EOS, 7]."""

    def __init__(self):
        self.loads: list[dict[str, torch.Tensor]] = []
        self.calls: list[tuple[list[list[int]], int, int]] = []

    def load_weights(self, weights):
        self.loads.append({n: t.clone() for n, t in weights})

    def generate(self, prompts, max_new_tokens, eos_id):
        self.calls.append((prompts, max_new_tokens, eos_id))
        return [[len(p), i, eos_id, 7] for i, p in enumerate(prompts)]


def test_weights_prompts_in_order_and_outputs_mapped_back():
    """Mutations caught: prompts sorted by length before the engine (as the hf
    generator batches them), outputs not cut at EOS, the weights of the first
    evaluation reused after training, an engine made per evaluation."""
    model, _, _ = tiny_llama(0)
    engines = []
    gen = VllmGenerator(lambda m: engines.append(FakeEngine()) or engines[-1])
    prompts = [[5, 6], [5, 6, 7, 8, 9], [4]]
    seen = []
    out = gen(model, prompts, 8, EOS, 0, 16, seen.append)
    (engine,) = engines
    assert engine.calls == [(prompts, 8, EOS)]
    assert out == [[2, 0], [5, 1], [1, 2]] and seen == [3]
    state = model.state_dict()
    assert engine.loads[0].keys() == state.keys()
    assert all(torch.equal(engine.loads[0][n], t) for n, t in state.items())
    with torch.no_grad():  # a stage trains
        model.model.layers[0].mlp.up_proj.weight.add_(1.0)
    gen(model, prompts, 8, EOS, 0, 16)
    assert len(engines) == 1 and len(engine.loads) == 2
    name = "model.layers.0.mlp.up_proj.weight"
    assert torch.equal(engine.loads[1][name], engine.loads[0][name] + 1.0)


def test_a_lora_adapter_is_merged_out_of_place_under_the_base_names():
    """Mutation caught: the adapter's delta left out (the engine would decode the base model)."""
    model, _, _ = tiny_llama(0)
    base = {n: t.clone() for n, t in model.state_dict().items()}
    model = inject_lora(model, LoRAAdapterArgs(r=2, alpha=4, dropout=0.0))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_()
    weights = dict(plain_weights(model))
    assert weights.keys() == base.keys()
    q = model.model.layers[1].self_attn.q_proj
    delta = q.lora_B["default"].weight @ q.lora_A["default"].weight * q.scaling["default"]
    name = "model.layers.1.self_attn.q_proj.weight"
    torch.testing.assert_close(weights[name], base[name] + delta)
    assert delta.abs().max() > 0 and torch.equal(q.base_layer.weight, base[name])  # the model untouched
    assert torch.equal(weights["model.layers.1.self_attn.k_proj.weight"], base["model.layers.1.self_attn.k_proj.weight"])


def test_a_model_with_tensors_the_base_lacks_is_refused():
    model, _, _ = tiny_llama(0)
    model.model.layers[0].mlp.extra = nn.Linear(4, 4)
    gen = VllmGenerator(lambda m: pytest.fail("no engine for a refused model"))
    with pytest.raises(UserError, match=r"eval.generator=hf") as err:
        gen(model, [[1, 2]], 4, EOS, 0, 16)
    assert "model.layers.0.mlp.extra" in str(err.value)


def test_the_run_refuses_vllm_in_one_line_without_it_or_without_cuda(trace_dir, tmp_path, capsys, monkeypatch):
    args = smoke_args(trace_dir, tmp_path / "runs", "--set", "eval.generator=vllm")
    assert run_cli(*args) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "vllm package" in err
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "vllm" else real(name, *a))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert run_cli(*args) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "CUDA" in err
    assert not list((tmp_path / "runs").glob("*/run.json"))


def test_config_names_the_generator_and_refuses_others():
    assert resolve("smoke", None, {}).eval.generator == "hf"
    with pytest.raises(UserError, match="eval.generator='vLLM' must be one of hf, vllm"):
        resolve("smoke", None, {"eval": {"generator": "vLLM"}})
    with pytest.raises(UserError, match="deepspeed"):
        resolve("smoke", None, {"eval": {"generator": "vllm"}, "backend": "deepspeed"})


def test_the_record_names_the_generator():
    from cl_bench.backends.torch_backend import TorchBackend

    backend = TorchBackend(resolve("smoke", None, {}), torch.device("cpu"))
    assert backend.describe()["generator"] == "hf"
    assert vllm_generation.GENERATORS == ("hf", "vllm")
