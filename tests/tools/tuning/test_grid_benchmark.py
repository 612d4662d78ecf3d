"""A tuning grid names its benchmark (cl_bench/tools/tuning/grid.py, tuned.py): TRACE
where it names none, so every committed grid reads as before; another benchmark's
order is resolved by that benchmark, its runs are planned with `--benchmark`, and the
tuned leaderboard selects only that benchmark's runs.

Mutations caught: Grid.flags without `--benchmark` (the plan's runs would train
TRACE); the order resolved by TRACE's tasks whatever the grid names (long-sequence's
CB refused); tuned.select ignoring a run's benchmark (a long-sequence run on TRACE's
task names in TRACE's tuned leaderboard); the TRACE-only rule (no MeetingBank) lost."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from cl_bench.errors import UserError
from cl_bench.report.leaderboard import load_runs
from cl_bench.tools.campaign.plan import planned, read_plan
from cl_bench.tools.tuning import grid as grids
from cl_bench.tools.tuning import plan, tuned
from test_protocol import SMOKE_GRID


def load(tmp_path: Path, **change) -> grids.Grid:
    path = tmp_path / "grid.yaml"
    path.write_text(yaml.safe_dump({**SMOKE_GRID, **change}))
    return grids.load(path)


def plan_configs(g: grids.Grid, tmp_path: Path) -> list:
    text = plan.tuning_plan(g, plan.Records(Path("none"), tmp_path), {})
    (tmp_path / "p.txt").write_text(text)
    return [planned(e)[0] for e in read_plan(tmp_path / "p.txt")]


def test_a_grid_without_a_benchmark_is_traces_and_plans_as_before(tmp_path):
    g = load(tmp_path)
    assert g.benchmark == "trace" and "--benchmark" not in g.flags("seqft", {"lr": 1e-5})
    assert {(c.data.benchmark, c.data.order) for c in plan_configs(g, tmp_path)} == \
        {("trace", "NumGLUE-cm,Py150,20Minuten")}


def test_a_grid_of_another_benchmark_plans_its_runs_on_it(tmp_path):
    g = load(tmp_path, benchmark="long-sequence", order=["CB", "COPA", "RTE"])
    assert g.order == ["CB", "COPA", "RTE"] and g.flags("seqft", {"lr": 1e-5})[4:6] == ["--benchmark", "long-sequence"]
    configs = plan_configs(g, tmp_path)
    assert {(c.data.benchmark, c.data.order, c.data.test_split) for c in configs} == \
        {("long-sequence", "CB,COPA,RTE", "eval")}


@pytest.mark.parametrize("change, says", [
    ({"benchmark": "long-sequense"}, "grid.yaml: benchmark: unknown benchmark 'long-sequense'"),
    ({"benchmark": "long-sequence"}, "grid.yaml: order: "),  # SMOKE_GRID's TRACE tasks are not its
    ({"order": ["MeetingBank", "Py150", "NumGLUE-cm"]}, "none of MeetingBank (its eval split is its train copy)"),
])
def test_a_grid_naming_a_wrong_benchmark_or_its_wrong_tasks_is_one_line(tmp_path, change, says):
    with pytest.raises(UserError) as e:
        load(tmp_path, **change)
    assert says in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_the_tuned_leaderboard_selects_its_benchmarks_runs_alone(tmp_path, fake_run):
    runs = tmp_path / "results"
    shared = tuned.expected_args({"seqft": {}}, "smoke")
    fake_run(runs / "seqft-trace", "seqft", shared["seqft"], [10, 10, 10], split="test")
    other = fake_run(runs / "seqft-other", "seqft", shared["seqft"], [30, 30, 30], split="test")
    record = json.loads((other / "run.json").read_text())
    (other / "run.json").write_text(json.dumps({**record, "benchmark": "long-sequence"}))
    assert [Path(r.source).parent.name for r in tuned.select(load_runs(runs), shared, "smoke")] == ["seqft-trace"]
