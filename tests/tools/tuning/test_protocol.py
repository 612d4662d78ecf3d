"""The tuning protocol (cl_bench/tools/tuning/): the grid file, the plan of tuning runs (eval
split only, refused by the campaign otherwise), a committed record reused where it fits,
and the rule that keeps the base value unless another beats it at 95%."""
from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import yaml

from cl_bench.tools.campaign.plan import Entry, planned, read_plan, refuse_test_split
from cl_bench.errors import UserError
from cl_bench.tools.tuning import grid as grids
from cl_bench.tools.tuning import plan
from cl_bench.tools.tuning import rule
from helpers import run_cli

ROOT = Path(__file__).resolve().parents[3]
SMOKE_GRID = {
    "profile": "smoke", "order": ["NumGLUE-cm", "Py150", "20Minuten"], "seed": 1234, "rule": "last-acc-keep-base",
    "output": "results/tuning",
    "methods": {"seqft": {"lr": [3.0e-6, 1.0e-5, 3.0e-5]},
                "ewc": {"lr": [3.0e-6, 1.0e-5, 3.0e-5], "strength": {"lambda_ewc": [1.0e3, 1.0e4, 1.0e5]}}},
    "finals": {"output": "results/tuned", "seeds": [1234, 2], "seeded": ["seqft"]},
}


def smoke_grid(tmp_path: Path, **change) -> grids.Grid:
    path = tmp_path / "grid.yaml"
    path.write_text(yaml.safe_dump({**SMOKE_GRID, **change}))
    return grids.load(path)


def test_the_cpu_grid_is_each_family_rate_a_third_and_three_times_and_the_strengths_around_their_defaults():
    from cl_bench.profiles import PROFILES
    from cl_bench import registry

    g = grids.load(ROOT / "configs" / "tuning" / "cpu.yaml")
    families = PROFILES["cpu"]["train"]["lr_by_family"]
    ranked = {n for n, c in registry.available().items()  # the project's own (other tests register more)
              if not c.reference and c.__module__.startswith("cl_bench.methods.")}
    assert set(g.methods) == ranked  # every ranked method is tuned
    for method, m in g.methods.items():
        family = registry.get(method).lr_family
        if family:
            assert m.lr == grids.third_and_triple(families[family]) and m.base_lr == families[family]
        else:  # SAME, CaRE: their own default and their committed sweep's rates
            assert m.base_lr == m.lr[0]
    assert grids.third_and_triple(3e-4) == [1e-4, 3e-4, 1e-3] and grids.third_and_triple(3e-3) == [1e-3, 3e-3, 1e-2]
    for method, arg in (("lwf", "lambda_kl"), ("olora", "lambda1"), ("mofo", "alpha")):
        d = g.methods[method].base_strength
        assert g.methods[method].strength == arg
        assert g.methods[method].values == pytest.approx([d / 3, d, 3 * d], rel=0.03)
    assert g.methods["ewc"].values == [1e3, 1e4, 1e5]


@pytest.mark.parametrize("change, message", [
    ({"methods": {"seqft": {"lr": [3e-6, 3e-5]}}}, "methods.seqft.lr: [3e-06, 3e-05] lacks the base rate 1e-05"),
    ({"order": ["MeetingBank", "Py150", "NumGLUE-cm"]}, "order: "),
    ({"methods": {"individual": {"lr": [1e-5]}}}, "methods.individual: a reference row is never ranked"),
    ({"rule": "best-bwt"}, "rule: 'best-bwt' is not a rule"),
    ({"methods": {"ewc": {"lr": [1e-5], "strength": {"lambda_ewc": [1e3]}}}}, "lacks the default 10000"),
])
def test_a_bad_grid_is_one_line_naming_the_file_and_field(tmp_path, change, message):
    with pytest.raises(UserError, match="grid.yaml: ") as e:
        smoke_grid(tmp_path, **change)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_every_line_of_the_cpu_tuning_plan_scores_the_eval_split(tmp_path):
    """Mutation: Grid.flags without `--set data.test_split=eval` fails here."""
    g = grids.load(ROOT / "configs" / "tuning" / "cpu.yaml")
    text = plan.tuning_plan(g, plan.Records(Path("none"), tmp_path), {})
    (tmp_path / "p.txt").write_text(text)
    entries = read_plan(tmp_path / "p.txt")
    assert text.startswith(plan.TUNING_MARK) and len(entries) == 45
    assert all(planned(e)[0].data.test_split == "eval" for e in entries)
    assert {planned(e)[0].data.order for e in entries} == {"Py150,NumGLUE-ds,C-STANCE"}
    refuse_test_split(tmp_path / "p.txt", entries)  # passes


