"""User-facing errors: the one exception type the CLI turns into a message and exit status 2.

Anything a user can get wrong (a suite field, an override, an unknown plugin name, a results file
from a newer clbench) raises a subclass of :class:`UserError` whose message alone says what to
fix. Everything else is a bug and keeps its traceback.

A stop request is not an error: Ctrl-C raises KeyboardInterrupt, and :func:`terminate_as_interrupt`
makes SIGTERM (what schedulers and `kill` send) raise :class:`Terminated`, a KeyboardInterrupt, so
both take the same path: what is complete is saved and the run says how to resume.
:func:`hangup_as_termination` does the same for SIGHUP, and :func:`stops_deferred` holds all
three back over a step that must not be cut in two (starting a child process and recording it).
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
    #: False for messages every process of a multi-process run raises alike (a stop): only the
    #: main process prints them. Other errors may be one rank's own, so every rank prints.
    every_rank: bool = True


class RunFailed(UserError):
    """A run stopped by what happened in it, not by its input: a loss that diverged to NaN, a
    method plugin that raised. The message says where; the run is marked failed with its
    completed rows kept. Exit status 1."""

    exit_code = 1


class Terminated(KeyboardInterrupt):
    """SIGTERM arrived; handled like Ctrl-C, with the exit status of a SIGTERM (128 + 15)."""

    exit_code = 128 + signal.SIGTERM


def stop_of(exc: KeyboardInterrupt) -> tuple[str, int]:
    """How a stop request is named to the user, and the exit status it ends with: Ctrl-C is
    `("interrupted", 130)`, SIGTERM (or SIGHUP) `("terminated", 143)`: the shell's 128 + signal."""
    if isinstance(exc, Terminated):
        return "terminated", Terminated.exit_code
    return "interrupted", 128 + signal.SIGINT


_stop_requests = [0]  # Ctrl-C, SIGTERM and SIGHUP received under terminate_as_interrupt


def stop_requests() -> int:
    """How many stop requests have arrived so far: code that gets control back from a plugin
    compares it with the count before, to find a stop the plugin caught and went on from."""
    return _stop_requests[0]


def _raise_terminated(signum: int, frame: object) -> None:
    _stop_requests[0] += 1
    raise Terminated()


def _raise_interrupted(signum: int, frame: object) -> None:
    _stop_requests[0] += 1
    raise KeyboardInterrupt


@contextmanager
def terminate_as_interrupt() -> Iterator[None]:
    """While inside, SIGTERM raises :class:`Terminated` in the main thread (elsewhere: no-op),
    and every stop request is counted (:func:`stop_requests`; Ctrl-C too, where Python's own
    handler has it)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    interrupt = signal.getsignal(signal.SIGINT)
    if interrupt is signal.default_int_handler:
        signal.signal(signal.SIGINT, _raise_interrupted)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
        if interrupt is signal.default_int_handler:
            signal.signal(signal.SIGINT, interrupt)


@contextmanager
def hangup_as_termination() -> Iterator[None]:
    """While inside, SIGHUP (the terminal closed) raises :class:`Terminated` like SIGTERM, e.g.
    for a process whose children run in their own session and would not get the hangup
    themselves. Left alone when SIGHUP is ignored (nohup) or handled by someone else, and
    outside the main thread."""
    if threading.current_thread() is not threading.main_thread() \
            or signal.getsignal(signal.SIGHUP) != signal.SIG_DFL:
        yield
        return
    signal.signal(signal.SIGHUP, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGHUP, signal.SIG_DFL)


@contextmanager
def stops_deferred() -> Iterator[None]:
    """While inside, Ctrl-C, SIGTERM and SIGHUP wait: their handlers run when the block ends.
    Only handlers that raise (Python functions) are deferred; a signal that kills or is ignored
    is left alone. A no-op outside the main thread, where no handler runs."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[int] = []
    previous = {}
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        handler = signal.getsignal(sig)
        if callable(handler):
            previous[sig] = handler
            signal.signal(sig, lambda signum, frame: pending.append(signum))
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for sig in dict.fromkeys(pending):
            previous[sig](sig, None)  # raises, as it would have inside the block
