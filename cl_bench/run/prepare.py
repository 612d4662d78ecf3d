"""Prepare a run whose config passed cl_bench/run/checks.py: claim (or, for
--resume, lock) the run folder, load data and model, set the method up, and
start the record, or continue the interrupted run where cl_bench/run/resume.py
says. What it returns, a Run (cl_bench/run/state.py), is what the stage loop
(cl_bench/run/sequencer.py) runs.
"""
from __future__ import annotations

import dataclasses
import secrets
import shlex
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

from cl_bench.record import io as results
from cl_bench.run import resume
from cl_bench.run.checks import Checked
from cl_bench.run.machine import calibration
from cl_bench.run.resume import Resuming
from cl_bench.run.state import Run
from cl_bench.eval.probes.representation import RepresentationProbe
from cl_bench.eval.probes.routing import RoutingProbe
from cl_bench.backends import Backend
from cl_bench.backends import create as create_backend
from cl_bench import registry
from cl_bench.benchmarks.trace import load_split
from cl_bench.config import RunConfig
from cl_bench.data.encode import Encoder
from cl_bench.errors import UserError
from cl_bench.eval.evaluation import majority_level
from cl_bench.eval.general.lima import LimaProbe
from cl_bench.eval.general.lm_eval_tasks import GeneralTasks
from cl_bench.method import Method, MethodContext, Stage
from cl_bench.models.loading import load
from cl_bench.record.schema import RunRecord, StageRecord
from cl_bench.data.replay import ReplayBuffer


def new_run_id(method: str) -> str:
    return f"{method}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"


def prepare(checked: Checked, resuming: Resuming | None = None, progress: bool = True,
            command: str | None = None, on_start: Callable[..., None] | None = None) -> Run:
    """Load data and model and set the method up for a config that passed the checks
    (cl_bench/run/checks.py, check_config); with `resuming` (resume.recorded, whose
    config is `checked.config`) the run continues where cl_bench/run/resume.py says.
    `command`: the command line to record (default: this process's).
    `on_start(run_dir, config, method_args, record)`, on the main rank, once the run
    folder is claimed (or locked, for a resume: `record` is then the one read under
    the lock), before data and model load."""
    t_start = time.perf_counter()
    command = command or shlex.join(["cl-bench", *sys.argv[1:]])
    config = checked.config
    benchmark = registry.get_benchmark(config.data.benchmark)
    data_dir = benchmark.resolve_data_dir(config.data.data_dir)
    benchmark.present_order(data_dir, config.data.order)  # a task the folder lacks stops here, no folder claimed
    g = config.general  # lm-eval's tasks built offline: a task without local data stops the run here
    general_tasks = GeneralTasks.prepare(g.tasks, g.limit, g.every_stage, config.eval.batch_size) if g.tasks else None
    backend = create_backend(config)  # deepspeed: joins the other ranks
    held: list = []  # rank 0: the run folder's lock, from here until execute ends
    if resuming is None:
        config.run_id = config.run_id or backend.on_main(lambda: new_run_id(config.method))
        run_dir = Path(config.output_dir) / config.run_id
        backend.on_main(lambda: held.append(results.claim_run_dir(run_dir)))
    else:
        run_dir = resuming.run_dir
        backend.on_main(lambda: held.append(results.lock_run(run_dir)))
    try:
        record, restart = resume.under_lock(resuming) if resuming is not None else (None, False)
        if on_start is not None:
            backend.on_main(lambda: on_start(run_dir, config, checked.method_args, record))
        run = _prepare_locked(checked, record, restart, run_dir, data_dir, backend, progress, command, t_start)
    except BaseException:
        for lock in held:
            lock.close()
        raise
    run.lock = held[0] if held else None
    run.general_tasks = general_tasks
    return run


