"""`cl-bench analyze RUN_DIR`: a run record turned into figures, PNG files written
beside it. Each figure is drawn when the record holds its data:

- heatmap.png: the stage x task score matrix, the zero-shot row on top where
  the run has one, each cell with its 95% interval (every run).
- tasks.png: per task, the zero-shot score, the score right after learning it
  and after the last stage, with 95% intervals, and the majority-class level
  of label tasks: what was learned, and what of it was kept.
- forms.png: the share of each cell's predictions that have the task's answer
  form, with BWT's format and content parts (cl_bench/metrics/cl.py, bwt_split).
- decisions.png: the expansion decision map [layer x slot] per task, Expand in
  dark (methods whose parameter reports carry the diagnostics "decisions", with
  "decision_layers" naming its rows, as bilevel-cka).
- cka.png: CKA per decoder layer between each earlier task's representation
  after the last stage and right after that task was learned (the record's
  "probes", written by runs with eval.cka_probe > 0; cl_bench/eval/probes/representation.py).
- routing.png: each earlier task's routing drift, the JS divergence of its
  routed-expert distribution from the one right after it was learned, by stage
  (mean over MoE layers) and per layer after the last stage (runs with
  eval.routing_probe > 0 on MoE models; cl_bench/eval/probes/routing.py).
- sharpness.png: per MoE layer, each expert of the newest group after the last
  stage by gradient norm and by top Hessian eigenvalue, experts that receive
  under 5% of the routing assignments hollow (runs with eval.sharpness > 0).

With decision maps it also writes depth.json: whether the deep layers expand
more than the shallow ones, with an interval (cl_bench/report/figures/depth.py); with
routing and CKA probes, sources.json: whether the forgetting tracks routing drift
or representation change (cl_bench/report/figures/sources.py).

Nothing is recomputed from a model: the figures show what the run recorded
(the intervals and answer forms come from its predictions, cl_bench/metrics/intervals.py).

`--against OTHER_RUN` also writes the cost comparison of cl_bench/report/figures/cost.py.
"""
from __future__ import annotations

import json
from pathlib import Path

from cl_bench.record.schema import RunRecord
from cl_bench.record.io import read_finished


# The score matrices' one colour scale: heatmap.png's and the site's HTML matrices
# (cl_bench/report/site/views.py) and legends, fixed at 0-100 so a colour means one
# score in every run.
SCORE_CMAP = "viridis"
SCORE_RANGE = (0.0, 100.0)
DPI = 120
# heatmap.png's text in points: at DPI, 11 pt is 18 px, drawn about 1:1 by the site's
# run page at 1,400 px (its figure is at most the page's width)
HEATMAP_FONT = 11


def score_rgba(value: float) -> tuple[float, float, float, float]:
    """The colour of a score on the matrices' scale (clipped to SCORE_RANGE)."""
    import matplotlib

    lo, hi = SCORE_RANGE
    return matplotlib.colormaps[SCORE_CMAP](min(max((value - lo) / (hi - lo), 0.0), 1.0))


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def text_colour(rgb) -> str:
    """Black or white, whichever contrasts more with background `rgb` (0-1 floats): the
    WCAG contrast ratio (L1 + 0.05) / (L2 + 0.05) of relative luminances
    L = 0.2126 R + 0.7152 G + 0.0722 B over linearised sRGB (WCAG 2.1, "relative
    luminance"); black wins where L > sqrt(1.05 * 0.05) - 0.05 ~ 0.179."""
    r, g, b = ((c / 12.92) if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4 for c in rgb[:3])
    return "#000000" if 0.2126 * r + 0.7152 * g + 0.0722 * b > 0.179 else "#ffffff"


def _with_zero_shot(record: RunRecord, iv: dict | None):
    """(labels, matrix, intervals) with the zero-shot row first where the run has one."""
    import numpy as np

    labels = [f"{s.index + 1}: {s.label}" for s in record.stages]
    rows = list(record.matrix)
    cis = list((iv or {}).get("matrix_ci") or [[None] * len(record.tasks)] * len(rows))
    if record.zero_shot is not None:
        labels, rows = ["zero-shot", *labels], [record.zero_shot, *rows]
        cis = [(iv or {}).get("zero_shot_ci") or [None] * len(record.tasks), *cis]
    return labels, np.array([[np.nan if v is None else v for v in row] for row in rows], dtype=float), cis


