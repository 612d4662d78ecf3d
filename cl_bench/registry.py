"""Method and benchmark registry: `@register_method`, `register_benchmark`, lazy
discovery, failure isolation.

Built-in methods are the modules of `cl_bench.methods`; outside packages add
theirs through the entry-point group `cl_bench.methods` (an entry point names a
module that registers on import, or a Method subclass). Nothing is imported
until it is needed, and a module that fails to import is remembered with its
error: `cl-bench list` shows it as broken, and only choosing it fails.

Benchmarks alike: the built-in ones are the modules of `cl_bench.benchmarks`
(TRACE, the default, and long-sequence), outside ones come through the group
`cl_bench.benchmarks` (a module that registers on import, or a Benchmark), and a
folder holding benchmark.yaml is a benchmark too (cl_bench/benchmarks/folder.py).
"""
from __future__ import annotations

import importlib
import logging
import pkgutil
import traceback
from dataclasses import dataclass
from importlib.metadata import entry_points
from pathlib import Path

from cl_bench.benchmark import DEFAULT as DEFAULT_BENCHMARK
from cl_bench.benchmark import Benchmark
from cl_bench.errors import UserError, did_you_mean
from cl_bench.method import Method

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "cl_bench.methods"
BENCHMARK_GROUP = "cl_bench.benchmarks"

_METHODS: dict[str, type] = {}  # name or alias -> Method subclass
_BROKEN: dict[str, str] = {}  # source (module or entry point) -> one-line error
_DISCOVERED = False
_BENCHMARKS: dict[str, Benchmark] = {}
_BENCHMARKS_BROKEN: dict[str, str] = {}
_BENCHMARKS_DISCOVERED = False


@dataclass(frozen=True)
class Broken:
    source: str
    error: str


def register_method(name: str, *, aliases: tuple[str, ...] = ()):
    """Class decorator: register a Method subclass under `name` (and aliases)."""
    def wrap(cls: type) -> type:
        if not (isinstance(cls, type) and issubclass(cls, Method)):
            raise TypeError(f"@register_method('{name}') must decorate a Method subclass, got {cls!r}")
        for key in (name, *aliases):
            if key != key.lower() or not key:
                raise ValueError(f"method name '{key}' must be non-empty lower-case")
            if key in _METHODS and _METHODS[key] is not cls:
                raise ValueError(
                    f"method name '{key}' is already registered by "
                    f"{_METHODS[key].__module__}.{_METHODS[key].__qualname__}")
            _METHODS[key] = cls
        cls.name = name
        cls.aliases = tuple(aliases)
        return cls

    return wrap


def _record_failure(source: str, exc: BaseException, broken: dict[str, str] = _BROKEN) -> None:
    last = traceback.format_exception_only(type(exc), exc)[-1].strip()
    broken[source] = last
    log.debug("plugin %s failed to load: %s", source, last)


def _import_builtin(module_name: str, package: str = "cl_bench.methods", broken: dict[str, str] = _BROKEN) -> None:
    builtin = importlib.import_module(package)
    module = f"{builtin.__name__}.{module_name}"
    if module in broken or not any(i.name == module_name for i in pkgutil.iter_modules(builtin.__path__)):
        return
    try:
        importlib.import_module(module)
    except Exception as exc:  # a broken plugin must never break the registry
        _record_failure(module, exc, broken)


def _discover(package: str, group: str, broken: dict[str, str], register) -> None:
    """Import the modules of `package` and load the entry points of `group`; what an
    entry point names, unless importing it registered it, goes to `register(name, obj)`."""
    for info in pkgutil.iter_modules(importlib.import_module(package).__path__):
        _import_builtin(info.name, package, broken)
    for ep in entry_points(group=group):
        source = f"entry point '{ep.name}' ({ep.value})"
        try:
            register(ep.name, ep.load())
        except Exception as exc:  # a broken plugin must never break the registry
            _record_failure(source, exc, broken)


def discover() -> None:
    """Import built-in method modules and outside entry points, isolating failures."""
    global _DISCOVERED
    if _DISCOVERED:
        return
    _DISCOVERED = True

    def register(name: str, obj) -> None:
        if isinstance(obj, type) and obj not in _METHODS.values():
            register_method(name)(obj)

    _discover("cl_bench.methods", ENTRY_POINT_GROUP, _BROKEN, register)


