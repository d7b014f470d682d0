"""User-facing errors: one line that says what was expected, what was found and what to do.

The CLI catches `SpecdecError` and prints its message without a traceback; anything else is a bug
and keeps its traceback.
"""


class SpecdecError(Exception):
    """An error caused by the user's input or environment, explained in one line."""

    exit_code = 2


class IncompatibleDrafter(SpecdecError):
    """A drafter that does not fit the target it is paired with."""
