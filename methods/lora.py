"""LoRA-SeqFT: one LoRA adapter trained through every task, base weights frozen.

Forward of each target projection (Hu et al., 2021, "LoRA"):
    h = W x + (alpha / r) · B A dropout(x),   A ∈ R^{r×d_in}, B ∈ R^{d_out×r}
with W frozen, A Kaiming-uniform(a=√5) and B zero at the start (peft's default
init, so the model starts as the pretrained one). The same adapter and its
AdamW moments continue from task to task, never reset (TRACE's LoRA baseline:
main.py with peft, r 8, alpha 32, dropout 0.1, q_proj+v_proj, lr 1e-4).

The adapter is built by peft (`get_peft_model` + `LoraConfig`, through
`cl_bench.models.lora_adapters.inject_lora`, which ogd shares), which injects
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

from dataclasses import dataclass

from torch import nn

from cl_bench.method import Method, MethodArgs
from cl_bench.models.lora_adapters import LoRAAdapterArgs, inject_lora, merged_adapter_report
from cl_bench.registry import register_method


@dataclass
class LoRAArgs(LoRAAdapterArgs, MethodArgs):
    lr: float = 1e-4  # TRACE's LoRA script


@register_method("lora")
class LoRA(Method):
    description = "LoRA-SeqFT: one peft LoRA adapter (q/v, r 8) trained through all tasks, base frozen"
    lr_family = "adapter"
    Args = LoRAArgs

    def setup(self, model: nn.Module) -> None:
        self.model = inject_lora(model, self.args)

    def param_report(self) -> dict:
        return merged_adapter_report(self.model)
