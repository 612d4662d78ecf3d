"""Is an MoE method's forgetting routing drift or representation change? Read from
a run's probes (cl_bench/eval/probes/routing.py, cl_bench/eval/probes/representation.py) and its
matrix R. One point per earlier task j and later stage b (j learned at stage s_j < b):

    F(j, b) = R[s_j][j] - R[b][j]                    forgetting, score points
    D(j, b) = mean over routed layers of JS_l(j, b)   routing drift, bits
    C(j, b) = mean over decoder layers of 1 - CKA_l(j, b)   representation change

All three grow with the stages since a task was learned (its age, b - s_j), so
their raw correlation would say only that time passes; and within one stage the
older tasks have drifted and forgotten longer. The test therefore compares tasks
against tasks of the same age: within each (run, age) the three are replaced by
their ranks, centred (an age held by one task adds nothing), and each task's
centred ranks are averaged over its ages, f_j, d_j, c_j: how much more than the
tasks of its age task j forgets, is routed elsewhere, moved. Then

    rho_D = corr over tasks (f, d),  rho_C = corr over tasks (f, c)

The unit of evidence is the task of a run (its points at several ages are not
independent draws: a task that drifts far at one age drifts far at the next), so
the 95% interval resamples tasks (percentile bootstrap) and the p-value shuffles
d (or c) among the tasks of each run (a permutation test; shuffling points within
ages instead ignores that dependence: p < 0.05 in 23 of 100 runs without a
link, tests/analysis/test_sources.py). A source is clear when its interval
lies above 0 and p < 0.05, as cl_bench/report/figures/depth.py's verdict:

    routing drift            rho_D clear, rho_C not
    representation change    rho_C clear, rho_D not
    both                     both clear (D and C move together; not told apart)
    not distinguishable      neither clear
    too few tasks            the permutation test cannot reach p < 0.05 at all

With few tasks the test has little power: "not distinguishable" is then the
expected answer, not evidence of no effect. With fewer distinct shuffles of the
tasks among themselves than 1 / 0.05 = 20 (three tasks in one run have 3! = 6;
two tasks correlate at +-1 whatever they do) no outcome could be clear, so rho,
its interval and p are left out (None) and the verdict says why. The magnitudes beside the verdict
(mean F, D, C over the last stage's points) say how much there is to explain. A
run without both probes has no analysis (None); one whose forgetting (or source)
ties within every age gets rho None and no verdict.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

from cl_bench.metrics.bootstrap import LEVEL, RESAMPLES, interval

SEED = 0
SOURCES = ("routing", "cka")  # D, C


def points(record) -> list[dict[str, Any]]:
    """One dict per (earlier task, later stage) with F, D and C: the tasks and
    stages where the matrix and both probes have a value."""
    probes = record.probes or {}
    cka, routing = probes.get("cka") or {}, probes.get("routing") or {}
    learned = {t: s.index for s in record.stages for t in s.tasks}
    out = []
    for b, row in enumerate(record.matrix):
        for j, task in enumerate(record.tasks):
            s = learned.get(task)
            if s is None or s >= b or row[j] is None or record.matrix[s][j] is None:
                continue
            js = (routing.get(str(b)) or {}).get(task, {}).get("js")
            layers = (cka.get(str(b)) or {}).get(task)
            if not js or not layers:
                continue
            out.append({"task": task, "stage": b, "age": b - s, "F": float(record.matrix[s][j] - row[j]),
                        "D": float(np.mean(js)), "C": float(np.mean([1.0 - v for v in layers]))})
    return out


def _centred_ranks(values: np.ndarray, strata: np.ndarray) -> np.ndarray:
    out = np.zeros(len(values))
    for s in np.unique(strata):
        at = np.flatnonzero(strata == s)
        ranks = np.argsort(np.argsort(values[at], kind="stable"), kind="stable").astype(float)
        for v in np.unique(values[at]):  # ties share their mean rank
            tied = values[at] == v
            ranks[tied] = ranks[tied].mean()
        out[at] = ranks - ranks.mean()
    return out


def _corr(a: np.ndarray, b: np.ndarray) -> float | None:
    den = np.sqrt((a * a).sum() * (b * b).sum())
    return None if den == 0 else float((a * b).sum() / den)


def _task_means(values: np.ndarray, cluster: np.ndarray, ids: np.ndarray) -> np.ndarray:
    return np.array([values[cluster == c].mean() for c in ids])


def sources(runs: Sequence[Sequence[dict[str, Any]]], resamples: int = RESAMPLES,
            seed: int = SEED) -> dict[str, Any] | None:
    """`runs`: each run's points(); pooled over runs (seeds of one method). Returns
    rho_D and rho_C with their intervals and p-values, the verdict and the last
    stage's magnitudes (module docstring); None when a run has no points."""
    rows = [(r, p) for r, pts in enumerate(runs) for p in pts]
    if not rows:
        return None
    stratum = np.array([f"{r}/{p['age']}" for r, p in rows])
    cluster = np.array([f"{r}/{p['task']}" for r, p in rows])
    ids = np.unique(cluster)
    run_of = np.array([c.split("/", 1)[0] for c in ids])
    within = [np.flatnonzero(run_of == r) for r in np.unique(run_of)]
    if math.prod(math.factorial(len(at)) for at in within) * (1 - LEVEL) < 1:
        return _summary({name: {"rho": None, "ci": None, "p": None, "clear": False} for name in SOURCES},
                        "too few tasks", runs, rows, ids, resamples)
    f = _task_means(_centred_ranks(np.array([p["F"] for _, p in rows]), stratum), cluster, ids)
    rng = np.random.default_rng(seed)
    out: dict[str, Any] = {}
    for name, key in zip(SOURCES, ("D", "C")):
        x = _task_means(_centred_ranks(np.array([p[key] for _, p in rows]), stratum), cluster, ids)
        rho = _corr(f - f.mean(), x - x.mean())
        boot = []
        for _ in range(resamples):  # tasks drawn with replacement
            at = rng.integers(0, len(ids), len(ids))
            value = _corr(f[at] - f[at].mean(), x[at] - x[at].mean())
            if value is not None:
                boot.append(value)
        perms = []
        for _ in range(resamples):  # the tasks' source values shuffled among the tasks of each run
            shuffled = x.copy()
            for at in within:
                shuffled[at] = x[rng.permutation(at)]
            perms.append(_corr(f - f.mean(), shuffled - shuffled.mean()) or 0.0)
        p = None if rho is None else (int(np.sum(np.abs(perms) >= abs(rho) - 1e-12)) + 1) / (resamples + 1)
        ci = interval(np.array(boot), LEVEL) if boot else None
        clear = rho is not None and ci is not None and p < 1 - LEVEL and ci[0] > 0
        out[name] = {"rho": rho, "ci": None if ci is None else list(ci), "p": p, "clear": bool(clear)}
    routing_clear, cka_clear = out["routing"]["clear"], out["cka"]["clear"]
    verdict = ("both" if routing_clear and cka_clear else "routing drift" if routing_clear else
               "representation change" if cka_clear else "not distinguishable")
    return _summary(out, verdict, runs, rows, ids, resamples)


