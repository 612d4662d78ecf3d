"""The stage loop: hooks -> train -> evaluate -> R[b][j] -> record + checkpoint.

It calls a method only through the hooks of cl_bench.method.Method and never
looks at its name. After every stage the run record, the predictions and a
checkpoint are written, so an interrupted run loses at most the stage in
progress and `--resume` continues at the next one.

With several ranks (the deepspeed backend) every rank runs this same loop on the
same data; only rank 0 writes files, logs and shows progress, and the backend
splits training steps and evaluation across the ranks.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import resource
import shutil
import secrets
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from cl_bench import precision, registry, results, signals
from cl_bench.backends import Backend, check_support
from cl_bench.backends import create as create_backend
from cl_bench.benchmarks.trace import load_benchmark, load_split, resolve_data_dir, resolve_order
from cl_bench.benchmarks.trace.tasks import CL_TASKS
from cl_bench.config import RunConfig, build, check_per_task
from cl_bench.data import Encoder, collate, tokenize_train
from cl_bench.errors import UserError, did_you_mean
from cl_bench.evaluation import evaluate_task, majority_level
from cl_bench.method import Method, MethodContext, Phase, Stage
from cl_bench.intervals import run_intervals
from cl_bench.metrics.cl import summarise
from cl_bench.models.loading import load
from cl_bench.analysis.probes import RepresentationProbe
from cl_bench.analysis.sharpness import expert_sharpness
from cl_bench.replay import ReplayBuffer

log = logging.getLogger(__name__)


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
    record: dict[str, Any]
    replay: ReplayBuffer
    replay_sources: dict[str, list]  # task name -> examples the buffer may hold
    predictions: list[dict] = field(default_factory=list)
    optimizer: torch.optim.Optimizer | None = None
    progress: bool = True
    probe: RepresentationProbe | None = None  # eval.cka_probe > 0
    lock: Any = None  # rank 0: the run folder's lock (results.lock_run), held until execute ends

    @property
    def cache_dir(self) -> Path | None:
        """Tokenised splits, shared by the runs of one output folder; written by rank 0
        only (the others tokenise in memory)."""
        return self.run_dir.parent / ".cache" if self.backend.is_main else None


def new_run_id(method: str) -> str:
    return f"{method}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def prepare(config: RunConfig | None, resume_dir: Path | None = None, progress: bool = True,
            command: str | None = None) -> Run:
    """Validate, load data and model, set the method up; with `resume_dir`, the
    config comes from that run's record and its checkpoint is restored.
    Everything that can be checked without a model is checked first. `command`:
    the command line to record (default: this process's)."""
    t_start = time.perf_counter()
    command = command or shlex.join(["cl-bench", *sys.argv[1:]])
    if resume_dir is not None:
        try:
            record = _resumable(results.read_record(resume_dir), resume_dir)
        except UserError:
            if (resume_dir / results.LOCK_FILE).is_file():  # a run starting there, before its first record?
                results.lock_run(resume_dir).close()  # if so, this names its PID
            raise
        config = build(record["config"], f"{resume_dir / results.RUN_FILE}: config")
        run_dir = resume_dir
    method_cls = _method_class(config.method)
    check_support(method_cls, config)
    method_args = method_cls.parse_args(method_cls.args_for(config))
    for key, lr in dataclasses.asdict(method_args).items():  # lr, and any other learning rate (*_lr)
        if (key == "lr" or key.endswith("_lr")) and isinstance(lr, float) and not (math.isfinite(lr) and lr > 0):
            raise UserError(f"method_args.{key}={lr} must be a finite number > 0, e.g. --method-arg {key}=3e-4")
    resolve_order(config.data.order)
    check_per_task(config, list(CL_TASKS))
    _check_model(config.model)
    data_dir = resolve_data_dir(config.data.data_dir)
    backend = create_backend(config)  # deepspeed: joins the other ranks
    held: list = []  # rank 0: the run folder's lock, from here until execute ends
    if resume_dir is None:
        config.run_id = config.run_id or backend.on_main(lambda: new_run_id(config.method))
        run_dir = Path(config.output_dir) / config.run_id
        backend.on_main(lambda: held.append(_claim(run_dir)))
    else:
        backend.on_main(lambda: held.append(results.lock_run(run_dir)))
    try:
        run = _prepare_locked(config, resume_dir, run_dir, record if resume_dir is not None else None,
                              method_cls, method_args, data_dir, backend, progress, command, t_start)
    except BaseException:
        for lock in held:
            lock.close()
        raise
    run.lock = held[0] if held else None
    return run


def _prepare_locked(config, resume_dir, run_dir, record, method_cls, method_args, data_dir, backend,
                    progress, command, t_start) -> Run:
    """The rest of prepare, under the run folder's lock (released if this raises)."""
    restart = False
    if resume_dir is not None:
        record = _resumable(results.read_record(resume_dir), resume_dir)  # again, now no one else writes it
        restart = not results.has_checkpoint(resume_dir)
    d = config.data
    tasks = load_benchmark(data_dir, d.order, d.n_train, d.n_test, config.seed, d.n_train_per_task,
                           d.n_test_per_task, d.test_split)
    if resume_dir is not None:
        _check_same_data(record, tasks, resume_dir)
    replay = ReplayBuffer(config.replay, config.seed)
    sources = {t.name: t.train for t in tasks}
    if config.replay.lima:
        sources["Lima"] = load_split(data_dir, "Lima", "train")
        replay.add_lima(sources["Lima"])

    torch.manual_seed(config.seed)
    device = backend.device
    loaded = load(config.model, config.seed, device, progress=progress and backend.is_main)
    encoder = Encoder.from_config(loaded.tokenizer, config.train)
    ctx = MethodContext(config=config, device=device, tokenizer=loaded.tokenizer, all_tasks=tasks,
                        encoder=encoder)
    method = method_cls(method_args, ctx)
    method.setup(loaded.model)
    stages = method.plan(tasks)
    ctx.n_stages = len(stages)

    if resume_dir is None or restart:
        backend.on_main(lambda: run_dir.mkdir(parents=True, exist_ok=True))
        first = record.get("command", command) if restart else command
        record = _new_record(config, method, method_args, loaded.info, tasks, stages, first, backend)
    run = Run(config, run_dir, method, tasks, stages, encoder, backend, record, replay, sources,
              progress=progress and backend.is_main)
    if config.eval.cka_probe:
        run.probe = RepresentationProbe(config.eval.cka_probe, config.eval.cka_probe_tokens)
    if resume_dir is not None and not restart:
        _restore(run, command)
    else:  # validation, data, model load and method set-up, before the first evaluation
        record["timing"]["prepare_s"] = round(time.perf_counter() - t_start, 2)
    if restart:  # no checkpoint yet: the run starts again from its first stage, in its folder
        record["resumes"] = [{"at_stage": 0, "command": command, "backend": backend.describe()}]
        if backend.is_main:
            log.info("%s: no checkpoint (it stopped before its first stage was saved); restarting it "
                     "from stage 1", run_dir)
        backend.barrier()  # every rank has read the files before rank 0 rewrites them
        backend.on_main(lambda: (run_dir / results.METRICS_FILE).unlink(missing_ok=True))
        _write(run)
    backend.barrier()  # every rank has read what rank 0 is about to rewrite
    return run


def _resumable(record: dict, resume_dir: Path) -> dict:
    if record.get("status") == "complete":
        raise UserError(f"{resume_dir}: this run is already complete; nothing to resume")
    if not isinstance(record.get("config"), dict):
        raise UserError(f"{resume_dir / results.RUN_FILE}: the record has no 'config'; it cannot be "
                        f"resumed: start a new run")
    return record


def _method_class(name: str) -> type:
    """registry.get, with a hint where only the case is wrong (method names are lower-case)."""
    try:
        return registry.get(name)
    except UserError:
        names = {key for cls in registry.available().values() for key in (cls.name, *cls.aliases)}
        if name.lower() == name or name.lower() not in names:
            raise
    raise UserError(f"unknown method '{name}'; did you mean '{name.lower()}'? method names are lower-case")


def _check_model(spec: str) -> None:
    """An unknown model name fails here, before any data loads, with the closest
    built-in name (case-insensitive); the rule is models.loading.load's."""
    from cl_bench.models.loading import builtin_names

    names = builtin_names()
    if (spec in names or Path(spec).expanduser().exists()
            or spec.count("/") == 1 and not spec.startswith((".", "/"))):
        return
    raise UserError(f"unknown model '{spec}'; {did_you_mean(spec.lower(), names)}not a built-in name "
                    f"({', '.join(names)}), an existing directory, or a hub id like 'org/name'")


def _claim(run_dir: Path):
    """Fail early, before loading a model, if the run folder cannot be written or is
    taken; returns its lock. A run starts only in an absent or empty folder (one that
    holds only a lock file counts as empty: a start that failed before writing)."""
    results.ensure_writable(run_dir.parent)
    if run_dir.exists() and not run_dir.is_dir():
        raise UserError(f"{run_dir}: is a file, not a run folder; choose another --run-id")
    if not (run_dir / results.LOCK_FILE).exists():
        _refuse_taken(run_dir)  # before a lock file goes into someone else's folder
    run_dir.mkdir(exist_ok=True)
    lock = results.lock_run(run_dir)  # a second writer fails here, naming the first one's PID
    try:
        _refuse_taken(run_dir)  # again, under the lock
    except UserError:
        lock.close()
        raise
    return lock


def _refuse_taken(run_dir: Path) -> None:
    found = sorted(p.name for p in run_dir.iterdir() if p.name != results.LOCK_FILE) if run_dir.is_dir() else []
    if results.RUN_FILE in found:
        raise UserError(f"{run_dir}: a run with this id exists; resume it with "
                        f"--resume {run_dir} or choose another --run-id")
    if found:
        shown = ", ".join(found[:3]) + (", ..." if len(found) > 3 else "")
        raise UserError(f"{run_dir}: folder exists and is not empty ({shown}); a run starts only in an "
                        f"absent or empty folder: choose another --run-id or --output-dir")


def _new_record(config, method, method_args, model_info, tasks, stages, command: str,
                backend: Backend) -> dict[str, Any]:
    return {
        "schema_version": results.SCHEMA_VERSION,
        "run_id": config.run_id,
        "status": "running",
        "command": command,
        "method": method.name,
        "method_args": dataclasses.asdict(method_args),
        "reference": method.reference,
        "uses_replay": method.uses_replay,
        "model": model_info,
        "benchmark": "trace",
        "tasks": [t.name for t in tasks],
        "stages": [{"index": s.index, "label": s.label, "tasks": [t.name for t in s.tasks]}
                   for s in stages],
        "profile": config.profile,
        "seed": config.seed,
        "data": {t.name: t.provenance for t in tasks},
        "matrix": [[None] * len(tasks) for _ in stages],
        "zero_shot": None,
        "majority": {t.name: majority_level(t) for t in tasks if majority_level(t) is not None},
        "task_metrics": [],
        "summary": None,
        "params": [],
        "replay": None,
        "config": config.to_dict(),
        "backend": backend.describe(),
        "timing": {"stages": [], "total_s": 0.0},
        "versions": results.versions(),
        "git_commit": results.git_commit(),
        "stages_done": 0,
    }


def _check_same_data(record: dict, tasks: list, where: Path) -> None:
    for t in tasks:
        old = record["data"].get(t.name, {})
        for split in ("train", "test"):
            if old.get(split, {}).get("sha256") != t.provenance[split]["sha256"]:
                raise UserError(f"{where}: the {split} data of {t.name} changed since the run "
                                f"started (sha256 differs); resume with the original data")


def _name_of(model: torch.nn.Module) -> dict[int, str]:
    return {id(p): n for n, p in model.named_parameters()}


def _checkpoint(run: Run, stage_index: int) -> None:
    """Full weights, method state and optimiser state (gathered by the backend after
    training: the model is an ordinary module on every rank here); rank 0 writes."""
    if not run.backend.is_main:
        return
    names = _name_of(run.method.model)
    state = {
        "stage": stage_index,
        "model": run.method.model.state_dict(),
        "method": run.method.state_dict(),
        "optimizer": None,
        "rng": results.rng_state(),
        "replay": run.replay.state_dict(),
        "probe": run.probe.state_dict() if run.probe is not None else None,
    }
    if run.optimizer is not None:
        state["optimizer"] = {
            "groups": [[names[id(p)] for p in g["params"]] for g in run.optimizer.param_groups],
            "state": run.optimizer.state_dict(),
        }
    results.save_checkpoint(run.run_dir, state)


def _restore(run: Run, command: str) -> None:
    state = results.load_checkpoint(run.run_dir)
    run.method.load_state_dict(state["method"])  # may rebuild architecture first
    run.method.model.load_state_dict(state["model"])
    if state["optimizer"] is not None:
        params = dict(run.method.model.named_parameters())
        groups = [{"params": [params[n] for n in names]} for names in state["optimizer"]["groups"]]
        run.optimizer = run.method.make_optimizer(groups)
        run.optimizer.load_state_dict(state["optimizer"]["state"])
    results.set_rng_state(state["rng"])
    run.replay.load_state_dict(state["replay"], run.replay_sources)
    if run.probe is not None and state.get("probe") is not None:
        run.probe.load_state_dict(state["probe"])
    done = state["stage"] + 1
    rec = run.record
    for kind in (rec.get("probes") or {}).values():  # what the interrupted stage recorded
        for key in [k for k in kind if int(k) >= done]:
            del kind[key]
    # Drop whatever the interrupted stage wrote after its checkpoint.
    rec["stages_done"] = done
    rec["params"] = rec["params"][:done]
    rec["timing"]["stages"] = rec["timing"]["stages"][:done]
    rec["task_metrics"] = [m for m in rec["task_metrics"] if m["stage"] < done]
    for b in range(done, len(rec["matrix"])):
        rec["matrix"][b] = [None] * len(rec["tasks"])
    run.predictions = [r for r in results.read_jsonl(run.run_dir / results.PREDICTIONS_FILE)
                       if r["stage"] < done]
    metrics = run.run_dir / results.METRICS_FILE
    kept = [r for r in results.read_jsonl(metrics) if r["stage"] < done]
    run.backend.barrier()  # every rank has read the files before rank 0 rewrites one
    run.backend.on_main(lambda: results.write_jsonl(metrics, kept))
    rec["status"] = "running"
    rec.pop("error", None)  # of the interrupted attempt
    rec.pop("failed_at", None)
    rec.setdefault("resumes", []).append({"at_stage": done, "command": command,
                                          "backend": run.backend.describe()})
    if run.backend.is_main:
        log.info("resuming %s at stage %d/%d", run.run_dir, done + 1, len(run.stages))


def _epochs(run: Run, stage: Stage) -> list[list[dict]]:
    """Rows of each epoch: a task joins epoch e while e < its epoch count."""
    per_task = [(run.config.train.epochs_for(t.name),
                 list(tokenize_train(run.encoder, t.train, run.cache_dir))) for t in stage.tasks]
    n_epochs = max(n for n, _ in per_task)
    return [[row for n, rows in per_task if e < n for row in rows] for e in range(n_epochs)]


def _evaluate(run: Run, stage_label: str, indices: list[int], model) -> dict[int, Any]:
    total = sum(len(run.tasks[j].test) for j in indices)
    out = {}
    with tqdm(total=total, desc=f"{stage_label} eval", unit="ex", disable=not run.progress,
              leave=False) as bar, precision.autocast(run.backend.eval_precision, run.backend.device):
        for j in indices:
            out[j] = evaluate_task(model, run.encoder, run.tasks[j], run.config.eval, bar.update,
                                   run.backend.generate)
    return out


def _write(run: Run) -> None:
    if not run.backend.is_main:
        return
    try:
        results.write_json(run.run_dir / results.RUN_FILE, run.record)
        results.write_jsonl(run.run_dir / results.PREDICTIONS_FILE, run.predictions)
    except (OSError, ValueError) as exc:  # ValueError: a NaN or inf, which JSON cannot hold
        raise _cannot_write(run, exc) from None


def _cannot_write(run: Run, exc: Exception) -> UserError:
    reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
    return UserError(f"{run.run_dir}: cannot write the run's files ({reason}); the last checkpoint is "
                     f"kept: free space or fix permissions, then cl-bench run --resume {run.run_dir}")


def execute(run: Run, keep_checkpoint: bool = False, stop: signals.Stop | None = None) -> dict[str, Any]:
    """Run the remaining stages; returns the final record. SIGINT or SIGTERM stops it
    as an interrupt (signals.interrupt_on_signals): the stage in progress is dropped
    and the record says "interrupted", also where the signal surfaced as another
    error (a collective whose peer rank had already stopped) or was swallowed (`stop`:
    the caller's, which may have fired while the run was being prepared)."""
    rec = run.record
    with signals.interrupt_on_signals(stop) as stop:
        try:
            stop.check()
            ev = run.config.eval
            if (ev.eval_all or ev.zero_shot) and rec["zero_shot"] is None:
                t0 = time.perf_counter()
                evals = _evaluate(run, "zero-shot", list(range(len(run.tasks))),
                                  run.method.eval_model(run.stages[0]))
                rec["zero_shot"] = [evals[j].score for j in range(len(run.tasks))]
                for j, ev_j in evals.items():  # stage -1: the zero-shot row, before any training
                    rec["task_metrics"].append({"stage": results.ZERO_SHOT_STAGE, "task": run.tasks[j].name, **ev_j.details})
                    run.predictions.extend({"stage": results.ZERO_SHOT_STAGE, **row} for row in ev_j.rows)
                rec["timing"]["zero_shot_s"] = round(time.perf_counter() - t0, 2)
                _write(run)
            for stage in run.stages[rec["stages_done"]:]:
                stop.check()
                _run_stage(run, stage)
            stop.check()
            rec["summary"] = summarise(rec["matrix"], rec["zero_shot"])
            if run.backend.is_main:
                rec["intervals"] = run_intervals(rec, run.predictions)
            rec["status"] = "complete"
            _write(run)
            if not keep_checkpoint and run.backend.is_main:
                for name in (results.CHECKPOINT_DIR, f"{results.CHECKPOINT_DIR}.old"):
                    shutil.rmtree(run.run_dir / name, ignore_errors=True)
            run.backend.barrier()  # no rank returns before rank 0 has written the run
        except BaseException as exc:
            rec["status"] = "interrupted" if isinstance(exc, KeyboardInterrupt) or stop.fired else "failed"
            rec["error"] = f"{type(exc).__name__}: {exc}"
            try:
                _write(run)
            except UserError as again:  # e.g. the disk is still full: the record keeps its last state
                log.warning("%s", again)
            if stop.fired and not isinstance(exc, KeyboardInterrupt):
                raise KeyboardInterrupt(stop.names) from exc
            raise
        finally:
            if run.lock is not None:
                run.lock.close()
                run.lock = None
        return rec


def _train_phase(run: Run, stage: Stage, phase: Phase, desc: str, log_rows: list[dict],
                 tag: bool) -> tuple[int, int]:
    """Train one phase of `stage`; returns (optimiser steps, replay examples used).
    Step log rows go to `log_rows`, tagged with the phase when `tag`."""
    method = run.method
    epochs = _epochs(run, stage)
    replay_rows, replayed = None, 0
    if method.uses_replay and phase.replay and len(run.replay):
        rows = list(tokenize_train(run.encoder, run.replay.examples(), run.cache_dir))
        if run.config.replay.policy == "epoch":
            epochs.append(rows)  # TRACE's extra epoch over the buffer
            replayed = len(rows)
        else:
            replay_rows = rows  # interleaved by the backend, one micro-batch a step
    t = run.config.train
    n_steps = sum(-(-len(rows) // t.batch_size) for rows in epochs)
    extra = {"phase": phase.name} if tag else {}
    with tqdm(total=n_steps, desc=desc, unit="step", disable=not run.progress) as bar:
        def on_step(step: int, parts: dict[str, float]) -> None:
            bad = [k for k, v in parts.items() if not math.isfinite(v)]
            if bad:  # diverged: the stage stops here, before anything of it is saved
                run.record["failed_at"] = {"stage": stage.index, "step": step}
                kept = f"stage {stage.index}'s checkpoint is kept" if stage.index else "no stage was saved"
                raise UserError(f"{desc}: {bad[0]} is {parts[bad[0]]} at step {step}; the run diverged "
                                f"and stopped ({kept}): lower method_args.lr (now {method.args.lr:g}) "
                                f"and start a new run")
            log_rows.append({"stage": stage.index, **extra, "step": step, **parts})
            bar.set_postfix({k: f"{v:.3f}" for k, v in parts.items() if k != "grad_norm"})
            bar.update()

        replayed += run.backend.train_stage(method, run.optimizer, stage, epochs,
                                            run.encoder.tokenizer.pad_token_id, on_step, replay_rows)
    return n_steps, replayed


def _probe(run: Run, stage: Stage, trained: list) -> None:
    """The optional analyses of eval: CKA per layer of each trained task since it
    was learned (every stage), expert sharpness (after the last stage)."""
    probes = run.record.setdefault("probes", {})
    model, ev = run.method.model, run.config.eval
    if run.probe is not None:
        probes.setdefault("cka", {})[str(stage.index)] = run.probe.after_stage(model, run.encoder, trained)
    if ev.sharpness and stage.index == len(run.stages) - 1:
        rows = [run.encoder.train_example(e.prompt, e.answer) for e in stage.tasks[-1].test[:ev.sharpness]]
        batch = {k: v.to(run.backend.device)
                 for k, v in collate(rows, run.encoder.tokenizer.pad_token_id).items()}
        probes.setdefault("sharpness", {})[str(stage.index)] = expert_sharpness(
            model, batch, ev.sharpness_iters, ev.sharpness_layers)
    if not probes:
        del run.record["probes"]


def _run_stage(run: Run, stage: Stage) -> None:
    rec, method = run.record, run.method
    n_stages = len(run.stages)
    label = f"stage {stage.index + 1}/{n_stages} [{stage.label}]"
    t0 = time.perf_counter()
    method.before_task(stage)
    phases = method.phases(stage)
    replayed = n_steps = 0
    log_rows: list[dict] = []
    for phase in phases:
        method.before_phase(stage, phase)
        run.optimizer = method.optimizer_for_stage(stage, run.optimizer)
        desc = f"{label} {phase.name}" if len(phases) > 1 else f"{label} train"
        steps_done, used = _train_phase(run, stage, phase, desc, log_rows, len(phases) > 1)
        n_steps += steps_done
        replayed += used
    method.after_task(stage)
    for task in stage.tasks:
        run.replay.add_task(task)
    train_s = time.perf_counter() - t0

    t1 = time.perf_counter()
    trained = sorted({run.tasks.index(task) for s in run.stages[:stage.index + 1] for task in s.tasks})
    indices = (list(range(len(run.tasks))) if run.config.eval.eval_all
               else method.eval_tasks(stage, trained))
    if run.config.eval.next_task and stage.index + 1 < n_stages:  # R[b][next], for FWT
        upcoming = [run.tasks.index(t) for t in run.stages[stage.index + 1].tasks]
        indices = sorted(set(indices) | set(upcoming))
    evals = _evaluate(run, label, indices, method.eval_model(stage))
    eval_s = time.perf_counter() - t1
    for j, ev in evals.items():
        rec["matrix"][stage.index][j] = ev.score
        rec["task_metrics"].append({"stage": stage.index, "task": run.tasks[j].name, **ev.details})
        run.predictions.extend({"stage": stage.index, **row} for row in ev.rows)
    rec["params"].append({"stage": stage.index, **method.param_report()})
    _probe(run, stage, [run.tasks[j] for j in trained])
    rec["timing"]["stages"].append({"stage": stage.index, "train_s": round(train_s, 2),
                                    "eval_s": round(eval_s, 2), "steps": n_steps,
                                    "peak_rss_mb": round(peak_rss_mb(), 1)})
    # total_s: the stages (training + evaluation) and the zero-shot row; prepare_s (loading) apart
    rec["timing"]["total_s"] = round(sum(s["train_s"] + s["eval_s"] for s in rec["timing"]["stages"])
                                     + rec["timing"].get("zero_shot_s", 0.0), 2)
    used = (rec["replay"] or {}).get("used", 0) + replayed
    rec["replay"] = {**run.replay.summary(), "used": used}
    rec["stages_done"] = stage.index + 1
    if run.backend.is_main:
        try:
            with (run.run_dir / results.METRICS_FILE).open("a") as fh:
                fh.writelines(json.dumps(r, allow_nan=False) + "\n" for r in log_rows)
        except (OSError, ValueError) as exc:
            raise _cannot_write(run, exc) from None
    # Record first, checkpoint second: a crash between the two resumes from the
    # previous checkpoint and redoes this stage, never skips it.
    _write(run)
    _checkpoint(run, stage.index)
    if not run.backend.is_main:
        return
    scores = ", ".join(f"{run.tasks[j].name} {evals[j].score:.1f}" for j in indices)
    log.info("%s done in %.0fs (train %.0fs, eval %.0fs): %s", label, train_s + eval_s,
             train_s, eval_s, scores)
