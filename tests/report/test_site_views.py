"""The site's views (cl_bench/report/site/views.py) on hand-made values: each test item's
story over the stages, and the interval bar."""
from cl_bench.report.site.views import interval_bar, item_story

LABELS = ["MeetingBank", "Py150", "C-STANCE"]


def test_a_right_answer_lost_later_is_forgotten_at_that_stage():
    assert item_story([None, 100.0, 0.0], 1, LABELS) == ("forgotten", "right after its stage, wrong after C-STANCE")
    assert item_story([100.0, 0.0, 100.0], 0, LABELS)[1] == \
        "right after its stage, wrong after Py150, recovered by the last stage"


def test_kept_never_learned_and_unscored_items():
    assert item_story([100.0, 100.0, 100.0], 0, LABELS)[0] == "kept"
    assert item_story([0.0, 100.0, 0.0], 0, LABELS) == ("never", "wrong right after its stage; right after Py150")
    assert item_story([None, None, 50.0], 1, LABELS)[0] == "unseen"


def test_graded_scores_say_the_numbers():
    assert item_story([40.0, 35.5, 50.0], 0, LABELS) == \
        ("forgotten", "40 right after its stage, 36 after Py150, recovered by the last stage")
    assert item_story([40.0, 40.0, 41.0], 0, LABELS) == ("kept", "40 right after its stage, never lower after")


def test_the_bar_places_the_interval_on_the_column_span():
    assert interval_bar(20.0, 25.0, 30.0, 0.0, 40.0) == {"left": 50.0, "width": 25.0, "mean": 62.5}
    assert interval_bar(None, 25.0, 30.0, 0.0, 40.0) is None


def test_the_heatmap_figure_and_the_html_matrix_share_one_colour_scale(monkeypatch, tmp_path):
    """Mutation caught: the figure's scale stretched to the run's highest score (as it
    was), so one colour meant different scores in the figure and on the page."""
    from pathlib import Path

    from matplotlib.colors import to_hex

    from cl_bench.record.io import read_record
    from cl_bench.report.figures import plots
    from cl_bench.report.site.views import score_colours

    drawn = []
    monkeypatch.setattr(plots, "_save", lambda fig, path: drawn.append(fig) or path)
    record = read_record(Path(__file__).resolve().parents[2] / "results" / "seqft-cpu-paper6-seed2")
    plots.heatmap(record, tmp_path / "heatmap.png")
    (image,) = drawn[0].axes[0].images
    for value in (0.0, 12.5, 37.1, 100.0):
        assert to_hex(image.to_rgba(value)) == score_colours(value)[0], value
