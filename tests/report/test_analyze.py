"""Representation probes and `cl-bench analyze` figures, on the tiny model."""
from __future__ import annotations

import json

import pytest
import torch

from cl_bench.report.figures.plots import analyze
from cl_bench.benchmarks.trace import load_task
from cl_bench.config import build
from cl_bench.data.encode import Encoder
from cl_bench.errors import UserError
from cl_bench.models.loading import tiny_llama
from cl_bench.profiles import PROFILES
from cl_bench.eval.probes.representation import RepresentationProbe


@pytest.fixture
def setup(trace_dir):
    model, tokenizer, _ = tiny_llama(0)
    config = build({**PROFILES["smoke"], "profile": "smoke"}, "test")
    encoder = Encoder.from_config(tokenizer, config.train)
    tasks = [load_task(trace_dir, name, 4, 4, 0) for name in ("NumGLUE-cm", "Py150")]
    return model, encoder, tasks


def test_probe_stores_a_reference_then_measures_cka_per_layer(setup):
    model, encoder, tasks = setup
    probe = RepresentationProbe(n_examples=3, max_tokens=64)
    assert probe.after_stage(model, encoder, tasks[:1]) == {}  # first sight: reference only
    same = probe.after_stage(model, encoder, tasks)  # task 0 unchanged; task 1 first seen
    assert list(same) == ["NumGLUE-cm"] and same["NumGLUE-cm"] == pytest.approx([1.0, 1.0], abs=1e-5)
    assert probe.references["Py150"][0].shape == (64, 64)  # capped tokens x width
    with torch.no_grad():  # move the last layer only: layer 0's representation stays
        for p in model.model.layers[1].parameters():
            p.add_(0.5 * torch.randn_like(p))
    moved = probe.after_stage(model, encoder, tasks)
    for task in ("NumGLUE-cm", "Py150"):
        assert moved[task][0] == pytest.approx(1.0, abs=1e-5) and moved[task][1] < 0.99
    restored = RepresentationProbe(n_examples=3, max_tokens=64)
    restored.load_state_dict(probe.state_dict())
    assert restored.after_stage(model, encoder, tasks[:1]) == {"NumGLUE-cm": moved["NumGLUE-cm"]}


def _record(**extra):
    return {"schema_version": 1, "method": "bilevel-cka", "model": {"id": "tiny-llama"}, "tasks": ["A", "B"],
            "stages": [{"index": 0, "label": "A"}, {"index": 1, "label": "B"}],
            "matrix": [[50.0, None], [40.0, 60.0]], "stages_done": 2,
            "summary": {"last_acc": 50.0, "stage_acc": 52.5, "bwt": -10.0}, **extra}


def _png(path):
    return path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_analyze_draws_what_the_record_holds(tmp_path):
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "run.json").write_text(json.dumps(_record()))
    assert [p.name for p in analyze(plain)] == ["heatmap.png"] and _png(plain / "heatmap.png")

    full = tmp_path / "full"
    full.mkdir()
    params = [{"stage": 0, "expansion_rate": None},
              {"stage": 1, "expansion_rate": 0.5, "decision_layers": [0, 1], "decisions": [[1, 0], [0, 1]]}]
    sharp = [{"layer": l, "expert": e, "token_share": s, "grad_norm": g, "top_hessian_eig": h}
             for l, e, s, g, h in ((0, 8, 0.3, 0.5, 2.0), (0, 9, 0.01, 0.0, 0.0), (1, 8, 0.2, 0.1, -0.4))]
    probes = {"cka": {"1": {"A": [0.99, 0.7]}}, "sharpness": {"1": sharp}}
    (full / "run.json").write_text(json.dumps(_record(params=params, probes=probes)))
    names = ["heatmap.png", "decisions.png", "cka.png", "sharpness.png"]
    assert [p.name for p in analyze(full)] == [*names, "depth.json"] and all(_png(full / n) for n in names)
    depth = json.loads((full / "depth.json").read_text())  # layer 0: 1 of 2 slots, layer 1: 1 of 2
    assert (depth["stages"], depth["rate"], depth["verdict"]) == ([1], [0.5, 0.5], "not distinguishable")

    typed = tmp_path / "typed"  # schema 2: a method's own keys under the row's "diagnostics"
    typed.mkdir()
    rows = [{"stage": 0, "expansion_rate": None, "diagnostics": {}},
            {"stage": 1, "expansion_rate": 0.5, "diagnostics": {"decision_layers": [0, 1],
                                                                "decisions": [[1, 0], [0, 1]]}}]
    (typed / "run.json").write_text(json.dumps(_record(schema_version=2, params=rows)))
    assert [p.name for p in analyze(typed)] == ["heatmap.png", "decisions.png", "depth.json"]
    assert (typed / "decisions.png").read_bytes() == (full / "decisions.png").read_bytes()


