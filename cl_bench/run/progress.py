"""Progress of a stage's training and evaluation: a tqdm bar on a terminal, or, with
bars off (`cl-bench run --no-progress`, as `cl-bench campaign` runs each run, its
output going to a log file), a log line at most every EVERY_S seconds:

    stage 2/3 [Py150] train: 45/96 step (47%), 31.2 s/step, ~26 min left; loss=1.234

A terminal that reports a width of 0 columns (some CI consoles and emulators) cannot
draw a bar: there the same lines are logged, at most every NARROW_S seconds.

The rate is over the steps this process has taken (a resumed stage's earlier steps
are counted as done, not as fast). The last update logs nothing: the stage's own
"done in" line follows. Off the main rank nothing is shown or logged.

Evaluation counts items when a batch of them is scored, and a batch of long prompts
can take minutes on a CPU; `decoding` shows where the batch in progress stands, from
the model's forward calls (prompt, then each new token), at most every TICK_S seconds:

    zero-shot eval:   0%|          | 0/385 [00:41<?, ?ex/s, MeetingBank: token 12/64]
"""
from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from collections.abc import Iterator
from typing import Any, Callable

from tqdm import tqdm

log = logging.getLogger(__name__)

EVERY_S = 180.0
NARROW_S = 10.0  # a terminal without width: plain lines, soon enough to see the run move
TICK_S = 0.5


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

    def set_postfix_str(self, text: str) -> None:
        """Where the unit in progress stands (`decoding`); logged once the interval has passed."""
        self.postfix = text
        self.update(0)

    def update(self, n: int = 1) -> None:
        self.n += n
        now = self.clock()
        if self.n >= self.total or now - self.last_t < self.every_s:
            return
        self.last_t = now
        if self.n == self.start_n:  # none done here yet (`decoding`'s first batch): no rate to give
            log.info("%s: %d/%d %s, %s in%s", self.desc, self.n, self.total, self.unit,
                     _duration(now - self.start_t), f"; {self.postfix}" if self.postfix else "")
            return
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
    """A tqdm bar (`show`), log lines (bars off, on the main rank; a terminal without
    width) or nothing."""
    if show and main and not _has_width():
        return LoggedProgress(total, desc, unit, initial, every_s=NARROW_S)
    if show or not main:
        return tqdm(total=total, initial=initial, desc=desc, unit=unit, disable=not show, leave=leave)
    return LoggedProgress(total, desc, unit, initial)


def _has_width() -> bool:
    """False where stderr (tqdm's stream) is a terminal that reports 0 columns."""
    try:
        return os.get_terminal_size(sys.stderr.fileno()).columns > 0
    except (OSError, ValueError, AttributeError):  # not a terminal (a pipe, a file): tqdm's own way
        return True


@contextlib.contextmanager
def decoding(model, bar) -> Iterator[Callable[[str, int], None]]:
    """Within-batch progress of generation on `bar`: a forward pre-hook on `model` counts
    its calls (one over the prompts, then one per new token: cl_bench/eval/generation.py),
    and pre-hooks on the layers of its longest ModuleList (the decoder layers) say which
    layer the call over the prompts is in (on a CPU it alone can take minutes); the
    bar's postfix is set at most every TICK_S seconds. Yields `task(name,
    max_new_tokens)`, to call before each task's generation."""
    from torch import nn

    state = {"task": "", "budget": 0, "token": 0, "shown": 0.0}
    layers = max((m for m in model.modules() if isinstance(m, nn.ModuleList)), key=len, default=[])

    def task(name: str, budget: int) -> None:
        state.update(task=name, budget=budget, token=0)

    def show(where: str) -> None:
        now = time.monotonic()
        if now - state["shown"] >= TICK_S:
            state["shown"] = now
            bar.set_postfix_str(f"{state['task']}: {where}")

    def on_call(module, args, kwargs) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:
            return
        state["token"] = 0 if ids.shape[-1] > 1 else state["token"] + 1  # (B, L): the prompts; (B, 1): a token
        # the call over the prompts yields token 1; decoding call k, token k + 1
        show("reading the prompts" if state["token"] == 0 else f"token {state['token'] + 1}/{state['budget']}")

    def on_layer(index: int):
        def hook(module, args) -> None:
            if state["token"] == 0:
                show(f"reading the prompts, layer {index + 1}/{len(layers)}")
        return hook

    handles = [model.register_forward_pre_hook(on_call, with_kwargs=True)]
    handles += [layer.register_forward_pre_hook(on_layer(i)) for i, layer in enumerate(layers)]
    try:
        yield task
    finally:
        for handle in handles:
            handle.remove()
