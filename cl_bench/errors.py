"""The one exception type the CLI turns into a clean one-line message and exit code 2."""


class UserError(Exception):
    """Bad input from the user: a file, a field, a name. The message says what,
    where and how to fix it; the CLI prints it without a traceback."""