def _summary(out, verdict, runs, rows, ids, resamples) -> dict[str, Any]:
    last = {r: max(p["stage"] for p in pts) for r, pts in enumerate(runs) if pts}
    at_last = [p for r, p in rows if p["stage"] == last[r]]
    return {**out, "verdict": verdict, "points": len(rows), "tasks": len(ids), "runs": len(runs),
            "resamples": resamples,
            "last": {k: float(np.mean([p[k] for p in at_last])) for k in ("F", "D", "C")}}


def record_sources(record) -> dict[str, Any] | None:
    """sources() of one run record, with its points (None: the run has no routing
    and CKA probes to read)."""
    pts = points(record)
    out = sources([pts])
    return None if out is None else {**out, "per_point": pts}


COLUMNS = ["Method", "Profile", "Order", "Runs", "Points", "Forgetting", "Routing JS", "1 − CKA",
           "ρ routing", "p routing", "ρ CKA", "p CKA", "Verdict"]


def build_table(runs) -> "pd.DataFrame":
    """One row per leaderboard row (cl_bench.report.leaderboard.build_rows' groups: seeds of
    one method pooled) whose runs have both probes: sources() and the last stage's
    magnitudes (Forgetting in score points, Routing JS in bits)."""
    import pandas as pd

    from cl_bench.report.leaderboard import build_rows, method_labels

    df, groups = build_rows(runs)
    rows = []
    for label, rec, group in zip(method_labels(df), df.to_dict("records"), groups):
        out = sources([points(r) for r in group])
        if out is None:
            continue
        cells = {"Method": label, "Profile": rec["Profile"], "Order": rec["Order"], "Runs": len(group),
                 "Points": out["points"], "Forgetting": out["last"]["F"], "Routing JS": out["last"]["D"],
                 "1 − CKA": out["last"]["C"], "Verdict": out["verdict"]}
        for name, col in (("routing", "routing"), ("cka", "CKA")):
            cells[f"ρ {col}"], cells[f"p {col}"] = out[name]["rho"], out[name]["p"]
            cells[f"ρ {col} lo"], cells[f"ρ {col} hi"] = out[name]["ci"] or (None, None)
        rows.append(cells)
    return pd.DataFrame(rows, columns=COLUMNS[:-1] + ["ρ routing lo", "ρ routing hi", "ρ CKA lo", "ρ CKA hi",
                                                      "Verdict"])


def format_table(df, fmt: str = "md") -> str:
    """table()'s frame as 'md', 'latex' (ρ with its interval in one cell) or 'csv' (raw numbers)."""
    from cl_bench.report.leaderboard import MISSING
    from cl_bench.report.leaderboard.table import render

    if fmt == "csv":
        return df.to_csv(index=False, na_rep="")

    def rho(r, col):
        if r[f"ρ {col}"] is None or r[f"ρ {col}"] != r[f"ρ {col}"]:
            return MISSING
        return f"{r[f'ρ {col}']:+.2f} [{r[f'ρ {col} lo']:+.2f}, {r[f'ρ {col} hi']:+.2f}]"

    def p(value):
        return MISSING if value is None or value != value else f"{value:.3f}"

    rows = [[r["Method"], r["Profile"], r["Order"], str(r["Runs"]), str(r["Points"]), f"{r['Forgetting']:.1f}",
             f"{r['Routing JS']:.2f}", f"{r['1 − CKA']:.4f}", rho(r, "routing"), p(r["p routing"]),
             rho(r, "CKA"), p(r["p CKA"]), r["Verdict"]] for r in df.to_dict("records")]
    align = ["left"] * 3 + ["right"] * 9 + ["left"]
    return render(rows, COLUMNS, fmt, align) + "\n"
