"""The run record (run.json) as typed dataclasses: RunRecord, StageRecord,
ParamReport, Timing and StageTiming, schema-versioned.

`RunRecord.from_json` is the one parser (cl_bench.record.io.read_record reads the
file through it: show, resume, compare, analyze, cost, the leaderboard); every
record cl-bench has written loads, and a record that does not fails with one line
naming the file and its schema version. `RunRecord.to_json` gives the JSON
object written (always of SCHEMA_VERSION): the fields in the order declared
here, optional ones left out while they are None.

Schema versions:
  1  a params row holds the method's param_report() keys flat, beside the counts.
  2  a params row holds the declared fields of ParamReport, every one of them,
     and the method's other keys under "diagnostics". A version-1 row is read
     into the same ParamReport (its undeclared keys become its diagnostics).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cl_bench.benchmark import DEFAULT as DEFAULT_BENCHMARK
from cl_bench.record import shape as record_shape
from cl_bench.errors import UserError

SCHEMA_VERSION = 2

# Optional fields of RunRecord and Timing that the JSON leaves out while they are None
# (the record gains them as the run goes: a resume, the intervals, an error).
_OMITTED_WHEN_NONE = frozenset({"majority", "backend", "machine", "probes", "general", "resumes", "intervals", "failed_at",
                                "error", "total_s", "prepare_s", "zero_shot_s"})


class Where:
    """Where a record came from, for one-line errors: the file and its schema version."""

    def __init__(self, path: Path | str | None, version: int):
        self.path, self.version = path or "<run record>", version

    def fail(self, what: str) -> UserError:
        return UserError(f"{self.path}: {what} (schema_version {self.version}); the record is damaged: "
                         f"put back the file as cl-bench wrote it, or move the run folder away")

    def get(self, data: dict, key: str, types: type | tuple, default: Any = None, required: bool = False,
            prefix: str = "") -> Any:
        """data[key] checked against `types`; absent or null: `default` (called when
        it is a factory), or the error "missing field" where `required`."""
        value = data.get(key)
        if value is None:
            if required:
                raise self.fail(f"missing field {prefix}{key}")
            return default() if callable(default) else default
        allowed = types if isinstance(types, tuple) else (types,)
        if not isinstance(value, allowed) or isinstance(value, bool) and bool not in allowed:
            names = " or ".join(t.__name__ for t in allowed)
            raise self.fail(f"field {prefix}{key} must be {names}, found {type(value).__name__}")
        return value

    def unknown(self, data: dict, known, prefix: str = "") -> None:
        extra = [k for k in data if k not in known]
        if extra:
            raise self.fail(f"unknown field {prefix}{extra[0]}")


def rounded(x, digits: int = 6) -> float:
    """A float as a method's stage_record stores it in run.json: `digits` decimals
    (a tensor's item or a numpy scalar taken as a float first)."""
    return round(float(x), digits)


def _to_json(obj) -> dict[str, Any]:
    """A record dataclass as JSON: fields in declared order, nested records
    converted, the optional fields of _OMITTED_WHEN_NONE left out while None."""
    out = {}
    for f in dataclasses.fields(obj):
        if not f.metadata.get("json", True):
            continue
        value = getattr(obj, f.name)
        if value is None and f.name in _OMITTED_WHEN_NONE:
            continue
        if isinstance(value, list):
            value = [v.to_json() if hasattr(v, "to_json") else v for v in value]
        elif hasattr(value, "to_json"):
            value = value.to_json()
        out[f.name] = value
    return out


@dataclass
class StageRecord:
    """One stage of the run's plan (Method.plan): its 0-based `index`, the `label`
    shown in tables (the task's name, or several joined), the `tasks` it trains."""

    index: int
    label: str
    tasks: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return _to_json(self)

    @classmethod
    def from_json(cls, data: Any, where: Where, at: str) -> StageRecord:
        if not isinstance(data, dict):
            raise where.fail(f"{at} must be an object, found {type(data).__name__}")
        where.unknown(data, {f.name for f in dataclasses.fields(cls)}, f"{at}.")
        return cls(where.get(data, "index", int, required=True, prefix=f"{at}."),
                   where.get(data, "label", str, required=True, prefix=f"{at}."),
                   where.get(data, "tasks", list, list, prefix=f"{at}."))


# The counts every method reports (Method.param_report; models/params.py says what they count).
COUNT_FIELDS = ("total", "trainable", "active_per_token", "deployed")


@dataclass
class ParamReport:
    """The parameters after one stage (record field `params`, one per stage done).

    stage: the stage's index. total: parameters held in memory; trainable: with
    gradients in this stage; active_per_token: touched per token at inference;
    deployed: what an exported model needs (PROTOCOL.md, "Parameter accounting").
    experts_per_layer: experts in each MoE layer, None for a model without any.
    expansion_rate: the share of the experts offered at this stage that the
    method expanded (None where it makes no such decision, and at stage 0).
    diagnostics: every other key the method's param_report() returned, as it
    returned them (bilevel-cka's decisions and decision_layers, SAME's spectra,
    CaRE's task-id accuracy...): the method's own; the core reads none of it
    except `cl-bench analyze`'s decision map (diagnostics "decisions", with
    "decision_layers" naming its rows) and `cl-bench params --decisions`.
    """

    stage: int
    total: int | None = None
    trainable: int | None = None
    active_per_token: int | None = None
    deployed: int | None = None
    experts_per_layer: list | None = None
    expansion_rate: float | None = None
    diagnostics: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_method(cls, stage: int, report: dict[str, Any]) -> ParamReport:
        """The row of `stage` from a method's param_report(): declared keys to their
        fields, every other key under diagnostics (the method files need not know)."""
        declared = {f.name for f in dataclasses.fields(cls)} - {"stage", "diagnostics"}
        return cls(stage, **{k: v for k, v in report.items() if k in declared},
                   diagnostics={k: v for k, v in report.items() if k not in declared})

    def to_json(self) -> dict[str, Any]:
        return _to_json(self)

    @classmethod
    def from_json(cls, data: Any, where: Where, at: str) -> ParamReport:
        if not isinstance(data, dict):
            raise where.fail(f"{at} must be an object, found {type(data).__name__}")
        names = [f.name for f in dataclasses.fields(cls)]
        if where.version == 1:  # flat: what is not declared is the method's own
            data = {**{k: v for k, v in data.items() if k in names},
                    "diagnostics": {k: v for k, v in data.items() if k not in names}}
        where.unknown(data, names, f"{at}.")
        counts = {k: where.get(data, k, int, prefix=f"{at}.") for k in COUNT_FIELDS}
        return cls(where.get(data, "stage", int, required=True, prefix=f"{at}."), **counts,
                   experts_per_layer=where.get(data, "experts_per_layer", list, prefix=f"{at}."),
                   expansion_rate=where.get(data, "expansion_rate", (int, float), prefix=f"{at}."),
                   diagnostics=where.get(data, "diagnostics", dict, dict, prefix=f"{at}."))


@dataclass
class StageTiming:
    """One stage's cost: seconds of training (the stage's hooks included) and of
    evaluation, optimiser steps, and the process's peak resident memory (MB) by
    the end of the stage."""

    stage: int
    train_s: float
    eval_s: float
    steps: int
    peak_rss_mb: float | None = None

    def to_json(self) -> dict[str, Any]:
        return _to_json(self)


@dataclass
class Timing:
    """stages: StageTiming per stage done. total_s: the stages' training and
    evaluation and the zero-shot row (prepare_s apart). prepare_s: validation,
    data, model load and method set-up of the first start. zero_shot_s: the
    zero-shot row, where the run has one."""

    stages: list[StageTiming] = field(default_factory=list)
    total_s: float | None = 0.0
    prepare_s: float | None = None
    zero_shot_s: float | None = None

    def to_json(self) -> dict[str, Any]:
        return _to_json(self)

    @classmethod
    def from_json(cls, data: Any, where: Where) -> Timing:
        if not isinstance(data, dict):
            raise where.fail(f"field timing must be an object, found {type(data).__name__}")
        where.unknown(data, {f.name for f in dataclasses.fields(cls)}, "timing.")
        number = (int, float)
        stages = []
        for i, row in enumerate(where.get(data, "stages", list, list, prefix="timing.")):
            at = f"timing.stages[{i}]"
            if not isinstance(row, dict):
                raise where.fail(f"{at} must be an object, found {type(row).__name__}")
            where.unknown(row, {f.name for f in dataclasses.fields(StageTiming)}, f"{at}.")
            stages.append(StageTiming(*(where.get(row, k, t, required=True, prefix=f"{at}.")
                                        for k, t in (("stage", int), ("train_s", number), ("eval_s", number),
                                                     ("steps", int))),
                                      where.get(row, "peak_rss_mb", number, prefix=f"{at}.")))
        return cls(stages, *(where.get(data, k, number, prefix="timing.")
                             for k in ("total_s", "prepare_s", "zero_shot_s")))


@dataclass(kw_only=True)
class RunRecord:
    """One run: what ran, on what, with which numbers (run.json).

    schema_version: of the file it was read from (SCHEMA_VERSION for a new
        record); a record written back is always of SCHEMA_VERSION.
    run_id: the run folder's name. status: running | complete | interrupted |
        failed. command: the command line that started it.
    method, method_args: the method's registered name and its resolved arguments;
        reference: whether it is a reference row (not ranked); uses_replay.
    model: models.loading's info (id, source, architecture, n_params, sha256).
    benchmark: its name (a record without one: trace, the only one then), tasks: the task names in order; stages: StageRecord per
        stage of the plan; profile; seed.
    data: per task, the provenance of its train and test subsets (indices, sha256).
    matrix: R[b][j], the score of task j after stage b (None: not evaluated);
        zero_shot: every task before training, where the run scored it.
    majority: the majority-class level of label tasks ({answer, score}).
    task_metrics: per (stage, task) the scorer's details; stage -1: zero-shot.
    summary: metrics.cl.summarise of matrix and zero_shot, once complete.
    params: ParamReport per stage done. replay: the replay buffer's summary.
    config: the resolved RunConfig, whole. backend: what trained it (name,
        world_size, precision...). machine: cl_bench.run.machine.calibration at the
        start (CPU, cores, threads, bf16 instruction sets, load average, a matmul rate);
        records before it have none. timing: Timing. versions: of the packages;
        git_commit: of cl-bench ("+dirty" with local changes). stages_done.
    probes: eval.cka_probe's CKA, eval.routing_probe's routed-expert shares and JS
        divergences, and eval.sharpness's rows, by stage.
    general: general ability and instruction drift (cl_bench/eval/general/): "lima",
        the Lima probe's points and ΔLima (general.lima).
    resumes: one {at_stage, command, backend} per --resume.
    intervals: cl_bench.metrics.intervals.run_intervals, once complete.
    failed_at: {stage, step} where a loss diverged. error: what stopped the run.
    source: the file it was read from (not written).
    """

    schema_version: int = SCHEMA_VERSION
    run_id: str | None = None
    status: str | None = None
    command: str | None = None
    method: str
    method_args: dict[str, Any] = field(default_factory=dict)
    reference: bool = False
    uses_replay: bool = False
    model: dict[str, Any] = field(default_factory=dict)
    benchmark: str = DEFAULT_BENCHMARK
    tasks: list[str]
    stages: list[StageRecord] = field(default_factory=list)
    profile: str | None = None
    seed: int | None = None
    data: dict[str, Any] = field(default_factory=dict)
    matrix: list[list[float | None]] = field(default_factory=list)
    zero_shot: list[float | None] | None = None
    majority: dict[str, Any] | None = None
    task_metrics: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] | None = None
    params: list[ParamReport] = field(default_factory=list)
    replay: dict[str, Any] | None = None
    config: dict[str, Any] | None = None
    backend: dict[str, Any] | None = None
    machine: dict[str, Any] | None = None
    timing: Timing = field(default_factory=Timing)
    versions: dict[str, str] = field(default_factory=dict)
    git_commit: str | None = None
    stages_done: int = 0
    probes: dict[str, Any] | None = None
    general: dict[str, Any] | None = None
    resumes: list[dict[str, Any]] | None = None
    intervals: dict[str, Any] | None = None
    failed_at: dict[str, Any] | None = None
    error: str | None = None
    source: Path | None = field(default=None, compare=False, repr=False, metadata={"json": False})

    @property
    def precision(self) -> str:
        """What the run computed in: 'bf16', 'fp32', or 'train bf16, eval fp32' where
        the two differ. Records from before `backend.precision` existed ran fp32."""
        chosen = (self.backend or {}).get("precision") or {}
        train, evaluate = chosen.get("train", "fp32"), chosen.get("eval", "fp32")
        return train if train == evaluate else f"train {train}, eval {evaluate}"

    @property
    def split(self) -> str:
        """The split its scores are on (data.test_split): 'test', or 'eval' for a tuning
        run. Records from before the field existed scored the test split."""
        return ((self.config or {}).get("data") or {}).get("test_split") or "test"

    @property
    def generator(self) -> str:
        """What decoded its evaluations (eval.generator): 'hf' or 'vllm'. Records from
        before `backend.generator` existed decoded with hf."""
        return (self.backend or {}).get("generator") or "hf"

    def to_json(self) -> dict[str, Any]:
        """The JSON object written to run.json: of SCHEMA_VERSION, whatever was read."""
        return {**_to_json(self), "schema_version": SCHEMA_VERSION}

    @classmethod
    def from_json(cls, data: Any, path: Path | str | None = None) -> RunRecord:
        """Parse a run.json object of any schema version up to SCHEMA_VERSION;
        a UserError naming `path` and the version for anything else."""
        where = path or "<run record>"
        if not isinstance(data, dict):
            raise UserError(f"{where}: not a run record (a JSON object); the record is damaged")
        if "schema_version" not in data:
            raise UserError(f"{where}: no field schema_version, so not a cl-bench run record; move it out of the "
                            f"runs folder")
        version = data["schema_version"]
        if isinstance(version, bool) or not isinstance(version, int) or version < 1:
            raise UserError(f"{where}: field schema_version={version!r} is not a positive integer; the record is "
                            f"damaged: put back the file as cl-bench wrote it, or move the run folder away")
        if version > SCHEMA_VERSION:
            raise UserError(f"{where}: field schema_version {version} is newer than this cl-bench reads "
                            f"(up to {SCHEMA_VERSION}); upgrade cl-bench")
        w = Where(path, version)
        w.unknown(data, {f.name for f in dataclasses.fields(cls) if f.metadata.get("json", True)})
        g = w.get
        tasks = g(data, "tasks", list, required=True)
        if not all(isinstance(t, str) for t in tasks):
            raise w.fail("field tasks must be a list of task names")
        stages = [StageRecord.from_json(s, w, f"stages[{i}]") for i, s in enumerate(g(data, "stages", list, list))]
        params = [ParamReport.from_json(p, w, f"params[{i}]") for i, p in enumerate(g(data, "params", list, list))]
        timing = Timing.from_json(data["timing"], w) if data.get("timing") is not None else Timing(total_s=None)
        record = cls(
            schema_version=version, run_id=g(data, "run_id", str), status=g(data, "status", str),
            command=g(data, "command", str), method=g(data, "method", str, required=True),
            method_args=g(data, "method_args", dict, dict), reference=g(data, "reference", bool, False),
            uses_replay=g(data, "uses_replay", bool, False), model=g(data, "model", dict, dict),
            benchmark=g(data, "benchmark", str, DEFAULT_BENCHMARK), tasks=tasks, stages=stages, profile=g(data, "profile", str),
            seed=g(data, "seed", int), data=g(data, "data", dict, dict), matrix=g(data, "matrix", list, list),
            zero_shot=g(data, "zero_shot", list), majority=g(data, "majority", dict),
            task_metrics=g(data, "task_metrics", list, list), summary=g(data, "summary", dict), params=params,
            replay=g(data, "replay", dict), config=g(data, "config", dict), backend=g(data, "backend", dict),
            machine=g(data, "machine", dict),
            timing=timing, versions=g(data, "versions", dict, dict), git_commit=g(data, "git_commit", str),
            stages_done=g(data, "stages_done", int, 0), probes=g(data, "probes", dict),
            general=g(data, "general", dict),
            resumes=g(data, "resumes", list), intervals=g(data, "intervals", dict),
            failed_at=g(data, "failed_at", dict), error=g(data, "error", str),
            source=Path(path) if path is not None else None)
        record_shape.check(record, w)
        return record
