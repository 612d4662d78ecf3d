"""`cl-bench site` in a real browser: headless Chromium (Debian's chromium and
chromium-driver, driven by selenium) opens the site of two smoke runs from disk,
sorts the leaderboard, reads a run's matrix, and checks that a compare page holds
the numbers of `cl-bench compare --format json`. Screenshots go to the test's
temporary folder."""
from __future__ import annotations

import json
import shutil
import tempfile

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
    return [tr.find_elements(By.TAG_NAME, "td")[col].text
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
