"""Method registry: `@register_method`, lazy discovery, failure isolation.

Built-in methods are the modules of `cl_bench.methods`; outside packages add
theirs through the entry-point group `cl_bench.methods` (an entry point names a
module that registers on import, or a Method subclass). Nothing is imported
until it is needed, and a module that fails to import is remembered with its
error: `cl-bench list` shows it as broken, and only choosing it fails.
"""
from __future__ import annotations

import importlib
import logging
import pkgutil
import traceback
from dataclasses import dataclass
from importlib.metadata import entry_points

from cl_bench.errors import UserError, did_you_mean
from cl_bench.method import Method

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "cl_bench.methods"

_METHODS: dict[str, type] = {}  # name or alias -> Method subclass
_BROKEN: dict[str, str] = {}  # source (module or entry point) -> one-line error
_DISCOVERED = False


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


def _record_failure(source: str, exc: BaseException) -> None:
    last = traceback.format_exception_only(type(exc), exc)[-1].strip()
    _BROKEN[source] = last
    log.debug("method plugin %s failed to load: %s", source, last)


def _import_builtin(module_name: str) -> None:
    import cl_bench.methods as builtin

    module = f"{builtin.__name__}.{module_name}"
    if module in _BROKEN or not any(i.name == module_name for i in pkgutil.iter_modules(builtin.__path__)):
        return
    try:
        importlib.import_module(module)
    except Exception as exc:  # a broken plugin must never break the registry
        _record_failure(module, exc)


def discover() -> None:
    """Import built-in method modules and outside entry points, isolating failures."""
    global _DISCOVERED
    if _DISCOVERED:
        return
    _DISCOVERED = True
    import cl_bench.methods as builtin

    for info in pkgutil.iter_modules(builtin.__path__):
        _import_builtin(info.name)
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        try:
            obj = ep.load()
        except Exception as exc:
            _record_failure(f"entry point '{ep.name}' ({ep.value})", exc)
            continue
        if isinstance(obj, type) and obj not in _METHODS.values():
            try:
                register_method(ep.name)(obj)
            except (TypeError, ValueError) as exc:
                _record_failure(f"entry point '{ep.name}' ({ep.value})", exc)


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
