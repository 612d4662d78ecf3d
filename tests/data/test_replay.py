"""The harness-owned replay buffer: budget, seeding, policies, resume."""
from __future__ import annotations

import json

import pytest

from cl_bench import registry
from cl_bench.record import io as results
from cl_bench.benchmarks.trace import load_task
from cl_bench.config import ReplayConfig
from cl_bench.data.replay import ReplayBuffer
from helpers import interrupted_run, make_trace, run_cli, smoke_args


def record_of(out):
    (path,) = list(out.glob("*/run.json"))
    return json.loads(path.read_text()), path.parent


def test_budget_is_ten_percent_at_least_one_and_seeded(tmp_path):
    root = make_trace(tmp_path / "t", n_train=45)
    task = load_task(root, "Py150", None, None, seed=1)
    buf = ReplayBuffer(ReplayConfig(), seed=1)
    buf.add_task(task)
    assert len(buf) == 4  # round(0.1 * 45)
    again = ReplayBuffer(ReplayConfig(), seed=1)
    again.add_task(task)
    other = ReplayBuffer(ReplayConfig(), seed=2)
    other.add_task(task)
    assert buf.entries == again.entries != other.entries
    tiny = ReplayBuffer(ReplayConfig(fraction=0.01), seed=1)
    tiny.add_task(task)
    assert len(tiny) == 1
    fixed = ReplayBuffer(ReplayConfig(per_task=7), seed=1)
    fixed.add_task(task)
    assert len(fixed) == 7


def test_buffer_round_trips_through_state_dict(tmp_path):
    root = make_trace(tmp_path / "t", n_train=30)
    tasks = [load_task(root, n, None, None, seed=0) for n in ("Py150", "20Minuten")]
    buf = ReplayBuffer(ReplayConfig(), seed=0)
    for t in tasks:
        buf.add_task(t)
    back = ReplayBuffer(ReplayConfig(), seed=0)
    back.load_state_dict(buf.state_dict(), {t.name: t.train for t in tasks})
    assert back.examples() == buf.examples() and back.per_task == {"Py150": 3, "20Minuten": 3}


@pytest.mark.slow
def test_interleave_adds_one_replay_micro_batch_per_step_after_task_0(trace_dir, tmp_path):
    out = tmp_path / "runs"
    assert run_cli(*smoke_args(trace_dir, out, "--method", "replay")) == 0
    record, run_dir = record_of(out)
    steps = results.read_jsonl(run_dir / "metrics.jsonl")
    assert not any("replay_lm" in s for s in steps if s["stage"] == 0)  # buffer empty at task 0
    assert all("replay_lm" in s for s in steps if s["stage"] > 0)
    # smoke: n_train 8 -> 1 stored per task; 2 steps per stage x micro-batch 2 in stages 1 and 2
    assert record["replay"]["stored"] == {"NumGLUE-cm": 1, "Py150": 1, "20Minuten": 1}
    assert record["replay"]["used"] == 2 * 2 * 2


@pytest.mark.slow
def test_methods_that_do_not_replay_use_nothing_but_see_the_same_buffer(trace_dir, tmp_path):
    out = tmp_path / "runs"
    assert run_cli(*smoke_args(trace_dir, out)) == 0
    record, run_dir = record_of(out)
    assert record["replay"]["used"] == 0 and record["replay"]["size"] == 3
    assert not any("replay_lm" in s for s in results.read_jsonl(run_dir / "metrics.jsonl"))


@pytest.mark.slow
def test_epoch_policy_adds_one_epoch_over_past_tasks(trace_dir, tmp_path):
    out = tmp_path / "runs"
    assert run_cli(*smoke_args(trace_dir, out, "--method", "replay", "--set", "replay.per_task=4",
                               "--set", "replay.policy=epoch")) == 0
    record, _ = record_of(out)
    steps = [s["steps"] for s in record["timing"]["stages"]]
    # 8 examples / batch 4 = 2 steps per task; + ceil(4 * b / 4) replay steps at stage b
    assert steps == [2, 2 + 1, 2 + 2]
    assert record["replay"]["used"] == 4 + 8


@pytest.mark.slow
def test_lima_is_opt_in(tmp_path):
    root = make_trace(tmp_path / "t", tasks=["NumGLUE-cm", "Py150", "20Minuten", "Lima"])
    out = tmp_path / "runs"
    assert run_cli(*smoke_args(root, out, "--method", "replay", "--set", "replay.lima=5")) == 0
    record, run_dir = record_of(out)
    assert record["replay"]["stored"]["Lima"] == 5
    assert all("replay_lm" in s for s in results.read_jsonl(run_dir / "metrics.jsonl"))


@pytest.mark.slow
def test_buffer_survives_resume(trace_dir, tmp_path, monkeypatch):
    straight = tmp_path / "straight"
    assert run_cli(*smoke_args(trace_dir, straight, "--method", "replay")) == 0
    expected, straight_dir = record_of(straight)

    broken = tmp_path / "broken"
    run_dir = interrupted_run(monkeypatch, *smoke_args(trace_dir, broken, "--method", "replay"),
                              at_stage=2)
    assert run_cli("run", "--resume", run_dir, "--no-progress") == 0
    resumed, _ = record_of(broken)
    assert resumed["replay"] == expected["replay"]
    assert resumed["matrix"] == expected["matrix"]
    replay_losses = lambda d: [s.get("replay_lm") for s in results.read_jsonl(d / "metrics.jsonl")]
    assert replay_losses(run_dir) == replay_losses(straight_dir)


def test_bad_replay_settings_fail_early(trace_dir, tmp_path, capsys):
    assert run_cli(*smoke_args(trace_dir, tmp_path / "o", "--set", "replay.policy=mixed")) == 2
    assert "replay.policy" in capsys.readouterr().err


REPLAYING = sorted(name for name in registry.available() if registry.get(name).uses_replay)


@pytest.mark.slow
@pytest.mark.parametrize("name", REPLAYING)
def test_every_replaying_method_replays_only_the_buffer_of_earlier_tasks_at_its_budget(
        name, trace_dir, tmp_path, monkeypatch):
    """Catches: replayed rows drawn from the current stage's tasks instead of the
    buffer of earlier tasks; and a replaying method other than `replay` given more
    than the run's one budget (more examples stored for it, or more replay
    micro-batches a step). Every method that declares uses_replay, on its smoke run
    with replay.per_task=2:
    - the buffer stores exactly 2 examples of each task (`stored`, `size`);
    - every row that reaches replay_loss during stage s is, token for token, an
      example the buffer held when stage s began: one added after an earlier stage
      (so none of stage s's own examples);
    - one replay micro-batch (micro_batch_size rows) per step that logs replay
      parts, and `used` counts exactly the rows replay_loss saw."""
    cls = registry.get(name)
    seen = {"stage": None, "buffer": [], "replayed": []}  # buffer: (stage added after, example)
    real_add, real_before, real_replay = ReplayBuffer.add_task, cls.before_task, cls.replay_loss

    def add_task(self, task):
        before = len(self.entries)
        real_add(self, task)
        seen["buffer"] += [(seen["stage"], self._examples[key]) for key in self.entries[before:]]

    def before_task(self, stage):
        seen["stage"] = stage.index
        return real_before(self, stage)

    def replay_loss(self, batch, step):
        held = {tuple(self.ctx.encoder.train_example(e.prompt, e.answer)["input_ids"]): s
                for s, e in seen["buffer"]}
        for ids, n in zip(batch["input_ids"].tolist(), batch["attention_mask"].sum(1).tolist()):
            row = tuple(ids[:n])
            assert row in held, f"stage {seen['stage']}: a replayed row is not in the buffer"
            assert held[row] < seen["stage"], f"stage {seen['stage']}: replayed a row of stage {held[row]}"
            seen["replayed"].append((seen["stage"], row))
        return real_replay(self, batch, step)

    monkeypatch.setattr(ReplayBuffer, "add_task", add_task)
    monkeypatch.setattr(cls, "before_task", before_task)
    monkeypatch.setattr(cls, "replay_loss", replay_loss)
    out = tmp_path / "runs"
    assert run_cli(*smoke_args(trace_dir, out, "--method", name, "--set", "replay.per_task=2")) == 0
    record, run_dir = record_of(out)
    assert record["replay"]["stored"] == {"NumGLUE-cm": 2, "Py150": 2, "20Minuten": 2}
    assert record["replay"]["size"] == 6 and len(seen["buffer"]) == 6
    replay_steps = [s for s in results.read_jsonl(run_dir / "metrics.jsonl")
                    if any(k.startswith("replay_") for k in s)]
    micro = record["config"]["train"]["micro_batch_size"]
    assert replay_steps and {s["stage"] for s in replay_steps} == {1, 2}
    assert len(seen["replayed"]) == micro * len(replay_steps) == record["replay"]["used"]
