"""Generic adapter from a Hugging Face dataset (or a local file in its record format) to examples.

A hub source names its dataset (`hub_path`, optional config `hub_name`), says how the dataset's
own splits map onto clbench's train/eval (:class:`SplitPolicy`), and turns one record into a
:class:`HubItem` (:meth:`HubSource.to_item`). This module does the rest: loading with
`datasets.load_dataset(path, name, split=..., revision=...)`, or from local files when
`params.data_files` is set (how the tests run, offline), deterministic train/eval assignment,
seeded selection, and clear errors when a dataset cannot be reached.
"""

from __future__ import annotations

import hashlib
from abc import abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import Field

from clbench.errors import UserError
from clbench.tasks.base import (
    Example,
    Messages,
    Split,
    TaskParams,
    TaskSource,
    seeded_rng,
    split_of,
)

#: How a dataset's splits become clbench's: `native` uses the dataset's own train/eval splits,
#: `hash` assigns each record of one split by a hash of its key, `eval_only` makes every record
#: an eval item (benchmarks such as AIME that must never be trained on).
SplitPolicy = Literal["native", "hash", "eval_only"]


class HubDataError(UserError):
    """A hub dataset (or its local copy) cannot be loaded or has no usable records."""


class HubParams(TaskParams):
    """Where a hub source reads its records from."""

    data_files: str | list[str] | dict[str, str | list[str]] | None = Field(
        default=None, description="Local JSON/JSONL/Parquet/CSV file(s) in the dataset's record "
        "format; when set nothing is downloaded. A mapping {train: ..., eval: ...} gives each "
        "split its own files; otherwise records are assigned by the source's split policy.")
    path: str | None = Field(default=None, description="Override of the hub dataset id (e.g. a "
                             "mirror with the same record format).")
    name: str | None = Field(default=None, description="Dataset configuration (subset); the "
                             "source's default when unset.")
    revision: str | None = Field(default=None, description="Dataset revision (branch, tag or "
                                 "commit) for reproducible runs.")
    eval_fraction: float = Field(default=0.2, gt=0.0, lt=1.0, description="Share of records "
                                 "that hash-assigned splits put in eval.")
    reveal_answer_in_feedback: bool = Field(default=False, description="Let the grader's "
                                            "feedback state the gold answer.")


@dataclass(frozen=True)
class HubItem:
    """One usable record: a stable key (for splits and ids), the question, the gold answer."""

    key: str
    question: str
    answer: Any
    reference: str
    metadata: dict[str, Any] = field(default_factory=dict)


_CACHE: dict[tuple, list[dict[str, Any]]] = {}


def _file_format(path: str) -> str:
    suffix = Path(path).suffix.lower()
    if suffix in (".json", ".jsonl"):
        return "json"
    if suffix in (".parquet", ".csv"):
        return suffix[1:]
    raise HubDataError(f"{path}: unsupported data file type {suffix or '(none)'}; use JSON, "
                       "JSONL, Parquet or CSV")


def load_records(path: str | None, name: str | None, split: str, revision: str | None,
                 data_files: str | list[str] | None = None) -> list[dict[str, Any]]:
    """Records of one split, from local `data_files` (all of them one split) or the hub."""
    if data_files is None:
        return load_split(path, name, split, revision)
    files = [data_files] if isinstance(data_files, str) else list(data_files)
    for f in files:
        if not Path(f).is_file():
            raise HubDataError(f"data file {f} does not exist")
    return load_split(_file_format(files[0]), None, "train", None, files)


