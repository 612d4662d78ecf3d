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


def program() -> str:
    """How to call cl-bench again from here, for the commands messages suggest:
    `cl-bench` where that name on PATH is the program running, else the path it was
    started by (`.venv/bin/cl-bench` after `make main`, which does not activate the venv)."""
    import os
    import shutil
    import sys

    started = sys.argv[0] if sys.argv else ""
    if os.path.basename(started) != "cl-bench":  # python -m cl_bench.cli, or a test
        return "cl-bench"
    found = shutil.which("cl-bench")
    if found and os.path.exists(started) and os.path.samefile(found, started):
        return "cl-bench"
    here = os.path.relpath(os.path.abspath(started))
    return here if not here.startswith("..") and os.sep in here else os.path.abspath(started)