def _summary_title(record: RunRecord, iv: dict | None, keys) -> str:
    from cl_bench.metrics.cl import summaries
    from cl_bench.report.text import summary_line

    return summary_line(record, iv, summaries(*keys))


def heatmap(record: RunRecord, path: Path, iv: dict | None = None) -> Path:
    import numpy as np

    plt = _pyplot()
    tasks = record.tasks
    labels, matrix, cis = _with_zero_shot(record, iv)
    font = HEATMAP_FONT
    fig, ax = plt.subplots(figsize=(1.6 * len(tasks) + 3.5, 0.8 * len(labels) + 2.4))
    image = ax.imshow(matrix, cmap=SCORE_CMAP, vmin=SCORE_RANGE[0], vmax=SCORE_RANGE[1])
    for (i, j), value in np.ndenumerate(matrix):
        if np.isfinite(value):
            ci = cis[i][j]
            text = f"{value:.1f}" + (f"\n[{ci[0]:.0f}, {ci[1]:.0f}]" if ci else "")
            ax.text(j, i, text, ha="center", va="center", color=text_colour(score_rgba(value)), fontsize=font)
    ax.set_xticks(range(len(tasks)), tasks, rotation=30, ha="right", fontsize=font)
    ax.set_yticks(range(len(labels)), labels, fontsize=font)
    ax.set_xlabel("task evaluated", fontsize=font)
    ax.set_ylabel("after stage", fontsize=font)
    title = _summary_title(record, iv, ("last_acc", "stage_acc", "bwt", "fwt"))
    ax.set_title(f"{record.method} on {record.model['id']} (95% intervals over items)\n{title}", fontsize=font)
    bar = fig.colorbar(image, ax=ax)
    bar.set_label("score (0-100)", fontsize=font)
    bar.ax.tick_params(labelsize=font)
    return _save(fig, path)


def tasks_figure(record: RunRecord, path: Path, iv: dict | None) -> Path | None:
    """Per task: zero-shot, right after learning (R[j][j]) and at the end (R[T-1][j])."""
    import numpy as np

    plt = _pyplot()
    R, tasks = record.matrix, record.tasks
    if len(R) != len(tasks) or iv is None:
        return None
    zero, zci = record.zero_shot, iv.get("zero_shot_ci")
    bars = [("zero-shot", [None if zero is None else zero[j] for j in range(len(tasks))],
             [None if zci is None else zci[j] for j in range(len(tasks))]),
            ("just learned", [R[j][j] for j in range(len(tasks))], [iv["matrix_ci"][j][j] for j in range(len(tasks))]),
            ("after the last stage", R[-1], iv["matrix_ci"][-1])]
    fig, ax = plt.subplots(figsize=(1.4 * len(tasks) + 2, 4))
    x = np.arange(len(tasks))
    for k, (label, values, cis) in enumerate(bars):
        v = np.array([np.nan if a is None else a for a in values])
        err = np.array([[0, 0] if c is None or a is None else [a - c[0], c[1] - a] for a, c in zip(values, cis)]).T
        ax.bar(x + (k - 1) * 0.27, v, 0.27, yerr=err, capsize=2, label=label)
    majority = record.majority or {}
    for j, task in enumerate(tasks):
        m = majority.get(task)
        if m:
            ax.hlines(m["score"], j - 0.42, j + 0.42, colors="k", linestyles="dashed",
                      label="majority class" if j == min(i for i, t in enumerate(tasks) if t in majority) else None)
    ax.set_xticks(x, tasks, rotation=30, ha="right")
    ax.set_ylabel("score (0-100), 95% intervals")
    ax.set_title(f"{record.method}: learned and kept\n" + _summary_title(record, iv, ("bwt", "fwt")), fontsize=9)
    ax.legend(fontsize=7)
    return _save(fig, path)


