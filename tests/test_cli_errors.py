"""Bad input: one clear line naming what, where and the fix; exit 2; no traceback."""
from __future__ import annotations

import json

import pytest

from helpers import run_cli, smoke_args


def error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert err and "Traceback" not in "\n".join(err)
    return err[-1]


def test_malformed_json_names_file_and_line(trace_dir, tmp_path, capsys):
    (trace_dir / "Py150" / "train.json").write_text('[{"prompt": "a", "answer": "b"},\n{oops}]')
    assert run_cli(*smoke_args(trace_dir, tmp_path / "out")) == 2
    line = error_line(capsys)
    assert "Py150/train.json:2:" in line and "fix the JSON" in line


def test_non_string_answer_names_record_and_field(trace_dir, tmp_path, capsys):
    (trace_dir / "20Minuten" / "test.json").write_text(json.dumps([{"prompt": "p", "answer": 3}]))
    assert run_cli(*smoke_args(trace_dir, tmp_path / "out")) == 2
    line = error_line(capsys)
    assert "20Minuten/test.json" in line and "answer" in line and "number" in line


def test_missing_split_and_missing_task_folder(trace_dir, tmp_path, capsys):
    (trace_dir / "Py150" / "test.json").unlink()
    assert run_cli(*smoke_args(trace_dir, tmp_path / "out")) == 2
    assert "test.json" in error_line(capsys)
    assert run_cli(*smoke_args(trace_dir, tmp_path / "out", "--order", "FOMC")) == 2
    assert "FOMC" in error_line(capsys)


@pytest.mark.parametrize("flag, value, expect", [
    ("--order", "NumGLUE-cm,Py15O", "did you mean 'Py150'"),
    ("--method", "seqtf", "did you mean 'seqft'"),
    ("--model", "no-such-model", "unknown model 'no-such-model'"),
    ("--model", "Tiny-Llama", "did you mean 'tiny-llama'"),
    ("--method", "LoRA", "did you mean 'lora'"),
    ("--profile", "smok", "did you mean 'smoke'"),
    ("--method-arg", "lrr=1", "did you mean 'lr'"),
    ("--method-arg", "lr=fast", "not a valid float"),
    ("--set", "train.epoch=2", "did you mean 'epochs'"),
])
def test_unknown_names_and_values(trace_dir, tmp_path, capsys, flag, value, expect):
    assert run_cli(*smoke_args(trace_dir, tmp_path / "out", flag, value)) == 2
    assert expect in error_line(capsys)


def test_unwritable_output_dir(trace_dir, tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    assert run_cli(*smoke_args(trace_dir, blocker / "runs")) == 2
    assert "not writable" in error_line(capsys)


@pytest.mark.slow
def test_existing_run_is_not_overwritten(trace_dir, tmp_path, capsys):
    out = tmp_path / "out"
    assert run_cli(*smoke_args(trace_dir, out, "--run-id", "r1")) == 0
    before = (out / "r1" / "run.json").read_bytes()
    assert run_cli(*smoke_args(trace_dir, out, "--run-id", "r1")) == 2
    assert "--resume" in error_line(capsys)
    assert (out / "r1" / "run.json").read_bytes() == before


def test_bad_yaml_config(trace_dir, tmp_path, capsys):
    bad = tmp_path / "c.yaml"
    bad.write_text("train:\n  epochs: [1\n")
    assert run_cli(*smoke_args(trace_dir, tmp_path / "out", "--config", bad)) == 2
    assert str(bad) in error_line(capsys)


def test_debug_shows_the_traceback(trace_dir, tmp_path):
    from cl_bench.errors import UserError

    with pytest.raises(UserError):
        run_cli("--debug", *smoke_args(trace_dir, tmp_path / "out", "--method", "nope"))


def test_help_summary_names_every_command():
    """`cl-bench --help`'s first line lists every subcommand (mutation caught: one left out,
    as campaign was)."""
    from cl_bench.cli import COMMANDS
    from cl_bench.cli_parser import DESCRIPTION

    listed = DESCRIPTION.split(":", 1)[1].strip(" .").split(" | ")
    assert sorted(listed) == sorted(COMMANDS)


def _commands() -> list[str]:
    import argparse

    from cl_bench.cli_parser import build_parser

    (sub,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return sorted(sub.choices)


@pytest.mark.parametrize("command", _commands())
def test_every_command_prints_its_help(command, capsys):
    """`cl-bench COMMAND --help` prints and exits 0 (mutation caught: an unescaped '%' in
    `leaderboard --view`'s help, which made argparse raise ValueError instead)."""
    with pytest.raises(SystemExit) as done:
        run_cli(command, "--help")
    assert done.value.code == 0 and "usage: " in capsys.readouterr().out


@pytest.mark.parametrize("value, message", [("-5", "-5: at least 100 resamples"), ("0", "0: at least 100"),
                                            ("abc", "'abc' is not a whole number")])
def test_compare_refuses_too_few_resamples_in_one_line(value, message, tmp_path, capsys):
    """`compare --resamples` below 100 (a negative count raised numpy's ValueError with a
    traceback; 0 printed dashes and "not distinguishable" on every row). Mutation caught:
    --resamples parsed as a plain int."""
    with pytest.raises(SystemExit) as done:
        run_cli("compare", tmp_path, tmp_path, "--resamples", value)
    err = capsys.readouterr().err
    assert done.value.code == 2 and message in err and "Traceback" not in err


def test_help_shows_no_doubled_percent_sign(capsys):
    """A description is not %-formatted by argparse, unlike a help string: its '%%' showed."""
    with pytest.raises(SystemExit):
        run_cli("compare", "--help")
    shown = " ".join(capsys.readouterr().out.split())  # as wrapped to the terminal's width
    assert "its 95% paired-bootstrap interval" in shown


@pytest.mark.parametrize("flag", ["--from-stage", "--calibrate-stage"])
def test_analyze_refuses_comparison_flags_without_a_run_to_compare(flag, tmp_path, capsys):
    """They were ignored without --against. Mutation caught: the check dropped."""
    assert run_cli("analyze", tmp_path, flag, "2") == 2
    err = capsys.readouterr().err
    assert "add --against OTHER_RUN" in err and "Traceback" not in err
