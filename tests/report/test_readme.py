"""The README kept true (issue 51): every repository path it names is in a clone, every
test file the README and docs/ name exists, every link of the README and docs/ to a page
of this repository lands on a file and on a heading of it, and a bare `cl-bench
leaderboard` prints the README's headline table (results/headline.yaml).

Mutations caught: a test path of docs/running.md put back where it was before tests/
had rooms (tests/test_resume_in_stage.py); a path in the README that is not committed;
a link to a heading that was renamed; `cl-bench leaderboard` without --runs reading the
whole of results/ again (34 rows in its winners view, the README's table 19)."""
from __future__ import annotations

import re
import subprocess
from fnmatch import fnmatch
from pathlib import Path

import pytest

from helpers import run_cli

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = [README, *sorted((ROOT / "docs").rglob("*.md"))]
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
LINK = re.compile(r"\]\(([^)\s]+)\)")
TEST_FILE = re.compile(r"(?<![\w./-])(tests/[\w/.-]*\.py)\b")


def _tracked() -> set[str]:
    """The files a clone holds (git's index); where this is not a git checkout, the files here."""
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True, check=True)
        return {p for p in out.stdout.split("\0") if p}
    except (OSError, subprocess.CalledProcessError):
        return {p.relative_to(ROOT).as_posix() for p in ROOT.rglob("*") if p.is_file() and ".git" not in p.parts}


def _in_clone(path: str, tracked: set[str]) -> bool:
    """`path` (a file, a folder, or a glob) is, or holds, a tracked file."""
    path = path.rstrip("/")
    if "*" in path:
        return any(fnmatch(t, path) or fnmatch(t, path + "/*") for t in tracked)
    return path in tracked or any(t.startswith(path + "/") for t in tracked)


def _paths(text: str, tops: set[str]):
    """Every path in `text` that starts at a top-level name of the repository (its files and
    folders: `docs/x.md`, `tests/run/`, `Makefile`, `.ci/run`); a placeholder such as
    `<run-id>` ends the path before it."""
    names = "|".join(re.escape(t) for t in sorted(tops, key=len, reverse=True))
    for m in re.finditer(rf"(?<![\w./~-])((?:{names})(?:/[\w.*-]+)*/?)", text):
        yield m.group(1).rstrip(".")


def test_every_repository_path_the_readme_names_is_committed():
    tracked = _tracked()
    tops = {t.split("/")[0] for t in tracked}
    named = sorted(set(_paths(README.read_text(encoding="utf-8"), tops)))
    missing = [p for p in named if not _in_clone(p, tracked)]
    assert len(named) > 20 and not missing, f"the README names paths a clone does not have: {missing}"


def test_every_test_file_the_readme_and_docs_name_exists():
    tracked = _tracked()
    named = {(doc.relative_to(ROOT).as_posix(), p) for doc in DOCS
             for p in TEST_FILE.findall(doc.read_text(encoding="utf-8"))}
    missing = sorted(f"{doc}: {p}" for doc, p in named if p not in tracked)
    assert len(named) > 10 and not missing, f"test files named that do not exist: {missing}"


def _slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it: lower case, punctuation and symbols dropped
    (backticks, brackets, arrows), each space a hyphen."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text(encoding="utf-8"))
    seen: dict[str, int] = {}
    out = set()
    for heading in re.findall(r"^#{1,6} (.+)$", text, re.M):
        slug = _slug(heading)
        out.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return out


def test_every_link_to_a_page_of_the_repository_lands():
    """Relative links of the README and docs/ (text outside code blocks): the file is
    committed, and a #heading it names is a heading of that page."""
    tracked = _tracked()
    broken, n = [], 0
    for doc in DOCS:
        for target in LINK.findall(FENCE.sub("", doc.read_text(encoding="utf-8"))):
            if re.match(r"[a-z]+:", target):  # the web, mail
                continue
            n += 1
            file, _, anchor = target.partition("#")
            page = (doc.parent / file).resolve() if file else doc
            rel = page.relative_to(ROOT).as_posix() if page.is_relative_to(ROOT) else str(page)
            if file and not _in_clone(rel, tracked):
                broken.append(f"{doc.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and page.suffix == ".md" and anchor not in _anchors(page):
                broken.append(f"{doc.relative_to(ROOT)}: {target} (no such heading)")
    assert n > 30 and not broken, f"links that lead nowhere: {broken}"


def _section(text: str, name: str) -> str:
    start = text.index(f"<!-- {name}:begin -->") + len(f"<!-- {name}:begin -->")
    return text[start:text.index(f"<!-- {name}:end -->", start)].strip()


@pytest.mark.slow  # reads every committed record of the headline (about 12 s)
def test_bare_leaderboard_prints_the_readme_headline_table(monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    assert run_cli("leaderboard") == 0
    printed = capsys.readouterr().out.strip()
    assert printed == _section(README.read_text(encoding="utf-8"), "leaderboard")
