"""Text read from files, made safe to show: what a suite, a results file or a task's items hold
reaches a terminal as text, never as control sequences (an escape that retitles the window,
moves the cursor or clears the screen)."""

from __future__ import annotations

import re
from typing import Any

#: Control characters dropped from text read from a file (tab and newline are kept).
CONTROL_CHARACTERS = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def printable(data: Any) -> Any:
    """`data` with the control characters of every string (mapping keys too) removed."""
    if isinstance(data, str):
        return CONTROL_CHARACTERS.sub("", data)
    if isinstance(data, dict):
        return {printable(k): printable(v) for k, v in data.items()}
    if isinstance(data, list):
        return [printable(v) for v in data]
    return data
