"""Copies of the student that hooks keep: a frozen copy of the whole model (SDPO's teacher,
GRPO's KL reference, LwF's stage-start model), a snapshot of its parameters (EWC's anchor, the
weights a stage started from), and the state of a copy for a checkpoint."""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def frozen_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of `model` in eval mode whose parameters take no gradient. Of a model with a LoRA
    adapter (:mod:`clbench.adapters`) only the adapters are copied: the frozen base weights are
    shared with the student, which never changes them while a stage trains (an in-place update
    of a shared weight by itself, an EMA or a refresh, leaves it exactly as it is)."""
    from clbench.adapters import is_adapted

    memo: dict[int, object] = {}
    if is_adapted(model):
        memo = {id(p): p for p in model.parameters() if not p.requires_grad}
    frozen = copy.deepcopy(model, memo)
    frozen.eval()
    frozen.requires_grad_(False)
    return frozen


def parameter_snapshot(model: torch.nn.Module, trainable_only: bool = False
                       ) -> dict[str, torch.Tensor]:
    """Each parameter's current value, by name, detached and on its device (with
    `trainable_only`, those that take a gradient)."""
    return {name: p.detach().clone() for name, p in model.named_parameters()
            if p.requires_grad or not trainable_only}


def module_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """`module.state_dict()` copied to the CPU: what a checkpoint keeps of a frozen copy."""
    return {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}
