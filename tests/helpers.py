"""Helpers the tests share (conftest.py keeps the fixtures and the pytest hooks):
the synthetic TRACE tree and the CLI, a method set up on the tiny random Llama
(2 layers, width 64), and what the method and backend tests of one family share.
Importable from every folder under tests/ (`pythonpath` in pyproject.toml)."""
from __future__ import annotations

import hashlib
import json
import os
import random
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from cl_bench import registry
from cl_bench.record import io as results
from cl_bench.run import checkpoint
from cl_bench.benchmarks.trace.loader import Example
from cl_bench.cli import main
from cl_bench.config import RunConfig, TrainConfig, resolve
from cl_bench.data.encode import IGNORE, Encoder, collate
from cl_bench.method import MethodContext, Stage
from cl_bench.models.loading import tiny_llama

# ---- the synthetic TRACE tree and the CLI --------------------------------------

SMOKE_TASKS = ["NumGLUE-cm", "Py150", "20Minuten"]


def trace_example(task: str, rng: random.Random) -> dict:
    a, b = rng.randint(1, 9), rng.randint(1, 9)
    if task == "Py150":
        return {"prompt": f"<s> def f{a}(x):<EOL> y = x + {b}<EOL>", "answer": f"return y * <NUM_LIT:{a}>"}
    if task == "20Minuten":
        return {"prompt": f"Provide a simplified version of the following paragraph in German.\n\n"
                          f"Paragraph:\nDer Hund {a} lief heute sehr schnell nach Hause {b}.\n\nSimplification:",
                "answer": f"Der Hund {a} lief nach Hause."}
    return {"prompt": f"Solve the following math problem.\nQuestion:\n{a} plus {b}?\nAnswer:",
            "answer": str(a + b)}


def make_trace(root: Path, tasks=SMOKE_TASKS, n_train: int = 12, n_test: int = 6) -> Path:
    rng = random.Random(0)
    for task in tasks:
        folder = root / task
        folder.mkdir(parents=True, exist_ok=True)
        for split, n in (("train", n_train), ("eval", n_test), ("test", n_test)):
            (folder / f"{split}.json").write_text(json.dumps([trace_example(task, rng) for _ in range(n)]))
    return root


def run_cli(*argv: str) -> int:
    return main([str(a) for a in argv])


def only_run(out: Path) -> Path:
    """The one run folder under `out` (which also holds the tokenisation cache)."""
    (run_dir,) = [p.parent for p in Path(out).glob("*/run.json")]
    return run_dir


def interrupted_run(monkeypatch, *argv, at_stage: int, backend: type | None = None,
                    after_step: int | None = None) -> Path:
    """Run the CLI, raising KeyboardInterrupt (Ctrl-C) while stage `at_stage`
    (0-based) trains on `backend` (a Backend class; default TorchBackend), on every
    rank: as it starts, or once step `after_step` of its first phase is taken (and
    checkpointed, where the run checkpoints in-stage); returns the run folder, whose
    finished stages are saved."""
    import torch

    if backend is None:
        from cl_bench.backends.torch_backend import TorchBackend as backend
    real = backend.train_stage

    def interrupt(self, method, optimizer, stage, epochs, pad_id, on_step=None, *args, **kwargs):
        if stage.index == at_stage and after_step is None:
            raise KeyboardInterrupt

        def report(step, parts):
            on_step(step, parts)
            if stage.index == at_stage and step == after_step:
                raise KeyboardInterrupt
        return real(self, method, optimizer, stage, epochs, pad_id, report, *args, **kwargs)

    monkeypatch.setattr(backend, "train_stage", interrupt)
    try:
        assert run_cli(*argv) == 130
    finally:
        monkeypatch.setattr(backend, "train_stage", real)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()  # with several ranks: until rank 0 has written the record
    argv = [str(a) for a in argv]
    return only_run(Path(argv[argv.index("--output-dir") + 1]))


def smoke_args(trace_dir: Path, out: Path, *extra: str) -> list[str]:
    """A smoke run on the synthetic data; lr 1e-3 so the tiny model visibly learns."""
    return ["run", "--profile", "smoke", "--data-dir", str(trace_dir), "--output-dir", str(out),
            "--no-progress", "--method-arg", "lr=1e-3", *extra]


