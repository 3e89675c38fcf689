"""User-facing errors: the one exception type the CLI turns into a message and exit status 2.

Anything a user can get wrong (a suite field, an override, an unknown plugin name, a results file
from a newer clbench) raises a subclass of :class:`UserError` whose message alone says what to
fix. Everything else is a bug and keeps its traceback.

A stop request is not an error: Ctrl-C raises KeyboardInterrupt, and :func:`terminate_as_interrupt`
makes SIGTERM (what schedulers and `kill` send) raise :class:`Terminated`, a KeyboardInterrupt, so
both take the same path: what is complete is saved and the run says how to resume.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

#: Exit status of the CLI for a user mistake (click uses 2 for usage errors too).
USER_ERROR_EXIT_CODE = 2


class UserError(Exception):
    """A mistake the user can fix; its message is shown without a traceback."""

    exit_code: int = USER_ERROR_EXIT_CODE


class Terminated(KeyboardInterrupt):
    """SIGTERM arrived; handled like Ctrl-C, with the exit status of a SIGTERM (128 + 15)."""

    exit_code = 128 + signal.SIGTERM


@contextmanager
def terminate_as_interrupt() -> Iterator[None]:
    """While inside, SIGTERM raises :class:`Terminated` in the main thread (elsewhere: no-op)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: object) -> None:
        raise Terminated()

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