def test_cost_against_another_run_divides_seconds_per_step_stage_by_stage(tmp_path):
    from cl_bench.report.figures.cost import cost

    def timed(run_id, secs, peaks, **extra):
        folder = tmp_path / run_id
        folder.mkdir()
        stages = [{"stage": b, "train_s": s, "eval_s": 1.0, "steps": 4, "peak_rss_mb": m}
                  for b, (s, m) in enumerate(zip(secs, peaks))]
        (folder / "run.json").write_text(json.dumps(_record(run_id=run_id, profile="cpu",
                                                            timing={"stages": stages}, **extra)))
        return folder

    search, base = timed("search", [8.0, 12.0], [100.0, 300.0]), timed("base", [8.0, 6.0], [100.0, 150.0])
    out = cost(search, base, from_stage=1)
    assert [r["stage"] for r in out["stages"]] == [1] and out["stages"][0]["s_per_step"] == 3.0
    assert out["median_step_ratio"] == 2.0 and out["peak_rss_ratio"] == 2.0
    assert cost(search, base)["median_step_ratio"] == 1.5  # median of 1.0 and 2.0
    slow = timed("slow", [16.0, 6.0], [100.0, 150.0])  # stage 0 (the same work) at half the speed
    calibrated = cost(search, slow, from_stage=1, calibrate_stage=0)
    assert calibrated["load_ratio"] == 0.5 and calibrated["median_calibrated_step_ratio"] == 4.0
    with pytest.raises(UserError, match=r"calibrate-stage 6: .* finished \(those are 1, 2\)"):  # numbered as show does
        cost(search, slow, calibrate_stage=5)
    paths = analyze(search, against=base, from_stage=1)
    assert json.loads((search / "cost-vs-base.json").read_text()) == out and paths[-1].name == "cost-vs-base.json"
    other_order = timed("other", [1.0, 1.0], [1.0, 1.0], tasks=["B", "A"])
    with pytest.raises(UserError, match="field tasks"):
        cost(search, other_order)


def test_analyze_names_a_missing_or_unfinished_record(tmp_path):
    with pytest.raises(UserError, match="no run record here"):
        analyze(tmp_path)
    (tmp_path / "run.json").write_text(json.dumps({**_record(), "stages_done": 0}))
    with pytest.raises(UserError, match="no stage finished"):
        analyze(tmp_path)


@pytest.mark.slow
def test_expert_sharpness_finds_an_eigenpair_of_each_experts_hessian_block(setup):
    from cl_bench.data.encode import collate
    from cl_bench.models.moe import upcycle_model
    from cl_bench.eval.probes.sharpness import expert_sharpness

    model, encoder, tasks = setup
    upcycle_model(model, router_std=0.5)
    model.requires_grad_(False)  # frozen weights must be handled too
    rows = [encoder.train_example(e.prompt, e.answer) for e in tasks[0].test[:2]]
    batch = collate(rows, encoder.tokenizer.pad_token_id)
    out = expert_sharpness(model, batch, iters=30)
    assert len(out) == 2 * 8 and [r["expert"] for r in out[:8]] == list(range(8))
    assert sum(r["token_share"] for r in out[:8]) == pytest.approx(1.0)
    assert not any(p.requires_grad for p in model.parameters())  # flags restored
    for r in out:
        if r["token_share"] == 0:  # no token routed to it: no gradient, zero Hessian block
            assert r["grad_norm"] == 0 and r["top_hessian_eig"] == 0
        if r["top_hessian_eig"] != 0:
            assert r["residual"] < 1e-3 * abs(r["top_hessian_eig"])  # converged to an eigenpair
    only_second = expert_sharpness(model, batch, iters=30, layers=[1])  # eval.sharpness_layers
    second = [r for r in out if r["layer"] == 1]
    assert [(r["expert"], r["grad_norm"]) for r in only_second] == [(r["expert"], r["grad_norm"]) for r in second]
    assert [r["top_hessian_eig"] for r in only_second] == pytest.approx([r["top_hessian_eig"] for r in second],
                                                                        rel=1e-5)  # other Lanczos starts
    assert sum(r["top_hessian_eig"] != 0 for r in out) >= 8


def test_lanczos_finds_the_largest_magnitude_eigenvalue_where_power_iteration_stalls():
    from cl_bench.eval.probes.sharpness import lanczos_top

    g = torch.Generator().manual_seed(0)
    q, _ = torch.linalg.qr(torch.randn(40, 40, generator=g, dtype=torch.float64))
    values = torch.linspace(-1.0, 1.0, 40, dtype=torch.float64)
    values[0], values[-1] = -3.0, 2.9  # a +/- pair of similar size
    matrix = q @ torch.diag(values) @ q.T
    eig, residual = lanczos_top(lambda v: (matrix @ v.double()).float(), torch.randn(40, generator=g), 25)
    assert eig == pytest.approx(-3.0, rel=1e-4) and residual < 1e-3


