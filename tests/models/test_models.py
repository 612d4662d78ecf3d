"""Model loading: tiny seeded model, meta-device configurations, bad names."""
from __future__ import annotations

import pytest
import torch

from cl_bench.errors import UserError
from cl_bench.models.loading import load, meta_model


def test_tiny_llama_is_seeded():
    a, b, c = (load("tiny-llama", s) for s in (1, 1, 2))
    assert a.info["sha256"] == b.info["sha256"] != c.info["sha256"]
    assert a.model.config.hidden_size == 64 and a.model.config.intermediate_size % 8 == 0
    assert torch.equal(a.model.model.embed_tokens.weight, b.model.model.embed_tokens.weight)


def test_llama_3_2_1b_config_counts_1_236b_without_memory():
    model = meta_model("llama-3.2-1b")
    assert next(model.parameters()).device.type == "meta"
    n = sum(p.numel() for p in model.parameters())
    assert n == 1_235_814_400  # the paper's 1.236B (tied embeddings counted once)


def test_llama_3_2_3b_config():
    n = sum(p.numel() for p in meta_model("llama-3.2-3b").parameters())
    assert round(n / 1e9, 2) == 3.21


def test_bad_model_names():
    with pytest.raises(UserError, match="unknown model"):
        load("no-such-model", 0)
    with pytest.raises(UserError, match="configuration without weights"):
        load("llama-3.2-1b", 0)


def test_directory_without_model(tmp_path):
    with pytest.raises(UserError, match="not a model directory"):
        load(str(tmp_path), 0)


def test_local_directory_round_trip(tmp_path):
    tiny = load("tiny-llama", 3)
    tiny.model.save_pretrained(tmp_path)
    tiny.tokenizer.save_pretrained(tmp_path)
    again = load(str(tmp_path), 0)
    assert torch.equal(again.model.lm_head.weight, tiny.model.lm_head.weight)
    assert again.info["sha256"]


def test_quiet_loading_silences_transformers_bars_and_restores_them(tmp_path, monkeypatch):
    """load(progress=False) reads the weights with transformers' bars off (its logging
    switch, and the GGUF reader's own tqdm, deaf to that switch) and leaves both as it
    found them; progress=True leaves them on."""
    import transformers
    from transformers import modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging as hf_logging

    tiny = load("tiny-llama", 3)
    tiny.model.save_pretrained(tmp_path)
    tiny.tokenizer.save_pretrained(tmp_path)
    original, real, seen = gguf_utils.tqdm, transformers.AutoModelForCausalLM.from_pretrained, []

    def reading(*args, **kwargs):  # the bars as the weights are read
        seen.append((hf_logging.is_progress_bar_enabled(), gguf_utils.tqdm([]).disable))
        return real(*args, **kwargs)

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", reading)
    for progress in (True, False):
        load(str(tmp_path), 0, progress=progress)
        assert gguf_utils.tqdm is original and hf_logging.is_progress_bar_enabled()
    assert seen == [(True, False), (False, True)]
