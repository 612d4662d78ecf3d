"""`cl-bench site --runs results --out site/`: the leaderboard and every run as a
static web site, opened from disk (no server, no network, nothing from a CDN).

Pages (Jinja2 templates in cl_bench/report/site/templates, plain JS and CSS in static/):

- index.html: one leaderboard per folder of runs (the runs directly inside it, as
  the README's tables are), each built by leaderboard.build_rows (the marks and
  intervals are the leaderboard's), sortable by any column and filtered by profile,
  precision and method family; reference rows apart, never ranked. Where runs of
  several benchmarks are present (or of one other than TRACE), one section per
  benchmark holds its folders' tables: runs of two benchmarks never share a table.
- runs/<run>.html: the R[b][j] heatmap with each cell's interval, the zero-shot
  row and majority-class levels, the summaries with intervals (BWT's format and
  content parts among them), the figures `cl-bench analyze` wrote, parameters,
  timings, config and commit; links to run.json and predictions.jsonl where they
  lie (relative paths: nothing is copied).
- compare/<baseline>__vs__<run>.html (and .json): compare.compare of the pair, the
  same code and output as `cl-bench compare --format json`. Pairs are pre-computed
  for every run against every baseline run (SeqFT) of its profile and precision
  that it can be compared with; a selector on the index goes to the generated ones.
- sensitivity/<folder>.html: each sensitivity.json under --runs (`cl-bench tune
  sensitivity --out`): Last Acc and BWT at each grid value, and the figure
  (cl_bench/report/site/sensitivity.py).
- items/<run>/<task>.html: the prediction browser, each test item's prompt,
  answer, and prediction and score at every stage, with what happened to it
  ("right after its stage, wrong after C-STANCE"). Left out with --no-browser
  (its pages hold every prediction, about the size of predictions.jsonl).

Run folders are named by their path under --runs, '/' written '__'.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
from importlib import resources
from pathlib import Path

from cl_bench import registry
from cl_bench.benchmark import DEFAULT as DEFAULT_BENCHMARK
from cl_bench.report import leaderboard
from cl_bench.report.compare import compare, differences
from cl_bench.errors import UserError
from cl_bench.report.general import lima_note, lima_rows, task_rows
from cl_bench.metrics.intervals import record_intervals
from cl_bench.record.schema import RunRecord
from cl_bench.metrics.cl import SUMMARY
from cl_bench.record.io import METRICS_FILE, PREDICTIONS_FILE, RUN_FILE, ZERO_SHOT_STAGE, read_jsonl
from cl_bench.report.site import sensitivity
from cl_bench.report.site import views

log = logging.getLogger(__name__)

# the figures of `cl-bench analyze` (cl_bench/report/figures/plots.py), shown where the run folder has them
FIGURES = (
    ("heatmap.png", "Score matrix with 95% intervals"),
    ("tasks.png", "Per task: zero-shot, just learned, after the last stage; majority-class level dashed"),
    ("forms.png", "Share of answers in the task's form, and BWT's format and content parts"),
    ("decisions.png", "Expansion decision map per stage"),
    ("depth.json", "Deep against shallow expansion"),
    ("cka.png", "CKA of earlier tasks' representations"),
    ("routing.png", "Routing drift of earlier tasks"),
    ("sharpness.png", "Sharpness of the newest experts"),
)


class _Site:
    """Paths and the template environment of one output folder."""

    def __init__(self, runs_dir: Path, out: Path):
        import jinja2

        self.runs_dir, self.out = Path(runs_dir), Path(out)
        self.env = jinja2.Environment(loader=jinja2.PackageLoader("cl_bench.report.site", "templates"),
                                      autoescape=jinja2.select_autoescape(["html"]),
                                      trim_blocks=True, lstrip_blocks=True, undefined=jinja2.StrictUndefined)
        self.env.globals["legend"] = views.score_legend()  # legend.html: every matrix's colour scale

    def rel(self, record: RunRecord) -> str:
        return Path(record.source).parent.relative_to(self.runs_dir).as_posix()

    def slug(self, record: RunRecord) -> str:
        return self.rel(record).replace("/", "__")

    def run_page(self, record: RunRecord) -> str:
        return f"runs/{self.slug(record)}.html"

    def link(self, page: str, target: str) -> str:
        """The page `target` (a path under out) relative to the folder of `page`."""
        return self.file_link(page, self.out / target)

    def file_link(self, page: str, path: Path) -> str:
        """The file `path` (on disk: a run's files are linked where they lie) relative
        to the folder of `page`."""
        return Path(os.path.relpath(Path(path).resolve(), (self.out / page).parent.resolve())).as_posix()

    def write(self, page: str, template: str, **context) -> None:
        path = self.out / page
        path.parent.mkdir(parents=True, exist_ok=True)
        root = "../" * page.count("/")
        html = self.env.get_template(template).render(root=root, page=page, **context)
        path.write_text(html, encoding="utf-8")


def build_site(runs_dir: Path, out: Path, exclude: list[str] = (), include: list[str] = (),
               browser: bool = True) -> Path:
    """Write the site for the complete runs under runs_dir into `out`; returns index.html."""
    runs = leaderboard.load_runs(runs_dir, exclude, include)
    site = _Site(runs_dir, out)
    if site.out.resolve() == site.runs_dir.resolve() or site.runs_dir.resolve() in site.out.resolve().parents:
        raise UserError(f"--out {out} is inside --runs {runs_dir}; write the site elsewhere (e.g. site/)")
    site.out.mkdir(parents=True, exist_ok=True)
    static = site.out / "static"
    static.mkdir(exist_ok=True)
    for name in ("site.css", "site.js"):
        shutil.copyfile(resources.files("cl_bench.report.site").joinpath("static", name), static / name)
    pairs = _compare_pages(site, runs)
    by_run: dict[str, list[dict]] = {}
    for pair in pairs:
        for side in ("baseline", "run"):
            by_run.setdefault(pair[side], []).append(pair)
    selector = {"runs": [{"slug": site.slug(r), "label": site.rel(r)} for r in runs],
                "pairs": {f"{p['baseline']}|{p['run']}": p["page"] for p in pairs}}
    for record in runs:
        _run_page(site, record, by_run.get(site.slug(record), []), selector, browser)
    _index(site, runs, selector, sensitivity.write_pages(site))
    log.info("site: %d runs, %d comparisons -> %s", len(runs), len(pairs), site.out / "index.html")
    return site.out / "index.html"


def _index(site: _Site, runs: list[RunRecord], selector: dict, sensitivity_pages: list[dict]) -> None:
    sections = []
    groups = leaderboard.by_benchmark(runs)
    alone = list(groups) == [DEFAULT_BENCHMARK]  # TRACE's runs alone: no benchmark sections, as before
    for bench, records in groups.items():
        folders: dict[str, list[RunRecord]] = {}
        for record in records:
            folders.setdefault(Path(site.rel(record)).parent.as_posix(), []).append(record)
        tables = []
        for folder in sorted(folders, key=lambda f: (f != ".", f)):
            df, members = leaderboard.build_rows(folders[folder])
            headers, rows = views.leaderboard_rows(df, members, lambda r: site.run_page(r))
            title = f"{site.runs_dir.name}/" if folder == "." else f"{site.runs_dir.name}/{folder}/"
            slug = ("top" if folder == "." else folder.replace("/", "-"))
            tables.append({"id": "t-" + (slug if alone else f"{bench}-{slug}"), "title": title,
                           "level": 2 if alone else 3,
                           "headers": headers, "more": [views.secondary(h) for h in headers], "rows": rows,
                           "ranked": [r for r in rows if not r["reference"]],
                           "reference": [r for r in rows if r["reference"]]})
        sections.append({"benchmark": None if alone else bench, "id": f"b-{bench}", "n_runs": len(records),
                         "tables": tables})
    rows = [r for section in sections for t in section["tables"] for r in t["rows"]]
    filters = {key: sorted({r[key] for r in rows}) for key in ("profile", "precision", "family")}
    first = next(iter(selector["pairs"]), "|").split("|")
    site.write("index.html", "index.html", sections=sections, filters=filters, selector=selector,
               pick_a=first[0], pick_b=first[1],
               baseline=registry.baseline(), runs_dir=site.runs_dir.name, n_runs=len(runs),
               sensitivity=sensitivity_pages)


def _run_page(site: _Site, record: RunRecord, pairs: list[dict], selector: dict, browser: bool) -> None:
    run_dir = Path(record.source).parent
    page = site.run_page(record)
    iv = record_intervals(record, run_dir)
    files = [{"name": name, "href": site.file_link(page, run_dir / name)}
             for name in (RUN_FILE, PREDICTIONS_FILE, METRICS_FILE) if (run_dir / name).exists()]
    figures = []
    for name, caption in FIGURES:
        path = run_dir / name
        if path.exists():
            figures.append({"name": name, "caption": caption, "src": site.file_link(page, path),
                            "text": path.read_text(encoding="utf-8") if name.endswith(".json") else None})
    tasks = []
    if browser:
        predictions = read_jsonl(run_dir / PREDICTIONS_FILE)
        for task in record.tasks:
            rows = [p for p in predictions if p["task"] == task]
            if rows:
                items_page = f"items/{site.slug(record)}/{task}.html"
                kinds = _items_page(site, record, task, rows, items_page)
                tasks.append({"task": task, "href": site.link(page, items_page), "kinds": kinds})
    timing = record.timing
    site.write(page, "run.html", record=record, rel=site.rel(record), files=files, figures=figures,
               matrix=views.matrix_rows(record, iv), tasks_header=record.tasks,
               majority=views.majority_row(record), summary=views.summary_rows(record, iv),
               lima=lima_rows(record.general, [s.label for s in record.stages]), lima_note=lima_note(record.general),
               general=task_rows(record.general, [s.label for s in record.stages]),
               timings=views.timing_rows(record), params=views.param_rows(record),
               totals={"total": views.minutes(timing.total_s), "prepare": views.minutes(timing.prepare_s),
                       "zero_shot": views.minutes(timing.zero_shot_s)},
               config=views.pretty(record.config), versions=views.pretty(record.versions),
               backend=views.pretty(record.backend), method_args=views.pretty(record.method_args),
               family=views.family(record.method), browse=tasks, browser=browser,
               pairs=[{**p, "href": site.link(page, p["page"])} for p in pairs],
               selector=selector, slug=site.slug(record),
               intervals_from="the record" if record.intervals else "its predictions")


def _items_page(site: _Site, record: RunRecord, task: str, rows: list[dict], page: str) -> dict[str, int]:
    """The prediction browser of one task; returns how many items are of each story kind."""
    n_stages = len(record.stages)
    labels = [s.label for s in record.stages]
    learned = next((s.index for s in record.stages if task in (s.tasks or [s.label])), None)
    stages = ([ZERO_SHOT_STAGE] if any(r["stage"] == ZERO_SHOT_STAGE for r in rows) else []) + list(range(n_stages))
    by_item: dict[int, dict] = {}
    for r in rows:
        item = by_item.setdefault(r["index"], {"index": r["index"], "prompt": r["prompt"], "answer": r["answer"],
                                               "cells": {}})
        item["cells"][r["stage"]] = r
    items, kinds = [], {}
    for index in sorted(by_item):
        item = by_item[index]
        scores = [item["cells"][b]["score"] if b in item["cells"] else None for b in range(n_stages)]
        kind, story = views.item_story(scores, learned, labels)
        kinds[kind] = kinds.get(kind, 0) + 1
        cells = []
        for b in stages:
            r = item["cells"].get(b)
            bg, fg = views.score_colours(None if r is None else r["score"])
            cells.append(None if r is None else {"prediction": r["prediction"], "score": f"{r['score']:.0f}",
                                                 "value": r["score"], "learned": b == learned, "bg": bg, "fg": fg})
        items.append({**item, "cells": cells, "kind": kind, "story": story})
    heads = [("zero-shot" if b == ZERO_SHOT_STAGE else f"after {b + 1}: {labels[b]}") for b in stages]
    site.write(page, "items.html", record=record, task=task, items=items, heads=heads, kinds=kinds,
               learned=None if learned is None else f"{learned + 1}: {labels[learned]}",
               run_href=site.link(page, site.run_page(record)),
               predictions_href=site.file_link(page, Path(record.source).parent / PREDICTIONS_FILE))
    return kinds


def _compare_pages(site: _Site, runs: list[RunRecord]) -> list[dict]:
    """Every run against every baseline run of its profile and precision that shares
    its tasks, items and budget; one page (and its JSON) per pair."""
    base = registry.baseline()
    pairs, done = [], set()
    for b in (r for r in runs if r.method == base):
        for r in runs:
            if r is b or (site.slug(r), site.slug(b)) in done or (r.profile, r.precision) != (b.profile, b.precision):
                continue
            if differences(b, r) or not all((Path(x.source).parent / PREDICTIONS_FILE).exists() for x in (b, r)):
                continue
            done.add((site.slug(b), site.slug(r)))
            result = compare([Path(b.source).parent, Path(r.source).parent])
            name = f"compare/{site.slug(b)}__vs__{site.slug(r)}"
            (site.out / "compare").mkdir(parents=True, exist_ok=True)
            (site.out / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
            (comp,) = result["comparisons"]
            page = f"{name}.html"
            site.write(page, "compare.html", result=result, baseline=b, run=r,
                       baseline_rel=site.rel(b), run_rel=site.rel(r),
                       baseline_href=site.link(page, site.run_page(b)),
                       run_href=site.link(page, site.run_page(r)),
                       summaries=views.comparison_rows(comp["summaries"], {k: s.label for k, s in SUMMARY.items()}),
                       tasks=views.comparison_rows(comp.get("tasks", {}), {}),
                       json_href=Path(name).name + ".json",
                       command=f"cl-bench compare {result['baseline']} {comp['run']} --format json")
            pairs.append({"baseline": site.slug(b), "run": site.slug(r), "page": page,
                          "label": f"{site.rel(r)} against {site.rel(b)}"})
            log.info("compare: %s against %s", site.rel(r), site.rel(b))
    return pairs