def forms(record: RunRecord, path: Path, iv: dict | None) -> Path | None:
    import numpy as np

    plt = _pyplot()
    if iv is None or not any(v is not None for row in iv.get("form_share") or [] for v in row):
        return None  # no predictions, or a benchmark that declares no answer form
    tasks = record.tasks
    labels = [f"{s.index + 1}: {s.label}" for s in record.stages]
    rows = iv["form_share"]
    if record.zero_shot is not None and iv.get("zero_shot_form_share"):
        labels, rows = ["zero-shot", *labels], [iv["zero_shot_form_share"], *rows]
    share = np.array([[np.nan if v is None else 100 * v for v in row] for row in rows], dtype=float)
    fig, ax = plt.subplots(figsize=(1.1 * len(tasks) + 3.5, 0.6 * len(labels) + 2))
    image = ax.imshow(share, cmap="magma", vmin=0, vmax=100)
    for (i, j), value in np.ndenumerate(share):
        if np.isfinite(value):
            ax.text(j, i, f"{value:.0f}%", ha="center", va="center", color=text_colour(image.to_rgba(value)),
                    fontsize=8)
    ax.set_xticks(range(len(tasks)), tasks, rotation=30, ha="right")
    ax.set_yticks(range(len(labels)), labels)
    ax.set_title(f"{record.method}: share of answers in the task's form\n"
                 + _summary_title(record, iv, ("bwt", "bwt_format", "bwt_content")), fontsize=8)
    fig.colorbar(image, ax=ax, label="well-formed predictions (%)")
    return _save(fig, path)


def decisions(record: RunRecord, path: Path) -> Path | None:
    """The diagnostics "decisions" of the parameter rows: [layer][slot] of 0/1."""
    plt = _pyplot()
    rows = [p for p in record.params if p.diagnostics.get("decisions")]
    if not rows:
        return None
    fig, axes = plt.subplots(1, len(rows), figsize=(max(2.2 * len(rows) + 1, 4), 4.5), squeeze=False)
    for ax, row in zip(axes[0], rows):
        grid = row.diagnostics["decisions"]
        layers = row.diagnostics.get("decision_layers") or list(range(len(grid)))
        ax.imshow(grid, cmap="Greys", vmin=0, vmax=1, aspect="auto", interpolation="nearest")
        ax.set_title(f"stage {row.stage + 1}\nexpand {100 * (row.expansion_rate or 0):.0f}%", fontsize=9)
        ax.set_xlabel("slot")
        step = max(1, len(layers) // 10)
        ax.set_yticks(range(0, len(layers), step), [layers[i] for i in range(0, len(layers), step)])
    axes[0][0].set_ylabel("decoder layer")
    fig.suptitle(f"{record.method}\nExpand (dark) / Recycle (light)", fontsize=10)
    return _save(fig, path)


def cka(record: RunRecord, path: Path) -> Path | None:
    plt = _pyplot()
    probes = record.probes or {}
    by_stage = probes.get("cka") or {}
    if not by_stage:
        return None
    last = max(by_stage, key=int)
    fig, ax = plt.subplots(figsize=(6, 4))
    for task, values in by_stage[last].items():
        ax.plot(range(len(values)), values, marker=".", label=task)
    ax.set_xlabel("decoder layer")
    ax.set_ylabel("CKA with the model right after the task")
    ax.set_ylim(0, 1.02)
    ax.set_title(f"{record.method}: representations of earlier tasks after stage {int(last) + 1}",
                 fontsize=9)
    ax.legend(fontsize=7)
    return _save(fig, path)


def routing(record: RunRecord, path: Path) -> Path | None:
    """Routing drift (cl_bench/eval/probes/routing.py): left, each earlier task's JS
    divergence from its routing right after it was learned, mean over routed layers,
    by stage; right, the last stage's JS per layer and task."""
    plt = _pyplot()
    by_stage = (record.probes or {}).get("routing") or {}
    stages = sorted(by_stage, key=int)
    tasks = [t for t in record.tasks if any("js" in (by_stage[s].get(t) or {}) for s in stages)]
    if not tasks:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for task in tasks:
        points = [(int(s) + 1, sum(e["js"]) / len(e["js"])) for s in stages
                  if "js" in (e := by_stage[s].get(task) or {})]
        axes[0].plot(*zip(*points), marker=".", label=task)
    axes[0].set_xlabel("after stage")
    axes[0].xaxis.get_major_locator().set_params(integer=True)
    axes[0].set_ylabel("JS divergence (bits), mean over routed layers")
    axes[0].set_ylim(0, 1)
    axes[0].legend(fontsize=7)
    last = stages[-1]
    shown = [t for t in tasks if "js" in (by_stage[last].get(t) or {})]
    grid = [by_stage[last][t]["js"] for t in shown]
    image = axes[1].imshow(grid, cmap="viridis", vmin=0, vmax=1, aspect="auto", interpolation="nearest")
    axes[1].set_yticks(range(len(shown)), shown, fontsize=7)
    axes[1].set_xlabel("routed layer (depth order)")
    axes[1].xaxis.get_major_locator().set_params(integer=True)
    axes[1].set_title(f"after stage {int(last) + 1}", fontsize=9)
    fig.colorbar(image, ax=axes[1], label="JS (bits)")
    fig.suptitle(f"{record.method}: routing of earlier tasks against right after each was learned", fontsize=10)
    return _save(fig, path)


RARE_SHARE = 0.05  # experts under this share of the assignments are marked


def sharpness(record: RunRecord, path: Path) -> Path | None:
    plt = _pyplot()
    by_stage = (record.probes or {}).get("sharpness") or {}
    if not by_stage:
        return None
    last = max(by_stage, key=int)
    rows = by_stage[last]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, label in ((axes[0], "grad_norm", "gradient norm"),
                           (axes[1], "top_hessian_eig", "top Hessian eigenvalue")):
        for rare in (False, True):
            pts = [r for r in rows if (r["token_share"] < RARE_SHARE) == rare]
            ax.scatter([r["layer"] for r in pts], [r[key] for r in pts], s=18,
                       facecolors="none" if rare else "C0", edgecolors="C0",
                       label=f"token share {'<' if rare else '>='} {RARE_SHARE:.0%}")
        ax.set_xlabel("decoder layer")
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.set_ylabel(label)
        ax.set_yscale("symlog", linthresh=1e-3)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"{record.method}: sharpness of the newest experts after stage {int(last) + 1}", fontsize=10)
    return _save(fig, path)


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    _pyplot().close(fig)
    return path


