"""The sensitivity view and the rank-order verdict (cl_bench/tools/tuning/sensitivity.py), on
synthetic run folders whose scores are known by hand."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from cl_bench.report.leaderboard import load_runs
from cl_bench.tools.tuning import grid as grids
from cl_bench.tools.tuning import plan
from cl_bench.tools.tuning import sensitivity


def test_each_grid_value_gives_its_last_acc_and_bwt_with_intervals_and_a_figure(tmp_path, fake_run):
    path = tmp_path / "grid.yaml"
    path.write_text(yaml.safe_dump({
        "profile": "smoke", "order": ["NumGLUE-cm", "Py150", "20Minuten"], "rule": "last-acc-keep-base",
        "output": "results/tuning", "methods": {"seqft": {"lr": [3.0e-6, 1.0e-5, 3.0e-5]},
                                                "ewc": {"lr": [3.0e-6, 1.0e-5, 3.0e-5]}},
        "finals": {"output": "results/tuned"}}, sort_keys=False))
    g = grids.load(path)
    for lr, final in ((3e-6, [30, 30, 30]), (1e-5, [20, 26, 30])):
        fake_run(tmp_path / g.folder("seqft", {"lr": lr}), "seqft", {"lr": lr}, final)
    rows = sensitivity.rows(g, plan.Records(Path("results"), tmp_path), {})
    assert [(r["method"], r["value"], r["base"]) for r in rows][:3] == [("seqft", 3e-6, False), ("seqft", 1e-5, True),
                                                                        ("seqft", 3e-5, False)]
    low, base, high = rows[:3]
    assert low["last_acc"][0] == pytest.approx(75.0) and low["bwt"][0] == pytest.approx(0.0)
    # peak 30 of 40 after each task's own stage: BWT = mean over the first two of (final - 75)
    assert base["last_acc"][0] == pytest.approx(100 * 76 / 120) and base["bwt"][0] == pytest.approx((-25 - 10) / 2)
    lo, hi = base["bwt"][1:]
    assert lo <= base["bwt"][0] <= hi and lo < hi
    assert high["last_acc"] is None and rows[3]["method"] == "ewc"
    table = sensitivity.format_table(rows)
    assert "| seqft | lr | 1e-05 (base) | 63.3 [" in table and "| seqft | lr | 3e-05 | not run | not run |" in table
    figure = sensitivity.figure(rows, tmp_path / "out" / "sensitivity.png")
    assert figure.stat().st_size > 1000


def _board(fake_run, root: Path, finals: dict[str, list[int]]) -> list:
    """One run a method, on the same items; `finals`: method -> final counts of 40."""
    for method, final in finals.items():
        fake_run(root / method, method, {}, final, split="test")
    return load_runs(root)


def test_rows_that_trade_places_at_95_are_named_and_the_rank_correlation_has_an_interval(tmp_path, fake_run):
    """seqft is far ahead of ewc at the shared rate and far behind tuned: they trade
    places at 95%. lwf and mofo swap too, by one item: a point swap, not at 95%.
    Mutation: trading on the point order alone names lwf and mofo."""
    shared = _board(fake_run, tmp_path / "shared", {"seqft": [36, 36, 36], "ewc": [20, 20, 20],
                                                    "lwf": [10, 10, 10], "mofo": [10, 10, 9]})
    tuned = _board(fake_run, tmp_path / "tuned", {"seqft": [20, 20, 20], "ewc": [36, 36, 36],
                                                  "lwf": [10, 10, 9], "mofo": [10, 10, 10]})
    v = sensitivity.verdict(shared, tuned, top=2)
    assert [(t["shared_ahead"], t["tuned_ahead"]) for t in v["trades"]] == [("seqft", "ewc")]
    assert v["shared_order"] == ["seqft", "ewc", "lwf", "mofo"] and v["tuned_order"] == ["ewc", "seqft", "mofo", "lwf"]
    assert v["top_changed"] and v["rho"] == pytest.approx(0.6)  # 1 - 6 * (1 + 1 + 1 + 1) / (4 * 15)
    lo, hi = v["rho_ci"]
    assert lo - 1e-9 <= 0.6 <= hi + 1e-9 and lo < hi  # a replicate that draws none of mofo's missed item ties them
    text = sensitivity.format_verdict(v)
    assert "trade places at 95%: seqft ahead of ewc at the shared rate [+" in text and "order changes" in text
    # each interval is of the first named minus the second: above 0 shared, below 0 tuned (mutation caught:
    # the intervals of the pair in sorted order, ewc minus seqft, printed beside "seqft ahead of ewc")
    (trade,) = v["trades"]
    assert trade["shared_ci"][0] > 0 and trade["tuned_ci"][1] < 0 and ", behind it tuned [-" in text


def test_the_same_order_in_both_leaderboards_is_rho_1_and_no_trades(tmp_path, fake_run):
    finals = {"seqft": [36, 36, 36], "ewc": [20, 20, 20], "lwf": [10, 10, 10]}
    v = sensitivity.verdict(_board(fake_run, tmp_path / "a", finals), _board(fake_run, tmp_path / "b", finals))
    assert v["rho"] == pytest.approx(1.0) and v["rho_ci"] == (1.0, 1.0) and v["trades"] == [] and not v["top_changed"]
    assert "rows that trade places at 95%: none" in sensitivity.format_verdict(v)


def test_the_verdict_ranks_the_ranked_methods_alone(tmp_path, fake_run):
    """The reference rows are the same runs in both boards: left out, they neither raise
    rho nor take a top place. Mutation caught: the reference rows kept (rho 0.5 and
    multitask first in both)."""
    v = sensitivity.verdict(_board(fake_run, tmp_path / "a", {"seqft": [36] * 3, "ewc": [20] * 3,
                                                              "multitask": [40] * 3}),
                            _board(fake_run, tmp_path / "b", {"seqft": [20] * 3, "ewc": [36] * 3,
                                                              "multitask": [40] * 3}), top=1)
    assert v["methods"] == ["ewc", "seqft"] and v["rho"] == pytest.approx(-1.0) and v["top_changed"]


def test_the_sensitivity_command_writes_table_figure_and_json_and_the_site_shows_them(tmp_path, fake_run,
                                                                                      monkeypatch, capsys):
    """Mutation: build_site without sensitivity.write_pages leaves no page and no index link."""
    from cl_bench.report.site.build import build_site
    from helpers import run_cli

    monkeypatch.chdir(tmp_path)
    (tmp_path / "grid.yaml").write_text(yaml.safe_dump({
        "profile": "smoke", "order": ["NumGLUE-cm", "Py150", "20Minuten"], "rule": "last-acc-keep-base",
        "output": "results/tuning", "methods": {"seqft": {"lr": [3.0e-6, 1.0e-5, 3.0e-5]}},
        "finals": {"output": "results/tuned"}}))
    fake_run(tmp_path / "results" / "tuning" / "seqft-lr1e-5", "seqft", {"lr": 1e-5}, [20, 26, 30])
    assert run_cli("tune", "sensitivity", "grid.yaml", "--out", "results/tuning") == 0
    assert "| seqft | lr | 1e-05 (base) | 63.3 [" in capsys.readouterr().out
    for name in ("sensitivity.md", "sensitivity.json", "sensitivity.png"):
        assert (tmp_path / "results" / "tuning" / name).is_file()
    index = build_site(tmp_path / "results", tmp_path / "site", browser=False)
    page = tmp_path / "site" / "sensitivity" / "tuning.html"
    html = page.read_text()
    assert "<td>1e-05 (base)</td><td>63.3 [" in html and "<td>3e-05</td><td>not run</td>" in html
    assert 'src="../../results/tuning/sensitivity.png"' in html
    assert 'href="sensitivity/tuning.html"' in index.read_text()


def test_tied_values_share_their_average_rank():
    """Ranks 1.5, 1.5, 3 against 1, 2, 3: Pearson's r of the ranks, 1.5 / sqrt(1.5 * 2).
    Mutation caught: ranks by a stable sort, ties unshared (rho 1)."""
    assert sensitivity._spearman([20.0, 20.0, 30.0], [1.0, 2.0, 3.0]) == pytest.approx(1.5 / (1.5 * 2) ** 0.5)


def test_show_and_compare_name_the_split_a_tuning_run_scored(tmp_path, fake_run, capsys):
    """A tuning run's intervals are over eval items, and say so. Mutation caught: the
    split written as "test" whatever the record scored."""
    from helpers import run_cli

    a = fake_run(tmp_path / "a", "seqft", {"lr": 1e-5}, [30] * 3)
    b = fake_run(tmp_path / "b", "seqft", {"lr": 3e-5}, [36] * 3)
    assert run_cli("show", a) == 0
    assert "[95% bootstrap intervals over eval items, " in capsys.readouterr().out
    assert run_cli("compare", a, b) == 0
    assert "paired bootstrap over eval items, " in capsys.readouterr().out
