"""The one exception type the CLI turns into a clean one-line message and exit code 2."""


class UserError(Exception):
    """Bad input from the user: a file, a field, a name. The message says what,
    where and how to fix it; the CLI prints it without a traceback."""


def did_you_mean(name: str, choices) -> str:
    """"did you mean 'x'? " for the closest of `choices` (a match but for case says
    so), or "" when none is close."""
    import difflib

    choices = list(choices)
    by_lower = {c.lower(): c for c in choices}
    if name not in choices and name.lower() in by_lower:
        return f"did you mean '{by_lower[name.lower()]}' (names are case-sensitive)? "
    close = difflib.get_close_matches(name, choices, n=1)
    return f"did you mean '{close[0]}'? " if close else ""


# A launch's ranks run `python -m cl_bench.cli`: its launcher tells them how it was called.
PROGRAM_ENV = "CL_BENCH_PROGRAM"


def program() -> str:
    """How to call cl-bench again from here, for the commands messages suggest:
    `cl-bench` where that name on PATH is the program running, else the path it was
    started by (`.venv/bin/cl-bench` after `make main`, which does not activate the venv);
    in a rank of `--nproc N`, its launcher's."""
    import os
    import shutil
    import sys

    if os.environ.get(PROGRAM_ENV):
        return os.environ[PROGRAM_ENV]
    started = sys.argv[0] if sys.argv else ""
    if os.path.basename(started) != "cl-bench":  # python -m cl_bench.cli, or a test
        return "cl-bench"
    found = shutil.which("cl-bench")
    if found and os.path.exists(started) and os.path.samefile(found, started):
        return "cl-bench"
    here = os.path.relpath(os.path.abspath(started))
    return here if not here.startswith("..") and os.sep in here else os.path.abspath(started)


# The flags of `cl-bench run` that say how a run runs, not what it computes: its config
# does not hold them, so --resume must be given them again, or a run launched on N ranks
# goes on in one process and its kept checkpoint is deleted at its end (every line that
# says how to continue a run carries them: resume_line).
LAUNCH_FLAGS = {"--nproc": int, "--keep-checkpoint": bool}


def launch_flags(argv: list[str]) -> list[str]:
    """The LAUNCH_FLAGS that the `cl-bench` arguments `argv` give (a recorded command's,
    without the program), as flags again, read as `run`'s parser reads them
    (abbreviations and --nproc=N too); the rest of argv, readable or not, is passed over."""
    import argparse

    parser = argparse.ArgumentParser(add_help=False, exit_on_error=False)
    for flag, kind in LAUNCH_FLAGS.items():
        parser.add_argument(flag, **({"action": "store_true"} if kind is bool else {"type": kind}))
    try:
        args, _ = parser.parse_known_args(argv)
    except argparse.ArgumentError:  # --nproc without a whole number: a command that never ran
        return []
    flags: list[str] = []
    for flag, kind in LAUNCH_FLAGS.items():
        value = getattr(args, flag[2:].replace("-", "_"))
        flags += ([flag] if value else []) if kind is bool else [] if value is None else [flag, str(value)]
    return flags


def resume_line(run_dir, command: str | None = None) -> str:
    """The command that continues the run in `run_dir`: --resume with the launch flags of
    `command` (a run's command line as recorded), by default of this process's own (a
    rank's: its launcher's, CL_BENCH_COMMAND)."""
    import os
    import shlex
    import sys

    if command is None:
        command = os.environ.get("CL_BENCH_COMMAND") or shlex.join(["cl-bench", *sys.argv[1:]])
    return shlex.join([program(), "run", "--resume", str(run_dir), *command_flags(command)])


def command_flags(command: str) -> list[str]:
    """The LAUNCH_FLAGS of a command line as a run records it (its program first)."""
    import shlex

    try:
        return launch_flags(shlex.split(command)[1:])
    except (ValueError, AttributeError):  # not a shell line, or not a string: an edited record
        return []


def last_command(resumes, command) -> str:
    """The command that last ran a run, from its record's fields: its last --resume's,
    else the one that started it ("" where the record holds neither)."""
    last = resumes[-1] if isinstance(resumes, list) and resumes and isinstance(resumes[-1], dict) else {}
    return last.get("command") or command or ""
