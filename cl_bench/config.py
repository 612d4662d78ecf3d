"""Run configuration: the merge order profile defaults (cl_bench/profiles.py) <-
YAML file (--config) <- CLI flags, validated into a RunConfig.

The resolved config is validated once here and recorded whole in the run record;
later code reads the dataclasses, never raw dicts. The fields themselves are in
cl_bench/config_fields.py, the parsing of given values in cl_bench/config_values.py
and the tuned file (`--tuned`) in cl_bench/config_tuned.py; their names are
re-exported here, so `from cl_bench.config import RunConfig, resolve` serves callers.
Modules below the registry (method.py, data/) import config_fields instead: this
module imports the registry, for the default method (registry.baseline()).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from cl_bench import config_tuned, registry
from cl_bench.config_fields import (DataConfig, DeepSpeedConfig, EvalConfig, GeneralConfig, ReplayConfig,
                                    RunConfig, TrainConfig, check_per_task, field_hint, field_types)
from cl_bench.config_values import coerce, parse_value, yaml_value
from cl_bench.errors import UserError, did_you_mean
from cl_bench.profiles import PROFILES, split_own

__all__ = ["DataConfig", "DeepSpeedConfig", "EvalConfig", "GeneralConfig", "PROFILES", "ReplayConfig",
           "RunConfig", "TrainConfig", "build", "check_per_task", "coerce", "field_hint", "load_yaml", "merge",
           "parse_value", "profile_fields", "resolve", "set_dotted"]


def _unknown(where: str, key: str, valid: list[str]) -> UserError:
    return UserError(f"{where}: unknown field '{key}'; {did_you_mean(key, valid)}valid fields: {', '.join(valid)}")


def merge(base: dict, override: dict) -> dict:
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict) and key != "method_args":
            out[key] = merge(out[key], value)
        elif key == "method_args" and isinstance(value, dict):
            out[key] = {**out.get(key, {}), **value}
        else:
            out[key] = value
    return out


_SECTIONS = {"data": DataConfig, "train": TrainConfig, "eval": EvalConfig, "replay": ReplayConfig,
             "general": GeneralConfig, "deepspeed": DeepSpeedConfig}


def build(raw: dict[str, Any], where: str) -> RunConfig:
    """Validate a nested dict against RunConfig and construct it."""
    top = field_types(RunConfig)
    kwargs: dict[str, Any] = {}
    for key, value in raw.items():
        if key not in top:
            raise _unknown(where, key, list(top))
        if key in _SECTIONS:
            if not isinstance(value, dict):
                raise UserError(f"{where}: '{key}' must be a mapping of fields")
            types_ = field_types(_SECTIONS[key])
            section = {}
            for sub, subvalue in value.items():
                if sub not in types_:
                    raise _unknown(f"{where}: {key}", sub, list(types_))
                section[sub] = coerce(subvalue, types_[sub], f"{key}.{sub}")
            kwargs[key] = _SECTIONS[key](**section)
        else:
            kwargs[key] = coerce(value, top[key], key)
    config = RunConfig(**kwargs)
    if not config.method:
        config.method = registry.baseline()
    return config


class _DuplicateKey(Exception):
    def __init__(self, key: Any, line: int, within: str):
        super().__init__(key)
        self.key, self.line, self.within = key, line, within


class _StrictLoader(yaml.SafeLoader):
    """yaml.safe_load's loader, refusing a mapping that names a key twice."""

    def construct_mapping(self, node, deep=False):
        seen: set = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if key in seen:
                parent = getattr(node, "cl_bench_name", None)
                raise _DuplicateKey(key, key_node.start_mark.line + 1, f" in '{parent}'" if parent else "")
            seen.add(key)
        for key_node, value_node in node.value:  # name nested sections for the message
            if isinstance(value_node, yaml.MappingNode):
                value_node.cl_bench_name = self.construct_object(key_node, deep=True)
        return super().construct_mapping(node, deep)


def load_yaml(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text()
    except OSError as exc:
        raise UserError(f"{path}: cannot read the config file ({exc.strerror}); check the path") from None
    try:
        data = yaml.load(text, Loader=_StrictLoader) or {}
    except _DuplicateKey as exc:
        raise UserError(f"{path}: line {exc.line}: '{exc.key}' is given twice{exc.within}; keep one "
                        f"(YAML would keep the last silently)") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise UserError(f"{path}: invalid YAML{at}; fix the syntax") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: the top level must be a mapping of config fields")
    return data


def set_dotted(raw: dict, dotted: str, text: str) -> None:
    """Apply one `--set section.field=value` override (value parsed later by type; a
    mapping `{k: v}` now, so that it merges into the field's mapping as a config file's
    does: `--set 'train.lr_by_family={full: 1e-4}'` keeps the profile's other families)."""
    parts = dotted.split(".")
    node = raw
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise UserError(f"--set {dotted}={text}: '{part}' is a value, not a section; "
                            f"set it whole or set its fields, not both")
    node[parts[-1]] = yaml_value(text, f"--set {dotted}") if text.lstrip().startswith("{") else text


def _benchmark_of(*raws: dict) -> str:
    """data.benchmark as the flags, else the file, give it (else the default)."""
    for raw in raws[::-1]:
        data = raw.get("data")
        if isinstance(data, dict) and data.get("benchmark") is not None:
            return str(data["benchmark"])
    return registry.DEFAULT_BENCHMARK


def profile_fields(profile: str, benchmark: str) -> dict[str, Any]:
    """Profile `profile`'s fields for a run on `benchmark`: those it shares with every
    benchmark, and the benchmark's own for it (cl_bench/profiles.py, OWN)."""
    shared, _ = split_own(PROFILES[profile])
    return merge(shared, registry.get_benchmark(benchmark).profiles.get(profile, {}))


def resolve(profile: str, config_file: Path | None, overrides: dict[str, Any]) -> RunConfig:
    """profile defaults <- YAML file <- CLI overrides, validated into a RunConfig."""
    file_raw = load_yaml(config_file) if config_file else {}
    ds = file_raw.get("deepspeed")
    if isinstance(ds, dict) and isinstance(ds.get("config"), str) and not Path(ds["config"]).is_absolute():
        ds["config"] = str((config_file.parent / ds["config"]).resolve())  # relative to the file naming it
    profile = overrides.get("profile") or file_raw.get("profile") or profile
    if profile not in PROFILES:
        raise UserError(f"unknown profile '{profile}'; {did_you_mean(profile, PROFILES)}available: {', '.join(PROFILES)}")
    benchmark = _benchmark_of(file_raw, overrides)
    raw = merge({"profile": profile, **profile_fields(profile, benchmark)}, file_raw)
    raw = merge(raw, overrides)
    if str(raw.get("tuned")).lower() in ("true", "yes", "on", "1"):  # --tuned, `tuned: true`, --set tuned=true
        raw["tuned"] = True
    elif raw.get("tuned") is not None:
        raise UserError(f"tuned={raw['tuned']!r}: give true (--tuned); the tuned file and its commit are filled in")
    if raw.get("tuned") is True:  # the method's arguments from the benchmark's tuned file
        raw = config_tuned.apply(raw, profile, benchmark)
    return build(raw, str(config_file) if config_file else "command line")
