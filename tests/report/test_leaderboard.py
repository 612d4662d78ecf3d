"""Leaderboard: fake run.json files in tmp_path, numbers worked out by hand."""

import io
import json
import logging

import pandas as pd
import pytest

from cl_bench.errors import UserError
from cl_bench.report.leaderboard import build_table, format_table, humanise, load_runs, update_readme
from cl_bench.record.schema import SCHEMA_VERSION

ORDER = ["MeetingBank", "Py150", "NumGLUE-cm"]
M135 = 134_515_008  # -> "134.5M"
B124 = 1_235_814_400  # -> "1.24B"


def make_run(run_id, method="seqft", seed=1, last=40.0, stage=60.0, bwt=-10.0, total_s=600.0,
             status="complete", reference=False, model="smollm2-135m", tasks=ORDER, params=None, args=None):
    """A minimal valid schema-1 record."""
    if params is None:
        params = [
            {"stage": 0, "total": 1, "trainable": 1, "active_per_token": 1, "deployed": 1, "experts_per_layer": None},
            {"stage": 1, "total": M135, "trainable": B124, "active_per_token": M135, "deployed": M135,
             "experts_per_layer": None},
        ]
    return {
        "schema_version": 1, "run_id": run_id, "status": status, "method": method, "method_args": args or {},
        "reference": reference, "model": {"id": model, "n_params": M135}, "profile": "cpu", "tasks": list(tasks), "seed": seed,
        "matrix": [[None] * len(tasks)] * len(tasks),
        "summary": {"last_acc": last, "stage_acc": stage, "bwt": bwt, "fwt": None, "forgetting": None},
        "params": params, "timing": {"total_s": total_s},
    }


def write(runs_dir, record):
    path = runs_dir / record["run_id"] / "run.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(record))
    return path


@pytest.fixture
def runs_dir(tmp_path):
    """seqft x2 seeds, ewc x1 (bwt null), individual (reference, best score), one unfinished run."""
    d = tmp_path / "runs"
    write(d, make_run("seqft-a", seed=1, last=40.0, stage=60.0, bwt=-10.0, total_s=600.0))
    write(d, make_run("seqft-b", seed=2, last=50.0, stage=62.0, bwt=-14.0, total_s=1200.0))
    write(d, make_run("ewc-a", method="ewc", last=55.0, stage=58.0, bwt=None, total_s=300.0))
    write(d, make_run("individual-a", method="individual", reference=True, last=70.0, bwt=None))
    write(d, make_run("lwf-running", method="lwf", status="running", last=99.0))
    return d


def row(df, method):
    (i,) = df.index[df["Method"] == method]
    return df.loc[i]


def test_groups_seeds_into_mean_and_sample_std(runs_dir):
    df = build_table(load_runs(runs_dir))
    seqft = row(df, "seqft")
    assert seqft["Runs"] == 2
    assert seqft["Tasks"] == 3
    # last 40, 50: mean 45, sample std sqrt(25 + 25) = 7.0711
    assert seqft["Last Acc mean"] == pytest.approx(45.0)
    assert seqft["Last Acc std"] == pytest.approx(50 ** 0.5)
    assert seqft["Stage Acc mean"] == pytest.approx(61.0)
    assert seqft["Stage Acc std"] == pytest.approx(2 ** 0.5)
    assert seqft["BWT mean"] == pytest.approx(-12.0)
    assert seqft["BWT std"] == pytest.approx(8 ** 0.5)
    assert seqft["Wall time (min)"] == pytest.approx(15.0)  # (600 + 1200) / 2 / 60
    ewc = row(df, "ewc")
    assert ewc["Runs"] == 1 and pd.isna(ewc["Last Acc std"]) and pd.isna(ewc["BWT mean"])


def test_params_come_from_the_last_stage(runs_dir):
    seqft = row(build_table(load_runs(runs_dir)), "seqft")
    assert seqft["Total params"] == M135
    assert seqft["Trainable"] == B124
    assert seqft["Active/token"] == M135
    assert seqft["Deployed"] == M135


def test_other_task_order_or_model_is_a_separate_row(tmp_path):
    d = tmp_path / "runs"
    write(d, make_run("a", seed=1))
    write(d, make_run("b", seed=2, tasks=list(reversed(ORDER))))
    write(d, make_run("c", seed=3, model="llama-3.2-1b"))
    df = build_table(load_runs(d))
    assert len(df) == 3 and df["Runs"].tolist() == [1, 1, 1]


