"""Progress of a stage's training and evaluation: a tqdm bar on a terminal, or, with
bars off (`cl-bench run --no-progress`, as `cl-bench campaign` runs each run, its
output going to a log file), a log line at most every EVERY_S seconds:

    stage 2/3 [Py150] train: 45/96 step (47%), 31.2 s/step, ~26 min left; loss=1.234

The rate is over the steps this process has taken (a resumed stage's earlier steps
are counted as done, not as fast). The last update logs nothing: the stage's own
"done in" line follows. Off the main rank nothing is shown or logged.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable

from tqdm import tqdm

log = logging.getLogger(__name__)

EVERY_S = 180.0


class LoggedProgress:
    """The part of tqdm's interface the sequencer uses, as log lines."""

    def __init__(self, total: int, desc: str, unit: str, initial: int = 0, every_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.total, self.desc, self.unit, self.n = total, desc, unit, initial
        self.every_s, self.clock = EVERY_S if every_s is None else every_s, clock
        self.start_n, self.start_t = initial, clock()
        self.last_t, self.postfix = self.start_t, ""

    def set_postfix(self, values: dict[str, Any]) -> None:
        self.postfix = ", ".join(f"{k}={v}" for k, v in values.items())

    def update(self, n: int = 1) -> None:
        self.n += n
        now = self.clock()
        if self.n >= self.total or now - self.last_t < self.every_s:
            return
        self.last_t = now
        per = (now - self.start_t) / max(self.n - self.start_n, 1)
        left = (self.total - self.n) * per
        log.info("%s: %d/%d %s (%d%%), %.1f s/%s, ~%s left%s", self.desc, self.n, self.total, self.unit,
                 100 * self.n // max(self.total, 1), per, self.unit, _duration(left),
                 f"; {self.postfix}" if self.postfix else "")

    def __enter__(self) -> "LoggedProgress":
        return self

    def __exit__(self, *exc) -> None:
        return None


def _duration(seconds: float) -> str:
    return f"{seconds / 3600:.1f} h" if seconds >= 5400 else f"{seconds / 60:.0f} min"


def bar(total: int, desc: str, unit: str, show: bool, main: bool, initial: int = 0, leave: bool = True):
    """A tqdm bar (`show`), log lines (bars off, on the main rank) or nothing."""
    if show or not main:
        return tqdm(total=total, initial=initial, desc=desc, unit=unit, disable=not show, leave=leave)
    return LoggedProgress(total, desc, unit, initial)
