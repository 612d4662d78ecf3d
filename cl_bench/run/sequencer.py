"""The stage loop: hooks -> train -> evaluate -> R[b][j] -> record + checkpoint.

It runs what cl_bench/run/prepare.py prepared, and calls a method only through the
hooks of cl_bench.method.Method, never looking at its name. After every stage
the run record, the predictions and a checkpoint are written
(cl_bench/run/checkpoint.py), so an interrupted run loses at most the stage in
progress and `--resume` continues at the next one; with train.checkpoint_every_s,
checkpoints are also written inside a stage, at step boundaries, and `--resume`
continues at the step after the last one (which stage and step:
cl_bench/run/resume.py; the backend is told only the step to start from). The
zero-shot row is written after each task it scores: a stop there keeps the tasks
scored, and `--resume` scores the rest.

With several ranks (the deepspeed backend) every rank runs this same loop on the
same data; only rank 0 writes files, logs and shows progress, and the backend
splits training steps and evaluation across the ranks.
"""
from __future__ import annotations

import logging
import math
import resource
import time
from typing import Any, Callable

from cl_bench.run import agreement
from cl_bench.run import checkpoint_shape
from cl_bench.run import precision
from cl_bench.run import progress
from cl_bench.record import io as results
from cl_bench.run import checkpoint
from cl_bench.run import resume
from cl_bench.run import signals
from cl_bench.eval.probes.sharpness import expert_sharpness
from cl_bench.data.encode import collate, epoch_members, phase_steps, tokenize_train
from cl_bench.errors import UserError
from cl_bench.eval.evaluation import evaluate_task, max_new_tokens
from cl_bench.eval.general.lima import ZERO_SHOT as LIMA_ZERO_SHOT
from cl_bench.eval.general.lima import measured
from cl_bench.metrics.intervals import run_intervals
from cl_bench.method import Phase, Stage, prune_optimizer
from cl_bench.run.metric_log import make_logger
from cl_bench.metrics.cl import summarise
from cl_bench.run.state import Run
from cl_bench.record.schema import ParamReport, RunRecord, StageTiming
from cl_bench.run.schedule import LrSchedule

log = logging.getLogger(__name__)


def execute(run: Run, keep_checkpoint: bool = False, stop: signals.Stop | None = None) -> RunRecord:
    """Run the remaining stages; returns the final record. SIGINT or SIGTERM stops it
    as an interrupt (signals.interrupt_on_signals): the stage in progress is dropped
    and the record says "interrupted", also where the signal surfaced as another
    error (a collective whose peer rank had already stopped) or was swallowed (`stop`:
    the caller's, which may have fired while the run was being prepared)."""
    rec = run.record
    run.global_step = sum(s.steps for s in rec.timing.stages)
    complete = False  # the record on disk says so
    with signals.interrupt_on_signals(stop) as stop:
        try:
            run.metrics = make_logger(run.config.log, run.run_dir, run.config.to_dict(), run.backend.is_main)
            if not (run.run_dir / results.RUN_FILE).exists():  # a record from the start: an in-stage
                run.write_files()  # checkpoint of stage 1 is resumed through it
            stop.check()
            ev = run.config.eval
            if (ev.eval_all or ev.zero_shot) and (rec.zero_shot is None or None in rec.zero_shot):
                _zero_shot_row(run, stop)
            if _general(run, LIMA_ZERO_SHOT):
                run.write_files()
            at = resume.load_in_stage(run)
            for stage in run.stages[rec.stages_done:]:
                stop.check()
                _run_stage(run, stage, stop, at)
                at = None
            stop.check()
            rec.summary = summarise(rec.matrix, rec.zero_shot)
            if run.backend.is_main:
                rec.intervals = run_intervals(rec, run.predictions)
            rec.status = "complete"
            run.write_files()
            complete = True
            if not keep_checkpoint and run.backend.is_main:
                for name in (checkpoint.CHECKPOINT_DIR, checkpoint.STEP_CHECKPOINT_DIR):
                    checkpoint.remove_checkpoint(run.run_dir, name)
            run.backend.barrier()  # no rank returns before rank 0 has written the run
        except BaseException as exc:
            if complete:  # cut while its checkpoints were removed: the record stays complete
                if isinstance(exc, KeyboardInterrupt) or stop.fired:
                    log.warning("%s: stopped while removing the complete run's checkpoints; the run is complete "
                                "(remove what is left of %s*/ by hand)", run.run_dir, checkpoint.CHECKPOINT_DIR)
                    return rec
                raise
            if isinstance(exc, checkpoint_shape.LayoutError):  # a checkpoint of another layout: the record
                raise  # stays as it was (this attempt wrote nothing else; zero-shot scores are written as they come)
            rec.status = "interrupted" if isinstance(exc, KeyboardInterrupt) or stop.fired else "failed"
            rec.error = f"{type(exc).__name__}: {exc}"
            try:
                run.write_files()
            except UserError as again:  # e.g. the disk is still full: the record keeps its last state
                log.warning("%s", again)
            if stop.fired and not isinstance(exc, KeyboardInterrupt):
                raise KeyboardInterrupt(stop.names) from exc
            raise
        finally:
            if run.metrics is not None:
                run.metrics.close()
                run.metrics = None
            if run.lock is not None:
                run.lock.close()
                run.lock = None
        return rec


