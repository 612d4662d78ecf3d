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
import contextvars
import logging

import torch
from torch import nn

CHOICES = ("auto", "fp32", "bf16")
log = logging.getLogger(__name__)


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
    """`auto` -> 'bf16' or 'fp32' for this device; 'fp32' and 'bf16' as given.
    Warns once where the choice makes a CPU run slow or unlike the committed
    bf16 records (see `_warn_once`)."""
    if choice == "fp32":
        return choice
    native = native_bf16(device)
    if device.type == "cpu" and not native:
        _warn_once(choice)
    if choice == "auto":
        return "bf16" if native else "fp32"
    return choice


_WARNED: set[str] = set()


def _warn_once(choice: str) -> None:
    """On a CPU without AVX-512 BF16 or AMX, `auto` runs fp32: about half the speed of
    bf16 on one that has them, and scores that differ from bf16 runs (compare refuses the
    pair, the leaderboard keeps them in separate rows). An explicit bf16 there is emulated:
    a 1408x576 @ 576x2048 product ran at 0.2 GFLOP/s in bf16 against 22.5 in fp32 on an
    AVX2-only EPYC, one thread (a one-off timing, not a committed record)."""
    if choice in _WARNED:
        return
    _WARNED.add(choice)
    if choice == "auto":
        log.warning("precision auto -> fp32: this CPU has no native bf16 (AVX-512 BF16 or AMX); the run is "
                    "slower than on one that has, and its scores are not comparable with bf16 runs")
    else:
        log.warning("precision bf16 on a CPU without native bf16 (AVX-512 BF16 or AMX): emulated, far slower "
                    "than fp32; set train.precision=fp32 and eval.precision=fp32 (or auto)")


def autocast(precision: str, device: torch.device):
    """The context a forward pass runs in: bf16 autocast, or nothing for fp32."""
    if precision == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


# the casts of one `evaluation` block: id(tensor) -> (tensor, its _version then, its bf16 copy);
# the entry holds the tensor, so its id cannot be reused while the block lasts
_CASTS: contextvars.ContextVar[dict | None] = contextvars.ContextVar("cl_bench_eval_casts", default=None)


@contextlib.contextmanager
def evaluation(precision: str, device: torch.device, model: nn.Module):
    """The context an evaluation runs in: `autocast(precision, device)`, and in bf16
    each weight cast to bf16 once for the whole block instead of at every forward.

    Autocast keeps its bf16 copy of a weight only for leaf, non-view tensors that
    require grad. Frozen weights (a LoRA base; an upcycled model's attention, dense
    MLPs and old experts) and slices of stacked parameters (the MoE experts) would be
    cast again at every prefill and every decoded token. Inside this block, where
    generation takes no gradient, the frozen fp32 parameters require grad, so autocast
    caches their casts, and `cast_once` gives code that slices a stacked parameter one
    cached copy of it. Both are autocast's own casts (`Tensor.to`), so the outputs are
    bit-identical; the cost is a bf16 copy of the weights while the block lasts.
    Everything is restored on the way out, also on an error."""
    if precision != "bf16":
        with autocast(precision, device):
            yield
        return
    frozen = [p for p in model.parameters() if not p.requires_grad and p.dtype == torch.float32]
    token = _CASTS.set({})
    try:
        for p in frozen:
            p.requires_grad_(True)
        with autocast(precision, device):
            yield
    finally:
        for p in frozen:
            p.requires_grad_(False)
        _CASTS.reset(token)


def cast_once(t: torch.Tensor) -> torch.Tensor:
    """`t` cast as autocast would cast it for a matrix product, once per `evaluation`
    block (again if `t` changed in place); `t` itself outside such a block, while
    autograd records, for a tensor that is not fp32, or where autocast is off."""
    cache = _CASTS.get()
    if (cache is None or torch.is_grad_enabled() or t.dtype != torch.float32
            or not torch.is_autocast_enabled(t.device.type)):
        return t
    hit = cache.get(id(t))
    if hit is None or hit[1] != t._version:
        hit = cache[id(t)] = (t, t._version, t.to(torch.get_autocast_dtype(t.device.type)))
    return hit[2]
