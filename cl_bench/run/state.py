"""What one run holds while it goes (Run): made by cl_bench/run/prepare.py, run by
the stage loop (cl_bench/run/sequencer.py), saved and restored by
cl_bench/run/checkpoint.py and cl_bench/run/resume.py. Its record and predictions
go to the run folder through Run.write_files (cl_bench/record/io.py)."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from cl_bench.backends import Backend
from cl_bench.config import RunConfig
from cl_bench.data.encode import Encoder
from cl_bench.data.replay import ReplayBuffer
from cl_bench.eval.general.lima import LimaProbe
from cl_bench.eval.general.lm_eval_tasks import GeneralTasks
from cl_bench.eval.probes.representation import RepresentationProbe
from cl_bench.eval.probes.routing import RoutingProbe
from cl_bench.method import Method, Stage
from cl_bench.record import io as results
from cl_bench.record.schema import RunRecord


@dataclass
class Run:
    """Everything one run holds while it goes."""

    config: RunConfig
    run_dir: Path
    method: Method
    tasks: list
    stages: list[Stage]
    encoder: Encoder
    backend: Backend
    record: RunRecord
    replay: ReplayBuffer
    replay_sources: dict[str, list]  # task name -> examples the buffer may hold
    predictions: list[dict] = field(default_factory=list)
    optimizer: torch.optim.Optimizer | None = None
    progress: bool = True
    probe: RepresentationProbe | None = None  # eval.cka_probe > 0
    routing: RoutingProbe | None = None  # eval.routing_probe > 0
    lima: LimaProbe | None = None  # general.lima > 0
    general_tasks: GeneralTasks | None = None  # general.tasks (lm-eval)
    lock: Any = None  # rank 0: the run folder's lock (results.lock_run), held until execute ends
    metrics: Any = None  # the per-step metric logger (cl_bench/run/metric_log.py), while execute runs
    global_step: int = 0  # optimiser steps so far over the whole run (the metric logger's x axis)

    @property
    def cache_dir(self) -> Path | None:
        """Tokenised splits, shared by the runs of one output folder; written by rank 0
        only (the others tokenise in memory)."""
        return self.run_dir.parent / ".cache" if self.backend.is_main else None

    def write_files(self) -> None:
        """The record and the predictions, on rank 0 (results.write_run)."""
        if self.backend.is_main:
            results.write_run(self.run_dir, self.record, self.predictions)
