"""`cl-bench claims` (cl_bench/report/claims.py): verdicts on hand-made runs with
predictions (8 test items a task, two tasks), worked out by hand."""
from __future__ import annotations

import json
import re

import pytest

from cl_bench.report.claims import evaluate
from helpers import run_cli
from helpers import make_record, write_run

BASE = 1000
# task 0 learned perfectly then forgotten, task 1 half learned
FORGETS = {(0, 0): [100] * 8, (0, 1): [100] * 4 + [0] * 4, (1, 0): [0] * 8, (1, 1): [100] * 8}
KEEPS = {**FORGETS, (1, 0): [100] * 6 + [0] * 2}  # BWT -100 -> -25, Last 50 -> 87.5
TIMID = {(0, 0): [100] * 4 + [0] * 4, (0, 1): [0] * 8, (1, 0): [100] * 4 + [0] * 4, (1, 1): [0] * 8}  # BWT 0, Last 25


def run(tmp_path, name, scores, added=500, decisions=None, seed=1, init=None):
    record, preds = make_record(scores, n_test=8, seed=seed)
    diag = {} if decisions is None else {"decisions": decisions, "decision_layers": list(range(len(decisions)))}
    if init is not None:
        diag["init"] = {"decisions": init}
    record.update(status="complete", run_id=name, stages_done=2, model={"id": "tiny-llama", "n_params": BASE},
                  stages=[{"index": 0, "label": "NumGLUE-cm"}, {"index": 1, "label": "C-STANCE"}],
                  params=[{"stage": 1, "total": BASE + added, "trainable": added, "active_per_token": BASE,
                           "deployed": BASE + added, "experts_per_layer": None, "diagnostics": diag}],
                  summary={"last_acc": 0.0, "stage_acc": 0.0, "bwt": 0.0})
    record["schema_version"] = 2
    write_run(tmp_path / "runs" / name, record, preds)
    return f"runs/{name}"


def claims_file(tmp_path, *claims) -> str:
    path = tmp_path / "claims.yaml"
    path.write_text(json.dumps({"claims": [{"id": str(i), "says": "s", **c} for i, c in enumerate(claims)]}))
    return path


def verdicts(tmp_path, *claims):
    return [(r["verdict"], r["measured"]) for r in evaluate(claims_file(tmp_path, *claims), tmp_path)]


def test_less_forgetting_holds_fails_or_cannot_be_told(tmp_path):
    """Mutations caught: the difference's sign (runs - against), the accuracy
    condition dropped (TIMID forgets nothing but learns less), BWT read as Last."""
    keeps, forgets, timid = (run(tmp_path, n, s) for n, s in (("k", KEEPS), ("f", FORGETS), ("t", TIMID)))
    (holds, text), (fails, _), (lower, _), (same, _) = verdicts(
        tmp_path, {"test": "less-forgetting", "runs": [keeps], "against": [forgets]},
        {"test": "less-forgetting", "runs": [forgets], "against": [keeps]},
        {"test": "less-forgetting", "runs": [timid], "against": [forgets]},
        {"test": "less-forgetting", "runs": [forgets], "against": [forgets]})
    assert (holds, fails, lower, same) == ("holds", "does not hold", "does not hold", "not distinguishable")
    assert text.startswith("BWT +75.0 [") and "Last +37.5 [" in text