def test_the_campaign_refuses_a_tuning_plan_that_would_score_the_test_split(tmp_path, trace_dir, capsys):
    """Mutation: campaign.main without its is_tuning_plan check starts (here: shows) the plan."""
    flags = f"--profile smoke --data-dir {trace_dir} --method seqft --order NumGLUE-cm,Py150"
    lines = f"{tmp_path}/a: {flags} --set data.test_split=eval\n{tmp_path}/b: {flags}\n"
    tuning, ordinary = tmp_path / "tune.txt", tmp_path / "plain.txt"
    tuning.write_text(f"{plan.TUNING_MARK}\n{lines}")
    ordinary.write_text(lines)
    assert run_cli("campaign", tuning, "--status", "--root", ROOT) == 2
    err = capsys.readouterr().err.strip()
    assert "tune.txt:3:" in err and "test split" in err and "data.test_split=eval" in err and "\n" not in err
    assert run_cli("campaign", ordinary, "--status", "--root", ROOT) == 0  # not a tuning plan: test split allowed


def _planned_record(g: grids.Grid, args: dict) -> tuple[dict, object, object]:
    config, method_args = planned(Entry(g.folder("seqft", args), g.flags("seqft", args), 0))
    record = {"status": "complete", "method": "seqft", "seed": config.seed, "profile": config.profile,
              "config": config.to_dict(),
              "method_args": dataclasses.asdict(method_args),
              "backend": {"precision": {"train": "fp32", "eval": "fp32"}}}  # smoke computes in fp32
    return record, config, method_args


@pytest.mark.parametrize("change, fit", [
    (lambda r: None, True),
    (lambda r: r["config"]["eval"].update(cka_probe=8, routing_probe=8), True),  # measurement only
    (lambda r: r["config"].update(output_dir="elsewhere", run_id="x"), True),
    (lambda r: r["config"].update(general={"lima": 64}), True),  # a probe
    (lambda r: r.update(profile="cpu"), False),  # another profile's row, which its boards would not show
    (lambda r: r["config"].pop("general"), True),  # a record from before the probe existed
    (lambda r: r["config"]["eval"].pop("generator"), True),  # a record from before eval.generator: hf
    (lambda r: r["config"]["eval"].update(generator="vllm"), False),
    (lambda r: r.update(seed=2), False),
    (lambda r: r["method_args"].update(lr=3e-5), False),
    (lambda r: r["config"]["data"].update(test_split="test"), False),
    (lambda r: r["config"]["data"].update(n_train=99), False),
    (lambda r: r.update(backend={"precision": {"train": "bf16", "eval": "bf16"}}), False),
    (lambda r: r.update(status="running"), False),
])
def test_a_committed_record_is_reused_only_where_it_is_the_planned_run_in_its_precision(tmp_path, change, fit):
    """Mutation: `fits` without its precision check passes the bf16 record of an fp32 plan."""
    g = smoke_grid(tmp_path)
    record, config, method_args = _planned_record(g, {"lr": 1e-5})
    change(record)
    assert plan.fits(record, config, method_args) is fit


def test_the_lima_probe_counts_as_scored_where_lima_replay_is_on(tmp_path):
    """Lima replay leaves the probe's items out of its buffer (run/prepare.py), so there
    the probe changes what trains. Mutation caught: general.lima never compared."""
    g = smoke_grid(tmp_path)
    flags = g.flags("seqft", {"lr": 1e-5}) + ["--set", "replay.lima=8"]
    config, method_args = planned(Entry(g.folder("seqft", {"lr": 1e-5}), flags, 0))
    record = {"status": "complete", "method": "seqft", "seed": config.seed, "profile": config.profile,
              "config": config.to_dict(), "method_args": dataclasses.asdict(method_args),
              "backend": {"precision": {"train": "fp32", "eval": "fp32"}}}
    assert plan.fits(record, config, method_args)
    record["config"]["general"] = {**record["config"]["general"], "lima": record["config"]["general"]["lima"] + 4}
    assert not plan.fits(record, config, method_args)


