"""The add-on contract: a continual-learning technique that composes with any method.

A method says how a step's loss is made (SFT, GRPO, SDPO, ...). An add-on is registered in the
`clbench.addons` entry-point group and acts on the same :class:`~clbench.train.loop.TrainingLoop`
through the one hook protocol, :class:`~clbench.train.loop.TrainingHooks`, after the method's own
hooks: it may choose or mix the items of a step (replay), add a term to every micro-batch's loss
(EWC, LwF), act at the start and end of a stage (a Fisher estimate, merging weights) and keep
state. Several add-ons of one run compose in the order the run lists them.

One add-on object lives for the whole run: what it keeps across stages simply stays on it.
Its :meth:`~clbench.train.loop.TrainingHooks.state_dict` must hold all of it: it is saved with
every stage's checkpoint (and restored before the next stage starts when a run resumes) and with
every checkpoint in the middle of a stage (restored after `on_stage_start` of the continued
stage). A run resumed at any point so trains exactly as an uninterrupted one.
"""

from __future__ import annotations

from typing import ClassVar

from pydantic import BaseModel, ConfigDict

from clbench.train.loop import TrainingHooks


class AddOnConfig(BaseModel):
    """Base of every add-on's config. Fields must carry descriptions (they are the CLI help)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


class AddOn(TrainingHooks):
    """A continual-learning add-on plugin (see the module docstring)."""

    name: ClassVar[str]
    description: ClassVar[str]
    Config: ClassVar[type[AddOnConfig]] = AddOnConfig
    #: Whether it trains correctly when the student is sharded (FSDP2): it reads and writes
    #: only what `loop.train_model` holds. A sharded launch refuses an add-on whose own class
    #: does not set it, as it refuses such a method.
    supports_sharding: ClassVar[bool] = False

    def __init__(self, config: AddOnConfig | dict | None = None) -> None:
        if not isinstance(config, AddOnConfig):
            config = self.Config.model_validate(config or {})
        self.config = config
