"""The tuned file read back (cl_bench/config_tuned.py, cl_bench/tools/tuning/tuned.py): `cl-bench run --tuned` takes the
method's arguments from it and records the file's commit; the tuned leaderboard holds
each method at its tuned arguments only, so that "≠ base" is against tuned SeqFT."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import yaml

from cl_bench import config as cfg
from cl_bench import config_tuned
from cl_bench.errors import UserError
from cl_bench.report.leaderboard import build_table, load_runs
from cl_bench.tools.tuning import tuned
from helpers import only_run, run_cli, smoke_args

TUNED = {"profile": "smoke", "methods": {"seqft": {"args": {"lr": 3.0e-5}}, "ewc": {"args": {"lr": 1.0e-5,
                                                                                             "lambda_ewc": 1.0e5}}}}


def git(root: Path, *argv: str) -> str:
    return subprocess.run(["git", "-C", str(root), *argv], check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture
def repo(tmp_path, monkeypatch) -> Path:
    """A checkout holding a committed configs/tuned/smoke.yaml, as config_tuned.ROOT."""
    root = tmp_path / "repo"
    (root / "configs" / "tuned").mkdir(parents=True)
    (root / "configs" / "tuned" / "smoke.yaml").write_text(yaml.safe_dump(TUNED))
    git(root.parent, "init", "-q", str(root))
    git(root, "-c", "user.name=t", "-c", "user.email=t@t", "add", ".")
    git(root, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "tuned")
    monkeypatch.setattr(config_tuned, "ROOT", root)
    return root


def test_the_tuned_file_is_read_from_the_checkout_whose_code_runs():
    """Mutation caught: ROOT one folder off (cl_bench/, as when the reader sat one level deeper
    in tools/tuning/ and kept parents[2]): every --tuned run would find no tuned file."""
    assert (config_tuned.ROOT / "pyproject.toml").is_file() and (config_tuned.ROOT / "configs" / "tuning").is_dir()


def test_tuned_takes_the_methods_arguments_from_the_file_and_names_its_commit(repo):
    """Mutation: config.resolve without the tuned hook leaves the default lr and no `tuned`."""
    config = cfg.resolve("cpu", None, {"profile": "smoke", "method": "ewc", "tuned": True})
    assert config.method_args == {"lr": 1e-5, "lambda_ewc": 1e5}
    assert config.tuned == f"configs/tuned/smoke.yaml@{git(repo, 'rev-parse', 'HEAD')}"
    assert cfg.resolve("cpu", None, {"profile": "smoke", "method": "ewc"}).tuned is None


@pytest.mark.parametrize("overrides, change, message", [
    ({"method_args": {"lr": "1e-3"}}, None, "--tuned sets lr of seqft from configs/tuned/smoke.yaml; drop "
                                            "--method-arg lr"),
    ({"method": "lwf"}, None, "no tuned arguments for lwf"),
    ({}, "edit", "has uncommitted changes; commit it"),
    ({"profile": "cpu"}, None, "cpu.yaml: no tuned file for this profile, nor a tuning grid"),
    ({"profile": "cpu"}, "grid", "make it with `cl-bench tune choose configs/tuning/cpu.yaml`"),
    ({"tuned": "configs/tuned/smoke.yaml@abc"}, None, "give true (--tuned)"),
])
def test_tuned_refuses_what_the_record_could_not_name(repo, overrides, change, message):
    if change == "edit":
        (repo / "configs" / "tuned" / "smoke.yaml").write_text(yaml.safe_dump({**TUNED, "profile": "x"}))
    if change == "grid":  # a profile with a grid but no tuned file yet: the command that makes it
        (repo / "configs" / "tuning").mkdir(parents=True, exist_ok=True)
        (repo / "configs" / "tuning" / "cpu.yaml").write_text("profile: cpu\n")
    with pytest.raises(UserError) as e:
        cfg.resolve("cpu", None, {"profile": "smoke", "method": "seqft", "tuned": True, **overrides})
    assert message in str(e.value)


def test_a_tuned_smoke_run_records_the_file_and_its_commit(repo, trace_dir, tmp_path):
    argv = [a for a in smoke_args(trace_dir, tmp_path / "out", "--method", "seqft", "--tuned",
                                  "--order", "NumGLUE-cm") if a not in ("--method-arg", "lr=1e-3")]
    assert run_cli(*argv) == 0
    record = json.loads((only_run(tmp_path / "out") / "run.json").read_text())
    assert record["config"]["tuned"] == f"configs/tuned/smoke.yaml@{git(repo, 'rev-parse', 'HEAD')}"
    assert record["method_args"]["lr"] == 3e-5


def test_the_tuned_leaderboard_holds_each_method_at_its_tuned_arguments_and_judges_base_against_tuned_seqft(
        tmp_path, fake_run):
    """Mutation: select ignoring the arguments puts SeqFT at its shared rate beside the tuned one."""
    runs = tmp_path / "results"
    at_tuned = tuned.expected_args({m: e["args"] for m, e in TUNED["methods"].items()}, "smoke")
    shared = tuned.expected_args({"seqft": {}, "ewc": {}}, "smoke")
    fake_run(runs / "seqft-shared", "seqft", shared["seqft"], [10, 10, 10], split="test")
    fake_run(runs / "seqft-tuned", "seqft", at_tuned["seqft"], [30, 30, 30], split="test")
    fake_run(runs / "ewc-tuned", "ewc", at_tuned["ewc"], [20, 20, 20], split="test")
    fake_run(runs / "ewc-tuned-on-eval", "ewc", at_tuned["ewc"], [40, 40, 40], split="eval")
    fake_run(runs / "ewc-other-order", "ewc", at_tuned["ewc"], [40, 40], split="test", tasks=["NumGLUE-cm", "Py150"])
    chosen = tuned.select(load_runs(runs), at_tuned, "smoke")
    assert sorted(Path(r.source).parent.name for r in chosen) == ["ewc-tuned", "seqft-tuned"]
    table = build_table(chosen)
    (ewc,) = table.index[table["Method"] == "ewc"]
    assert list(table["Method"]) == ["seqft", "ewc"] and table.loc[ewc, "Last ≠ base"] == "yes"
    assert [Path(r.source).parent.name for r in tuned.select(load_runs(runs), shared, "smoke")] == ["seqft-shared"]


def test_the_finals_run_each_method_at_its_tuned_arguments_on_the_test_split_seeded_rows_at_every_seed(
        repo, tmp_path, trace_dir, monkeypatch):
    """A committed row that is the finals run (same arguments, seed, budget and data files)
    is named, not re-run. Every method's first seed comes before any extra seed, so the
    extra seeds are what --hours cuts. Mutations: finals_plan without the records lookup
    plans ewc again; the seeds looped inside the methods (seqft-seed2 before ewc's row);
    the data files not compared (a row made on another release of the data kept)."""
    from cl_bench.tools.campaign.plan import Entry, planned, read_plan
    from cl_bench.tools.tuning import grid as grids
    from cl_bench.tools.tuning import plan
    import dataclasses

    path = tmp_path / "grid.yaml"
    path.write_text(yaml.safe_dump({
        "profile": "smoke", "order": ["NumGLUE-cm", "Py150", "20Minuten"], "rule": "last-acc-keep-base",
        "output": "results/tuning", "methods": {"seqft": {"lr": [3.0e-6, 1.0e-5, 3.0e-5]},
                                                "ewc": {"lr": [3.0e-6, 1.0e-5, 3.0e-5]}},
        "finals": {"output": "results/tuned", "seeds": [1234, 2], "seeded": ["seqft", "ewc"],
                   "set": ["general.lima=4"]}}, sort_keys=False))
    g = grids.load(path)
    monkeypatch.setenv("CL_BENCH_DATA", str(trace_dir))
    flags = ["--profile", "smoke", "--method", "ewc", "--tuned", "--seed", "2"]
    config, method_args = planned(Entry(Path("x/y"), flags, 0))  # committed without the probe
    committed = tmp_path / "results" / "ewc-smoke-seed2"
    committed.mkdir(parents=True)
    data = {task: {role: {"sha256": sha} for role, sha in shas.items()}
            for task, shas in plan.data_digests(config).items()}
    record = {"status": "complete", "method": "ewc", "seed": 2, "profile": "smoke",
              "config": {**config.to_dict(), "tuned": None}, "data": data,
              "method_args": dataclasses.asdict(method_args), "git_commit": "abcdef123",
              "backend": {"precision": {"train": "fp32", "eval": "fp32"}}}
    (committed / "run.json").write_text(json.dumps(record))
    text = plan.finals_plan(g, Path("configs/tuned/smoke.yaml"), config_tuned.load(config_tuned.path_for("smoke")),
                            plan.Records(Path("results"), tmp_path), g.finals.output, g.finals.seeds,
                            g.finals.seeded)
    (tmp_path / "finals.txt").write_text(text)
    entries = read_plan(tmp_path / "finals.txt")
    assert [str(e.run_dir) for e in entries] == ["results/tuned/seqft", "results/tuned/ewc",
                                                 "results/tuned/seqft-seed2", "results/ewc-smoke-seed2"]
    assert "kept: code abcdef12" in text
    assert text.index("# The extra seeds") > text.index("results/tuned/ewc: ")
    configs = [planned(e)[0] for e in entries]
    assert {c.data.test_split for c in configs} == {"test"} and [c.seed for c in configs] == [1234, 1234, 2, 2]
    assert [c.method_args.get("lr") for c in configs] == [3e-5, 1e-5, 3e-5, 1e-5]
    assert all(c.tuned.startswith("configs/tuned/smoke.yaml@") for c in configs)
    assert [c.general.lima for c in configs] == [4, 4, 4, 4]
    # the same row made on other data files (another release: data_dir is not compared) is not the finals run
    first = next(iter(data))
    data[first]["test"]["sha256"] = "0" * 64
    (committed / "run.json").write_text(json.dumps(record))
    other = plan.finals_plan(g, Path("configs/tuned/smoke.yaml"), config_tuned.load(config_tuned.path_for("smoke")),
                             plan.Records(Path("results"), tmp_path), g.finals.output, g.finals.seeds,
                             g.finals.seeded)
    assert "results/tuned/ewc-seed2: " in other and "kept:" not in other
    # A folder the boards leave out (the grid's finals.exclude) is no row to keep: the seed is run
    # anew. Mutation caught: Records ignoring its exclude (the excluded row kept).
    apart = plan.finals_plan(g, Path("configs/tuned/smoke.yaml"), config_tuned.load(config_tuned.path_for("smoke")),
                             plan.Records(Path("results"), tmp_path, ["ewc-smoke-*"]), g.finals.output,
                             g.finals.seeds, g.finals.seeded)
    assert "results/tuned/ewc-seed2: " in apart and "kept:" not in apart
    # A method not in `seeded` runs at the first seed alone (mutation caught: every method at every seed).
    once = plan.finals_plan(g, Path("configs/tuned/smoke.yaml"), config_tuned.load(config_tuned.path_for("smoke")),
                            plan.Records(Path("results"), tmp_path), g.finals.output, g.finals.seeds, ["seqft"])
    assert "results/tuned/seqft-seed2: " in once and "--method ewc --tuned --seed 2" not in once
    assert "results/tuned/ewc: " in once


def test_a_board_refuses_two_runs_at_one_seed_or_none_at_the_rows_own_and_says_missing_extra_seeds(
        tmp_path, fake_run, caplog):
    """Each ranked method's row is one run per seed, seed 1234 among them. Mutations caught:
    check_rows returning the runs unchecked (the duplicate pooled, the missing row unseen),
    the extra seeds' warning dropped."""
    from cl_bench.tools.tuning.grid import Finals

    finals = Finals(Path("results/tuned"), [1234, 2, 3], ["seqft"])
    shared = tuned.expected_args({"seqft": {}, "ewc": {}}, "smoke")
    runs = tmp_path / "results"
    fake_run(runs / "seqft", "seqft", shared["seqft"], [30] * 3, split="test")
    fake_run(runs / "seqft-seed2", "seqft", shared["seqft"], [30] * 3, split="test", seed=2)
    fake_run(runs / "ewc", "ewc", shared["ewc"], [20] * 3, split="test")

    def board():
        return tuned.check_rows(tuned.select(load_runs(runs), shared, "smoke"), "shared", finals, list(shared))

    with caplog.at_level("WARNING"):
        assert len(board()) == 3
    assert "pools fewer seeds than the finals give: seqft (3)" in caplog.text
    fake_run(runs / "calibration" / "seqft-lr", "seqft", shared["seqft"], [10] * 3, split="test")
    with pytest.raises(UserError) as e:
        board()
    assert "seqft seed 1234: 2 runs (" in str(e.value) and "calibration/seqft-lr" in str(e.value)
    assert "\n" not in str(e.value)
    (runs / "calibration" / "seqft-lr" / "run.json").unlink()
    (runs / "ewc" / "run.json").unlink()
    with pytest.raises(UserError, match="the shared leaderboard: ewc: no run at seed 1234; "):
        board()
    # a run at a seed the finals do not give, and a reference row's second run, would be pooled
    # unseen (mutations caught: either check dropped)
    fake_run(runs / "ewc-again", "ewc", shared["ewc"], [20] * 3, split="test")
    fake_run(runs / "seqft-seed4", "seqft", shared["seqft"], [30] * 3, split="test", seed=4)
    with pytest.raises(UserError, match=r": seqft seed 4: not a seed of the finals \([^)]*/seqft-seed4\);"):
        board()
    (runs / "seqft-seed4" / "run.json").unlink()
    for name in ("multitask", "multitask-again"):
        fake_run(runs / name, "multitask", tuned.default_args("multitask", "smoke"), [25] * 3, split="test")
    with pytest.raises(UserError, match=r": multitask seed 1234: 2 runs \([^)]*/multitask, [^)]*/multitask-again\);"):
        board()


def test_the_commands_from_plan_to_verdict(repo, fake_run, monkeypatch, capsys):
    """plan -> choose -> finals -> leaderboard (tuned and shared) -> verdict, through
    `cl-bench tune`, on synthetic runs."""
    monkeypatch.chdir(repo)
    (repo / "grid.yaml").write_text(yaml.safe_dump({
        "profile": "smoke", "order": ["NumGLUE-cm", "Py150", "20Minuten"], "rule": "last-acc-keep-base",
        "output": "results/tuning", "methods": {"seqft": {"lr": [3.0e-6, 1.0e-5, 3.0e-5]},
                                                "ewc": {"lr": [3.0e-6, 1.0e-5, 3.0e-5]}},
        "finals": {"output": "results/tuned", "seeds": [1234]}}, sort_keys=False))
    for method, finals in (("seqft", ([20] * 3, [30] * 3, [38] * 3)), ("ewc", ([20] * 3, [30] * 3, [31] * 3))):
        for lr, final in zip((3e-6, 1e-5, 3e-5), finals):
            fake_run(repo / "results" / "tuning" / f"{method}-lr{lr:.0e}".replace("e-0", "e-"), method,
                     {"lr": lr}, final)
    assert run_cli("tune", "plan", "grid.yaml", "--records", "results", "--out", "plan.txt") == 0
    assert (repo / "plan.txt").read_text().startswith("#! tuning: eval split only")
    assert run_cli("tune", "choose", "grid.yaml") == 0
    chosen = yaml.safe_load((repo / "configs" / "tuned" / "smoke.yaml").read_text())
    assert {m: e["args"] for m, e in chosen["methods"].items()} == {"seqft": {"lr": 3e-5}, "ewc": {"lr": 1e-5}}
    assert chosen["methods"]["seqft"]["lr"]["runs"][3e-5] == "results/tuning/seqft-lr3e-5"
    git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qam", "chosen")
    assert run_cli("tune", "finals", "grid.yaml", "--out", "finals.txt") == 0
    finals = (repo / "finals.txt").read_text()
    assert "results/tuned/seqft: --profile smoke --method seqft --tuned --seed 1234" in finals
    at_tuned = tuned.expected_args({"seqft": {"lr": 3e-5}, "ewc": {"lr": 1e-5}}, "smoke")
    shared = tuned.expected_args({"seqft": {}, "ewc": {}}, "smoke")
    fake_run(repo / "results" / "tuned" / "seqft", "seqft", at_tuned["seqft"], [36] * 3, split="test")
    fake_run(repo / "results" / "ewc", "ewc", at_tuned["ewc"], [20] * 3, split="test")  # ewc kept its rate
    fake_run(repo / "results" / "seqft", "seqft", shared["seqft"], [10] * 3, split="test")
    (repo / "README.md").write_text("a\n<!-- tl:begin -->\nold\n<!-- tl:end -->\nb\n")
    capsys.readouterr()
    assert run_cli("tune", "leaderboard", "grid.yaml", "--exclude", "tuning/*", "--update-readme", "README.md",
                   "--section", "tl") == 0
    table = capsys.readouterr().out
    assert table in (repo / "README.md").read_text() and "old" not in (repo / "README.md").read_text()
    assert [line.split("|")[1].strip() for line in table.splitlines()[2:]] == ["seqft", "ewc"]
    assert run_cli("tune", "leaderboard", "grid.yaml", "--view", "shared", "--exclude", "tuning/*") == 0
    shared_table = capsys.readouterr().out
    assert [line.split("|")[1].strip() for line in shared_table.splitlines()[2:]] == ["ewc", "seqft"]
    # each view writes its own section by default: the shared table never lands in the tuned one
    # (mutation caught: the default section tuned-leaderboard whatever the view)
    (repo / "doc.md").write_text("<!-- tuned-leaderboard:begin -->\nT\n<!-- tuned-leaderboard:end -->\n"
                                 "<!-- shared-leaderboard:begin -->\nS\n<!-- shared-leaderboard:end -->\n")
    assert run_cli("tune", "leaderboard", "grid.yaml", "--view", "shared", "--exclude", "tuning/*",
                   "--update-readme", "doc.md") == 0
    doc = (repo / "doc.md").read_text()
    assert "\nT\n" in doc and "\nS\n" not in doc and shared_table in doc
    capsys.readouterr()
    assert run_cli("tune", "verdict", "grid.yaml", "--exclude", "tuning/*", "--top", "1") == 0
    out = capsys.readouterr().out
    assert "top 1 shared-rate: ewc" in out and "top 1 tuned:       seqft" in out
    assert "trade places at 95%: ewc ahead of seqft at the shared rate" in out
