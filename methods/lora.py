"""LoRA-SeqFT: one LoRA adapter trained through every task, base weights frozen.

Forward of each target projection (Hu et al., 2021, "LoRA"):
    h = W x + (alpha / r) · B A dropout(x),   A ∈ R^{r×d_in}, B ∈ R^{d_out×r}
with W frozen, A Kaiming-uniform(a=√5) and B zero at the start (peft's default
init, so the model starts as the pretrained one). The same adapter and its
AdamW moments continue from task to task, never reset (TRACE's LoRA baseline:
main.py with peft, r 8, alpha 32, dropout 0.1, q_proj+v_proj, lr 1e-4).

The adapter is built by peft (`get_peft_model` + `LoraConfig`), which injects
its LoRA layers into the model in place. `self.model` is that injected model
(`PeftModel.get_base_model()`), not the `PeftModel` wrapper: the wrapper's
forward hides the model's own signature (the harness's decoder reads it to find
the KV-cache argument, `cache` in transformers 5) and would route through
deprecated `past_key_values` aliases. The weights and the computation are the
same either way; the state dict keys are the model's own plus `base_layer` and
`lora_A/B.default`.

Differences from TRACE: none in the update rule. TRACE trains under DeepSpeed
in bf16 with an effective batch of 32-64; here batch size, precision and
epochs come from the run's profile.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from cl_bench.errors import UserError
from cl_bench.method import Method, MethodArgs
from cl_bench.registry import register_method


@dataclass
class LoRAArgs(MethodArgs):
    lr: float = 1e-4  # TRACE's LoRA script
    r: int = 8  # adapter rank
    alpha: int = 32  # scale alpha / r = 4
    dropout: float = 0.1  # on the adapter's input only
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "v_proj"])


def add_lora(model: nn.Module, args: LoRAArgs) -> nn.Module:
    """Inject one peft LoRA adapter ("default") into `model` in place; only the
    adapter stays trainable. Returns the same model object."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=args.r, lora_alpha=args.alpha, lora_dropout=args.dropout,
                        target_modules=list(args.target_modules), bias="none")
    try:
        return get_peft_model(model, config).get_base_model()
    except ValueError as exc:  # peft: "Target modules {...} not found in the base model ..."
        raise UserError(f"LoRA: {exc}; set method_args.target_modules to the model's "
                        f"projection names") from None


def adapter_size(model: nn.Module) -> int:
    return sum(p.numel() for n, p in model.named_parameters() if ".lora_" in n)


@register_method("lora")
class LoRA(Method):
    description = "LoRA-SeqFT: one peft LoRA adapter (q/v, r 8) trained through all tasks, base frozen"
    lr_family = "adapter"
    Args = LoRAArgs

    def setup(self, model: nn.Module) -> None:
        self.model = add_lora(model, self.args)

    def param_report(self) -> dict:
        total = sum(p.numel() for p in self.model.parameters())
        adapter = adapter_size(self.model)
        return {"total": total,
                "trainable": sum(p.numel() for p in self.model.parameters() if p.requires_grad),
                # unmerged at inference: every base weight and the adapter touch each token
                "active_per_token": total,
                # deployed merged: W + (alpha/r)·B A folds into W, so the adapter adds nothing
                "deployed": total - adapter,
                "experts_per_layer": None}