def _zero_shot_row(run: Run, stop: signals.Stop) -> None:
    """The zero-shot row (stage -1, before any training) of the tasks not scored yet;
    the record and the predictions are written after each task, so a stop keeps the
    tasks scored and --resume scores the rest (resume.keep_zero_shot)."""
    rec = run.record
    rec.zero_shot = rec.zero_shot or [None] * len(run.tasks)
    last = time.perf_counter()

    def task_done(j: int, ev_j) -> None:
        nonlocal last
        rec.zero_shot[j] = ev_j.score
        rec.task_metrics.append({"stage": results.ZERO_SHOT_STAGE, "task": run.tasks[j].name, **ev_j.details})
        run.predictions.extend({"stage": results.ZERO_SHOT_STAGE, **row} for row in ev_j.rows)
        now = time.perf_counter()
        rec.timing.zero_shot_s = round((rec.timing.zero_shot_s or 0.0) + now - last, 2)
        last = now
        run.write_files()

    todo = [j for j, score in enumerate(rec.zero_shot) if score is None]
    _evaluate(run, "zero-shot", todo, run.method.model, stop, task_done)


class _InStageCheckpoints:
    """Writes the stage's in-stage checkpoint after a step once train.checkpoint_every_s
    seconds have passed since the stage started or the last one was written."""

    def __init__(self, run: Run, stage: Stage, t0: float):
        self.run, self.stage, self.t0, self.every = run, stage, t0, run.config.train.checkpoint_every_s
        self.last = time.perf_counter()

    def after_step(self, phase: int, next_step: int, log_rows: list[dict]) -> None:
        if self.every is None:
            return
        # rank 0's clock decides for every rank (taking the state whole is collective)
        if not self.run.backend.on_main(lambda: time.perf_counter() - self.last >= self.every):
            return
        self.run.method.before_checkpoint()
        with self.run.backend.whole(self.run.optimizer):
            checkpoint.save_in_stage(self.run, checkpoint.InStage(
                self.stage.index, phase, next_step, log_rows, self.run.global_step,
                round(time.perf_counter() - self.t0, 2)))  # rank 0's is the one written
        self.last = time.perf_counter()


