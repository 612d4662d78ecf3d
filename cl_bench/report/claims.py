"""`cl-bench claims FILE`: a paper's claims, each tested on committed runs with a
verdict at 95%: holds, does not hold, or not distinguishable (or "not run yet"
while its runs are missing or unfinished).

A claims file (YAML) names the runs and the test; nothing in it is a number the
verdict depends on, except `expect`, which is shown beside the measurement:

    claims:
      - id: a
        says: less forgetting than Standard Upcycling at similar accuracy
        test: less-forgetting
        runs: [results/long/bilevel-cka-cpu-long-prefix3]   # the claim's method
        against: [results/long/upcycle-cpu-long-prefix3]    # what it is compared with

Tests (runs - against; several runs a side are seeds, pooled as the leaderboard
pools them: replicates over seeds and items, paired over the same test items):

- less-forgetting: BWT higher at 95% and Last Acc not lower at 95% -> holds;
  BWT lower at 95%, or Last Acc lower at 95% -> does not hold; else not
  distinguishable.
- fewer-added: the parameters each run adds to the base model (deployed minus
  base, the last stage's). Counts have no item noise, only seeds: holds when
  every run adds fewer than every run against, does not hold when every run adds
  at least as many as every run against, not distinguishable otherwise (the
  seeds overlap). `expect` (a share, e.g. 0.6: "about 60% fewer") is the claim's
  size, judged apart from its direction: the size holds when every run's reduction
  1 - run / mean(against) reaches it, does not hold when none does, else not
  distinguishable; the measurement says both ("fewer, but 7% against the claimed
  60%: the size does not hold"). The verdict column is the direction's.
- ablation: `runs` the ablation, `against` the full method. holds (the removed
  part helps) when the ablation is worse at 95% in Last Acc or BWT and better in
  neither; does not hold when it is better in one and worse in neither; else
  not distinguishable (including worse in one and better in the other).
- deep-expand: cl_bench/report/figures/depth.py over the runs' decision maps (tasks
  of every run pooled; the runs must decide over the same layers): holds for
  "deep layers expand more", does not hold for "shallow layers expand more".
  It takes no `against`. Where the runs record where their search started
  (bilevel-cka's `init.decisions`), the start's deep and shallow rates are
  printed beside: a pattern already there came from the initialisation.

`follows_from` (optional): the input a verdict follows from by construction (e.g.
"depth_prior=fixed" for deep-expand, where the search starts with deep layers
biased to Expand). The verdict is still computed and shown, marked "follows from
<input>, not a finding", so a reader never counts it as evidence.

The differences shown are the runs' own (mean over seeds of each run's summary on
its items), their intervals from the replicates.

Runs compared must share tasks, order and budget (cl_bench/report/compare.py's
differences); a pair that does not is refused with the reason.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import yaml

from cl_bench.record import io as results
from cl_bench.errors import UserError
from cl_bench.metrics import bootstrap

TESTS = ("less-forgetting", "fewer-added", "ablation", "deep-expand")
HOLDS, FAILS, UNCLEAR, MISSING = "holds", "does not hold", "not distinguishable", "not run yet"
FIELDS = {"id", "says", "test", "runs", "against", "expect", "follows_from"}


def load(path: Path) -> list[dict[str, Any]]:
    """The claims of a file, checked: one UserError naming the file, the claim and the field."""
    try:
        raw = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except OSError as e:
        raise UserError(f"{path}: cannot read the claims file ({e.strerror}); pass a YAML file") from None
    except UnicodeDecodeError:
        raise UserError(f"{path}: not a text file; pass the claims file (YAML, UTF-8)") from None
    except yaml.YAMLError as e:
        raise UserError(f"{path}: not valid YAML ({str(e).splitlines()[0]}); fix the file") from None
    claims = raw.get("claims") if isinstance(raw, dict) else None
    if not isinstance(claims, list) or not claims:
        raise UserError(f"{path}: no 'claims:' list; start the file with 'claims:' and one '- id: ...' per claim")
    for i, claim in enumerate(claims):
        where = f"{path}: claims[{i}]"
        if not isinstance(claim, dict):
            raise UserError(f"{where} must be a mapping with id, says, test, runs")
        unknown = set(claim) - FIELDS
        if unknown:
            raise UserError(f"{where}: unknown field {sorted(unknown)[0]!r}; the fields are {', '.join(sorted(FIELDS))}")
        for key in ("id", "says", "test", "runs"):
            if key not in claim:
                raise UserError(f"{where}: missing field {key!r}")
        if claim["test"] not in TESTS:
            raise UserError(f"{where}.test: {claim['test']!r} is not a test; use one of {', '.join(TESTS)}")
        needs_against = claim["test"] != "deep-expand"
        if not needs_against and "against" in claim:
            raise UserError(f"{where}.against: deep-expand tests the runs alone; remove 'against'")
        for key in ("runs", "against") if needs_against else ("runs",):
            value = claim.get(key)
            if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
                raise UserError(f"{where}.{key}: give a list of run folders, e.g. [results/my-run]")
        if "follows_from" in claim and (not isinstance(claim["follows_from"], str) or not claim["follows_from"]):
            raise UserError(f"{where}.follows_from: name the input the verdict follows from, e.g. depth_prior=fixed")
        if "expect" in claim:
            expect = claim["expect"]
            if claim["test"] != "fewer-added":
                raise UserError(f"{where}.expect: only fewer-added takes an expected share; remove it")
            if isinstance(expect, bool) or not isinstance(expect, (int, float)) or not 0 < expect <= 1:
                raise UserError(f"{where}.expect: {expect!r} is not a share; write e.g. 0.6 for 60% fewer")
    return claims


def _records(folders: list[str], root: Path) -> tuple[list, list[str]]:
    """The complete records of `folders`, and the names of those that are not (yet)."""
    found, missing = [], []
    for folder in folders:
        path = root / folder
        if not (path / results.RUN_FILE).is_file():
            missing.append(path.name)
            continue
        record = results.read_record(path)
        if record.status == "complete":
            found.append(record)
        else:
            missing.append(f"{path.name} ({record.status}, {record.stages_done} of {len(record.stages)} stages)")
    return found, missing


def _scores(records: list) -> tuple[dict, dict]:
    """The runs' replicates (pooled over seeds, as the leaderboard's) and their point
    summaries (mean over the runs)."""
    from cl_bench.metrics.intervals import point_summaries
    from cl_bench.report.leaderboard.rows import entries, group_replicates

    loaded = entries(records)
    for e in loaded:
        if e.items is None:
            raise UserError(f"{e.record.source}: no predictions beside the record; a claim's interval needs them")
    points = [point_summaries(e.items) for e in loaded]
    mean = {k: None if any(p[k] is None for p in points) else float(np.mean([p[k] for p in points]))
            for k in points[0]}
    return group_replicates(loaded), mean


def _difference(a: tuple[dict, dict], b: tuple[dict, dict], key: str, runs: list) -> dict[str, Any]:
    (reps_a, point_a), (reps_b, point_b) = a, b
    ci = bootstrap.interval(reps_a[key] - reps_b[key])
    if ci is None or point_a[key] is None or point_b[key] is None:
        raise UserError(f"{runs[0].source}: no {key} to compare (it needs at least two tasks scored after "
                        f"the first); take the run out of the claim")
    return {"diff": point_a[key] - point_b[key], "ci": list(ci)}


def _sign(d: dict) -> int:
    """+1 / -1 when the interval lies above / below 0, 0 when it holds 0."""
    lo, hi = d["ci"]
    return 1 if lo > 0 else -1 if hi < 0 else 0


def _fmt(name: str, d: dict) -> str:
    return f"{name} {d['diff']:+.1f} [{d['ci'][0]:+.1f}, {d['ci'][1]:+.1f}]"


def _comparable(runs: list, against: list) -> None:
    from cl_bench.report.compare import differences

    for r in runs + against[1:]:  # item by item where the seeds match; else tasks, precision and budget
        problems = differences(against[0], r, items=r.seed == against[0].seed)
        if problems:
            raise UserError(f"{r.source}: not comparable with {against[0].source}: {'; '.join(problems)}")


def _less_forgetting(runs, against, claim) -> tuple[str, str, dict]:
    a, b = _scores(runs), _scores(against)
    bwt, last = _difference(a, b, "bwt", runs), _difference(a, b, "last_acc", runs)
    if _sign(bwt) > 0 and _sign(last) >= 0:
        verdict = HOLDS
    elif _sign(bwt) < 0 or _sign(last) < 0:
        verdict = FAILS
    else:
        verdict = UNCLEAR
    return verdict, f"{_fmt('BWT', bwt)}; {_fmt('Last', last)}", {"bwt": bwt, "last_acc": last}


def _added(record) -> int:
    base = (record.model or {}).get("n_params")
    last = record.params[-1] if record.params else None
    if base is None or last is None or last.deployed is None:
        raise UserError(f"{record.source}: no parameter report of the last stage or no base model size")
    return int(last.deployed - base)


def _fewer_added(runs, against, claim) -> tuple[str, str, dict]:
    mine, theirs = [_added(r) for r in runs], [_added(r) for r in against]
    reduction = 1 - np.mean(mine) / np.mean(theirs) if np.mean(theirs) else float("nan")
    verdict = HOLDS if max(mine) < min(theirs) else FAILS if min(mine) >= max(theirs) else UNCLEAR
    from cl_bench.report.leaderboard import humanise

    text = f"adds {humanise(np.mean(mine))} against {humanise(np.mean(theirs))}: {_share(reduction)}"
    if len(mine) > 1:
        text += f" (runs {', '.join(humanise(m) for m in mine)})"
    details = {"added": mine, "against": theirs, "reduction": float(reduction)}
    if claim.get("expect") is not None:
        expect = float(claim["expect"])
        each = [1 - m / np.mean(theirs) for m in mine]
        size = HOLDS if min(each) >= expect else FAILS if max(each) < expect else UNCLEAR
        text += f"; the claim is {100 * expect:.0f}% fewer: the size {'is ' if size == UNCLEAR else ''}{size}"
        details["size"] = size
    return verdict, text, details


def _share(reduction: float) -> str:
    """A reduction in words: '60% fewer', '12% more', 'as many' (under half a percent)."""
    if np.isnan(reduction):
        return "no share (the runs against add none)"
    shown = round(100 * abs(reduction))
    return "as many" if shown == 0 else f"{shown}% {'fewer' if reduction > 0 else 'more'}"


def _ablation(runs, against, claim) -> tuple[str, str, dict]:
    a, b = _scores(runs), _scores(against)
    diffs = {k: _difference(a, b, k, runs) for k in ("last_acc", "bwt")}
    signs = [_sign(d) for d in diffs.values()]
    verdict = (HOLDS if min(signs) < 0 and max(signs) <= 0 else FAILS if max(signs) > 0 and min(signs) >= 0
               else UNCLEAR)
    return verdict, f"{_fmt('Last', diffs['last_acc'])}; {_fmt('BWT', diffs['bwt'])}", diffs


def _deep_expand(runs, against, claim) -> tuple[str, str, dict]:
    from cl_bench.report.figures.depth import decision_maps, depth_profile

    maps, layers = [], None
    for r in runs:
        found = decision_maps(r.params)
        if found is None:
            raise UserError(f"{r.source}: no decision maps in params[].diagnostics.decisions; deep-expand needs "
                            f"a method that decides per layer")
        if layers is not None and found[1] != layers:
            raise UserError(f"{r.source}: decides over other layers than {runs[0].source}; pool runs of one "
                            f"model and method")
        maps, layers = maps + found[0], found[1]
    if len(layers) < 2:
        raise UserError(f"{runs[0].source}: decides in {len(layers)} layer; deep-expand needs a shallow and a "
                        f"deep third")
    out = depth_profile(maps, layers)
    verdict = {"deep layers expand more": HOLDS, "shallow layers expand more": FAILS}.get(out["verdict"], UNCLEAR)
    text = (f"deep {100 * out['deep_rate']:.0f}% vs shallow {100 * out['shallow_rate']:.0f}% expand: "
            f"{100 * out['diff']:+.0f} [{100 * out['ci'][0]:+.0f}, {100 * out['ci'][1]:+.0f}] points, p {out['p']:.3f}")
    alike = {int(x) for m in maps for row in m for x in row}
    if len(alike) == 1:  # the rule's verdict stands; the reader learns why there is no depth to see
        text += f"; every decision was {'Expand' if alike == {1} else 'Recycle'}, in every layer"
    starts = [p.diagnostics["init"]["decisions"] for r in runs for p in r.params
              if p.diagnostics.get("decisions") and (p.diagnostics.get("init") or {}).get("decisions")]
    if len(starts) == len(maps):  # where the search started: a depth pattern there is the init's
        start = depth_profile(starts, layers)
        out["init"] = start
        text += (f"; at the search's start deep {100 * start['deep_rate']:.0f}% vs shallow "
                 f"{100 * start['shallow_rate']:.0f}%")
    return verdict, text, out


RUNNERS = {"less-forgetting": _less_forgetting, "fewer-added": _fewer_added, "ablation": _ablation,
           "deep-expand": _deep_expand}


def evaluate(path: Path, root: Path = Path(".")) -> list[dict[str, Any]]:
    """Each claim of the file with its verdict, measurement text and numbers."""
    out = []
    for claim in load(path):
        runs, missing = _records(claim["runs"], root)
        against, missing_against = _records(claim.get("against") or [], root)
        row = {"id": str(claim["id"]), "says": claim["says"], "test": claim["test"], "runs": claim["runs"],
               "against": claim.get("against") or []}
        if missing or missing_against:
            out.append({**row, "verdict": MISSING, "measured": f"waiting for {', '.join(missing + missing_against)}"})
            continue
        if against:
            _comparable(runs, against)
        verdict, text, numbers = RUNNERS[claim["test"]](runs, against, claim)
        if claim.get("follows_from"):
            verdict = f"{verdict}; follows from {claim['follows_from']}, not a finding"
        out.append({**row, "verdict": verdict, "measured": text, "numbers": numbers})
    return out


def format_table(rows: list[dict[str, Any]]) -> str:
    from tabulate import tabulate

    def names(folders):
        return ", ".join(Path(f).name for f in folders)

    body = [[r["id"], r["says"], names(r["runs"]), names(r["against"]) or "–", r["measured"], r["verdict"]]
            for r in rows]
    return tabulate(body, ["Claim", "Says", "Runs", "Against", "Measured (95%)", "Verdict"], tablefmt="pipe",
                    disable_numparse=True) + "\n"