# ---- a method on the tiny Llama --------------------------------------------------

def make_task(name: str, n: int = 8, offset: int = 0) -> SimpleNamespace:
    """`n` arithmetic examples, numbered from `offset` (other offsets: other examples)."""
    train = [Example(f"Question: {i} plus {i + 1}? Answer:", f"{2 * i + 1} apples", i)
             for i in range(offset, offset + n)]
    return SimpleNamespace(name=name, train=train)


def make_method(name: str, seed: int = 0, *, profile: str | None = None, tasks=(), n_stages: int | None = None,
                context: MethodContext | None = None, **args):
    """The registered method `name` with `args`, set up on a seeded tiny Llama (the
    global generator seeded again before setup, for what setup draws). Its context:
    `context` if given (e.g. MethodContext.for_shapes), else the tiny config (short
    prompts) or `profile`'s, with an encoder as the harness gives it, `tasks` as
    all_tasks and `n_stages`. The one way the tests build a method."""
    model, tokenizer, _ = tiny_llama(seed)
    if context is None:
        config = (resolve(profile, None, {"method": name}) if profile else
                  RunConfig(model="tiny-llama", seed=seed,
                            train=TrainConfig(max_prompt_len=96, max_answer_len=16, truncation_head=16)))
        context = MethodContext(config, torch.device("cpu"), tokenizer, all_tasks=list(tasks),
                                encoder=Encoder.from_config(tokenizer, config.train), n_stages=n_stages)
    cls = registry.get(name)
    method = cls(cls.parse_args(args), context)
    torch.manual_seed(seed)
    method.setup(model)
    return method


def random_batch(seed: int = 0, length: int = 12, prompt: int = 0) -> dict[str, torch.Tensor]:
    """Two rows of random ids (seeded), the second right-padded over its last 3
    positions, as the collator pads; the first `prompt` positions labelled IGNORE."""
    ids = torch.randint(3, 259, (2, length), generator=torch.Generator().manual_seed(seed))  # (2, L)
    mask = torch.ones_like(ids)
    mask[1, length - 3:] = 0
    labels = ids.masked_fill(mask == 0, IGNORE)
    labels[:, :prompt] = IGNORE
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


# ---- mechanism tests (O-LoRA, OGD, LwF): the backend's hooks, by hand -------------

def encode(method, examples) -> dict[str, torch.Tensor]:
    """`examples` (prompt, answer) as one training batch, through the method's encoder."""
    encoder = method.ctx.encoder
    return collate([encoder.train_example(e.prompt, e.answer) for e in examples], method.ctx.pad_id)


def distinct_stages(n: int) -> list[Stage]:
    # Different examples per task, so each task's gradients are its own.
    return [Stage(i, [make_task(f"task{i}", n=6, offset=10 * i)], f"task{i}") for i in range(n)]


def answer_ce(model, batch) -> torch.Tensor:
    """Causal-LM cross-entropy by hand: mean over the positions whose next label is not IGNORE."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                   use_cache=False).logits  # (B, L, V)
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), batch["labels"][:, 1:].flatten(),
                           ignore_index=IGNORE)


def run_steps(method, stage: Stage, batch, n_steps: int, optimizer=None, on_step=None):
    """The backend's per-step hook order on one fixed batch (no before/after_task)."""
    optimizer = method.optimizer_for_stage(stage, optimizer)
    for step in range(n_steps):
        optimizer.zero_grad(set_to_none=True)
        loss, parts = method.loss(batch, step)
        loss.backward()
        method.before_step(step)
        if on_step is not None:
            on_step(step, loss, parts)
        optimizer.step()
        method.after_step(step)
    return optimizer


# ---- the LoRA family (lora, olora, ogd) --------------------------------------------
# The tiny model has 2 layers of width 64 with 2 KV heads of 16, so q_proj is
# 64 -> 64 and v_proj 64 -> 32; one rank-8 LoRA on both adds, per layer,
# 8·(64+64) + 8·(64+32) = 1792 parameters, 3584 in all.

