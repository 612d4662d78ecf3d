"""cl_bench/report/figures/sources.py: is a run's forgetting routing drift or representation
change, on hand-made records (8 tasks, one a stage: 28 points)."""
from __future__ import annotations

import numpy as np
import pytest

from cl_bench.report.figures.sources import points, record_sources, sources
from cl_bench.record.schema import RunRecord, StageRecord

T = 8


def record(forget, drift, change, learned=None, n=T) -> RunRecord:
    """A run whose task j scores 50 right after stage j and 50 - forget(j, b) after a
    later stage b, with routing JS drift(j, b) in each of 2 routed layers and CKA
    1 - change(j, b) in each of 3 decoder layers."""
    tasks = [f"t{j}" for j in range(n)]
    matrix = [[50.0 - forget(j, b) if j < b else 50.0 if j == b else None for j in range(n)] for b in range(n)]
    routing = {str(b): {tasks[j]: {"shares": [[1.0]], **({"js": [drift(j, b)] * 2} if j < b else {})}
                        for j in range(b + 1)} for b in range(n)}
    cka = {str(b): {tasks[j]: [1.0 - change(j, b)] * 3 for j in range(b)} for b in range(n)}
    return RunRecord(method="m", tasks=tasks, matrix=matrix, probes={"routing": routing, "cka": cka},
                     stages=[StageRecord(b, tasks[b], [tasks[b]]) for b in range(n)])


V = [3, 7, 0, 5, 1, 6, 2, 4]  # each task's vulnerability: not a function of its position


def noise(seed):
    rng = np.random.default_rng(seed)
    table = rng.random((T, T))
    return lambda j, b: float(table[j, b])


def test_forgetting_that_follows_routing_within_a_stage_is_routing_drift():
    """Among tasks of the same age the ones routed further forget more (each task's
    vulnerability V), representation change is noise. Mutations caught: F taken from
    the wrong row (R[0][j] for every j: no task's score before it was learned is 50),
    D and C swapped, the sign of F."""
    rec = record(lambda j, b: 5.0 * V[j] + b - j, lambda j, b: 0.05 * V[j] + 0.01 * (b - j), noise(0))
    pts = points(rec)
    assert len(pts) == T * (T - 1) // 2
    assert {(p["task"], p["stage"]): p["F"] for p in pts}[("t1", 5)] == 39.0
    assert {(p["task"], p["stage"]): p["D"] for p in pts}[("t1", 5)] == pytest.approx(0.39)
    out = sources([pts])
    assert out["routing"]["rho"] == pytest.approx(1.0) and out["routing"]["clear"], out
    assert not out["cka"]["clear"] and out["verdict"] == "routing drift", out
    assert out["last"]["F"] == pytest.approx(np.mean([5.0 * V[j] + 7 - j for j in range(7)]))
    swapped = record(lambda j, b: 5.0 * V[j] + b - j, noise(0), lambda j, b: 0.05 * V[j] + 0.01 * (b - j))
    assert record_sources(swapped)["verdict"] == "representation change"
    backwards = record(lambda j, b: -5.0 * V[j], lambda j, b: 0.05 * V[j], noise(0))
    assert record_sources(backwards)["routing"]["rho"] == pytest.approx(-1.0)
    assert record_sources(backwards)["verdict"] == "not distinguishable"  # less drift, more forgetting: not a source


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_shared_trend_over_the_stages_is_not_a_source(seed):
    """Forgetting, drift and change all grow with the stages since a task was learned
    (b - j); drift and change by age alone, forgetting with noise: among tasks of one
    age nothing links them, so no verdict (rho None: the sources tie within every
    age). Mutations caught: the ranks not centred (the pooled correlation of growing
    series is near 1 and clear), centred within each stage instead of each age
    (within a stage the older tasks have drifted and forgotten longer: clear again)."""
    f = noise(seed)
    rec = record(lambda j, b: 10.0 * (b - j) + f(j, b), lambda j, b: 0.1 * (b - j), lambda j, b: 0.01 * (b - j))
    out = record_sources(rec)
    assert out["verdict"] == "not distinguishable", {k: out[k] for k in ("routing", "cka")}
    assert out["routing"]["rho"] is None and out["cka"]["rho"] is None


def test_both_when_drift_and_change_move_together_and_seeds_pool():
    rec = record(lambda j, b: 5.0 * V[j], lambda j, b: 0.05 * V[j], lambda j, b: 0.001 * V[j])
    one = record_sources(rec)
    assert one["verdict"] == "both"
    two = sources([points(rec), points(rec)])
    assert (two["runs"], two["points"], two["tasks"]) == (2, 2 * one["points"], 2 * T - 2)


def test_a_task_learned_in_a_joint_stage_counts_from_that_stage_and_probes_are_needed():
    """The score 'right after it was learned' is that of the stage that trained it
    (a stage may train several tasks); a record without probes has no analysis."""
    rec = record(lambda j, b: 5.0 * V[j], lambda j, b: 0.05 * V[j], noise(0))
    rec.stages = [StageRecord(0, "t0+t1", ["t0", "t1"])] + [StageRecord(b, f"t{b}", [f"t{b}"]) for b in range(2, T)]
    rec.matrix[0][1] = 60.0
    rec.probes["routing"]["1"]["t1"]["js"] = [0.2, 0.2]
    rec.probes["cka"]["1"]["t1"] = [0.9] * 3
    by = {(p["task"], p["stage"]): p["F"] for p in points(rec)}
    assert by[("t1", 1)] == 60.0 - 50.0 and by[("t1", 2)] == 60.0 - rec.matrix[2][1]
    rec.probes = None
    assert points(rec) == [] and record_sources(rec) is None