def load_split(path: str | None, name: str | None, split: str, revision: str | None,
               data_files: Any = None) -> list[dict[str, Any]]:
    """Records of `split` (in `datasets`' split syntax, `train[:80%]`) of a hub dataset, or with
    `data_files` of local files read by the `datasets` builder `path` (`json`, `csv`,
    `parquet`); cached per process."""
    cache_key = (path, name, split, revision, repr(data_files))
    if cache_key in _CACHE:
        return _CACHE[cache_key]
    import datasets

    try:
        if data_files is not None:
            ds = datasets.load_dataset(path, data_files=data_files, split=split)
        else:
            ds = datasets.load_dataset(path, name, split=split, revision=revision)
    except Exception as exc:
        where = f"local files {data_files}" if data_files is not None else (
            f"hub dataset {path}" + (f" ({name})" if name else ""))
        raise HubDataError(
            f"cannot load split {split!r} of {where}: {type(exc).__name__}: {str(exc)[:300]}. "
            "Hub datasets need network access (and may need `huggingface-cli login`); offline, "
            "point the task's `data_files` parameter at a local copy in the same record "
            "format.") from None
    records = [dict(r) for r in ds]
    _CACHE[cache_key] = records
    return records


def stable_key(*parts: Any) -> str:
    """A short hex key from record fields (for datasets without an id column)."""
    return hashlib.sha256("\x1f".join(str(p) for p in parts).encode()).hexdigest()[:16]


class HubSource(TaskSource):
    """Base of hub-backed sources. Subclasses set the `hub_*` attributes and implement
    :meth:`to_item`, :meth:`messages` and :meth:`grade`."""

    origin = "hub"
    Params: ClassVar[type[TaskParams]] = HubParams
    hub_path: ClassVar[str]
    hub_name: ClassVar[str | None] = None
    split_policy: ClassVar[SplitPolicy] = "hash"
    #: hub split names: for `native` both train and eval; for `hash`/`eval_only` only "source".
    hub_splits: ClassVar[dict[str, str]] = {"source": "train"}

    params: HubParams

    @abstractmethod
    def to_item(self, record: dict[str, Any]) -> HubItem | None:
        """Turn one record into an item; None skips it (e.g. another level or type)."""

    @abstractmethod
    def messages(self, item: HubItem) -> Messages:
        """The chat prompt of one item."""

    # -----------------------------------------------------------------------------------------

    def _records(self, which: str) -> list[dict[str, Any]]:
        p = self.params
        files = p.data_files
        if isinstance(files, dict):
            if which not in files:
                raise HubDataError(f"{self.name}: data_files has no {which!r} entry (keys: "
                                   f"{', '.join(sorted(files))})")
            files = files[which]
        return load_records(p.path or self.hub_path, p.name or self.hub_name,
                            self.hub_splits.get(which, which), p.revision, files)

    def items(self, split: Split) -> list[HubItem]:
        """All usable items of `split`, in record order, duplicates (same key) dropped."""
        p = self.params
        # Per-split files and native splits give the split directly; otherwise one source split
        # is divided by the policy.
        per_split = isinstance(p.data_files, dict) or self.split_policy == "native"
        records = self._records(split if per_split else "source")
        policy = None if per_split else self.split_policy
        out: list[HubItem] = []
        seen: set[str] = set()
        for record in records:
            item = self.to_item(record)
            if item is None or item.key in seen:
                continue
            if policy == "eval_only" and split != "eval":
                continue
            if policy == "hash" and split_of(item.key, p.eval_fraction) != split:
                continue
            seen.add(item.key)
            out.append(item)
        return out

    def build(self, split: Split, seed: int, size: int) -> list[Example]:
        """A seeded sample of `size` items (all of them, shuffled, if fewer exist)."""
        items = self.items(split)
        if not items and size > 0:
            if self.split_policy == "eval_only" and split == "train":
                raise HubDataError(f"{self.name} is an evaluation-only benchmark; it has no train "
                                   "split (use it as a probe, or train on another source)")
            raise HubDataError(f"{self.name}: no usable {split} records (check the dataset's "
                               "configuration and the source's filters)")
        rng = seeded_rng(self.name, self.params.draw_key(), split, seed)
        chosen = rng.sample(items, min(size, len(items)))
        return [Example(id=f"{self.name}:{it.key}", messages=self.messages(it),
                        reference=it.reference, answer=it.answer,
                        metadata={"source": self.params.path or self.hub_path, **it.metadata})
                for it in chosen]
