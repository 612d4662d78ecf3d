"""Per-step training metrics to TensorBoard or Weights & Biases, beside metrics.jsonl.

    logger = make_logger(kind, run_dir, config_dict, is_main)   # once per run
    logger.log(step, {"lm": 2.31, "grad_norm": 0.8, ...})       # once per optimiser step
    logger.close()                                               # at the end, also on error

How it is meant to be called (the sequencer does not call it yet): build it once
per run after the run folder exists, with `kind` from the config (none |
tensorboard | wandb), `config_dict` the run's recorded config and `is_main` the
backend's (rank 0); call `log` from the same place the JSONL metrics line is
written (the sequencer's `on_step`), once per optimiser step, with the logged
loss parts of that step (what `Method.loss` returned, grad_norm, ... and the
stage index if wanted); and `close` it in a `finally`. `step` must grow through
the run (stages included, e.g. the number of step rows logged so far), since
both backends plot against it; per-stage step numbers that restart at 0 would
overlap. Values must be finite numbers (the sequencer stops a diverged run
before it would log one).

Backends (libraries imported only when chosen; a missing one is a UserError
naming the extra to install):
- "none": a no-op.
- "tensorboard": `torch.utils.tensorboard.SummaryWriter` (needs the tensorboard
  package), else tensorboardX's, writing event files under <run_dir>/tensorboard/;
  one scalar per metric name. A resumed run appends a new event file there.
- "wandb": `wandb.init(mode="offline" unless WANDB_MODE is set, dir=run_dir,
  config=config_dict, name=<run dir's name>, project=WANDB_PROJECT or "cl-bench")`
  (console capture off, quiet), then `run.log(metrics, step=step)`; offline runs
  land in <run_dir>/wandb/ and upload later with `wandb sync`. A resumed run is a
  new W&B run.
Only rank 0 logs: `is_main=False` always gets the no-op logger, whatever `kind`.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Protocol

from cl_bench.errors import UserError, did_you_mean

KINDS = ("none", "tensorboard", "wandb")


class MetricLogger(Protocol):
    def log(self, step: int, metrics: dict[str, float]) -> None: ...

    def close(self) -> None: ...


class NullLogger:
    """Logs nothing ("none", and every rank but 0)."""

    def log(self, step: int, metrics: dict[str, float]) -> None:
        pass

    def close(self) -> None:
        pass


class TensorBoardLogger:
    """One scalar per metric name, event files under <run_dir>/tensorboard/."""

    def __init__(self, run_dir: Path):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:  # torch's writer needs the tensorboard package; tensorboardX has its own
            try:
                from tensorboardX import SummaryWriter
            except ImportError:
                raise UserError("the tensorboard metric logger needs the tensorboard package: "
                                "pip install 'cl-bench[tensorboard]'") from None
        self.log_dir = Path(run_dir) / "tensorboard"
        self.writer = SummaryWriter(log_dir=str(self.log_dir))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for name, value in metrics.items():
            self.writer.add_scalar(name, value, global_step=step)

    def close(self) -> None:
        self.writer.close()


class WandbLogger:
    """A W&B run, offline unless WANDB_MODE says otherwise, kept under run_dir."""

    def __init__(self, run_dir: Path, config: dict[str, Any]):
        try:
            import wandb
        except ImportError:
            raise UserError("the wandb metric logger needs the wandb package: "
                            "pip install 'cl-bench[wandb]'") from None
        self._wandb = wandb
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        # console="off": the harness's own output (progress bars, the one-line errors)
        # stays the terminal's; W&B records metrics and config only.
        self.run = wandb.init(mode=os.environ.get("WANDB_MODE", "offline"), dir=str(run_dir),
                              config=config, name=run_dir.name,
                              project=os.environ.get("WANDB_PROJECT", "cl-bench"),
                              settings=wandb.Settings(console="off", silent=True))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(dict(metrics), step=step)

    def close(self) -> None:
        self.run.finish()
        # finish() can return before W&B's service has written the run's log (offline,
        # seen with wandb 0.31); shutting the service down waits for it.
        self._wandb.teardown()


def make_logger(kind: str, run_dir: Path, config_dict: dict[str, Any], is_main: bool) -> MetricLogger:
    """The logger of `kind` (KINDS) for the run in `run_dir`; the no-op one off rank 0."""
    if kind not in KINDS:
        raise UserError(f"unknown metric logger '{kind}'; {did_you_mean(kind, KINDS)}"
                        f"choose from {', '.join(KINDS)}")
    if not is_main or kind == "none":
        return NullLogger()
    if kind == "tensorboard":
        return TensorBoardLogger(run_dir)
    return WandbLogger(run_dir, config_dict)
