"""LoRA adapters that methods compose: their shape arguments, peft injection, which
parameters are the adapter, and the parameter report of an adapter that merges
into its base weights.

    h = W x + (alpha / r) · B A dropout(x),   A ∈ R^{r×d_in}, B ∈ R^{d_out×r}

- `LoRAAdapterArgs`: the adapter's fields (r, alpha, dropout, target_modules), a
  dataclass a method's Args lists before `MethodArgs`
  (`class Args(LoRAAdapterArgs, MethodArgs)`), so the fields come after the
  common ones as `lr, weight_decay, beta1, beta2, r, alpha, dropout,
  target_modules`.
- `inject_lora`: one peft adapter ("default") injected in place, only it trainable
  (lora, ogd).
- `lora_parameters`: the adapter's parameters in the model's own order, found by
  name (".lora_" in peft's `lora_A/B.default` and in any wrapper naming its
  factors `lora_A`/`lora_B`, as O-LoRA's does).
- `merged_adapter_report`: the param_report of a model carrying such adapters
  unmerged (every weight touches each token) but deployable merged
  (W + s·B A folds into W, so the adapters add nothing deployed).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import nn

from cl_bench.errors import UserError


@dataclass
class LoRAAdapterArgs:
    """The adapter's shape; a method's Args adds it before MethodArgs (module docstring)."""

    r: int = 8  # adapter rank
    alpha: int = 32  # scale alpha / r = 4
    dropout: float = 0.1  # on the adapter's input only
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "v_proj"])


def inject_lora(model: nn.Module, args: LoRAAdapterArgs) -> nn.Module:
    """Inject one peft LoRA adapter ("default") into `model` in place; only the
    adapter stays trainable. Returns the injected model (`PeftModel.get_base_model()`,
    the same object as `model`), not peft's wrapper."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=args.r, lora_alpha=args.alpha, lora_dropout=args.dropout,
                        target_modules=list(args.target_modules), bias="none")
    try:
        return get_peft_model(model, config).get_base_model()
    except ValueError as exc:  # peft: "Target modules {...} not found in the base model ..."
        raise UserError(f"LoRA: {exc}; set method_args.target_modules to the model's "
                        f"projection names") from None


def lora_parameters(model: nn.Module) -> list[nn.Parameter]:
    """Every LoRA factor of `model` (".lora_" in its name), in named_parameters order."""
    return [p for n, p in model.named_parameters() if ".lora_" in n]


def merged_adapter_report(model: nn.Module) -> dict[str, Any]:
    """param_report of `model` with its LoRA factors (`lora_parameters`) unmerged at
    inference and merged into the base weights when deployed."""
    total = sum(p.numel() for p in model.parameters())
    adapters = sum(p.numel() for p in lora_parameters(model))
    return {"total": total,
            "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad),
            # unmerged at inference: every base weight and the adapters touch each token
            "active_per_token": total,
            # deployed merged: W + s·B A folds into W, so the adapters add nothing
            "deployed": total - adapters,
            "experts_per_layer": None}