def test_fewer_added_compares_every_seed_and_judges_the_claimed_share_apart(tmp_path):
    """The direction is the verdict; the claimed share is judged per seed beside it.
    Mutations caught: the reduction computed against the wrong side, seeds that
    disagree counted as a verdict, the size judged on the mean reduction (60% here:
    it would hold, though one seed reduces 40%)."""
    small = [run(tmp_path, f"s{i}", KEEPS, added=a, seed=i) for i, a in enumerate((100, 300), 1)]
    big = [run(tmp_path, f"b{i}", KEEPS, added=500, seed=i) for i in (1, 2)]
    mixed = run(tmp_path, "m", KEEPS, added=600, seed=3)
    out = verdicts(tmp_path, {"test": "fewer-added", "runs": small, "against": big, "expect": 0.6},
                   {"test": "fewer-added", "runs": big, "against": small},
                   {"test": "fewer-added", "runs": [small[0], mixed], "against": big},
                   {"test": "fewer-added", "runs": small, "against": big, "expect": 0.3},
                   {"test": "fewer-added", "runs": small, "against": big, "expect": 0.9})
    assert out[0][0] == "holds" and "60% fewer" in out[0][1]  # seeds reduce 80% and 40%
    assert out[0][1].endswith("60% fewer (runs 100, 300); the claim is 60% fewer: the size is not distinguishable")
    assert out[1][0] == "does not hold" and out[1][1] == "adds 500 against 200: 150% more (runs 500, 500)"
    assert out[2][0] == "not distinguishable"
    assert out[3][1].endswith("; the claim is 30% fewer: the size holds")
    assert out[4][0] == "holds" and out[4][1].endswith("; the claim is 90% fewer: the size does not hold")


def test_a_share_is_said_in_words_whichever_way_it_goes():
    """Mutation caught: the sign dropped ("100% fewer" for twice as many), or a
    rounded zero printed as "0% fewer"."""
    from cl_bench.report.claims import _share

    assert [_share(x) for x in (0.6, -1.0, 0.004, -0.004)] == ["60% fewer", "100% more", "as many", "as many"]


def test_an_ablation_holds_when_the_full_method_is_better_and_never_worse(tmp_path):
    full, ablated, worse_bwt = (run(tmp_path, n, s) for n, s in (("full", KEEPS), ("abl", FORGETS), ("t", TIMID)))
    out = verdicts(tmp_path, {"test": "ablation", "runs": [ablated], "against": [full]},
                   {"test": "ablation", "runs": [full], "against": [ablated]},
                   {"test": "ablation", "runs": [full], "against": [full]},
                   {"test": "ablation", "runs": [worse_bwt], "against": [ablated]})  # Last lower, BWT higher
    assert [v for v, _ in out] == ["holds", "does not hold", "not distinguishable", "not distinguishable"]
    assert out[0][1].startswith("Last -37.5 [") and "BWT -75.0 [" in out[0][1]


def test_deep_expand_pools_the_decision_maps_of_every_run(tmp_path):
    deep = [[0, 0]] * 10 + [[1, 0]] * 10 + [[1, 1]] * 10  # 30 layers: thirds expand 0%, 50%, 100%
    runs = [run(tmp_path, f"d{i}", KEEPS, decisions=deep, seed=i) for i in (1, 2)]
    flipped = run(tmp_path, "f", KEEPS, decisions=deep[::-1])
    out = verdicts(tmp_path, {"test": "deep-expand", "runs": runs}, {"test": "deep-expand", "runs": [flipped]})
    assert out[0][0] == "holds" and out[0][1].startswith("deep 100% vs shallow 0% expand: +100")
    assert out[1][0] == "does not hold"
    everywhere = run(tmp_path, "e", KEEPS, decisions=[[1, 1]] * 30)
    mixed = run(tmp_path, "m", KEEPS, decisions=[[1, 1]] * 29 + [[1, 0]])
    (same, text), (_, mixed_text) = verdicts(tmp_path, {"test": "deep-expand", "runs": [everywhere]},
                                             {"test": "deep-expand", "runs": [mixed]})
    assert same == "not distinguishable" and text.endswith("; every decision was Expand, in every layer")
    assert "every decision" not in mixed_text


def test_a_verdict_that_follows_from_an_input_is_marked_and_not_a_finding(tmp_path):
    """Mutation caught: follows_from accepted but ignored (the verdict would read "holds")."""
    deep = [[0, 0]] * 10 + [[1, 0]] * 10 + [[1, 1]] * 10
    runs = [run(tmp_path, "fixed", KEEPS, decisions=deep)]
    (verdict, _), = verdicts(tmp_path, {"test": "deep-expand", "runs": runs, "follows_from": "depth_prior=fixed"})
    assert verdict == "holds; follows from depth_prior=fixed, not a finding"


