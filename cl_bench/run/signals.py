"""Stopping a run on a signal, with one consistent record.

`kill`, `timeout`, schedulers and DeepSpeed's launcher stop a process with SIGTERM;
a terminal sends SIGINT. Both must end a run the same way: the stage in progress is
dropped, the record says "interrupted", and no process of the run outlives the
command that started it.

- `interrupt_on_signals()`, around a run in the process that trains (one process,
  or each rank): the first SIGINT or SIGTERM raises KeyboardInterrupt; later ones
  are ignored, so that a second signal (DeepSpeed's launcher sends SIGTERM to ranks
  that already have SIGINT) cannot cut the write of the record. Python drops an
  exception raised where it cannot propagate (a finaliser: `__del__`, which the
  garbage collector runs at any point); so the trainer also calls `Stop.check()`
  after every step and evaluation batch, and that swallowed KeyboardInterrupt is
  not printed as an "Exception ignored" traceback.
- `wait_forwarding(proc)`, in `cl-bench run --nproc N`, which started the launcher
  in its own process group: a SIGINT or SIGTERM is forwarded to that whole group
  (launcher and ranks), then this waits until every process of it has exited, so
  the record is final when the command returns. A second signal, or `grace`
  seconds, kills the group.
"""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@dataclass
class Stop:
    """The signals received while a run was guarded (empty: none). `settled`: the run's
    end is being said (a rank lost, cl_bench/cli.py): a signal is noted, not raised."""
    signals: list[int] = field(default_factory=list)
    settled: bool = False

    @property
    def fired(self) -> bool:
        return bool(self.signals)

    @property
    def names(self) -> str:
        return ", ".join(signal.Signals(s).name for s in self.signals)

    def check(self) -> None:
        """Raise the interrupt now if a signal came and its KeyboardInterrupt was
        swallowed (transformers' lazy imports catch it while a model loads)."""
        if self.fired:
            raise KeyboardInterrupt(self.names)


@contextlib.contextmanager
def interrupt_on_signals(stop: Stop | None = None) -> Iterator[Stop]:
    """SIGINT and SIGTERM raise KeyboardInterrupt once (see the module docstring),
    recorded in `stop` (a new one by default; pass the caller's to share it);
    outside the main thread, where Python cannot install handlers, nothing changes."""
    stop = Stop() if stop is None else stop
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return

    def handler(signum, frame):
        first = not stop.fired and not stop.settled
        stop.signals.append(signum)
        if first:
            raise KeyboardInterrupt(signal.Signals(signum).name)

    def unraisable(info):  # our interrupt, swallowed by a finaliser: stop.check() raises it again
        if not (stop.fired and isinstance(info.exc_value, KeyboardInterrupt)):
            previous_hook(info)

    previous_hook, sys.unraisablehook = sys.unraisablehook, unraisable
    try:
        with _handling(handler):
            yield stop
    finally:
        sys.unraisablehook = previous_hook


@contextlib.contextmanager
def _handling(handler) -> Iterator[None]:
    """`handler` for SIGINT and SIGTERM while inside; the previous handlers after."""
    previous = {s: signal.signal(s, handler) for s in STOP_SIGNALS}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def start_group(argv: list[str], env: dict[str, str]) -> subprocess.Popen:
    """Start `argv` as the leader of a new process group (its ranks join it)."""
    return subprocess.Popen(argv, env=env, start_new_session=True)


def wait_forwarding(proc: subprocess.Popen, grace: float = 60.0) -> tuple[int, Stop]:
    """Wait for `proc` (started by `start_group`), forwarding SIGINT and SIGTERM to its
    process group as SIGTERM (the second as SIGKILL); returns its exit code and the
    signals received. After a signal, also waits (up to `grace` seconds, then kills the
    group) until no process of the group is left."""
    stop = Stop()

    def forward(signum, frame):
        stop.signals.append(signum)
        _signal_group(proc.pid, signal.SIGTERM if len(stop.signals) == 1 else signal.SIGKILL)

    with _handling(forward):
        code = proc.wait()
        if stop.fired:
            _wait_group(proc.pid, grace)
    return code, stop


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _group_alive(pgid: int) -> bool:
    """Whether a process of group `pgid` is still running; on Linux, zombies (which
    only wait to be reaped) do not count."""
    if not os.path.isdir("/proc"):
        try:
            os.killpg(pgid, 0)
            return True
        except (ProcessLookupError, PermissionError):
            return False
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/stat") as f:
                    state, _, group = f.read().rsplit(")", 1)[1].split()[:3]  # after "pid (comm)"
            except (OSError, ValueError):
                continue
            if int(group) == pgid and state != "Z":
                return True
    return False


def _wait_group(pgid: int, grace: float) -> None:
    """Wait until group `pgid` is gone (orphaned ranks that exited are zombies of
    whoever adopted them, which _group_alive does not count); after `grace` seconds
    kill it, and give up 5 seconds later."""
    deadline, killed = time.monotonic() + grace, False
    while _group_alive(pgid):
        if time.monotonic() > deadline:
            if killed:
                break
            _signal_group(pgid, signal.SIGKILL)
            deadline, killed = time.monotonic() + 5, True
        time.sleep(0.1)
