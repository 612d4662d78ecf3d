"""A run record (run.json) or checkpoint edited into any shape other than the one
cl-bench writes is refused with exit 2 and one line naming the file and the field
(cl_bench/record/shape.py, cl_bench/run/checkpoint_shape.py), and nothing in the run
folder changes; where the edit is harmless the run loads and resumes to the end.
Never a traceback. The mutations are seeded and random (tests/shape_mutations.py:
type swaps, deletions, wrong lengths, unknown names), over valid interrupted runs
built once: one with a zero-shot row and two of its three stages done, one
stopped inside stage 2 with an in-stage checkpoint."""
from __future__ import annotations

import json
import random
import shutil

import pytest
import torch

from cl_bench.record import io as results
from cl_bench.run import checkpoint
from helpers import file_digests, interrupted_run, make_trace, only_run, run_cli, smoke_args
from shape_mutations import mutate

N_MUTATIONS = 40


@pytest.fixture(scope="module")
def valid_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("shapes")
    trace = make_trace(root / "trace")
    with pytest.MonkeyPatch.context() as mp:
        return interrupted_run(mp, *smoke_args(trace, root / "runs", "--set", "eval.zero_shot=true"), at_stage=2)


@pytest.fixture(scope="module")
def in_stage_run(tmp_path_factory):
    """Stopped (Ctrl-C) after step 2 of stage 2's 4, with an in-stage checkpoint after every step."""
    from cl_bench.backends.torch_backend import TorchBackend

    root = tmp_path_factory.mktemp("in-stage")
    real = TorchBackend.train_stage

    def train_stage(self, method, optimizer, stage, epochs, pad_id, on_step=None, *args, **kwargs):
        def report(step, parts):
            on_step(step, parts)
            if stage.index == 1 and step == 2:
                raise KeyboardInterrupt
        return real(self, method, optimizer, stage, epochs, pad_id, report, *args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(TorchBackend, "train_stage", train_stage)
        assert run_cli(*smoke_args(make_trace(root / "trace"), root / "runs", "--set", "train.checkpoint_every_s=0",
                                   "--set", "train.batch_size=2", "--set", "train.micro_batch_size=1")) == 130
    return only_run(root / "runs")


def _copy(valid_run, tmp_path, i):
    run_dir = tmp_path / str(i) / "r"
    shutil.copytree(valid_run, run_dir)
    return run_dir


def _outcome(capsys, run_dir, argv, names: str) -> int:
    """Run `argv`; exit 0, or exit 2 with one line naming `names` and the folder
    left as it was. Any exception (a traceback) fails the test."""
    before = file_digests(run_dir)
    capsys.readouterr()
    code = run_cli(*argv)
    err = capsys.readouterr().err.strip()
    assert code in (0, 2), (code, err)
    if code == 2:
        assert err and "\n" not in err and "Traceback" not in err, err
        assert names in err and "field " in err, err
        assert file_digests(run_dir) == before
    return code


def _resume(run_dir):
    return ["run", "--resume", run_dir, "--no-progress"]


@pytest.mark.slow
def test_random_edits_of_a_record_load_or_are_refused_in_one_line(valid_run, tmp_path, capsys):
    """Mutation caught: record_shape.check dropped (checked: mutation 2, matrix[1][1]
    turned into a string, ends show in a ValueError traceback)."""
    rng = random.Random(0)
    valid = json.loads((valid_run / results.RUN_FILE).read_text())
    codes = []
    for i in range(N_MUTATIONS):
        record, what = mutate(valid, rng)
        run_dir = _copy(valid_run, tmp_path, i)
        (run_dir / results.RUN_FILE).write_text(json.dumps(record))
        try:
            codes.append(_outcome(capsys, run_dir, ["show", run_dir], "run.json"))
            codes.append(_outcome(capsys, run_dir, _resume(run_dir), "run.json"))
        except BaseException as exc:
            raise AssertionError(f"record mutation {i} ({what}): {type(exc).__name__}: {exc}") from exc
    assert 0 in codes and 2 in codes  # both kinds of edit were drawn


@pytest.mark.slow
def test_random_edits_of_a_checkpoint_load_or_are_refused_in_one_line(valid_run, tmp_path, capsys):
    """Mutation caught: the weights' check (Loaded.check_weights) dropped from
    checkpoint (checked: mutation 4, a weight turned into {}, ends in
    load_state_dict's multi-line RuntimeError traceback)."""
    rng = random.Random(0)
    path = valid_run / checkpoint.CHECKPOINT_DIR / "state.pt"
    valid = torch.load(path, weights_only=True)
    codes = []
    for i in range(N_MUTATIONS):
        state, what = mutate(valid, rng)
        run_dir = _copy(valid_run, tmp_path, i)
        torch.save(state, run_dir / checkpoint.CHECKPOINT_DIR / "state.pt")
        try:
            codes.append(_outcome(capsys, run_dir, _resume(run_dir), "state.pt"))
        except BaseException as exc:
            raise AssertionError(f"checkpoint mutation {i} ({what}): {type(exc).__name__}: {exc}") from exc
    assert 0 in codes and 2 in codes


@pytest.mark.slow
def test_random_edits_of_an_in_stage_checkpoint_load_or_are_refused_in_one_line(in_stage_run, tmp_path, capsys):
    """checkpoint-step/ (train.checkpoint_every_s), whose weights are applied inside
    the stage, after its hooks. Mutations caught: the field checks of
    resume.load_in_stage dropped (checked: mutation 1, global_step turned into a
    string, ends in a TypeError traceback); sequencer.execute writing the record
    as failed on a LayoutError (checked: mutation 0, a deleted weight, changes
    run.json)."""
    rng = random.Random(0)
    path = in_stage_run / checkpoint.STEP_CHECKPOINT_DIR / "state.pt"
    valid = torch.load(path, weights_only=True)
    codes = []
    for i in range(N_MUTATIONS // 2):
        state, what = mutate(valid, rng)
        run_dir = _copy(in_stage_run, tmp_path, i)
        torch.save(state, run_dir / checkpoint.STEP_CHECKPOINT_DIR / "state.pt")
        try:
            codes.append(_outcome(capsys, run_dir, _resume(run_dir), "checkpoint-step/state.pt"))
        except BaseException as exc:
            raise AssertionError(f"in-stage checkpoint mutation {i} ({what}): {type(exc).__name__}: {exc}") from exc
    assert 2 in codes


def _edit_record(key, value):
    def edit(run_dir):
        record = json.loads((run_dir / results.RUN_FILE).read_text())
        path, last = record, key.split(".")
        for k in last[:-1]:
            path = path[int(k)] if isinstance(path, list) else path[k]
        path[int(last[-1]) if isinstance(path, list) else last[-1]] = value
        (run_dir / results.RUN_FILE).write_text(json.dumps(record))
    return edit


def _edit_state(change):
    def edit(run_dir):
        path = run_dir / checkpoint.CHECKPOINT_DIR / "state.pt"
        torch.save(change(torch.load(path, weights_only=True)), path)
    return edit


def _shrunk_weight(state):
    key = next(iter(state["model"]))
    return {**state, "model": {**state["model"], key: state["model"][key][:1]}}


def _stray_optimizer_entry(state):
    """An optimiser state entry keyed by no parameter id (torch's load_state_dict keeps
    such an entry as it is)."""
    saved = state["optimizer"]["state"]
    return {**state, "optimizer": {**state["optimizer"], "state": {**saved, "state": {**saved["state"], "x": 1}}}}


def _another_task(name):
    """Py150 replaced by `name` wherever the record names it, but in its config."""
    def edit(run_dir):
        path = run_dir / results.RUN_FILE
        config = json.loads(path.read_text())["config"]
        record = json.loads(path.read_text().replace('"Py150"', f'"{name}"'))
        path.write_text(json.dumps({**record, "config": config}))
    return edit


EDITS = [  # (case, edit of the run folder, what the one line says)
    ("unknown task", _edit_record("tasks.1", "NoSuchTask"), "run.json: field stages[1] must have index 1 and tasks"),
    ("unknown task everywhere", _another_task("NoSuchTask"), "run.json: field tasks=['NumGLUE-cm', 'NoSuchTask', "),
    ("another task", _another_task("C-STANCE"), "run.json: field tasks=['NumGLUE-cm', 'C-STANCE', "),
    ("unknown method", _edit_record("config.method", "nosuch"), "run.json: in field config: unknown method 'nosuch'"),
    ("another stage label", _edit_record("stages.1.label", "X"), "run.json: field stages differs from the 3 stages"),
    ("predictions not JSON", lambda d: (d / "predictions.jsonl").write_text('{"stage": 0,\n'),
     "predictions.jsonl:1: not valid JSON"),
    ("metrics row without stage", lambda d: (d / "metrics.jsonl").write_text('{"step": 0, "lm": 1.0}\n'),
     "metrics.jsonl:1: field stage: each line must be a JSON object with an integer stage"),
    ("short matrix row", _edit_record("matrix.0", [None]), "run.json: field matrix[0] must be a list of 3 values"),
    ("plain values", _edit_state(lambda s: {"stage": 1, "weights": {"a": 1}}), "state.pt: field method is missing"),
    ("weights of another shape", _edit_state(_shrunk_weight), "state.pt: field model.model.embed_tokens.weight must"),
    ("a list", _edit_state(lambda s: [1, 2]), "state.pt: holds a list, not the fields cl-bench writes"),
    ("stage beyond the record", _edit_state(lambda s: {**s, "stage": 2}), "state.pt: field stage=2 must be in [0, 1]"),
    ("a resume's backend not an object",
     _edit_record("resumes", [{"at_stage": 1, "command": "cl-bench run --resume r", "backend": [2]}]),
     "run.json: field resumes[0] must be an object with an integer at_stage, the command as a string"),
    ("optimiser state of no parameter", _edit_state(_stray_optimizer_entry),
     "state.pt: field optimizer.state.state.x is not a parameter of the saved groups"),
]


@pytest.mark.parametrize("edit, message", [c[1:] for c in EDITS], ids=[c[0] for c in EDITS])
@pytest.mark.slow
def test_each_kind_of_edit_is_refused_in_one_line(valid_run, tmp_path, capsys, edit, message):
    """The issue's cases and one of each check. Mutation caught: that check removed
    (a KeyError or TypeError traceback, or a resume that ran on: exit 0)."""
    run_dir = _copy(valid_run, tmp_path, 0)
    edit(run_dir)
    before = file_digests(run_dir)
    capsys.readouterr()
    assert run_cli(*_resume(run_dir)) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err and "Traceback" not in err, err
    assert file_digests(run_dir) == before