def analyze(run_dir: Path, against: Path | None = None, from_stage: int = 0,
            calibrate_stage: int | None = None) -> list[Path]:
    """Write every figure the record of `run_dir` supports (and, with `against`,
    the cost comparison); returns their paths."""
    from cl_bench.report.figures.cost import cost
    from cl_bench.report.figures.depth import record_depth
    from cl_bench.report.figures.sources import record_sources
    from cl_bench.metrics.intervals import record_intervals
    from cl_bench.record.io import atomic_write_text

    record = read_finished(run_dir)
    iv = record_intervals(record, run_dir)
    out = [heatmap(record, run_dir / "heatmap.png", iv)]
    for draw, name in ((tasks_figure, "tasks.png"), (forms, "forms.png")):
        drawn = draw(record, run_dir / name, iv)
        if drawn is not None:
            out.append(drawn)
    for draw, name in ((decisions, "decisions.png"), (cka, "cka.png"), (routing, "routing.png"),
                       (sharpness, "sharpness.png")):
        drawn = draw(record, run_dir / name)
        if drawn is not None:
            out.append(drawn)
    for name, found in (("depth.json", record_depth(record)), ("sources.json", record_sources(record))):
        if found is not None:
            path = run_dir / name
            atomic_write_text(path, json.dumps(found, indent=1) + "\n")
            out.append(path)
    if against is not None:
        result = cost(run_dir, against, from_stage, calibrate_stage)
        path = run_dir / f"cost-vs-{result['other']}.json"
        path.write_text(json.dumps(result, indent=1) + "\n")
        out.append(path)
    return out
