"""Runs of different benchmarks never pool (issue 54, the leaderboard and site item):
not into one row, not into one ranking, not into one table. Tiny fake records of two
benchmarks in tmp_path: TRACE's (seqft 40, ewc 55) and long-sequence's (seqft 70, on
the same task names, so only the benchmark tells the two seqft groups apart).

Mutations caught: "Benchmark" dropped from rows.GROUP_KEYS (the two seqft groups pool
into one row of 2 runs); winners' sets keyed without the benchmark (long-sequence's
seqft wins TRACE's Last Acc); rows.by_benchmark returning one group (one table, both
benchmarks' rows in it, on the command line and on the site); the headline reading
every benchmark (long-sequence's runs in the README's table)."""
from __future__ import annotations

import re

import pytest

from cl_bench.report.leaderboard import build_table, build_winners_table, by_benchmark, load_runs
from cl_bench.report.site.build import build_site
from helpers import run_cli
from test_leaderboard import make_run, write


def bench_run(run_id, benchmark=None, **kw):
    record = make_run(run_id, **kw)
    if benchmark is not None:  # None: a record from before records named their benchmark (reads as trace)
        record["benchmark"] = benchmark
    return record


@pytest.fixture
def runs_dir(tmp_path):
    d = tmp_path / "runs"
    write(d, bench_run("seqft-trace", last=40.0))
    write(d, bench_run("ewc-trace", "trace", method="ewc", last=55.0))
    write(d, bench_run("seqft-long", "long-sequence", last=70.0))
    return d


def rows_of(df):
    return {(r["Benchmark"], r["Method"]): r["Runs"] for r in df.to_dict("records")}


def test_rows_of_two_benchmarks_never_pool(runs_dir):
    df = build_table(load_runs(runs_dir))
    assert rows_of(df) == {("trace", "seqft"): 1, ("trace", "ewc"): 1, ("long-sequence", "seqft"): 1}
    # TRACE's rows first, each benchmark ranked by Last Acc on its own
    assert list(zip(df["Benchmark"], df["Method"])) == [("trace", "ewc"), ("trace", "seqft"),
                                                         ("long-sequence", "seqft")]
    assert list(by_benchmark(load_runs(runs_dir))) == ["trace", "long-sequence"]


def test_winners_are_chosen_within_each_benchmark(runs_dir):
    df = build_winners_table(load_runs(runs_dir))
    last = df[df["On"] == "Last Acc"].set_index("Runs")["Best"].to_dict()
    assert last == {"cpu, 3 tasks, fp32": "ewc", "long-sequence: cpu, 3 tasks, fp32": "seqft"}


def tables(text: str) -> dict[str, str]:
    """'**Benchmark: NAME**' -> the text of its table."""
    parts = re.split(r"^\*\*Benchmark: (\S+)\*\*\n", text, flags=re.M)
    assert parts[0] == ""
    return dict(zip(parts[1::2], parts[2::2]))


def test_the_leaderboard_prints_one_table_per_benchmark(runs_dir, capsys):
    assert run_cli("leaderboard", "--runs", runs_dir) == 0
    out = tables(capsys.readouterr().out)
    assert list(out) == ["trace", "long-sequence"]
    assert "| ewc" in out["trace"] and "| seqft" in out["trace"] and out["trace"].count("| seqft") == 1
    assert "| seqft" in out["long-sequence"] and "| ewc" not in out["long-sequence"]
    for view in ("forms", "winners"):
        assert run_cli("leaderboard", "--runs", runs_dir, "--view", view) == 0
        assert list(tables(capsys.readouterr().out)) == ["trace", "long-sequence"]
    assert run_cli("leaderboard", "--runs", runs_dir, "--format", "csv") == 0
    csv = capsys.readouterr().out
    assert csv.startswith("# benchmark: trace\nMethod,") and "\n# benchmark: long-sequence\nMethod," in csv


def test_trace_alone_prints_as_it_always_did(tmp_path, capsys):
    """No heading, no Benchmark column: TRACE's records alone give the table they gave."""
    d = tmp_path / "runs"
    write(d, bench_run("seqft-trace", last=40.0))
    write(d, bench_run("ewc-trace", "trace", method="ewc", last=55.0))
    for fmt in ("md", "csv"):
        assert run_cli("leaderboard", "--runs", d, "--format", fmt) == 0
        out = capsys.readouterr().out
        assert "Benchmark" not in out and "benchmark" not in out
    assert out.startswith("Method,Args,Model,Profile,Precision,Tasks,Order,Reference,Runs,")


def test_the_headline_is_traces_alone(runs_dir, capsys, monkeypatch):
    """A bare `cl-bench leaderboard` (results/headline.yaml) keeps its scope, TRACE's
    runs, whatever other benchmarks' runs lie in its folder."""
    results = runs_dir.parent / "results"
    runs_dir.rename(results)
    (results / "headline.yaml").write_text("runs: .\n")
    monkeypatch.chdir(runs_dir.parent)
    assert run_cli("leaderboard", "--format", "csv") == 0
    out = capsys.readouterr().out
    assert "benchmark" not in out
    assert sorted(line.split(",")[0] for line in out.strip().splitlines()[1:]) == ["ewc", "seqft"]
    assert ",40.0," in out and ",70.0," not in out


def test_the_site_has_one_leaderboard_section_per_benchmark(runs_dir, tmp_path):
    index = build_site(runs_dir, tmp_path / "site", browser=False).read_text(encoding="utf-8")
    sections = re.split(r'<h2 class="benchmark" id="b-([^"]+)">', index)
    assert sections[1::2] == ["trace", "long-sequence"]
    trace, long_ = sections[2], sections[4].split("<h2>Compare two runs</h2>")[0]
    pages = lambda html: set(re.findall(r'href="runs/([^"]+)\.html"', html))  # noqa: E731
    assert pages(trace) == {"seqft-trace", "ewc-trace"} and pages(long_) == {"seqft-long"}
    assert 'id="t-trace-top"' in trace and 'id="t-long-sequence-top"' in long_


def test_a_trace_only_site_has_no_benchmark_sections(tmp_path):
    d = tmp_path / "runs"
    write(d, bench_run("seqft-trace", last=40.0))
    index = build_site(d, tmp_path / "site", browser=False).read_text(encoding="utf-8")
    assert 'class="benchmark"' not in index and '<h2 id="t-top">runs/</h2>' in index
    assert "one table per folder of runs." in index
