"""User-facing errors: the one exception type the CLI turns into a message and exit status 2.

Anything a user can get wrong (a suite field, an override, an unknown plugin name, a results file
from a newer clbench) raises a subclass of :class:`UserError` whose message alone says what to
fix. Everything else is a bug and keeps its traceback.
"""

from __future__ import annotations

#: Exit status of the CLI for a user mistake (click uses 2 for usage errors too).
USER_ERROR_EXIT_CODE = 2


class UserError(Exception):
    """A mistake the user can fix; its message is shown without a traceback."""

    exit_code: int = USER_ERROR_EXIT_CODE
