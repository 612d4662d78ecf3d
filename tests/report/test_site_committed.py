"""The committed site (site/, `make site`) is whole in a clone: every local link and
image of its pages, and every page its compare selector goes to, is a file that git
tracks (mutation caught: site/runs/ ignored, as `.gitignore`'s `runs/` once did, so
the run pages never reached a clone; a page linking a file that is not committed).

And it is current (issue 51, item 5): its index shows every complete run that `make
site` reads (results/, the headline scope of results/headline.yaml among them), and a
rebuild writes the same bytes, so `make site` on a clean tree changes nothing.
Mutations caught: a complete run added to results/ without rebuilding the site (named
by the test); a page that differs between builds, a build time in it or output in
hash order."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

from cl_bench.report.leaderboard.files import record_paths
from cl_bench.report.leaderboard.headline import load_headline

ROOT = Path(__file__).resolve().parents[2]
LINK = re.compile(r'\b(?:href|src)="([^"]*)"')
PAIRS = re.compile(r'<script type="application/json" id="pairs-data">(.*?)</script>', re.S)
RUN_LINK = re.compile(r'href="runs/([^"/]+)\.html"')
COUNT = re.compile(r"(\d+) complete runs under")


def _tracked() -> set[str]:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: what a clone holds is unknown")
    return {p for p in out.stdout.split("\0") if p}


def _targets(page: Path, text: str):
    """(link as written, repository-relative path it points at) of each local link."""
    for link in LINK.findall(text):
        parts = urlsplit(link)
        if parts.scheme or parts.netloc or not parts.path:  # the web, or an anchor on the page
            continue
        yield link, os.path.normpath(os.path.join(page.parent.relative_to(ROOT), unquote(parts.path)))
    site = ROOT / "site"
    for found in PAIRS.findall(text):  # the selector's pages, relative to the site's root
        for target in json.loads(found).values():
            yield target, os.path.normpath(os.path.join(site.relative_to(ROOT), target))


def test_every_local_link_of_the_committed_site_is_committed():
    tracked = _tracked()
    pages = sorted(p for p in tracked if p.startswith("site/") and p.endswith(".html"))
    assert "site/index.html" in pages
    assert any(p.startswith("site/runs/") for p in pages), "no run page is committed"
    broken, n = [], 0
    for page in pages:
        for link, target in _targets(ROOT / page, (ROOT / page).read_text(encoding="utf-8")):
            n += 1
            if target not in tracked:
                broken.append(f"{page}: {link}")
    assert n > 100 and not broken, f"{len(broken)} of {n} links lead nowhere in a clone: {broken[:10]}"


def complete_runs(runs_dir: Path, exclude=()) -> set[str]:
    """The complete runs under runs_dir as the site names them (path, '/' written '__'),
    from each run.json's status alone (no record is parsed: the test stays fast)."""
    out = set()
    for path in record_paths(runs_dir, exclude):
        try:
            status = json.loads(path.read_text(encoding="utf-8")).get("status")
        except ValueError:
            continue
        if status == "complete":
            out.add(path.parent.relative_to(runs_dir).as_posix().replace("/", "__"))
    return out


def shown_runs(index: Path) -> tuple[set[str], int | None]:
    """The runs the index links (its leaderboard rows) and the count its lead states."""
    text = index.read_text(encoding="utf-8")
    count = COUNT.search(text)
    return set(RUN_LINK.findall(text)), int(count.group(1)) if count else None


def test_the_committed_site_shows_every_complete_run():
    index = ROOT / "site" / "index.html"
    head = load_headline(ROOT / "results" / "headline.yaml")
    assert head is not None and index.is_file()
    shown, count = shown_runs(index)
    headline = complete_runs(head.runs, head.exclude)
    assert headline, "the headline scope holds no complete run"
    missing = sorted(headline - shown)
    assert not missing, (f"site/index.html lacks {len(missing)} complete run(s) of the headline scope: {missing}; "
                         f"rebuild the site: make site")
    every = complete_runs(ROOT / "results")  # what `make site` reads: all of results/
    assert (sorted(every - shown), sorted(shown - every)) == ([], []), \
        "site/index.html and results/ name different runs (shown: missing, stale); rebuild it: make site"
    assert count == len(every), f"site/index.html says {count} complete runs; results/ holds {len(every)}"


def test_a_run_added_without_a_rebuild_is_found(tmp_path):
    runs = tmp_path / "results"
    for name, status in (("a", "complete"), ("b", "complete"), ("sub/c", "complete"), ("d", "interrupted")):
        (runs / name).mkdir(parents=True)
        (runs / name / "run.json").write_text(json.dumps({"status": status}))
    index = tmp_path / "index.html"
    index.write_text('<p>2 complete runs under</p><a href="runs/a.html">a</a><a href="runs/sub__c.html">c</a>')
    shown, count = shown_runs(index)
    assert complete_runs(runs) - shown == {"b"} and count == 2
    assert complete_runs(runs, ["sub/*"]) == {"a", "b"}


def _build(runs: Path, out: Path, hash_seed: str) -> dict[str, bytes]:
    env = {**os.environ, "PYTHONHASHSEED": hash_seed}
    code = "import sys; from cl_bench.cli import main; sys.exit(main(sys.argv[1:]))"
    subprocess.run([sys.executable, "-c", code, "site", "--runs", str(runs), "--out", str(out)],
                   check=True, env=env, capture_output=True, cwd=ROOT)
    return {p.relative_to(out).as_posix(): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


@pytest.mark.slow
def test_a_rebuild_writes_the_same_bytes(tmp_path):
    """Two runs of results/ (a baseline and another method of its profile: run pages,
    a comparison, the prediction browser), built twice into one folder and once into
    another, each build its own process with its own hash seed: every file the same."""
    runs = tmp_path / "runs"
    for name in ("seqft-cpu-paper6-seed2", "replay-cpu-paper6-seed2"):
        shutil.copytree(ROOT / "results" / name, runs / name)
    first = _build(runs, tmp_path / "site", "1")
    assert "index.html" in first and any(k.startswith("compare/") for k in first)
    assert _build(runs, tmp_path / "site", "2") == first
    other = _build(runs, tmp_path / "again", "3")
    assert other.keys() == first.keys()
    assert [k for k in first if other[k] != first[k]] == []
