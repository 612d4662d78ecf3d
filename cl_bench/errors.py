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
