"""The real TRACE 500 release, when it is present ($CL_BENCH_DATA, or pytest --data-dir):
each task's split sizes, MeetingBank's train as a copy of eval, and the answer budget
covering the answers."""

import math
import os
from pathlib import Path

import pytest

from cl_bench.benchmarks.trace import CL_TASKS, TASKS, file_sha256, load_split, load_task

# The real release, found as the CLI finds it: $CL_BENCH_DATA (pytest --data-dir sets it,
# tests/conftest.py), else ../shared/trace/LLM-CL-Benchmark_500 beside the repository.
REAL_DATA = Path(os.environ.get("CL_BENCH_DATA")
                 or Path(__file__).parents[2] / ".." / "shared" / "trace" / "LLM-CL-Benchmark_500")
if os.environ.get("CI") == "true" and not REAL_DATA.is_dir():
    raise RuntimeError(f"CI=true but the TRACE data is missing at {REAL_DATA}: its tests would be skipped; "
                       f"set CL_BENCH_DATA or pass --data-dir")

real = pytest.mark.skipif(not REAL_DATA.is_dir(), reason=f"{REAL_DATA} not present")

# SOURCE.md: train 500 per task (Lima 1030; MeetingBank 100, a copy of eval),
# eval/test 100 except NumGLUE-cm (41/81) and Lima (300/300).
REAL_SIZES = {task: (500, 100, 100) for task in CL_TASKS}
REAL_SIZES.update({"MeetingBank": (100, 100, 100), "NumGLUE-cm": (500, 41, 81), "Lima": (1030, 300, 300)})


@pytest.mark.slow
@real
@pytest.mark.parametrize("task", list(TASKS))
def test_real_task_loads(task):
    sizes = tuple(len(load_split(REAL_DATA, task, s)) for s in ("train", "eval", "test"))
    assert sizes == REAL_SIZES[task]
    data = load_task(REAL_DATA, task, n_train=50, n_test=20, seed=1234)
    assert len(data.train) == min(50, sizes[0]) and len(data.test) == 20


@pytest.mark.slow
@real
def test_real_meetingbank_train_is_eval_copy():
    folder = REAL_DATA / "MeetingBank"
    assert file_sha256(folder / "train.json") == file_sha256(folder / "eval.json")
    assert file_sha256(folder / "train.json") != file_sha256(folder / "test.json")


CHARS_PER_TOKEN = 3


def scored_span(task, answer):
    """The part of a gold answer that the task's metric looks at."""
    answer = answer.strip()
    return answer[:1] if TASKS[task].metric == "first_char_accuracy" else answer


@pytest.mark.slow
@real
@pytest.mark.parametrize("task", list(CL_TASKS))
def test_real_budget_covers_answers(task):
    """max_new_tokens fits at least 90% of the test answers at 3 chars/token
    (for ScienceQA the scored span is the option letter), and is not oversized:
    at most 4x the longest answer of any split at that rate, plus a few tokens
    for EOS and stray whitespace."""
    spec = TASKS[task]

    def needed(split):
        return [math.ceil(len(scored_span(task, ex.answer)) / CHARS_PER_TOKEN)
                for ex in load_split(REAL_DATA, task, split)]

    test = needed("test")
    covered = sum(n <= spec.max_new_tokens for n in test) / len(test)
    assert covered >= 0.9, f"{task}: max_new_tokens={spec.max_new_tokens} covers {covered:.0%}"
    longest = max(max(needed(split)) for split in ("train", "eval", "test"))
    assert spec.max_new_tokens <= 4 * longest + 8, f"{task}: budget far above the answers"
    if spec.metric == "first_char_accuracy":
        assert all(scored_span(task, ex.answer).isalpha()
                   for ex in load_split(REAL_DATA, task, "test"))