def test_too_few_tasks_for_the_permutation_test_to_reach_005_get_no_rho():
    """Three earlier tasks in one run have 3! = 6 shuffles: p could never fall below
    0.05 (and two tasks correlate at +-1 whatever they do), so no rho, interval or p
    and the verdict says so; four tasks (24 shuffles), or two runs of three pooled
    (36), are tested. Mutation caught: the check dropped (two tasks give rho +1.00
    [+1.00, +1.00], which reads as a perfect link)."""
    forget, drift = (lambda j, b: 5.0 * V[j] + b - j), (lambda j, b: 0.05 * V[j] + 0.01 * (b - j))
    for n in (3, 4):
        few = record_sources(record(forget, drift, noise(0), n=n))
        assert few["verdict"] == "too few tasks" and few["tasks"] == n - 1, few
        assert all(few[k] == {"rho": None, "ci": None, "p": None, "clear": False} for k in ("routing", "cka"))
        assert few["points"] == n * (n - 1) // 2 and few["last"]["F"] > 0
    assert record_sources(record(forget, drift, noise(0), n=5))["routing"]["rho"] == pytest.approx(1.0)
    small = points(record(forget, drift, noise(0), n=4))
    assert sources([small, small])["routing"]["rho"] == pytest.approx(1.0)


def test_the_interval_resamples_tasks_not_points():
    """One task (t0) forgets most and drifts most at every age, the others' drift
    runs against their forgetting: the evidence is that one task, so the interval
    over tasks is much wider than one over points would be (the same points, each
    labelled its own task). Mutation caught: points resampled one by one."""
    f = noise(0)
    rec = record(lambda j, b: 100.0 if j == 0 else f(j, b), lambda j, b: 1.0 if j == 0 else 0.5 - 0.1 * f(j, b),
                 noise(100))
    pts = points(rec)
    singles = [{**p, "task": f"{p['task']}@{p['stage']}"} for p in pts]
    by_task, by_point = sources([pts])["routing"]["ci"], sources([singles])["routing"]["ci"]
    assert by_task[1] - by_task[0] > 1.2 * (by_point[1] - by_point[0]), (by_task, by_point)


def test_analyze_writes_sources_json_and_the_leaderboard_shows_the_view(tmp_path, capsys):
    """`cl-bench analyze` writes sources.json beside a run with both probes;
    `cl-bench leaderboard --view sources` shows its row (and none for a run
    without probes) and writes it between the README's section markers."""
    import json

    from helpers import run_cli

    rec = record(lambda j, b: 5.0 * V[j] + b - j, lambda j, b: 0.05 * V[j] + 0.01 * (b - j), noise(0))
    plain = record(lambda j, b: 1.0, lambda j, b: 0.0, lambda j, b: 0.0)
    plain.probes, plain.method = None, "seqft"
    for name, r in (("moe", rec), ("dense", plain)):
        r.status, r.run_id, r.model, r.profile, r.stages_done = "complete", name, {"id": "tiny"}, "smoke", T
        r.summary = {"last_acc": 40.0, "stage_acc": 50.0, "bwt": -10.0}
        (tmp_path / "runs" / name).mkdir(parents=True)
        (tmp_path / "runs" / name / "run.json").write_text(json.dumps(r.to_json()))
    assert run_cli("analyze", tmp_path / "runs" / "moe") == 0
    written = json.loads((tmp_path / "runs" / "moe" / "sources.json").read_text())
    assert written["verdict"] == "routing drift" and len(written["per_point"]) == T * (T - 1) // 2
    readme = tmp_path / "README.md"
    readme.write_text("x\n<!-- sources:begin -->\n<!-- sources:end -->\ny\n")
    capsys.readouterr()
    assert run_cli("leaderboard", "--runs", tmp_path / "runs", "--view", "sources", "--update-readme", readme,
                   "--section", "sources") == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert len(lines) == 2 and "routing drift" in lines[1] and "+1.00 [+1.00, +1.00]" in lines[1]
    assert lines[1] in readme.read_text() and readme.read_text().startswith("x\n") and "seqft" not in readme.read_text()


@pytest.mark.slow  # 100 analyses, a few seconds
def test_with_no_link_the_p_value_falls_below_005_about_one_time_in_twenty():
    """Each task has its own lasting forgetting and drift levels, drawn independently
    (and both grow with age): no link. Over 100 such runs p < 0.05 must come out
    about 5% of the time (at most 10 here). Mutation caught: points shuffled within
    ages instead of tasks within the run (the dependence of a task's points ignored:
    23 of the 100)."""
    hits = clear = 0
    for seed in range(100):
        rng = np.random.default_rng(1000 + seed)
        u, v, e = rng.normal(size=T), rng.normal(size=T), rng.normal(size=(2, T, T))
        rec = record(lambda j, b: 10.0 * (b - j) + 5 * u[j] + e[0, j, b], lambda j, b: 0.1 * (b - j) + v[j] + e[1, j, b],
                     lambda j, b: 0.0)
        out = sources([points(rec)], resamples=200)
        hits += out["routing"]["p"] < 0.05
        clear += out["routing"]["clear"]
    assert hits <= 10 and clear <= 5, (hits, clear)