def _prepare_locked(checked, record, restart, run_dir, data_dir, backend, progress, command, t_start) -> Run:
    """The rest of prepare, under the run folder's lock (released if this raises);
    `record`, `restart`: --resume's, as resume.under_lock read them (None, False: a
    new run)."""
    config = checked.config
    d = config.data
    benchmark = registry.get_benchmark(d.benchmark)
    tasks = benchmark.load_tasks(data_dir, d.order, d.n_train, d.n_test, config.seed, d.n_train_per_task,
                                 d.n_test_per_task, d.test_split)
    _check_answers(tasks, data_dir)
    if record is not None:
        _check_same_tasks(record, tasks, run_dir / results.RUN_FILE)
        _check_same_data(record, tasks, run_dir)
    replay = ReplayBuffer(config.replay, config.seed)
    sources = {t.name: t.train for t in tasks}
    lima = LimaProbe.load(data_dir, config.general.lima) if config.general.lima else None
    if config.replay.lima:
        sources["Lima"] = load_split(data_dir, "Lima", "train")
        held_out = lima.indices if lima else set()  # the probe's items stay out of the buffer
        replay.add_lima([e for e in sources["Lima"] if e.index not in held_out])

    torch.manual_seed(config.seed)
    device = backend.device
    loaded = load(config.model, config.seed, device, progress=progress and backend.is_main)
    encoder = Encoder.from_config(loaded.tokenizer, config.train)
    ctx = MethodContext(config=config, device=device, tokenizer=loaded.tokenizer, all_tasks=tasks,
                        encoder=encoder, replay=replay)
    method = checked.method_cls(checked.method_args, ctx)
    method.setup(loaded.model)
    backend.check_model(method.model)
    stages = method.plan(tasks)
    ctx.n_stages = len(stages)
    if record is not None:
        _check_same_stages(record, stages, run_dir / results.RUN_FILE)

    recorded = record  # --resume: the record as read under the lock
    if record is None or restart:
        first = (command if record.command is None else record.command) if restart else command
        record = new_record(config, method, checked.method_args, loaded.info, tasks, stages, first, backend)
    run = Run(config, run_dir, method, tasks, stages, encoder, backend, record, replay, sources,
              progress=progress and backend.is_main)
    if config.eval.cka_probe:
        run.probe = RepresentationProbe(config.eval.cka_probe, config.eval.cka_probe_tokens)
    if config.eval.routing_probe:
        run.routing = RoutingProbe(config.eval.routing_probe)
    run.lima = lima
    if recorded is None or restart:  # validation, data, model load and method set-up, before the first evaluation
        record.timing.prepare_s = round(time.perf_counter() - t_start, 2)
    if recorded is not None:
        resume.take_up(run, recorded, restart, command)
    backend.barrier()  # every rank has read what rank 0 is about to rewrite
    return run


def new_record(config: RunConfig, method: Method, method_args, model_info: dict[str, Any], tasks: list,
               stages: list[Stage], command: str, backend: Backend) -> RunRecord:
    """The record of a run about to start: status "running", nothing scored yet."""
    return RunRecord(
        run_id=config.run_id, status="running", command=command, method=method.name,
        method_args=dataclasses.asdict(method_args), reference=method.reference, uses_replay=method.uses_replay,
        model=model_info, benchmark=registry.get_benchmark(config.data.benchmark).name, tasks=[t.name for t in tasks],
        stages=[StageRecord(s.index, s.label, [t.name for t in s.tasks]) for s in stages],
        profile=config.profile, seed=config.seed, data={t.name: t.provenance for t in tasks},
        matrix=[[None] * len(tasks) for _ in stages],
        majority={t.name: majority_level(t) for t in tasks if majority_level(t) is not None},
        config=config.to_dict(), backend=backend.describe(), machine=calibration(backend.train_precision),
        versions=results.versions(),
        git_commit=results.git_commit())


def _check_same_tasks(record: RunRecord, tasks: list, path: Path) -> None:
    """A record to resume names the tasks its config loads."""
    names = [t.name for t in tasks]
    if record.tasks != names:
        raise UserError(f"{path}: field tasks={record.tasks} differs from its config's data.order ({names}); "
                        f"put back the record as cl-bench wrote it, or move the run folder away")


def _check_same_stages(record: RunRecord, stages: list[Stage], path: Path) -> None:
    """A record to resume has the stages its method plans."""
    if [(s.label, s.tasks) for s in record.stages] != [(s.label, [t.name for t in s.tasks]) for s in stages]:
        raise UserError(f"{path}: field stages differs from the {len(stages)} stages its method plans; put back "
                        f"the record as cl-bench wrote it, or move the run folder away")


def _check_answers(tasks: list, data_dir: Path) -> None:
    """A task whose training records used all have an empty answer would train on
    EOS alone (and with empty prompts too, on no token at all: the loss is NaN)."""
    for t in tasks:
        if all(not e.answer.strip() for e in t.train):
            raise UserError(f"{Path(data_dir) / t.provenance['train']['file']}: field \"answer\" is empty in all "
                            f"{len(t.train)} training records used, so no answer tokens are left to train on; "
                            f"fill in the answers, or leave {t.name} out of data.order")


def _check_same_data(record: RunRecord, tasks: list, where: Path) -> None:
    for t in tasks:
        old = record.data.get(t.name, {})
        for split in ("train", "test"):
            if old.get(split, {}).get("sha256") != t.provenance[split]["sha256"]:
                raise UserError(f"{where}: the {split} data of {t.name} changed since the run "
                                f"started (sha256 differs); resume with the original data")