@pytest.mark.slow
def test_a_run_with_probes_records_them_survives_resume_and_analyze_draws_them(trace_dir, tmp_path,
                                                                                monkeypatch):
    from helpers import interrupted_run, only_run, run_cli, smoke_args

    probes = ("--set", "eval.cka_probe=2", "--set", "eval.sharpness=2", "--set", "eval.sharpness_iters=3",
              "--set", "eval.sharpness_layers=[0,1]")
    straight = tmp_path / "straight"
    assert run_cli(*smoke_args(trace_dir, straight, "--method", "upcycle", *probes)) == 0
    record = json.loads((only_run(straight) / "run.json").read_text())
    cka = record["probes"]["cka"]
    assert cka["0"] == {} and list(cka["2"]) == ["NumGLUE-cm", "Py150"]  # smoke order's first two
    assert all(0 <= v <= 1.0 + 1e-6 for vals in cka["2"].values() for v in vals)
    assert list(record["probes"]["sharpness"]) == ["2"] and len(record["probes"]["sharpness"]["2"]) == 2 * 8

    broken = tmp_path / "broken"
    run_dir = interrupted_run(monkeypatch, *smoke_args(trace_dir, broken, "--method", "upcycle", *probes),
                              at_stage=2)
    assert run_cli("run", "--resume", run_dir, "--no-progress") == 0
    assert json.loads((run_dir / "run.json").read_text())["probes"] == record["probes"]

    assert run_cli("analyze", str(only_run(straight))) == 0
    assert {p.name for p in only_run(straight).glob("*.png")} == {"heatmap.png", "tasks.png", "forms.png",
                                                                   "cka.png", "sharpness.png"}


def test_analyze_draws_intervals_tasks_and_forms_from_the_predictions(tmp_path):
    """With predictions beside the record: the per-task figure (zero-shot, just
    learned, last) and the answer-form shares, titled with BWT's two parts."""
    run = tmp_path / "run"
    run.mkdir()
    record = _record(tasks=["NumGLUE-cm", "C-STANCE"], zero_shot=[0.0, 0.0],
                     majority={"C-STANCE": {"answer": "A", "score": 50.0}},
                     matrix=[[50.0, None], [0.0, 100.0]])
    preds = [{"stage": b, "task": t, "index": i, "prompt": "p", "answer": a, "prediction": p_, "score": s}
             for b, t, a, rows in ((-1, "NumGLUE-cm", "7", [("x", 0.0), ("x", 0.0)]),
                                   (-1, "C-STANCE", "A", [("x", 0.0), ("x", 0.0)]),
                                   (0, "NumGLUE-cm", "7", [("7", 100.0), ("8", 0.0)]),
                                   (1, "NumGLUE-cm", "7", [("A", 0.0), ("A", 0.0)]),
                                   (1, "C-STANCE", "A", [("A", 100.0), ("A", 100.0)]))
             for i, (p_, s) in enumerate(rows)]
    (run / "run.json").write_text(json.dumps(record))
    (run / "predictions.jsonl").write_text("".join(json.dumps(p) + "\n" for p in preds))
    assert [p.name for p in analyze(run)] == ["heatmap.png", "tasks.png", "forms.png"]
    assert all(_png(run / n) for n in ("tasks.png", "forms.png"))


def test_every_figure_text_contrasts_with_its_cell(tmp_path, monkeypatch):
    """The heatmap's numbers are black on its light cells and white on its dark ones:
    each text's WCAG contrast with its cell is at least 4.5 (AA), the brightest cell
    included (mutation caught: white text everywhere, the heatmap as it was)."""
    import matplotlib.axes
    import matplotlib.colors

    from cl_bench.report.figures import plots

    def luminance(rgb):
        lin = [c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4 for c in rgb[:3]]
        return 0.2126 * lin[0] + 0.7152 * lin[1] + 0.0722 * lin[2]

    texts, real = [], matplotlib.axes.Axes.text
    monkeypatch.setattr(matplotlib.axes.Axes, "text", lambda self, x, y, s, **kw: (
        texts.append((self, x, y, kw.get("color"))), real(self, x, y, s, **kw))[1])
    run = tmp_path / "r"
    run.mkdir()
    (run / "run.json").write_text(json.dumps(_record()))
    analyze(run)
    assert len(texts) == 3  # the three scored cells
    for ax, x, y, colour in texts:
        image = ax.get_images()[0]
        cell = image.to_rgba(image.get_array()[y, x])
        lighter, darker = sorted((luminance(cell), luminance(matplotlib.colors.to_rgb(colour))), reverse=True)
        assert (lighter + 0.05) / (darker + 0.05) >= 4.5, (x, y, colour)
    assert plots.text_colour(matplotlib.colormaps["viridis"](1.0)) == "#000000"  # the site's brightest cell