LORA_SIZE = 2 * (8 * (64 + 64) + 8 * (64 + 32))  # 3584


def batch_of(method, task, n: int = 4) -> dict[str, torch.Tensor]:
    """The first `n` training examples of `task` as one batch."""
    return encode(method, task.train[:n])


def train_stage(method, stage: Stage, n_steps: int = 3, optimizer=None):
    """The backend's hook order on one fixed batch, between before_task and
    after_task; returns the optimiser."""
    method.before_task(stage)
    optimizer = run_steps(method, stage, batch_of(method, stage.tasks[0]), n_steps, optimizer)
    method.after_task(stage)
    return optimizer


def stages(n: int) -> list[Stage]:
    return [Stage(i, [make_task(f"task{i}")], f"task{i}") for i in range(n)]


def complete_record(run_dir: Path) -> dict:
    record = json.loads((run_dir / "run.json").read_text())
    assert record["status"] == "complete"
    assert [[v is not None for v in row] for row in record["matrix"]] == \
        [[j <= b for j in range(3)] for b in range(3)]
    assert record["summary"] is not None and len(record["params"]) == 3
    return record


# ---- EWC and LwF: the smoke profile's config, the λ = 0 reference -------------------

TWO_TASKS = ("--order", "NumGLUE-cm,Py150")


def record(run_dir: Path) -> dict:
    return json.loads((run_dir / "run.json").read_text())


def flat_params(record: dict) -> list[dict]:
    """The record's parameter rows with the method's own keys beside the counts, whether
    a row holds them flat or under "diagnostics" (the record's schema versions)."""
    return [{**p, **p.get("diagnostics", {})} for p in record["params"]]


def metric(run_dir: Path, key: str, stage: int | None = None) -> list[float]:
    return [r[key] for r in results.read_jsonl(run_dir / "metrics.jsonl")
            if stage is None or r["stage"] == stage]


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return checkpoint.load_checkpoint(run_dir)["model"]


def task(*pairs: tuple[str, str]):
    return SimpleNamespace(name="t", train=[SimpleNamespace(prompt=p, answer=a) for p, a in pairs])


TASK_A = task(("Question:\n1 plus 2?\nAnswer:", "3"), ("Question:\n4 plus 4?\nAnswer:", "8"))
TASK_B = task(("<s> def f(x):<EOL>", "return x"), ("<s> y = 2<EOL>", "print(y)"))


def make(name: str, n_tasks: int = 3, **args):
    """A method on the tiny model with the smoke profile's config over `n_tasks` tasks, set up."""
    return make_method(name, profile="smoke", tasks=[TASK_A] * n_tasks, n_stages=n_tasks, **args)


def assert_same_as_seqft(run_dir: Path, seqft: Path) -> None:
    assert metric(run_dir, "lm") == metric(seqft, "lm")  # exact, step for step
    assert len(set(metric(seqft, "lm"))) > 1  # it trained
    assert record(run_dir)["matrix"] == record(seqft)["matrix"]
    ours, theirs = final_weights(run_dir), final_weights(seqft)
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)


# ---- the deepspeed backend ---------------------------------------------------------

LOSS_RTOL = 1e-5