def _run_stage(run: Run, stage: Stage, stop: signals.Stop, at: checkpoint.InStage | None = None) -> None:
    """Train, evaluate and save `stage`; `at`: continue it from that in-stage checkpoint;
    `stop` is checked after every step and evaluation batch."""
    rec, method = run.record, run.method
    n_stages = len(run.stages)
    label = f"stage {stage.index + 1}/{n_stages} [{stage.label}]"
    t0 = time.perf_counter() - (at.train_s if at else 0.0)
    checkpoints = _InStageCheckpoints(run, stage, t0)
    method.before_task(stage)
    phases = method.phases(stage)
    if at is not None and at.phase >= len(phases):
        raise at.state.fail(f"phase={at.phase}", f"must be below the stage's {len(phases)} phases")
    replayed = n_steps = 0
    log_rows: list[dict] = list(at.log_rows) if at else []
    for p, phase in enumerate(phases):
        method.before_phase(stage, phase)
        run.optimizer = method.optimizer_for_stage(stage, run.optimizer)
        start: int | None = 0  # the first step to compute; None: the whole phase is in the checkpoint
        if at is not None and p <= at.phase:
            start = None if p < at.phase else at.step
            if p == at.phase:  # the hooks up to here rebuilt what the stage had; the saved state goes over it
                resume.enter_in_stage(run, at)
        desc = f"{label} {phase.name}" if len(phases) > 1 else f"{label} train"
        steps_done, used = _train_phase(run, stage, p, phase, desc, log_rows, len(phases) > 1, start,
                                        checkpoints, stop)
        n_steps += steps_done
        replayed += used
    method.after_task(stage)
    prune_optimizer(run.optimizer, method.model)  # parameters the method removed leave the optimiser
    run.backend.same_on_every_rank(label, lambda: agreement.fingerprint(method.model, method.state_dict()))
    for task in stage.tasks:
        run.replay.add_task(task)
    train_s = time.perf_counter() - t0

    t1 = time.perf_counter()
    trained = sorted({run.tasks.index(task) for s in run.stages[:stage.index + 1] for task in s.tasks})
    own = sorted(run.tasks.index(task) for task in stage.tasks)
    indices = (list(range(len(run.tasks))) if run.config.eval.eval_all
               else own if method.eval_scope == "stage" else trained)
    if run.config.eval.next_task and stage.index + 1 < n_stages:  # R[b][next], for FWT
        upcoming = [run.tasks.index(t) for t in run.stages[stage.index + 1].tasks]
        indices = sorted(set(indices) | set(upcoming))
    evals = _evaluate(run, label, indices, method.model, stop)
    eval_s = time.perf_counter() - t1
    for j, ev in evals.items():
        rec.matrix[stage.index][j] = ev.score
        rec.task_metrics.append({"stage": stage.index, "task": run.tasks[j].name, **ev.details})
        run.predictions.extend({"stage": stage.index, **row} for row in ev.rows)
    rec.params.append(ParamReport.from_method(stage.index, method.param_report()))
    _probe(run, stage, [run.tasks[j] for j in trained])
    rec.timing.stages.append(StageTiming(stage.index, round(train_s, 2), round(eval_s, 2), n_steps,
                                         round(peak_rss_mb(), 1)))
    # total_s: the stages (training + evaluation) and the zero-shot row; prepare_s (loading) apart
    rec.timing.total_s = round(sum(s.train_s + s.eval_s for s in rec.timing.stages)
                               + (rec.timing.zero_shot_s or 0.0), 2)
    used = (rec.replay or {}).get("used", 0) + replayed
    rec.replay = {**run.replay.summary(), "used": used}
    rec.stages_done = stage.index + 1
    if run.backend.is_main:
        results.append_metrics(run.run_dir, log_rows)
    # Record first, checkpoint second: a crash between the two resumes from the
    # previous checkpoint and redoes this stage, never skips it.
    run.write_files()
    with run.backend.whole(run.optimizer):  # ZeRO-3 keeps the optimiser state cut between phases
        checkpoint.save(run, stage.index)
    if not run.backend.is_main:
        return
    scores = ", ".join(f"{run.tasks[j].name} {evals[j].score:.1f}" for j in indices)
    log.info("%s done in %.0fs (train %.0fs, eval %.0fs): %s", label, train_s + eval_s,
             train_s, eval_s, scores)


def _train_phase(run: Run, stage: Stage, index: int, phase: Phase, desc: str, log_rows: list[dict],
                 tag: bool, start: int | None, checkpoints: _InStageCheckpoints,
                 stop: signals.Stop) -> tuple[int, int]:
    """Train phase `index` of `stage` from step `start` (None: none of it, it is
    already taken); returns (optimiser steps, replay examples used), the steps
    taken before `start` included. Step log rows go to `log_rows`, tagged with the
    phase when `tag`."""
    method = run.method
    epochs = epoch_rows(run, stage)
    replay_rows, replayed = None, 0
    if method.uses_replay and phase.replay and len(run.replay):
        rows = list(tokenize_train(run.encoder, run.replay.examples(), run.cache_dir))
        if run.config.replay.policy == "epoch":
            epochs.append(rows)  # TRACE's extra epoch over the buffer
            replayed = len(rows)
        else:
            replay_rows = rows  # interleaved by the backend, one micro-batch a step
    t = run.config.train
    n_steps = phase_steps(map(len, epochs), t.batch_size)
    extra = {"phase": phase.name} if tag else {}
    start = n_steps if start is None else start
    if start > n_steps:
        raise checkpoint_shape.LayoutError(
            f"{checkpoint.checkpoint_file(run.run_dir, checkpoint.STEP_CHECKPOINT_DIR)}: field step={start} is beyond "
            f"the phase's {n_steps} steps; {checkpoint_shape.FIX}")
    schedule = LrSchedule(run.optimizer, t.lr_schedule, t.warmup_ratio, n_steps)
    schedule.at(start)
    with progress.bar(n_steps, desc, "step", run.progress, run.backend.is_main, initial=start) as bar:
        def on_step(step: int, parts: dict[str, float]) -> None:
            bad = [k for k, v in parts.items() if not math.isfinite(v)]
            if bad:  # diverged: the stage stops here, before anything of it is saved
                run.record.failed_at = {"stage": stage.index, "step": step}
                kept = f"stage {stage.index}'s checkpoint is kept" if stage.index else "no stage was saved"
                raise UserError(f"{desc}: {bad[0]} is {parts[bad[0]]} at step {step}; the run diverged "
                                f"and stopped ({kept}): lower method_args.lr (now {method.args.lr:g}) "
                                f"and start a new run")
            schedule.at(step + 1)
            log_rows.append({"stage": stage.index, **extra, "step": step, **parts})
            run.global_step += 1
            run.metrics.log(run.global_step, {"stage": stage.index, **parts})
            bar.set_postfix({k: f"{v:.3f}" for k, v in parts.items() if k != "grad_norm"})
            bar.update()
            if step + 1 < n_steps:  # at the phase's end, the next phase's first step comes soon
                checkpoints.after_step(index, step + 1, log_rows)
            stop.check()  # a signal whose interrupt a finaliser swallowed during the step

        replayed += run.backend.train_stage(method, run.optimizer, stage, epochs,
                                            run.encoder.tokenizer.pad_token_id, on_step, replay_rows,
                                            start_step=start)
    return n_steps, replayed