def _rates(fake_run, root: Path, g: grids.Grid, finals: dict, method="seqft", **kw) -> dict:
    """Runs at each rate of the grid: `finals` rate -> per-task final counts (of 40)."""
    return {lr: fake_run(root / g.folder(method, {"lr": lr}), method, {"lr": lr}, final, **kw)
            for lr, final in finals.items()}


def test_the_rule_keeps_the_base_rate_when_the_best_is_not_higher_at_95(tmp_path, fake_run):
    """Mutation: choosing the point-best rate whatever the interval fails here."""
    g = smoke_grid(tmp_path)
    runs = _rates(fake_run, tmp_path, g, {3e-6: [20, 20, 20], 1e-5: [30, 30, 30], 3e-5: [31, 31, 30]})
    out = rule.decide({lr: p.relative_to(tmp_path) for lr, p in runs.items()}, 1e-5, tmp_path)
    assert out["best"] == 3e-5 and out["chosen"] == 1e-5 and out["at_edge"] is None
    lo, hi = out["best_vs_base"]["ci"]
    assert lo <= 0 < hi and out["best_vs_base"]["diff"] == pytest.approx(100 * 2 / 120)


def test_the_rule_takes_another_rate_when_it_beats_the_base_at_95(tmp_path, fake_run):
    """Mutation: keeping the base rate always fails here."""
    g = smoke_grid(tmp_path)
    runs = _rates(fake_run, tmp_path, g, {3e-6: [20, 20, 20], 1e-5: [30, 30, 30], 3e-5: [38, 38, 38]})
    out = rule.decide({lr: p.relative_to(tmp_path) for lr, p in runs.items()}, 1e-5, tmp_path)
    assert out["chosen"] == 3e-5 and out["best_vs_base"]["ci"][0] > 0
    assert out["at_edge"] == "highest"  # the grid's end: what lies past it was not tried (the tuned file says so)
    tie = rule.decide({1e-5: runs[1e-5].relative_to(tmp_path), 3e-5: runs[1e-5].relative_to(tmp_path)}, 1e-5,
                      tmp_path)
    assert tie["best"] == 1e-5 and tie["best_vs_base"] is None  # a tie goes to the base
    below = rule.decide({3e-6: runs[1e-5].relative_to(tmp_path), 1e-5: runs[1e-5].relative_to(tmp_path)}, 1e-5,
                        tmp_path)
    assert below["best"] == 1e-5  # also where the tied value is the smaller (mutation: the tie-break dropped)


def test_choose_waits_for_a_rate_run_that_is_not_complete(tmp_path, fake_run):
    """Mutation caught: `_folders` without its status check reads a running run's partial record."""
    g = smoke_grid(tmp_path, methods={"seqft": SMOKE_GRID["methods"]["seqft"]},
                   finals={"output": "results/tuned", "seeded": []})
    runs = _rates(fake_run, tmp_path, g, {3e-6: [20, 20, 20], 1e-5: [30, 30, 30], 3e-5: [38, 38, 38]})
    record = json.loads((runs[3e-5] / "run.json").read_text())
    (runs[3e-5] / "run.json").write_text(json.dumps({**record, "status": "running"}))
    with pytest.raises(UserError, match=r"tuning runs not complete for seqft \(rate\)"):
        rule.choose(g, plan.Records(Path("results"), tmp_path))


@pytest.mark.parametrize("field, change", [
    ("method_args.lr", {"args": {"lr": 1e-3}}), ("seed", {"seed": 2}), ("method", {"method": "ewc"}),
    ("tasks", {"tasks": ["Py150", "NumGLUE-cm", "20Minuten"]}), ("profile", {"profile": "cpu"}),
    ("backend.precision.train", {"precision": "bf16"})])