def small_buckets(tmp_path: Path) -> Path:
    """Tiny buckets and no persistent parameters, so that on the tiny model ZeRO-2
    reduces in several buckets and ZeRO-3 really partitions every weight."""
    path = tmp_path / "small.json"
    path.write_text(json.dumps({"zero_optimization": {
        "reduce_bucket_size": 2000, "allgather_bucket_size": 2000,
        "stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 2000}}))
    return path


def deepspeed_args(tmp_path: Path, zero: int) -> list[str]:
    return ["--backend", "deepspeed", "--zero", str(zero), "--set", f"deepspeed.config={small_buckets(tmp_path)}"]


def launch_env() -> dict:
    """The environment of a `cl-bench` started as its own process (a launch of ranks):
    this checkout's cl_bench and tests/ first, one thread, a hung collective failing
    within 3 minutes, and none of this process's rank variables (it is not a rank)."""
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(map(str, (root / "tests", root))),
           "CL_BENCH_DIST_TIMEOUT_MIN": "3"}
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


def signal_once_saved(proc: subprocess.Popen, run_dir: Path, sig: int) -> tuple[int, str]:
    """Send `sig` to `proc` once stage 1 is saved (record and checkpoint); its exit
    code and output. The deadline guards against a hang, not a speed: on a loaded machine
    (CI's other xdist worker beside two DeepSpeed ranks, other work) the launch and stage 1
    have taken over 300 s."""
    deadline = time.monotonic() + 600
    while not checkpoint.has_checkpoint(run_dir):
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        assert time.monotonic() < deadline
        time.sleep(0.05)
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=120)
    return proc.returncode, out


def interrupted_ds_run(monkeypatch, *argv, at_stage: int, after_step: int | None = None) -> Path:
    """interrupted_run on the deepspeed backend."""
    from cl_bench.backends.deepspeed_backend import DeepSpeedBackend

    return interrupted_run(monkeypatch, *argv, at_stage=at_stage, backend=DeepSpeedBackend, after_step=after_step)


def tied_tiny_llama(folder: Path) -> Path:
    """The tiny Llama with its head tied to its embeddings (tie_word_embeddings, as
    Llama-3.2 and SmolLM2 have; the built-in tiny-llama is untied), saved for --model."""
    from transformers import LlamaForCausalLM

    model, tokenizer, _ = tiny_llama(0)
    model.config.tie_word_embeddings = True
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        tied = LlamaForCausalLM(model.config)
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    tied.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def assert_follows_fp32(fp32: Path, bf16: Path, grad_norm: bool = True) -> None:
    """A bf16 run follows the fp32 run of the same method: each step's loss within 2e-3
    and (`grad_norm`) its grad_norm within 2e-2 relative (tests/backends/test_deepspeed.py's
    bf16 tests)."""
    for x, y in zip(log_rows(fp32), log_rows(bf16), strict=True):
        assert y["lm"] == pytest.approx(x["lm"], rel=2e-3), (x, y)
        assert not grad_norm or y["grad_norm"] == pytest.approx(x["grad_norm"], rel=2e-2), (x, y)


def log_rows(run_dir: Path) -> list[dict]:
    return results.read_jsonl(run_dir / "metrics.jsonl")


def assert_close_values(x, y, rtol: float, atol: float, at: str) -> None:
    """Two JSON values equal, floats within the tolerance (nested dicts and lists)."""
    if isinstance(x, dict) and isinstance(y, dict):
        assert x.keys() == y.keys(), at
        for key in x:
            assert_close_values(x[key], y[key], rtol, atol, f"{at}.{key}")
    elif isinstance(x, list) and isinstance(y, list):
        assert len(x) == len(y), at
        for i, (u, v) in enumerate(zip(x, y)):
            assert_close_values(u, v, rtol, atol, f"{at}[{i}]")
    elif isinstance(x, float) or isinstance(y, float):
        assert y == pytest.approx(x, rel=rtol, abs=atol), (at, x, y)
    else:
        assert x == y, (at, x, y)


def assert_same_run(a: Path, b: Path, rtol: float = LOSS_RTOL, atol: float = 1e-6) -> None:
    """Two run folders hold the same results: every logged number within the tolerance
    (grad_norm: DeepSpeed sums its squares in fp64), the R matrix and the predictions equal,
    the parameter rows (counts, each method's stage record) equal, floats within the tolerance."""
    ra, rb = log_rows(a), log_rows(b)
    assert len(ra) == len(rb) > 0
    for x, y in zip(ra, rb):
        assert x.keys() == y.keys()
        for key in x.keys() - {"stage", "step", "phase"}:
            assert y[key] == pytest.approx(x[key], rel=rtol, abs=atol), (key, x, y)
    rec_a, rec_b = (json.loads((d / "run.json").read_text()) for d in (a, b))
    assert rec_a["matrix"] == rec_b["matrix"]
    # counts and the methods' records; those round to 6 decimals (record.schema.rounded): a last-place step
    assert_close_values(rec_a["params"], rec_b["params"], rtol, max(atol, 2e-6), "params")
    preds = lambda d: [r["prediction"] for r in results.read_jsonl(d / "predictions.jsonl")]
    assert preds(a) == preds(b)


# ---- decoding -------------------------------------------------------------------

def assert_decodes_as_the_plain_loop(model, prompts: list[list[int]], new_tokens: int, pad_id: int,
                                     batch_size: int) -> None:
    """cl_bench.eval.generation's outputs equal the plain loop's (cl_bench/tools/perf/plain_decoding.py)
    with an EOS picked so that rows stop at different steps, and some decoding step
    ran with fewer rows than the batch (the stopped rows left it)."""
    from cl_bench.eval.generation import greedy_generate
    from cl_bench.tools.perf.plain_decoding import plain_generate

    free = plain_generate(model, prompts, new_tokens, -1, pad_id, batch_size)
    # the token the first prompt's continuation makes at step 1, as EOS
    eos = free[0][1]
    stops = [g.index(eos) if eos in g else new_tokens for g in free]
    assert len(set(stops)) > 1, f"rows must stop at different steps: {stops}"
    calls: list[tuple[int, int]] = []  # (rows, columns) of each forward
    handle = model.register_forward_pre_hook(
        lambda m, a, k: calls.append(tuple(k["input_ids"].shape)), with_kwargs=True)
    try:
        ours = greedy_generate(model, prompts, new_tokens, eos, pad_id, batch_size)
    finally:
        handle.remove()
    assert ours == plain_generate(model, prompts, new_tokens, eos, pad_id, batch_size)
    batch, shrank = 0, False
    for rows, cols in calls:
        if cols > 1:  # a prefill: a new batch
            batch = rows
        shrank |= cols == 1 and rows < batch
    assert shrank, calls


# a hand-made run record and its predictions (the views that read records: intervals,
# compare, claims)
RECORD_TASKS = ["NumGLUE-cm", "C-STANCE"]


def make_record(scores: dict, tasks=RECORD_TASKS, seed=1, n_test=None) -> tuple[dict, list[dict]]:
    """A record (as JSON, schema 1) and predictions from per-(stage, task) item
    scores (0 or 100); stage -1 is the zero-shot row. A correct item predicts the
    answer itself."""
    n = len(tasks)
    matrix = [[None] * n for _ in range(n)]
    zero = [None] * n
    preds = []
    for (b, j), items in scores.items():
        mean = sum(items) / len(items)
        if b < 0:
            zero[j] = mean
        else:
            matrix[b][j] = mean
        answer, wrong = ("7", "8") if tasks[j].startswith("NumGLUE") else ("A", "B")
        for i, s in enumerate(items):  # wrong answers are well formed, except at stage 1 ("x")
            preds.append({"stage": b, "task": tasks[j], "index": i, "prompt": "p", "answer": answer,
                          "prediction": answer if s else ("x" if b == 1 else wrong), "score": float(s)})
    record = {"schema_version": 1, "method": "seqft", "tasks": list(tasks), "matrix": matrix,
              "zero_shot": zero if any(v is not None for v in zero) else None, "seed": seed,
              "data": {t: {"test": {"indices": list(range(n_test or 4)), "sha256": "t"},
                           "train": {"indices": [1, 2], "sha256": "r"}} for t in tasks},
              "config": {"model": "tiny-llama", "data": {"order": tasks}, "train": {"batch_size": 4},
                         "eval": {}, "replay": {}}}
    return record, preds


def write_run(folder, record, preds):
    folder.mkdir(parents=True)
    (folder / "run.json").write_text(json.dumps(record))
    (folder / "predictions.jsonl").write_text("".join(json.dumps(p) + "\n" for p in preds))
    return folder


def file_digests(folder: Path) -> dict[str, str] | None:
    """Every file under `folder` -> its sha256 (None for no folder): equal before and
    after means nothing already written changed."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()} if folder.exists() else None


def one_line_error(capsys) -> str:
    """What the command wrote to stderr, asserted to be one line with no traceback."""
    err = capsys.readouterr().err.strip()
    assert err and "\n" not in err and "Traceback" not in err, err
    return err
