"""Given values into a config field's type: text from a flag (`--set train.epochs=2`,
`--method-arg lr=1e-4`) parsed, a YAML value checked, each with a one-line error
naming the field (cl_bench/config_fields.py holds the fields; cl_bench/config.py
and Method.parse_args use these)."""
from __future__ import annotations

import types
import typing
from typing import Any

import yaml

from cl_bench.errors import UserError


def parse_value(text: str, typ: Any, where: str) -> Any:
    """Turn a CLI string into `typ` (int, float, bool, str, Optional[...], list[str], dict)."""
    origin = typing.get_origin(typ)
    args = typing.get_args(typ)
    if origin in (typing.Union, types.UnionType):
        if text.lower() in ("none", "null") and type(None) in args:
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return parse_value(text, arg, where)
            except UserError as exc:
                errors.append(str(exc))
        raise UserError(errors[0] if errors else f"{where}: cannot parse {text!r}")
    if typ is bool:
        if text.lower() in ("1", "true", "yes", "on"):
            return True
        if text.lower() in ("0", "false", "no", "off"):
            return False
        raise UserError(f"{where}={text!r} is not a boolean; use true or false")
    if typ in (int, float):
        try:
            return typ(text)
        except ValueError:
            raise UserError(f"{where}={text!r} is not a valid {typ.__name__}") from None
    if typ is str or typ is Any:
        return text
    if origin in (list, tuple):
        value = yaml_value(text, where) if text.startswith("[") else text.split(",")
        if not isinstance(value, list):
            raise UserError(f"{where}={text!r} must be a list like [a, b]")
        return [parse_value(str(v), args[0], where) for v in value] if args else value
    if origin is dict:
        value = yaml_value(text, where)
        if not isinstance(value, dict):
            raise UserError(f"{where}={text!r} must be a mapping like {{key: value}}")
        return coerce(value, typ, where)  # each entry as the field's type says
    raise UserError(f"{where}: cannot parse a value of type {typ}")


def yaml_value(text: str, where: str) -> Any:
    """A flow-style YAML value of a flag ([1, 2], {a: 1}); safe_load: tags are refused."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        problem = getattr(exc, "problem", None) or type(exc).__name__
        raise UserError(f"{where}={text!r} is not a valid YAML value ({problem}); "
                        f"write a plain list like [1, 2] or mapping like {{key: 1}}") from None


def coerce(value: Any, typ: Any, where: str) -> Any:
    """Check a YAML value against a field type; strings are parsed as on the CLI."""
    if isinstance(value, str) and typ is not str:
        return parse_value(value, typ, where)
    origin = typing.get_origin(typ)
    args = typing.get_args(typ)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for arg in (a for a in args if a is not type(None)):
            try:
                return coerce(value, arg, where)
            except UserError:
                continue
        raise UserError(f"{where}={value!r} does not match the type {typ}")
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if typ in (int, float, bool, str) and not isinstance(value, typ) or (
            typ is int and isinstance(value, bool)):
        raise UserError(f"{where}={value!r} must be {'an' if typ is int else 'a'} {typ.__name__}")
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise UserError(f"{where}={value!r} must be a list")
        return [coerce(v, args[0], f"{where}[{i}]") for i, v in enumerate(value)] if args else list(value)
    if origin is dict:
        if not isinstance(value, dict):
            raise UserError(f"{where}={value!r} must be a mapping")
        if args:  # each entry as its field type says (`--set data.n_train_per_task.Py150=64` gives a string)
            return {k: coerce(v, args[1], f"{where}.{k}") for k, v in value.items()}
    return value