def available() -> dict[str, type]:
    """Registered methods by primary name (aliases folded in)."""
    discover()
    return {cls.name: cls for cls in _METHODS.values()}


def broken() -> list[Broken]:
    discover()
    return [Broken(source, error) for source, error in sorted(_BROKEN.items())]


def baseline() -> str:
    """The name of the method that declares `Method.baseline` (the default method of
    a run, the row the leaderboard marks the others against)."""
    found = sorted(name for name, cls in available().items() if cls.baseline)
    if len(found) != 1:
        raise UserError(f"exactly one method must declare baseline = True; found {found or 'none'}")
    return found[0]


def get(name: str) -> type:
    """The Method class registered as `name`; an unknown name lists close matches."""
    if name in _METHODS:
        return _METHODS[name]
    _import_builtin(name.replace("-", "_"))  # the usual case: only the chosen module loads
    if name in _METHODS:
        return _METHODS[name]
    discover()
    if name in _METHODS:
        return _METHODS[name]
    failed = [b for b in broken() if name in b.source.rsplit(".", 1)[-1] or f"'{name}'" in b.source]
    if failed:
        raise UserError(f"method '{name}' failed to load: {failed[0].source}: {failed[0].error}; "
                        f"fix the plugin or choose another method")
    names = sorted(_METHODS)
    raise UserError(f"unknown method '{name}'; {did_you_mean(name, names)}available: {', '.join(names)}")


# ---- benchmarks ----

def register_benchmark(benchmark: Benchmark) -> Benchmark:
    """Register `benchmark` under its name (`--benchmark NAME`)."""
    if not isinstance(benchmark, Benchmark):
        raise TypeError(f"register_benchmark takes a cl_bench.benchmark.Benchmark, got {benchmark!r}")
    name = benchmark.name
    if not name or name != name.lower():
        raise ValueError(f"benchmark name '{name}' must be non-empty lower-case")
    if _BENCHMARKS.get(name, benchmark) is not benchmark:
        raise ValueError(f"benchmark name '{name}' is already registered")
    _BENCHMARKS[name] = benchmark
    return benchmark


def discover_benchmarks() -> None:
    """Import the built-in benchmarks and outside entry points, isolating failures."""
    global _BENCHMARKS_DISCOVERED
    if _BENCHMARKS_DISCOVERED:
        return
    _BENCHMARKS_DISCOVERED = True

    def register(name: str, obj) -> None:
        if isinstance(obj, Benchmark) and obj not in _BENCHMARKS.values():
            register_benchmark(obj)

    _discover("cl_bench.benchmarks", BENCHMARK_GROUP, _BENCHMARKS_BROKEN, register)


def benchmarks() -> dict[str, Benchmark]:
    """Registered benchmarks by name."""
    discover_benchmarks()
    return dict(sorted(_BENCHMARKS.items()))


def broken_benchmarks() -> list[Broken]:
    discover_benchmarks()
    return [Broken(source, error) for source, error in sorted(_BENCHMARKS_BROKEN.items())]


def get_benchmark(name: str | None) -> Benchmark:
    """The benchmark registered as `name` (None: the default), or the one a folder
    holding benchmark.yaml declares; an unknown name lists close matches."""
    name = name or DEFAULT_BENCHMARK
    if name not in _BENCHMARKS:
        _import_builtin(name.replace("-", "_"), "cl_bench.benchmarks", _BENCHMARKS_BROKEN)
    if name not in _BENCHMARKS and not Path(name).expanduser().is_dir():
        discover_benchmarks()
    if name in _BENCHMARKS:
        return _BENCHMARKS[name]
    if Path(name).expanduser().is_dir():
        from cl_bench.benchmarks.folder import from_folder

        return from_folder(Path(name).expanduser())
    failed = [b for b in broken_benchmarks() if f"'{name}'" in b.source or b.source.endswith(name.replace("-", "_"))]
    if failed:
        raise UserError(f"benchmark '{name}' failed to load: {failed[0].source}: {failed[0].error}; "
                        f"fix the plugin or choose another benchmark")
    names = sorted(_BENCHMARKS)
    raise UserError(f"unknown benchmark '{name}'; {did_you_mean(name, names)}available: {', '.join(names)}, "
                    f"or a folder holding benchmark.yaml")
