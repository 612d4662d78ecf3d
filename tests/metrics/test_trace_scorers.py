"""The "trace" scorer set: TRACE's evaluation code through its own libraries."""

import json
import sys
from pathlib import Path

import pytest

from cl_bench.errors import UserError
from cl_bench.metrics import scorers, trace_scorers as ts
from cl_bench.metrics.sari import corpus_sari

pytest.importorskip("rouge", reason="the trace scorers need `rouge` (pip install -e '.[test]')")
pytest.importorskip("fuzzywuzzy", reason="the trace scorers need `fuzzywuzzy` (pip install -e '.[test]')")

RUN = Path(__file__).resolve().parents[2] / "results" / "seqft-cpu-paper6-timed"


def _cell(stage: int, task: str) -> list[dict]:
    rows = [json.loads(line) for line in (RUN / "predictions.jsonl").read_text().splitlines()]
    return sorted((r for r in rows if r["stage"] == stage and r["task"] == task), key=lambda r: r["index"])


@pytest.mark.skipif(not RUN.is_dir(), reason="the committed paper6 runs are not here")
def test_meetingbank_after_stage_1_matches_the_issue():
    # issue 44: results/seqft-cpu-paper6-timed after stage 1, MeetingBank: TRACE 19.51, cl-bench 17.90
    rows = _cell(1, "MeetingBank")
    preds, answers = [r["prediction"] for r in rows], [r["answer"] for r in rows]
    assert round(ts.score("rouge_l", preds, answers), 2) == 19.51
    assert round(scorers.score("rouge_l", preds, answers), 2) == 17.90


@pytest.mark.skipif(not RUN.is_dir(), reason="the committed paper6 runs are not here")
@pytest.mark.parametrize("task", ["C-STANCE", "NumGLUE-cm", "NumGLUE-ds"])
def test_accuracy_cells_equal_cl_bench(task):
    # issue 44: every accuracy cell of the committed cpu paper6 runs equals cl-bench's
    record = json.loads((RUN / "run.json").read_text())
    j = record["tasks"].index(task)
    for b in range(j, len(record["matrix"])):
        rows = _cell(b, task)
        got = ts.score("accuracy", [r["prediction"] for r in rows], [r["answer"] for r in rows])
        assert got == pytest.approx(record["matrix"][b][j], abs=1e-9)


def test_accuracy_is_exact_unstripped_and_counts_empties():
    # TRACE compares as given: " A" != "A"; "" adds nothing and counts: 100 * 1/3
    assert ts.accuracy([" A", "A", ""], ["A", "A", "A"]) == pytest.approx(100 / 3)
    assert ts.first_char_accuracy(["A\nbecause", "", "B"], ["A\nso", "A", "C"]) == pytest.approx(100 / 3)


def test_rouge_l_uses_the_rouge_package():
    # `rouge` splits sentences on "." and scores the union LCS: "a. b" against "a b" is a full match
    assert ts.rouge_l(["a. b"], ["a b"]) == pytest.approx(100.0, abs=1e-6)
    # a text with no sentence (only dots) makes `rouge` raise; here that item scores 0
    assert ts.rouge_l(["...", "a b"], ["a b", "a b"]) == pytest.approx(50.0, abs=1e-6)


def test_edit_similarity_rounds_each_item():
    # fuzz.ratio("abc", "abd") = round(100 * 4/6) = 67 under either backend; "<STR_LIT>" is "" after
    # the clean-up, so it adds nothing and counts: (67 + 0) / 2
    assert ts.edit_similarity(["abc", "<STR_LIT>"], ["abd", "x"]) == pytest.approx(33.5)
    assert ts.fuzz_backend() in ("difflib", "python-Levenshtein")


def test_sari_scores_empty_predictions_as_hf_does():
    src, ans = ["About 95 species are currently accepted ."], ["About 95 species are now accepted ."]
    # HF's metric scores "" too (cl-bench's default set gives it 0)
    assert ts.sari([""], ans, src) == pytest.approx(corpus_sari(src, [""], [ans]))
    assert ts.sari([""], ans, src) > 0
    assert scorers.score("sari", [""], ans, src) == 0.0


def test_missing_library_and_unknown_metric_are_one_line_errors(monkeypatch):
    monkeypatch.setitem(sys.modules, "rouge", None)
    with pytest.raises(UserError, match="trace-scorers"):
        ts.score("rouge_l", ["a"], ["a"])
    with pytest.raises(UserError, match="available"):
        ts.score("bleu", ["a"], ["a"])