def test_runs_in_other_precisions_are_separate_rows_never_pooled_as_seeds(tmp_path):
    d = tmp_path / "runs"
    bf16 = {"name": "torch", "precision": {"train": "bf16", "eval": "bf16"}}
    write(d, {**make_run("a", seed=1, last=40.0), "backend": bf16})
    write(d, {**make_run("b", seed=2, last=50.0), "backend": bf16})
    write(d, make_run("c", seed=3, last=10.0))  # before backend.precision: fp32
    write(d, {**make_run("e", seed=4, last=20.0),
              "backend": {"name": "torch", "precision": {"train": "bf16", "eval": "fp32"}}})
    df = build_table(load_runs(d))
    assert dict(zip(df["Precision"], df["Runs"])) == {"bf16": 2, "fp32": 1, "train bf16, eval fp32": 1}
    assert df.loc[df["Precision"] == "bf16", "Last Acc mean"].item() == pytest.approx(45.0)
    assert "| fp32 " in format_table(df, "md")


def test_reference_rows_sit_at_the_bottom_flagged(runs_dir):
    df = build_table(load_runs(runs_dir))
    # individual has the best Last Acc (70) but is never ranked
    assert df["Method"].tolist() == ["ewc", "seqft", "individual"]
    assert df["Reference"].tolist() == [False, False, True]
    md_lines = format_table(df, "md").strip().splitlines()
    assert md_lines[-1].startswith("| individual (reference)")
    assert "seqft (reference)" not in format_table(df, "md")


def test_incomplete_runs_are_skipped_with_a_warning(runs_dir, caplog):
    with caplog.at_level(logging.WARNING, logger="cl_bench.report.leaderboard"):
        runs = load_runs(runs_dir)
    assert {r.run_id for r in runs} == {"seqft-a", "seqft-b", "ewc-a", "individual-a"}
    assert "lwf-running" in caplog.text and "running" in caplog.text
    assert all(r.source.name == "run.json" for r in runs)


def test_markdown_shows_mean_pm_std_only_for_several_runs(runs_dir):
    md = format_table(build_table(load_runs(runs_dir)), "md")
    lines = md.strip().splitlines()
    assert lines[0].startswith("| Method") and "Last Acc" in lines[0] and "Active/token" in lines[0]
    seqft = next(line for line in lines if line.startswith("| seqft"))
    cells = [c.strip() for c in seqft.strip("|").split("|")]
    # no predictions beside these records: no intervals, and no marks
    assert cells == ["seqft", "smollm2-135m", "cpu", "fp32", "3", "2", "45.0 ± 7.1", "61.0 ± 1.4", "-12.0 ± 2.8",
                     "–", "–", "–", "–", "134.5M", "1.24B", "134.5M", "134.5M", "0", "–", "15.0"]
    ewc = [c.strip() for c in next(line for line in lines if line.startswith("| ewc")).strip("|").split("|")]
    assert ewc[6:9] == ["55.0", "58.0", "–"]  # one run: no ±; null BWT: en dash


def test_csv_keeps_raw_numbers_and_empty_missing(runs_dir):
    text = format_table(build_table(load_runs(runs_dir)), "csv")
    back = pd.read_csv(io.StringIO(text))
    seqft = row(back, "seqft")
    assert seqft["Last Acc mean"] == pytest.approx(45.0)
    assert seqft["Last Acc std"] == pytest.approx(50 ** 0.5)
    assert seqft["Total params"] == M135
    assert "–" not in text and "±" not in text
    ewc_line = next(line for line in text.splitlines() if line.startswith("ewc,"))
    assert ",," in ewc_line  # BWT mean/std empty
    assert bool(row(back, "individual")["Reference"]) is True


def test_latex_is_booktabs_with_escaped_names(tmp_path):
    d = tmp_path / "runs"
    write(d, make_run("o-a", method="o_lora", seed=1, last=40.0))
    write(d, make_run("o-b", method="o_lora", seed=2, last=50.0, bwt=None))
    write(d, make_run("multi", method="multitask", reference=True, bwt=None))
    tex = format_table(build_table(load_runs(d)), "latex")
    assert "\\toprule" in tex and "\\bottomrule" in tex
    assert "o\\_lora" in tex and "45.0 $\\pm$ 7.1" in tex and "134.5M" in tex
    assert "multitask (reference)" in tex and " -- " in tex and "Last $\\neq$ base" in tex
    # bwt: one value (-10.0) among two runs -> no std to show
    assert "-10.0 $\\pm" not in tex and "-10.0" in tex
    # what pdflatex sets: no symbol it has no glyph for (table.LATEX_SYMBOLS; mutation caught: the
    # symbols left as they are)
    assert tex.isascii(), sorted({c for c in tex if not c.isascii()})


def test_humanise():
    assert humanise(M135) == "134.5M"
    assert humanise(B124) == "1.24B"
    assert humanise(6_070_000_000) == "6.07B"
    assert humanise(12_300) == "12.3K"
    assert humanise(999) == "999"
    assert humanise(None) == "–"


