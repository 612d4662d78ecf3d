"""The sensitivity pages of `cl-bench site`: each `sensitivity.json` under --runs (written
by `cl-bench tune sensitivity --out DIR`, cl_bench/tools/tuning/sensitivity.py) as a page,
sensitivity/<folder>.html: the table of Last Acc and BWT at each grid value and the
figure beside it (linked where it lies), with the command that wrote them."""
from __future__ import annotations

import json

from cl_bench.errors import UserError
from cl_bench.report.text import point_and_interval

FILE = "sensitivity.json"


def write_pages(site) -> list[dict]:
    """Writes the pages; returns [{"title", "href"}] for the index."""
    links = []
    for path in sorted(site.runs_dir.rglob(FILE)):
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            rows = [{"method": r["method"], "argument": r["argument"] + ("" if r["at"] is None else
                                                                         f" at lr {r['at']:g}"),
                     "value": f"{r['value']:g}" + (" (base)" if r["base"] else ""),
                     "last_acc": point_and_interval(r["last_acc"]), "bwt": point_and_interval(r["bwt"]), "folder": r["folder"]}
                    for r in data["rows"]]
        except (ValueError, KeyError, TypeError) as e:
            raise UserError(f"{path}: not a sensitivity file ({type(e).__name__}: {e}); write it again with "
                            f"`cl-bench tune sensitivity GRID --out {path.parent}`") from None
        folder = path.parent.relative_to(site.runs_dir).as_posix()
        page = f"sensitivity/{folder.replace('/', '__') or 'top'}.html"
        figure = path.parent / "sensitivity.png"
        site.write(page, "sensitivity.html", title=f"{site.runs_dir.name}/{folder}", rows=rows,
                   command=data.get("command", ""),
                   figure=site.file_link(page, figure) if figure.is_file() else None)
        links.append({"title": f"{site.runs_dir.name}/{folder}", "href": page})
    return links
