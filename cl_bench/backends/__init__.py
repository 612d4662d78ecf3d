"""Training backends behind one interface: `train_stage(method, optimizer, stage, epochs,
pad_id, on_step, replay_rows, start_step) -> replay examples used`, each running the one
loop of loop.py, plus what base.Backend adds (rank, writes on rank 0 only, sharded
generation).

torch: one process (torch_backend.py). deepspeed: ZeRO-2/3 over N ranks
(deepspeed_backend.py); `import deepspeed` happens only when it is chosen.
"""
from __future__ import annotations

import torch

from cl_bench.backends.base import Backend, check_support
from cl_bench.config import RunConfig

__all__ = ["Backend", "check_support", "create"]


def create(config: RunConfig) -> Backend:
    if config.backend == "deepspeed":
        from cl_bench.backends.deepspeed_backend import DeepSpeedBackend

        return DeepSpeedBackend(config)
    from cl_bench.backends.torch_backend import TorchBackend

    return TorchBackend(config, torch.device("cuda" if torch.cuda.is_available() else "cpu"))
