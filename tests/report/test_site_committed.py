"""The committed site (site/, `make site`) is whole in a clone: every local link and
image of its pages, and every page its compare selector goes to, is a file that git
tracks (mutation caught: site/runs/ ignored, as `.gitignore`'s `runs/` once did, so
the run pages never reached a clone; a page linking a file that is not committed)."""
from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

ROOT = Path(__file__).resolve().parents[2]
LINK = re.compile(r'\b(?:href|src)="([^"]*)"')
PAIRS = re.compile(r'<script type="application/json" id="pairs-data">(.*?)</script>', re.S)


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