def test_deep_expand_shows_where_the_search_started(tmp_path):
    """A run that records its start (init.decisions) gets the start's depth rates
    beside the verdict. Mutation caught: the final maps reported as the start."""
    deep = [[0, 0]] * 10 + [[1, 0]] * 10 + [[1, 1]] * 10
    start = [[0, 0]] * 20 + [[1, 0]] * 10
    runs = [run(tmp_path, "guided", KEEPS, decisions=deep, init=start)]
    (verdict, text), = verdicts(tmp_path, {"test": "deep-expand", "runs": runs})
    assert verdict == "holds" and text.endswith("; at the search's start deep 50% vs shallow 0%")


def test_missing_or_unfinished_runs_are_not_run_yet_and_incomparable_runs_are_refused(tmp_path, capsys):
    done = run(tmp_path, "done", KEEPS)
    path = tmp_path / "runs" / "half" / "run.json"
    run(tmp_path, "half", KEEPS)
    record = json.loads(path.read_text())
    path.write_text(json.dumps({**record, "status": "running", "stages_done": 1}))
    out = verdicts(tmp_path, {"test": "less-forgetting", "runs": ["runs/nowhere"], "against": ["runs/half"]})
    assert out == [("not run yet", "waiting for nowhere, half (running, 1 of 2 stages)")]
    other, preds = make_record(KEEPS, tasks=["NumGLUE-cm", "Py150"], n_test=8)
    other.update(status="complete", stages_done=2)
    write_run(tmp_path / "runs" / "other", other, preds)
    one_layer = run(tmp_path, "one", KEEPS, decisions=[[1, 0]])
    for claim, message in (({"test": "less-forgetting", "runs": ["runs/other"], "against": [done]},
                            "not comparable with .*done/run.json: tasks"),
                           ({"test": "deep-expand", "runs": [one_layer]}, "decides in 1 layer"),
                           ({"test": "deep-expand", "runs": [done]}, "no decision maps")):
        assert run_cli("claims", claims_file(tmp_path, claim), "--root", tmp_path) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and re.search(message, err), err


@pytest.mark.parametrize("body, message", [
    ("claims: []", "no 'claims:' list"),
    ("claims: [{id: a, says: s, test: bigger, runs: [r]}]", r"claims\[0\].test: 'bigger' is not a test"),
    ("claims: [{id: a, says: s, test: ablation, runs: [r]}]", r"claims\[0\].against: give a list"),
    ("claims: [{id: a, says: s, test: ablation, runs: [r], against: [r], expected: 1}]", "unknown field 'expected'"),
    ("claims: [{id: a, test: ablation}]", "missing field 'says'"),
    ("claims: [", "not valid YAML"),
    ("claims: [{id: a, says: s, test: fewer-added, runs: [r], against: [r], expect: 60%}]",
     r"claims\[0\].expect: '60%' is not a share"),
    ("claims: [{id: a, says: s, test: ablation, runs: [r], against: [r], expect: 0.6}]",
     r"claims\[0\].expect: only fewer-added"),
    ("claims: [{id: a, says: s, test: deep-expand, runs: [r], against: r}]", r"claims\[0\].against: deep-expand"),
])
def test_a_bad_claims_file_is_one_line_naming_the_file_and_field(tmp_path, capsys, body, message):
    path = tmp_path / "c.yaml"
    path.write_text(body)
    assert run_cli("claims", path) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(path) in err and re.search(message, err), err


def test_the_command_writes_the_table_into_the_readme_and_the_verdicts_as_json(tmp_path, capsys):
    keeps, forgets = run(tmp_path, "k", KEEPS), run(tmp_path, "f", FORGETS)
    path = claims_file(tmp_path, {"test": "less-forgetting", "runs": [keeps], "against": [forgets]})
    readme = tmp_path / "README.md"
    readme.write_text("top\n<!-- claims:begin -->\nstale table\n<!-- claims:end -->\n")
    assert run_cli("claims", path, "--root", tmp_path, "--update-readme", readme, "--output", tmp_path / "c.json") == 0
    table = capsys.readouterr().out
    assert "| holds" in table and table.strip() in readme.read_text() and "stale" not in readme.read_text()
    written = json.loads((tmp_path / "c.json").read_text())
    assert written["command"].startswith("cl-bench claims") and written["claims"][0]["verdict"] == "holds"