def test_unknown_format_is_a_user_error(runs_dir):
    with pytest.raises(UserError, match="md, csv, latex"):
        format_table(build_table(load_runs(runs_dir)), "html")


def test_bad_json_names_the_file(tmp_path):
    bad = tmp_path / "runs" / "x" / "run.json"
    bad.parent.mkdir(parents=True)
    bad.write_text('{"schema_version": 1, ')
    with pytest.raises(UserError, match="not valid JSON") as err:
        load_runs(tmp_path / "runs")
    assert str(bad) in str(err.value)


def test_record_without_schema_version_is_rejected(tmp_path):
    rec = make_run("x")
    del rec["schema_version"]
    path = write(tmp_path, rec)
    with pytest.raises(UserError, match="schema_version") as err:
        load_runs(tmp_path)
    assert str(path) in str(err.value)


def test_newer_schema_asks_to_upgrade(tmp_path):
    write(tmp_path, {**make_run("x"), "schema_version": SCHEMA_VERSION + 1})
    with pytest.raises(UserError, match="upgrade cl-bench"):
        load_runs(tmp_path)


def test_missing_field_names_file_and_field(tmp_path):
    rec = make_run("x")
    del rec["model"]["id"]
    path = write(tmp_path, rec)
    with pytest.raises(UserError, match="model.id") as err:
        build_table(load_runs(tmp_path))
    assert str(path) in str(err.value)


def test_missing_or_empty_dir_names_it(tmp_path):
    with pytest.raises(UserError, match="does not exist") as err:
        load_runs(tmp_path / "nope")
    assert str(tmp_path / "nope") in str(err.value)
    with pytest.raises(UserError, match="no run.json") as err:
        load_runs(tmp_path)
    assert str(tmp_path) in str(err.value)


def test_only_unfinished_runs_is_an_error(tmp_path):
    write(tmp_path, make_run("x", status="interrupted"))
    with pytest.raises(UserError, match="no complete run"):
        load_runs(tmp_path)


README = """# cl-bench

intro text

<!-- leaderboard:begin -->
old table
<!-- leaderboard:end -->

## After
tail text
"""


