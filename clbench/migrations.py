"""Reading what earlier versions of clbench wrote: every migration, in one place.

Files outlive the code that wrote them: results files arrive from other people's runs, run
folders are resumed after an upgrade. Everything that reads such a file passes it through a
function here first, so that the rest of clbench (the method API, the schemas, the reports) knows
only the current format.
"""

from __future__ import annotations

from typing import Any


def progress_state(progress: dict[str, Any]) -> dict[str, Any]:
    """A step checkpoint's training-loop progress in the current form: the hooks' states under
    `hooks` (`method`, `addons`). Before add-ons existed the method's hooks' state was kept
    under `objective`."""
    if "hooks" not in progress and "objective" in progress:
        progress = dict(progress)
        progress["hooks"] = {"method": progress.pop("objective"), "addons": []}
    return progress
