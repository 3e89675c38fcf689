"""Where a run's random numbers come from: seeds derived from stable hashes, and RNG snapshots.

Every stage re-seeds Python, NumPy and torch from (run seed, stage index), sampled evaluation
from (run seed, row, column, batch), bootstrap intervals from (column, row): a resumed run draws
exactly what an uninterrupted one draws. `rng_states` snapshots the generators into a checkpoint and
`set_rng_states` puts such a snapshot back (a stage continued from its middle).
"""

from __future__ import annotations

import hashlib
import random
from typing import Any

MAX_SEED = 2**32 - 1  # largest |run seed|: it is hashed into 31-bit seeds, or given to torch


def derive_seed(*parts: Any) -> int:
    """A 31-bit seed from a stable hash of `parts` (independent of PYTHONHASHSEED)."""
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:4], "big") >> 1


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (all devices)."""
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def rng_states() -> dict[str, Any]:
    """The current state of every generator (Python, NumPy, torch CPU and CUDA), as tensors and
    plain Python values only (a checkpoint then loads with `weights_only=True`)."""
    import numpy as np
    import torch

    name, keys, position, has_gauss, gauss = np.random.get_state()
    states: dict[str, Any] = {"python": random.getstate(),
                              "numpy": (name, keys.tolist(), position, has_gauss, gauss),
                              "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def set_rng_states(states: dict[str, Any]) -> None:
    """Restore what :func:`rng_states` returned (CUDA only where it was recorded and exists)."""
    import numpy as np
    import torch

    random.setstate(states["python"])
    name, keys, *rest = states["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), *rest))
    torch.set_rng_state(states["torch"].cpu())  # torch takes CPU byte tensors only
    if "cuda" in states and torch.cuda.is_available():  # the devices visible now, in order
        for index, state in enumerate(states["cuda"][:torch.cuda.device_count()]):
            torch.cuda.set_rng_state(state.cpu(), index)
