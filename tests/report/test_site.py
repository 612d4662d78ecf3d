"""`cl-bench site` in a real browser: headless Chromium (Debian's chromium and
chromium-driver, driven by selenium) opens the site of two smoke runs from disk,
sorts the leaderboard, reads a run's matrix, and checks that a compare page holds
the numbers of `cl-bench compare --format json`. Screenshots go to the test's
temporary folder."""
from __future__ import annotations

import json
import re
import shutil
import tempfile
from pathlib import Path

import pytest
from helpers import run_cli, smoke_args

from cl_bench.record.io import read_record

pytestmark = pytest.mark.slow

CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run", "--window-size=1400,1000")


@pytest.fixture
def browser():
    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (pip install -e '.[test]')")
    if not (chromium and driver):
        pytest.skip("no headless Chromium here: apt-get install -y chromium chromium-driver")
    from selenium.webdriver.chrome.service import Service

    profile = tempfile.mkdtemp(prefix="cl-bench-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in (*CHROMIUM_FLAGS, f"--user-data-dir={profile}"):
        options.add_argument(flag)
    chrome = webdriver.Chrome(service=Service(driver), options=options)
    try:
        yield chrome
    finally:
        chrome.quit()
        shutil.rmtree(profile, ignore_errors=True)


def _column(browser, table, header: str) -> list[str]:
    from selenium.webdriver.common.by import By

    heads = [th.text for th in table.find_elements(By.CSS_SELECTOR, "thead th")]
    col = heads.index(header)
    return [tr.find_elements(By.TAG_NAME, "td")[col].text.split("\n")[0]  # a score's interval on its 2nd line
            for tr in table.find_elements(By.CSS_SELECTOR, "tbody.ranked tr")]


def _click_header(table, header: str) -> None:
    from selenium.webdriver.common.by import By

    next(th for th in table.find_elements(By.CSS_SELECTOR, "thead th") if th.text.startswith(header)).click()


def test_site_in_headless_chromium(browser, trace_dir, tmp_path, capsys):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    runs = tmp_path / "runs"
    for method in ("seqft", "replay"):
        assert run_cli(*smoke_args(trace_dir, runs, "--method", method, "--run-id", method)) == 0
    site = tmp_path / "site"
    assert run_cli("site", "--runs", runs, "--out", site) == 0
    capsys.readouterr()
    shots = tmp_path / "screenshots"
    shots.mkdir()

    # the index: both rows, sorted by a click on a header (then reversed by a second)
    browser.get((site / "index.html").as_uri())
    table = browser.find_element(By.CSS_SELECTOR, "table.leaderboard")
    assert sorted(_column(browser, table, "Method")) == ["replay", "seqft"]
    _click_header(table, "Method")
    assert _column(browser, table, "Method") == ["replay", "seqft"]
    _click_header(table, "Method")
    assert _column(browser, table, "Method") == ["seqft", "replay"]
    _click_header(table, "Last Acc")
    last = {m: read_record(runs / m).summary["last_acc"] for m in ("seqft", "replay")}
    assert _column(browser, table, "Method") == sorted(last, key=last.get)
    assert [float(v) for v in _column(browser, table, "Last Acc")] == sorted(round(v, 1) for v in last.values())
    Select(browser.find_element(By.CSS_SELECTOR, "select[data-filter=precision]")).select_by_index(1)
    assert "2 of 2 rows shown" in browser.find_element(By.ID, "shown").text
    browser.save_screenshot(str(shots / "index.png"))

    # a run page, reached by the row's link: its matrix, cell by cell
    table.find_element(By.LINK_TEXT, "seqft").click()
    record = read_record(runs / "seqft")
    rows = browser.find_elements(By.CSS_SELECTOR, "#matrix tbody tr:not(.majority)")
    zero = [record.zero_shot] if record.zero_shot is not None else []
    assert len(rows) == len(zero) + len(record.matrix) == len(zero) + 3
    for tr, values in zip(rows, zero + record.matrix):
        cells = tr.find_elements(By.TAG_NAME, "td")
        assert [c.text.split("\n")[0] for c in cells] == ["–" if v is None else f"{v:.1f}" for v in values]
    assert "95% interval" in rows[-1].find_elements(By.TAG_NAME, "td")[0].get_attribute("title")
    browser.save_screenshot(str(shots / "run.png"))

    # the compare page, through the selector: the numbers of `cl-bench compare --format json`
    Select(browser.find_element(By.ID, "pick-a")).select_by_visible_text("seqft")
    Select(browser.find_element(By.ID, "pick-b")).select_by_visible_text("replay")
    browser.find_element(By.ID, "pick-go").click()
    assert browser.current_url.endswith("compare/seqft__vs__replay.html")
    assert run_cli("compare", runs / "seqft", runs / "replay", "--format", "json") == 0
    (expected,) = json.loads(capsys.readouterr().out)["comparisons"]
    for section in ("summaries", "tasks"):
        shown = {}
        for tr in browser.find_elements(By.CSS_SELECTOR, f"#{section} tbody tr"):
            tds = tr.find_elements(By.TAG_NAME, "td")
            ci = (tds[3].get_attribute("data-lo"), tds[3].get_attribute("data-hi"))
            p = tds[4].get_attribute("data-value")
            shown[tr.get_attribute("data-key")] = {
                "run": float(tds[0].get_attribute("data-value")), "baseline": float(tds[1].get_attribute("data-value")),
                "diff": float(tds[2].get_attribute("data-value")),
                "ci": None if ci[0] is None else [float(ci[0]), float(ci[1])], "p": None if p is None else float(p)}
            assert tds[2].text == f"{shown[tr.get_attribute('data-key')]['diff']:+.1f}"
        assert shown == expected[section] and shown
    browser.save_screenshot(str(shots / "compare.png"))

    # the prediction browser of one task: every test item, with what happened to it
    browser.get((site / "runs" / "seqft.html").as_uri())
    browser.find_element(By.LINK_TEXT, "NumGLUE-cm").click()
    items = browser.find_elements(By.CSS_SELECTOR, "#items tbody tr")
    assert len(items) == len(record.data["NumGLUE-cm"]["test"]["indices"])
    assert all(tr.find_element(By.CSS_SELECTOR, "td.story").text for tr in items)
    browser.save_screenshot(str(shots / "items.png"))
    assert all((shots / f"{name}.png").stat().st_size > 10_000 for name in ("index", "run", "compare", "items"))


def _in_view(browser, element) -> bool:
    """Shown, and inside the window's width without scrolling."""
    left, right = browser.execute_script(
        "var r = arguments[0].getBoundingClientRect(); return [r.left, r.right];", element)
    width = browser.execute_script("return document.documentElement.clientWidth;")
    return element.is_displayed() and 0 <= left and right <= width


def test_the_site_at_1400_px(browser, tmp_path):
    """Issue 51, item 6, at a 1,400 px window: the index shows Method, Last Acc and BWT
    with their intervals (text and bar) in view and its table needs no sideways
    scroll, the other columns one click away; the run page's and the prediction
    browser's matrices have a colour legend on the figures' scale, and the heatmap
    figure's text is drawn at 12 px or more. Mutations caught: the scores' interval
    text left out; every column shown by default (the table scrolls); a matrix
    without its legend; the heatmap squeezed below legible size (its old 520 px cap)."""
    from selenium.webdriver.common.by import By

    from cl_bench.metrics.intervals import record_intervals
    from cl_bench.record.io import read_record
    from cl_bench.report.figures import plots
    from cl_bench.report.site.views import score_colours

    root = Path(__file__).resolve().parents[2]
    runs = tmp_path / "runs"
    for name in ("seqft-cpu-paper6-seed2", "replay-cpu-paper6-seed2"):
        shutil.copytree(root / "results" / name, runs / name, ignore=shutil.ignore_patterns("*.png"))
        record = read_record(runs / name)
        plots.heatmap(record, runs / name / "heatmap.png", record_intervals(record, runs / name))
    site = tmp_path / "site"
    assert run_cli("site", "--runs", runs, "--out", site) == 0
    shots = tmp_path / "screenshots"
    shots.mkdir()

    browser.get((site / "index.html").as_uri())
    table = browser.find_element(By.CSS_SELECTOR, "table.leaderboard")
    heads = table.find_elements(By.CSS_SELECTOR, "thead th")
    texts = [th.get_attribute("textContent") for th in heads]
    first = table.find_element(By.CSS_SELECTOR, "tbody.ranked tr").find_elements(By.TAG_NAME, "td")
    for header in ("Method", "Last Acc", "BWT"):
        assert _in_view(browser, heads[texts.index(header)]), header
    for header in ("Last Acc", "BWT"):
        cell = first[texts.index(header)]
        interval = cell.find_element(By.CSS_SELECTOR, ".interval")
        assert re.fullmatch(r"\[-?\d+\.\d, -?\d+\.\d\]", interval.text) and _in_view(browser, interval), header
        assert _in_view(browser, cell.find_element(By.CSS_SELECTOR, ".bar .ci")), header
    scroll = table.find_element(By.XPATH, "..")
    assert browser.execute_script("return arguments[0].scrollWidth <= arguments[0].clientWidth;", scroll)
    wall = heads[texts.index("Wall time (min)")]
    assert not wall.is_displayed()
    browser.save_screenshot(str(shots / "index-1400.png"))
    browser.find_element(By.ID, "all-columns").click()
    assert wall.is_displayed()

    browser.get((site / "runs" / "seqft-cpu-paper6-seed2.html").as_uri())
    legend = browser.find_element(By.ID, "matrix-legend")
    assert _in_view(browser, legend)
    gradient = legend.find_element(By.CSS_SELECTOR, ".legend-bar").get_attribute("style")
    for value in (0.0, 50.0, 100.0):  # the cells' colours, which are the figure's (plots.score_rgba)
        hex_ = score_colours(value)[0]
        rgb = "rgb({}, {}, {})".format(*(int(hex_[k:k + 2], 16) for k in (1, 3, 5)))
        assert rgb in gradient, (value, gradient)
    image = browser.find_element(By.CSS_SELECTOR, "figure img[src$='heatmap.png']")
    browser.execute_script("arguments[0].scrollIntoView();", image)
    natural, shown = browser.execute_script("return [arguments[0].naturalWidth, arguments[0].clientWidth];", image)
    assert natural > 0 and plots.HEATMAP_FONT * plots.DPI / 72 * shown / natural >= 12, (natural, shown)
    browser.save_screenshot(str(shots / "run-1400.png"))

    browser.find_element(By.LINK_TEXT, "NumGLUE-cm").click()
    assert browser.find_element(By.ID, "items-legend").is_displayed()
