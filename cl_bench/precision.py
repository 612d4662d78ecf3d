"""Numeric precision of training and evaluation: `fp32`, `bf16` or `auto`.

bf16 means `torch.autocast(device, dtype=torch.bfloat16)` around the forward
passes: matrix products and attention run in bf16, while the weights, their
gradients and the optimiser state stay fp32 (fp32 master weights; no loss
scaling is needed, since bf16 has fp32's exponent range). fp32 runs no autocast
at all, so an fp32 run is bit-identical to one made before this setting existed.

`auto` picks bf16 where the device multiplies bf16 matrices natively (CUDA
devices that report bf16 support; CPUs with AVX-512 BF16 or AMX), else fp32.
`cl-bench perf precision` measures the speed and the agreement of the two.
"""
from __future__ import annotations

import contextlib

import torch

CHOICES = ("auto", "fp32", "bf16")


def native_bf16(device: torch.device) -> bool:
    """Whether `device` multiplies bf16 matrices in hardware."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type == "cpu":
        cpu = torch.cpu
        return any(getattr(cpu, name, lambda: False)()
                   for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"))
    return False


def resolve(choice: str, device: torch.device) -> str:
    """`auto` -> 'bf16' or 'fp32' for this device; 'fp32' and 'bf16' as given."""
    if choice == "auto":
        return "bf16" if native_bf16(device) else "fp32"
    return choice


def autocast(precision: str, device: torch.device):
    """The context a forward pass runs in: bf16 autocast, or nothing for fp32."""
    if precision == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()