def epoch_rows(run: Run, stage: Stage) -> list[list[dict]]:
    """Rows of each epoch of `stage`, as the phase trains them: a task joins epoch e
    while e < its epoch count (epoch_members); each epoch's rows are batched together.
    MethodContext.stage_steps counts the same steps without tokenising
    (tests/test_method.py holds the two together)."""
    rows = [list(tokenize_train(run.encoder, t.train, run.cache_dir)) for t in stage.tasks]
    members = epoch_members([run.config.train.epochs_for(t.name) for t in stage.tasks])
    return [[row for i in tasks for row in rows[i]] for tasks in members]


def _evaluate(run: Run, stage_label: str, indices: list[int], model, stop: signals.Stop,
              task_done: Callable[[int, Any], None] | None = None) -> dict[int, Any]:
    """TaskEval per task index; `task_done(j, its TaskEval)` after each task."""
    total = sum(len(run.tasks[j].test) for j in indices)
    out = {}
    with progress.bar(total, f"{stage_label} eval", "ex", run.progress, run.backend.is_main,
                      leave=False) as bar, precision.evaluation(run.backend.eval_precision, run.backend.device, model), \
            progress.decoding(model, bar) as decoding:
        def batch_done(n: int) -> None:
            bar.update(n)
            stop.check()

        for j in indices:
            decoding(run.tasks[j].name, max_new_tokens(run.tasks[j].spec, run.config.eval))
            out[j] = evaluate_task(model, run.encoder, run.tasks[j], run.config.eval, batch_done,
                                   run.backend.generate)
            if task_done is not None:
                task_done(j, out[j])
    return out


def _probe(run: Run, stage: Stage, trained: list) -> None:
    """The optional analyses of eval: CKA per layer of each trained task since it
    was learned and its routing drift (every stage), expert sharpness (after the
    last stage)."""
    probes = run.record.probes or {}
    model, ev = run.method.model, run.config.eval
    if run.probe is not None:
        probes.setdefault("cka", {})[str(stage.index)] = run.probe.after_stage(model, run.encoder, trained)
    if run.routing is not None:
        routed = run.routing.after_stage(model, run.encoder, trained)
        if routed:
            probes.setdefault("routing", {})[str(stage.index)] = routed
    if ev.sharpness and stage.index == len(run.stages) - 1:
        rows = [run.encoder.train_example(e.prompt, e.answer) for e in stage.tasks[-1].test[:ev.sharpness]]
        batch = {k: v.to(run.backend.device)
                 for k, v in collate(rows, run.encoder.tokenizer.pad_token_id).items()}
        probes.setdefault("sharpness", {})[str(stage.index)] = expert_sharpness(
            model, batch, ev.sharpness_iters, ev.sharpness_layers)
    run.record.probes = probes or None
    _general(run, str(stage.index))


def _general(run: Run, point: str) -> bool:
    """The Lima probe and the lm-eval tasks at `point` (a stage index, or the zero-shot point), where
    due and not yet in the record, in the evaluation's precision; whether anything was measured."""
    rec, model = run.record, run.method.model
    lima = run.lima is not None and not measured(rec.general, point)
    tasks = (run.general_tasks is not None and run.general_tasks.due(point, len(run.stages))
             and point not in ((rec.general or {}).get("lm_eval") or {}).get("points", {}))
    with precision.evaluation(run.backend.eval_precision, run.backend.device, model):
        if lima:
            rec.general = run.lima.record(rec.general, point, model, run.encoder)
        if tasks:
            rec.general = run.general_tasks.record(rec.general, point, model, run.encoder.tokenizer)
    return lima or tasks


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB
