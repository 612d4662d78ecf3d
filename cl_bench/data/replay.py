"""The replay buffer: one budget per run, owned by the harness (PROTOCOL.md).

After each stage the harness stores `per_task` examples of every task the stage
trained (default 10% of the task's training subset, at least 1), drawn with the
run seed; Lima examples join from the start only when asked (`replay.lima`).
Every method that declares `uses_replay` draws from this same buffer; no method
can size its own. The buffer is saved in the checkpoint as (task, index) pairs.

Mixing policies (a harness setting, recorded):
- interleave: each optimiser step adds one replay micro-batch (when the buffer
  is non-empty), through `Method.replay_loss`;
- epoch: TRACE's extra epoch over the buffer after the task's own epochs
  (the current task is not yet in the buffer, as in TRACE's replay.py).
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field

from cl_bench.config_fields import ReplayConfig


@dataclass
class ReplayBuffer:
    config: ReplayConfig
    seed: int
    entries: list[tuple[str, int]] = field(default_factory=list)  # (task, source index)
    per_task: dict[str, int] = field(default_factory=dict)
    _examples: dict[tuple[str, int], object] = field(default_factory=dict, repr=False)

    def budget(self, n_train: int) -> int:
        if self.config.per_task is not None:
            return min(self.config.per_task, n_train)
        return min(n_train, max(1, round(self.config.fraction * n_train)))

    def add_task(self, task) -> None:
        """Store a seeded sample of `task.train` (a TaskData)."""
        self._add(task.name, self.chosen(task))

    def chosen(self, task) -> list:
        """The examples of `task.train` that `add_task` stores (a seeded sample)."""
        k = self.budget(len(task.train))
        chosen = sorted(random.Random(f"{self.seed}/replay/{task.name}").sample(range(len(task.train)), k))
        return [task.train[i] for i in chosen]

    def add_lima(self, examples: list) -> None:
        k = min(self.config.lima, len(examples))
        chosen = sorted(random.Random(f"{self.seed}/replay/Lima").sample(range(len(examples)), k))
        self._add("Lima", [examples[i] for i in chosen])

    def _add(self, task: str, examples: list) -> None:
        for e in examples:
            self.entries.append((task, e.index))
            self._examples[(task, e.index)] = e
        self.per_task[task] = self.per_task.get(task, 0) + len(examples)

    def examples(self) -> list:
        return [self._examples[key] for key in self.entries]

    def __len__(self) -> int:
        return len(self.entries)

    def state_dict(self) -> dict:
        return {"entries": list(self.entries), "per_task": dict(self.per_task)}

    def load_state_dict(self, state: dict, sources: dict[str, list]) -> None:
        """`sources` maps a task name to its examples (TaskData.train, or Lima's)."""
        by_index = {name: {e.index: e for e in examples} for name, examples in sources.items()}
        self.entries = [tuple(e) for e in state["entries"]]
        self.per_task = dict(state["per_task"])
        self._examples = {(t, i): by_index[t][i] for t, i in self.entries}

    def summary(self) -> dict:
        return {"policy": self.config.policy, "fraction": self.config.fraction,
                "per_task_budget": self.config.per_task, "lima": self.config.lima,
                "stored": dict(self.per_task), "size": len(self)}


def sample_rows(rows: list, n: int, key: str) -> list:
    """n rows drawn without replacement (with replacement only if n > len(rows))."""
    rng = random.Random(key)
    if n <= len(rows):
        return [rows[i] for i in rng.sample(range(len(rows)), n)]
    return [rows[rng.randrange(len(rows))] for _ in range(n)]