def test_choose_refuses_a_run_in_a_grid_points_folder_that_is_not_that_point(tmp_path, fake_run, field, change):
    """A run moved or copied into a point's folder is not read as the point's run.
    Mutations caught: `_folders` without `_is_the_point` chooses from the wrong run; its
    profile or precision check dropped (another profile's run, a bf16 run of an fp32 point)."""
    g = smoke_grid(tmp_path, methods={"seqft": SMOKE_GRID["methods"]["seqft"]},
                   finals={"output": "results/tuned", "seeded": []})
    _rates(fake_run, tmp_path, g, {3e-6: [20, 20, 20], 1e-5: [30, 30, 30]})
    folder = tmp_path / g.folder("seqft", {"lr": 3e-5})
    fake_run(folder, change.get("method", "seqft"), change.get("args", {"lr": 3e-5}), [38, 38, 38],
             seed=change.get("seed", 1234), tasks=change.get("tasks", SMOKE_GRID["order"]),
             profile=change.get("profile", "smoke"), precision=change.get("precision", "fp32"))
    with pytest.raises(UserError, match=rf"run.json: {field} is .* move that run out of"):
        rule.choose(g, plan.Records(Path("results"), tmp_path))


def test_the_rule_refuses_a_run_that_scored_the_test_split(tmp_path, fake_run):
    g = smoke_grid(tmp_path)
    runs = _rates(fake_run, tmp_path, g, {1e-5: [30, 30, 30], 3e-5: [38, 38, 38]}, split="test")
    with pytest.raises(UserError, match="scored the test split; the rule reads tuning runs on the eval split"):
        rule.decide({lr: p.relative_to(tmp_path) for lr, p in runs.items()}, 1e-5, tmp_path)


def test_the_strength_is_tuned_after_the_rate_at_the_chosen_rate(tmp_path, fake_run):
    """The plan adds the strength's runs once the rate is decided, at that rate; choose
    writes both (its default strength's point being the rate's run)."""
    g = smoke_grid(tmp_path, methods={"ewc": SMOKE_GRID["methods"]["ewc"]},
                   finals={"output": "results/tuned", "seeded": []})
    records = plan.Records(Path("results"), tmp_path)
    assert "# not yet (rate runs not done): ewc (lambda_ewc 1000, 10000, 100000)" in plan.tuning_plan(g, records, {})
    _rates(fake_run, tmp_path, g, {3e-6: [20, 20, 20], 1e-5: [30, 30, 30], 3e-5: [38, 38, 38]}, method="ewc")
    decided = rule.decided_rates(g, records)
    assert decided == {"ewc": 3e-5}
    text = plan.tuning_plan(g, records, decided)
    strength = [line for line in text.splitlines() if "lambda_ewc=" in line]
    assert [s.split(":")[0] for s in strength] == ["results/tuning/ewc-lr3e-5-lambda_ewc1e3",
                                                    "results/tuning/ewc-lr3e-5-lambda_ewc1e5"]
    # a name ending in a digit is kept apart from its value (mutation caught: olora-lr3e-3-lambda11.7e-1)
    assert g.folder("olora", {"lr": 3e-3, "lambda1": 0.17}).as_posix() == "results/tuning/olora-lr3e-3-lambda1_1.7e-1"
    assert all("lr=3e-05" in s and "data.test_split=eval" in s for s in strength)
    with pytest.raises(UserError, match=r"ewc \(lambda_ewc at lr 3e-05\)"):
        rule.choose(g, records)
    for lam, final in ((1e3, [37, 37, 37]), (1e5, [39, 39, 39])):
        args = {"lr": 3e-5, "lambda_ewc": lam}
        fake_run(tmp_path / g.folder("ewc", args), "ewc", args, final)
    tuned = rule.choose(g, records)["methods"]["ewc"]
    assert tuned["args"] == {"lr": 3e-5, "lambda_ewc": 1e4}  # 1e5 is not higher than the default at 95%
    assert tuned["lambda_ewc"]["runs"][1e4] == "results/tuning/ewc-lr3e-5"
    # A strength that beats the default at 95% is taken (mutation caught: the strength kept at its default).
    args = {"lr": 3e-5, "lambda_ewc": 1e5}
    shutil.rmtree(tmp_path / g.folder("ewc", args))
    fake_run(tmp_path / g.folder("ewc", args), "ewc", args, [40, 40, 40])
    assert rule.choose(g, records)["methods"]["ewc"]["args"] == {"lr": 3e-5, "lambda_ewc": 1e5}