def test_update_readme_replaces_only_between_markers(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(README)
    update_readme(readme, "| a |\n|---|\n| 1 |\n")
    text = readme.read_text()
    assert "old table" not in text
    head, rest = text.split("<!-- leaderboard:begin -->")
    middle, tail = rest.split("<!-- leaderboard:end -->")
    assert head == "# cl-bench\n\nintro text\n\n"
    assert middle.strip() == "| a |\n|---|\n| 1 |"
    assert tail == "\n\n## After\ntail text\n"
    update_readme(readme, "| a |\n|---|\n| 1 |\n")  # idempotent
    assert readme.read_text() == text
    assert [p.name for p in tmp_path.iterdir()] == ["README.md"]  # no temp file left behind


def test_update_readme_without_markers_leaves_file_alone(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("# no markers here\n<!-- leaderboard:end -->\n")
    with pytest.raises(UserError, match="add a line <!-- leaderboard:begin -->"):
        update_readme(readme, "table")
    assert readme.read_text() == "# no markers here\n<!-- leaderboard:end -->\n"


def test_repeated_seed_in_a_group_warns(tmp_path, caplog):
    write(tmp_path, make_run("a", seed=7))
    write(tmp_path, make_run("a-copy", seed=7))
    with caplog.at_level(logging.WARNING, logger="cl_bench.report.leaderboard"):
        df = build_table(load_runs(tmp_path))
    assert df["Runs"].tolist() == [2]
    assert "seed repeated" in caplog.text and "[7, 7]" in caplog.text


def test_nulls_everywhere_render_as_dashes(tmp_path):
    write(tmp_path, make_run("a", last=None, stage=None, bwt=None, total_s=None, params=[]))
    df = build_table(load_runs(tmp_path))
    cells = [c.strip() for c in format_table(df, "md").strip().splitlines()[-1].strip("|").split("|")]
    assert cells[6:] == ["–"] * 14


def test_a_sweep_gives_one_row_per_argument_set_labelled_by_what_differs(tmp_path):
    d = tmp_path / "runs"
    for i, lam in enumerate([100.0, 1000.0]):
        for seed in (1, 2):
            write(d, make_run(f"ewc-{i}-{seed}", method="ewc", seed=seed, last=10.0 * (i + 1) + seed,
                              args={"lambda_ewc": lam, "lr": 1e-5}))
    write(d, make_run("seqft-a", args={"lr": 1e-5}))
    df = build_table(load_runs(d))
    assert len(df) == 3 and df["Runs"].tolist() == [1, 2, 2]  # seqft (40) first by Last Acc
    md = format_table(df, "md")
    assert "| ewc (lambda_ewc=1000.0) " in md and "| ewc (lambda_ewc=100.0) " in md
    assert "| seqft " in md  # one argument set: the bare name
    assert "21.5" in md  # mean of 21, 22 for lambda 1000


def test_exclude_skips_matching_run_folders(tmp_path):
    d = tmp_path / "runs"
    write(d, make_run("seqft-a"))
    write(d / "sweeps" / "ewc-lambda", make_run("ewc-x", method="ewc"))
    assert [r.method for r in load_runs(d, ["sweeps/*"])] == ["seqft"]
    assert [r.method for r in load_runs(d, ["sweeps"])] == ["seqft"]
    assert len(load_runs(d)) == 2
    write(d, make_run("upcycle-a", method="upcycle"))
    assert [r.method for r in load_runs(d, include=["upcycle-*", "sweeps/*"])] == ["ewc", "upcycle"]  # by path
    assert [r.method for r in load_runs(d, ["sweeps"], include=["*-a"])] == ["seqft", "upcycle"]
    with pytest.raises(UserError, match="matching nothing-\\*"):
        load_runs(d, include=["nothing-*"])


def test_added_parameters_and_the_mean_expansion_rate_over_the_stages_that_report_one(tmp_path):
    grown = [{"stage": b, "total": M135 + 1500 * b, "trainable": 1, "active_per_token": M135,
              "deployed": M135 + 1500 * b, "experts_per_layer": [8 + b], "expansion_rate": rate}
             for b, rate in enumerate([None, 0.5, 0.25])]
    write(tmp_path, make_run("moe", method="bilevel-cka", params=grown))
    df = build_table(load_runs(tmp_path))
    assert row(df, "bilevel-cka")["Added"] == 3000 and row(df, "bilevel-cka")["Expansion"] == 0.375
    cells = [c.strip() for c in format_table(df, "md").strip().splitlines()[-1].strip("|").split("|")]
    assert cells[-3:] == ["3.0K", "38%", "10.0"]


def test_added_parameters_and_expansion_are_means_over_seeds_with_their_std(tmp_path):
    """bilevel-cka's decisions differ by seed, so do its added parameters: the row
    shows their mean and std, never the first seed's. Mutation caught: params
    taken from the group's first run."""
    for seed, (added, rate) in enumerate([(1000, 0.2), (3000, 0.6), (2000, 0.4)], 1):
        grown = [{"stage": b, "total": M135 + added * b, "trainable": 1, "active_per_token": M135,
                  "deployed": M135 + added * b, "experts_per_layer": [8 + b], "expansion_rate": r}
                 for b, r in enumerate([None, rate])]
        write(tmp_path, make_run(f"moe-{seed}", method="bilevel-cka", seed=seed, params=grown))
    write(tmp_path, make_run("flat", method="upcycle"))
    df = build_table(load_runs(tmp_path))
    moe = row(df, "bilevel-cka")
    assert (moe["Added"], moe["Added std"]) == (2000, pytest.approx(1000))
    assert (moe["Expansion"], moe["Expansion std"]) == (pytest.approx(0.4), pytest.approx(0.2))
    assert row(df, "upcycle")["Added"] == 0 and pd.isna(row(df, "upcycle")["Added std"])
    lines = format_table(df, "md").strip().splitlines()
    cells = [c.strip() for c in next(l for l in lines if "bilevel-cka" in l).strip("|").split("|")]
    assert cells[-3:-1] == ["2.0K ± 1.0K", "40% ± 20"]
    assert "Added std" in format_table(df, "csv").splitlines()[0]


def test_labels_name_the_arguments_that_tell_a_methods_rows_apart():
    """A record written before an argument existed lacks it: the rows are told apart by
    the arguments both have (mask_init), not by every argument the newer one added.
    Only where nothing both have differs does a missing argument label them. Mutation
    caught: labels built from every key of either row."""
    import json

    import pandas as pd

    from cl_bench.report.leaderboard.table import method_labels

    old = {"lr": 1e-4, "mask_init": "prior"}
    new = {"lr": 1e-4, "mask_init": "guided", "kappa_flat": 4.0, "probe_batches": 20}
    added = {"lr": 1e-4, "extra": 2}
    df = pd.DataFrame({"Method": ["bilevel-cka", "bilevel-cka", "seqft", "seqft"],
                       "Args": [json.dumps(a) for a in (old, new, {"lr": 1e-4}, added)]})
    assert method_labels(df) == ["bilevel-cka (mask_init=prior)", "bilevel-cka (mask_init=guided)",
                                 "seqft (extra=None)", "seqft (extra=2)"]
