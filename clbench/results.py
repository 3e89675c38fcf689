"""The versioned schema of `results.json`: one document per run, written atomically.

A result holds everything needed to trust and reproduce a number: the suite (and its content
hash), the method and its resolved config, the model, the seed, library versions and the git
revision, the accuracy matrix R (row 0 = the base model, then one row per completed stage) with
the metadata of every column, the metrics with the variant each used, per-stage reports, drift,
artifacts and compute.

Versioning: `schema_version` is `MAJOR.MINOR`. A minor bump only adds fields, so a reader
accepts any newer minor version (it ignores the fields it does not know) and refuses an unknown
major version with a message saying what to upgrade. Documents of the version this code writes
are validated strictly, so a misspelt field is an error rather than silently dropped.

`account_compute` fills a run's compute (tokens, wall time summed over resumed sessions, device,
peak memory) as the run goes; `reset_peak_memory` starts a run's peak from what the process holds
when the run starts.
"""

from __future__ import annotations

import json
import math
import os
import platform
import subprocess
import sys
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from clbench import migrations
from clbench.atomic import atomic_write_json
from clbench.errors import UserError
from clbench.spec.reading import describe_validation_error
from clbench.spec.schema import NAME_PATTERN, RunSpec, SuiteSpec, entry_name
from clbench.text import printable

if TYPE_CHECKING:
    import torch

RESULTS_SCHEMA_VERSION = "1.6"  # 1.1: `joint`; 1.2: a cell's score may be null (undefined);
# 1.3: `method.git_revision`; 1.4: `addons`, no `drift` (always empty); 1.5: `defaults` of the
# method and of each add-on; 1.6: `examples`
RESULTS_FILENAME = "results.json"

RunStatus = Literal["complete", "partial", "failed", "collapsed"]
ColumnKind = Literal["stream", "ood", "general"]

# Distributions whose versions every result records (those not installed are left out).
_VERSIONED = ("clbench", "torch", "transformers", "accelerate", "datasets", "pydantic", "trl",
              "lm_eval", "numpy", "math-verify", "vllm")


class ResultsError(UserError):
    """A results file that cannot be read: missing, not JSON, invalid, or from a newer major."""


def _now() -> datetime:
    return datetime.now(UTC)


class Record(BaseModel):
    """Base of every part of a result: strict, except when reading a newer minor version."""

    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _drop_unknown_fields_of_newer_minor(cls, data: Any, info: ValidationInfo) -> Any:
        if isinstance(data, dict) and info.context and info.context.get("lenient"):
            return {k: v for k, v in data.items() if k in cls.model_fields}
        return data


class Column(Record):
    """One column of R: a stream task (trained in stage `stage`) or a held-out probe."""

    name: str = Field(pattern=NAME_PATTERN, description="As the suite names it (it names the "
                      "column's item files, so a results file cannot point outside its run).")
    kind: ColumnKind
    higher_is_better: bool = True
    stage: int | None = Field(default=None, ge=1, description="1-based stage that trains this "
                              "column; None for probes.")
    source: str = Field(description="Task source name, or `lm_eval:<task>` for lm-eval probes.")
    source_version: str | None = Field(default=None, description="The task source's `version` "
                                       "(None for an lm-eval probe, and where runs recorded "
                                       "before versions were did not record it: version 1).")

    @model_validator(mode="after")
    def _stage_iff_stream(self) -> Column:
        if (self.kind == "stream") != (self.stage is not None):
            raise ValueError("stream columns carry their stage index and probes carry none")
        return self


class Cell(Record):
    """One score of R: the mean over `n` items and its interval."""

    score: float | None = Field(description="A fraction in [0, 1]; null where the score is "
                                "undefined (an lm-eval probe that gave NaN).")
    n: int = Field(ge=0, description="Items behind the score.")
    ci_low: float | None = None
    ci_high: float | None = None

    @model_validator(mode="after")
    def _fractions(self) -> Cell:
        for name in ("score", "ci_low", "ci_high"):
            value = getattr(self, name)
            if value is not None and not 0.0 <= value <= 1.0:  # NaN fails too
                raise ValueError(f"{name} {value} is not a fraction in [0, 1] (null where "
                                 "undefined)")
        if self.ci_low is not None and self.ci_high is not None and self.ci_low > self.ci_high:
            raise ValueError(f"ci_low {self.ci_low} is above ci_high {self.ci_high}")
        return self


#: Bounds of `examples`: completions per column and characters per completion.
EXAMPLES_PER_COLUMN = 2
EXAMPLE_CHARS = 1500


class ExampleCompletion(Record):
    """One graded completion of the last row, as published beside the numbers."""

    id: str = Field(max_length=200)
    completion: str = Field(max_length=EXAMPLE_CHARS, description="The completion, cut to "
                            f"{EXAMPLE_CHARS} characters.")
    correct: bool


class MetricValue(Record):
    """A metric of the run; `value` is None where it is undefined (e.g. BWT with one stage)."""

    value: float | None
    variant: str | None = Field(default=None, description="Which published definition.")
    higher_is_better: bool = True
    note: str | None = Field(default=None, description="Why the value is undefined, if it is.")
    per_stage: list[float | None] | None = Field(default=None, description="Value after each "
                                                 "stage, for metrics defined per stage (OP).")


class StageRecord(Record):
    """What happened in one stage: the method's report summarised."""

    index: int = Field(ge=1)
    name: str
    summary: dict[str, float | None] = Field(default_factory=dict, description="Mean of each "
                                             "per-step metric over the stage.")
    counters: dict[str, int] = Field(default_factory=dict, description="Generated, trained "
                                     "and teacher tokens, and similar counts.")
    wall_time: dict[str, float] = Field(default_factory=dict, description="Seconds per phase.")
    extra: dict[str, Any] = Field(default_factory=dict)
    diagnostics: dict[str, Any] = Field(default_factory=dict, description="Measured after the "
                                        "stage: `weight_drift` (vs_base, vs_previous), "
                                        "`response_drift`, `artifacts` (per task column), "
                                        "`rollouts` (entropy, never-ended share), `distance` "
                                        "(per task column), `collapse` (reasons).")

    @field_validator("diagnostics")
    @classmethod
    def _shapes(cls, diagnostics: dict[str, Any]) -> dict[str, Any]:
        # what reports and the leaderboard read from them, as they read it
        for key, shape in DIAGNOSTIC_SHAPES.items():
            value = diagnostics.get(key)
            if value is not None and not isinstance(value, shape):
                raise ValueError(f"{key} should be a {'mapping' if shape is dict else 'list'}, "
                                 f"got {type(value).__name__}")
        for per_column in ("artifacts", "distance"):
            columns = diagnostics.get(per_column) or {}
            inner = columns.get("columns", {}) if per_column == "distance" else columns
            if not isinstance(inner, dict) or not all(isinstance(v, dict)
                                                      for v in inner.values()):
                raise ValueError(f"{per_column} should map each column to a mapping")
        return diagnostics


#: The shape of each diagnostic a stage record may hold (see `StageRecord.diagnostics`).
DIAGNOSTIC_SHAPES: dict[str, type] = {"weight_drift": dict, "response_drift": dict,
                                      "artifacts": dict, "rollouts": dict, "distance": dict,
                                      "collapse": list}


class MethodInfo(Record):
    """The method as run: its plugin name, where it came from and its full config."""

    name: str
    config: dict[str, Any] = Field(default_factory=dict, description="Resolved config, "
                                   "defaults included.")
    distribution: str | None = Field(default=None, description="The installed distribution "
                                     "the method came from.")
    version: str | None = Field(default=None, description="That distribution's version.")
    git_revision: str | None = Field(default=None, description="The commit of the git checkout "
                                     "holding the method's code (`+dirty` with local changes), "
                                     "if it is in one.")
    defaults: dict[str, Any] | None = Field(default=None, description="The method's config at "
                                            "its defaults, as its code had them: what tells the "
                                            "run's settings apart, read without the plugin.")


class AddOnInfo(Record):
    """A continual-learning add-on as run: its plugin name, where it came from, its config."""

    name: str
    config: dict[str, Any] = Field(default_factory=dict, description="Resolved config, "
                                   "defaults included.")
    distribution: str | None = None
    version: str | None = None
    git_revision: str | None = None
    defaults: dict[str, Any] | None = Field(default=None, description="The add-on's config at "
                                            "its defaults, as its code had them.")


class ModelInfo(Record):
    """The model as asked for and as actually loaded (path, dtype, parameter count, ...)."""

    spec: dict[str, Any]
    resolved: dict[str, Any] = Field(default_factory=dict)


class Compute(Record):
    """What the run cost."""

    tokens: dict[str, int] = Field(default_factory=dict, description="Generated, trained and "
                                   "teacher tokens over the whole run.")
    wall_time_s: float = Field(default=0.0, ge=0.0)
    device: str = ""
    peak_memory_bytes: int | None = None


class RunResult(Record):
    """The whole `results.json` of one run."""

    schema_version: str = RESULTS_SCHEMA_VERSION
    status: RunStatus
    error: str | None = Field(default=None, description="Why a failed run stopped.")
    suite: dict[str, Any] = Field(description="The suite as run (`SuiteSpec` dump).")
    suite_hash: str
    method: MethodInfo
    addons: list[AddOnInfo] = Field(default_factory=list, description="The add-ons on the "
                                    "method, in the order they composed.")
    model: ModelInfo
    seed: int
    joint: bool = Field(default=False, description="A joint reference run: one stage trained "
                        "on every stream task at once; R has the base row and that stage's.")
    versions: dict[str, str] = Field(default_factory=dict)
    git_revision: str | None = None
    created: datetime = Field(default_factory=_now)
    updated: datetime = Field(default_factory=_now)
    columns: list[Column]
    row_labels: list[str] = Field(default_factory=list)
    matrix: list[list[Cell | None]] = Field(default_factory=list, description="R: row 0 is the "
                                            "base model, row i is after stage i.")
    metrics: dict[str, MetricValue] = Field(default_factory=dict)
    stages: list[StageRecord] = Field(default_factory=list)
    artifacts: dict[str, Any] = Field(default_factory=dict)
    compute: Compute = Field(default_factory=Compute)
    examples: dict[str, list[ExampleCompletion]] = Field(
        default_factory=dict, description="Per column, a few graded completions of the last "
        f"row (at most {EXAMPLES_PER_COLUMN}: a right and a wrong one where both exist), so a "
        "published result shows what its numbers are made of.")

    @model_validator(mode="after")
    def _consistent_shape(self) -> RunResult:
        names = [c.name for c in self.columns]
        if len(set(names)) != len(names):
            raise ValueError(f"column names must be unique, got {names}")
        if len(self.row_labels) != len(self.matrix):
            raise ValueError(f"{len(self.matrix)} matrix rows but {len(self.row_labels)} row "
                             "labels")
        n_stages = sum(c.kind == "stream" for c in self.columns)
        if len(self.matrix) > n_stages + 1:
            raise ValueError(f"{len(self.matrix)} matrix rows for {n_stages} stages (at most "
                             "base + one per stage)")
        for i, row in enumerate(self.matrix):
            if len(row) != len(self.columns):
                raise ValueError(f"matrix row {i} has {len(row)} cells for {len(self.columns)} "
                                 "columns")
        for column, shown in self.examples.items():
            if column not in names or len(shown) > EXAMPLES_PER_COLUMN:
                raise ValueError(f"examples of {column!r}: at most {EXAMPLES_PER_COLUMN} "
                                 "completions of one of the run's columns")
        rows = 2 if self.joint else n_stages + 1
        if self.status == "complete" and len(self.matrix) != rows:
            raise ValueError(f"a complete run has {rows} rows of R (the base row and one per "
                             f"{'joint stage' if self.joint else 'stage'}), this one "
                             f"{len(self.matrix)}")
        return self

    def suite_spec(self) -> SuiteSpec:
        """The suite as a validated spec (fails for a suite of a newer suite schema)."""
        return SuiteSpec.model_validate(self.suite)

    def entry_name(self) -> str:
        """The method with its add-ons (`sdpo+ewc`), as tables and the leaderboard name it."""
        return entry_name(self.method.name, [a.name for a in self.addons])

    def score_matrix(self) -> list[list[float | None]]:
        """R as plain numbers (None for a cell not evaluated)."""
        return [[None if c is None else c.score for c in row] for row in self.matrix]


def columns_for_suite(suite: SuiteSpec, source_versions: dict[str, str] | None = None
                      ) -> list[Column]:
    """The columns of R for `suite`: its stages in order, then its probes; `source_versions`
    gives each task source's `version`."""
    versions = source_versions or {}
    cols = [Column(name=s.name, kind="stream", stage=i + 1, source=s.task.name,
                   source_version=versions.get(s.task.name))
            for i, s in enumerate(suite.stages)]
    for p in suite.probes:
        # a probe is validated to have either a task or an lm-eval task
        lm_eval_task = p.lm_eval.task if p.lm_eval else None
        source = p.task.name if p.task else f"lm_eval:{lm_eval_task}"
        cols.append(Column(name=p.name, kind=p.kind, source=source,
                           source_version=versions.get(source)))
    return cols


class CodeOrigin(Protocol):
    """Where a method's code came from (:class:`clbench.plugins.registry.Origin`)."""

    distribution: str | None
    version: str | None
    source_revision: str | None


def new_result(run: RunSpec, origin: CodeOrigin | None = None,
               source_versions: dict[str, str] | None = None,
               addon_origins: Sequence[CodeOrigin | None] = (),
               defaults: Sequence[dict[str, Any] | None] = ()) -> RunResult:
    """An empty `partial` result for `run`: provenance filled in (the method's from `origin`,
    each add-on's from `addon_origins`; the configs at their defaults, the method's then each
    add-on's, from `defaults`), no rows yet."""
    origins = list(addon_origins) or [None] * len(run.addons)
    defaults = list(defaults) or [None] * (1 + len(run.addons))
    return RunResult(
        status="partial",
        suite=run.suite.model_dump(mode="json"),
        suite_hash=run.suite.content_hash(),
        method=MethodInfo(name=run.method.name, config=dict(run.method.params),
                          distribution=origin.distribution if origin else None,
                          version=origin.version if origin else None,
                          git_revision=origin.source_revision if origin else None,
                          defaults=defaults[0]),
        addons=[AddOnInfo(name=a.name, config=dict(a.params),
                          distribution=o.distribution if o else None,
                          version=o.version if o else None,
                          git_revision=o.source_revision if o else None, defaults=d)
                for a, o, d in zip(run.addons, origins, defaults[1:], strict=True)],
        model=ModelInfo(spec=run.model.model_dump(mode="json")),
        seed=run.seed,
        joint=run.joint,
        versions=collect_versions(),
        git_revision=git_revision(),
        columns=columns_for_suite(run.suite, source_versions),
    )


def _finite_or_none(value: Any) -> Any:
    """NaN and infinity are not JSON; a diverged loss is recorded as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite_or_none(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite_or_none(v) for v in value]
    return value


def write_results(path: str | os.PathLike[str], result: RunResult) -> Path:
    """Stamp `updated` and the schema version this code writes (a resumed run's older document
    gains this version's fields), and write `result` atomically (non-finite floats become
    null)."""
    result.updated, result.schema_version = _now(), RESULTS_SCHEMA_VERSION
    return atomic_write_json(path, _finite_or_none(result.model_dump(mode="json")))


def _parse_version(text: Any) -> tuple[int, int] | None:
    if not isinstance(text, str):
        return None
    parts = text.split(".")
    if len(parts) != 2 or not all(p.isdigit() for p in parts):
        return None
    return int(parts[0]), int(parts[1])


#: The deepest nesting of objects and lists a results file may have (its own go about 8 deep).
MAX_RESULTS_DEPTH = 32


def _depth(data: Any) -> int:
    """How deep lists and objects nest in `data` (a scalar: 0), without recursion."""
    deepest, stack = 0, [(data, 1)]
    while stack:
        node, depth = stack.pop()
        children = node.values() if isinstance(node, dict) else node \
            if isinstance(node, list) else None
        if children is None:
            continue
        deepest = max(deepest, depth)
        if depth > MAX_RESULTS_DEPTH:
            break
        stack += [(child, depth + 1) for child in children]
    return deepest


#: The largest results file read (a run's own is a few hundred KB).
MAX_RESULTS_BYTES = 64 * 2**20


def read_results(path: str | os.PathLike[str]) -> RunResult:
    """Read a results file; refuses an unknown major version, accepts newer minor ones.

    The file is someone else's, perhaps: it must be a regular file (a FIFO would block the
    reader) of bounded size, JSON without NaN or infinity and without a key given twice; the
    control characters of its text (terminal escapes) are dropped, so nothing it holds reaches a
    terminal as more than text."""
    path = Path(path)
    try:
        if not path.is_file() and path.exists():
            raise ResultsError(f"{path}: not a regular file, so not a results file")
        if path.stat().st_size > MAX_RESULTS_BYTES:
            raise ResultsError(f"{path}: larger than {MAX_RESULTS_BYTES // 2**20} MiB, too large "
                               "to be a results file")
        data = json.loads(path.read_text(encoding="utf-8"), parse_constant=_no_constant,
                          object_pairs_hook=_unique_keys)
    except FileNotFoundError:
        raise ResultsError(f"{path}: no such results file") from None
    except (OSError, UnicodeDecodeError, ValueError) as exc:  # JSONDecodeError is one
        raise ResultsError(f"{path}: not a readable JSON results file: {exc}") from None
    except RecursionError:
        raise ResultsError(f"{path}: nested too deeply to be a results file") from None
    if not isinstance(data, dict):
        raise ResultsError(f"{path}: expected a JSON object, got {type(data).__name__}")
    if _depth(data) > MAX_RESULTS_DEPTH:
        raise ResultsError(f"{path}: nested more than {MAX_RESULTS_DEPTH} levels deep, too deep "
                           "to be a results file")
    found = _parse_version(data.get("schema_version"))
    ours = _parse_version(RESULTS_SCHEMA_VERSION)
    assert ours is not None
    if found is None:
        raise ResultsError(f"{path}: schema_version {data.get('schema_version')!r} is not of "
                           "the form MAJOR.MINOR; is this a clbench results file?")
    if found[0] != ours[0]:
        newer = "a newer" if found[0] > ours[0] else "an older"
        raise ResultsError(f"{path}: results schema version {found[0]}.{found[1]} is from "
                           f"{newer} clbench; this clbench reads {ours[0]}.x. Install a clbench "
                           f"that reads schema {found[0]}.x to use this file.")
    data = printable(data)
    try:
        return RunResult.model_validate(migrations.results(data),
                                        context={"lenient": found[1] > ours[1]})
    except ValidationError as err:
        hint = f"not part of results schema {RESULTS_SCHEMA_VERSION}"
        raise ResultsError(describe_validation_error(err, str(path),
                                                     unknown_field_hint=hint)) from None


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number a results file holds (clbench writes null)")


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"the key {key!r} is given twice in one object")
        out[key] = value
    return out


def collect_versions() -> dict[str, str]:
    """Versions of Python, the platform and the libraries that shape a result."""
    versions = {"python": platform.python_version(), "platform": platform.platform()}
    for dist in _VERSIONED:
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    torch = sys.modules.get("torch")  # only if already imported: this must stay cheap
    cuda = getattr(getattr(torch, "version", None), "cuda", None)
    if cuda:
        versions["cuda"] = str(cuda)
    return versions


def git_revision(folder: str | os.PathLike[str] | None = None) -> str | None:
    """The commit of the checkout holding clbench (`+dirty` if it has local changes), or None."""
    where = Path(folder) if folder is not None else Path(__file__).resolve().parent
    try:
        head = subprocess.run(["git", "-C", str(where), "rev-parse", "HEAD"],
                              capture_output=True, text=True, timeout=10, check=False)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(["git", "-C", str(where), "diff-index", "--quiet", "HEAD", "--"],
                               capture_output=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() + ("+dirty" if dirty.returncode == 1 else "")


# ---------------------------------------------------------------------------------------------
# A run's compute
# ---------------------------------------------------------------------------------------------

class Clock:
    """Seconds between readings, so wall time adds up across resumed sessions."""

    def __init__(self) -> None:
        self.last = time.monotonic()

    def lap(self) -> float:
        now = time.monotonic()
        elapsed, self.last = now - self.last, now
        return elapsed

    def peek(self) -> float:
        """Seconds since the last lap, without starting a new one."""
        return time.monotonic() - self.last


#: The run's time (and peak memory) since its last row of R was written, as of its last save point.
KEPT_TIME_FILE = "kept-time.json"


class KeptTime:
    """A run's wall time since its last row of R, kept at every save point (a step checkpoint,
    a trained stage, a column of the row in progress), so that a run resumed after a stop
    counts the work the stop did not throw away; the time after the last save point is lost
    with that work. The peak memory so far is kept beside it, for the same reason. Written by
    the main process only."""

    def __init__(self, run_dir: Path, rows: int, write: bool) -> None:
        self.path = run_dir / KEPT_TIME_FILE
        self.clock = Clock()
        self.write = write
        kept = self._kept(rows)
        self.carried = self._number(kept, "seconds")  # earlier sittings, for the row in progress
        #: The peak memory since the last row, of earlier sittings and this one's save points
        #: (0 if none): a sitting stopped without writing a row never put its peak into
        #: results.json.
        self.carried_peak = int(self._number(kept, "peak_memory_bytes"))

    def _kept(self, rows: int) -> dict[str, Any]:
        try:
            kept = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError):  # none kept, or unreadable: this sitting counts from now
            return {}
        if not isinstance(kept, dict) or kept.get("rows") != rows:
            return {}  # kept for a row written since, which counted it
        return kept

    @staticmethod
    def _number(kept: dict[str, Any], key: str) -> float:
        value = kept.get(key)
        return max(0.0, float(value)) if isinstance(value, (int, float)) else 0.0

    def saved(self, rows: int, peak_memory_bytes: int = 0) -> None:
        """A save point: what is saved now survives a stop, and so do its time and the peak
        memory so far."""
        self.carried_peak = max(peak_memory_bytes, self.carried_peak)
        if self.write:
            atomic_write_json(self.path, {"rows": rows,
                                          "seconds": self.carried + self.clock.peek(),
                                          "peak_memory_bytes": self.carried_peak})

    def lap(self) -> float:
        """The seconds to add to the run's wall time as a row is written."""
        elapsed, self.carried = self.carried + self.clock.lap(), 0.0
        self.carried_peak = 0  # the row's compute holds it now
        return elapsed


def peak_memory_kind(device: str) -> str:
    """What `compute.peak_memory_bytes` measures on `device` (see `account_compute`)."""
    return "GPU memory allocated" if device.startswith("cuda") else "resident memory"


def account_compute(result: RunResult, elapsed: float, device: torch.device) -> None:
    """Fill `result.compute`: tokens over all stages, wall time (`elapsed` added to what earlier
    sessions of the run took), device, peak memory (since :func:`reset_peak_memory`; the
    largest over the run's sessions)."""
    tokens: dict[str, int] = {}
    for st in result.stages:
        for k, v in st.counters.items():
            tokens[k] = tokens.get(k, 0) + int(v)
    result.compute.tokens = tokens
    result.compute.wall_time_s += elapsed
    result.compute.device = str(device)
    result.compute.peak_memory_bytes = max(peak_memory_bytes(device),
                                           result.compute.peak_memory_bytes or 0)


def peak_memory_bytes(device: torch.device) -> int:
    """The run's peak memory on `device` so far (since :func:`reset_peak_memory`): CUDA's
    allocated peak on a GPU, the process's resident high-water mark on a CPU."""
    import torch

    return int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" \
        else resident_peak_bytes()


def reset_peak_memory(device: torch.device) -> bool:
    """Measure peak memory from here on (called as a run starts): a process that runs several
    runs one after another (an in-process sweep) would otherwise report for each the peak of
    the largest run before it. On a CPU this resets Linux's high-water mark of resident memory
    (`/proc/self/clear_refs`) to what the process holds now. False where it cannot be done (no
    /proc: the peak stays the process's since it started)."""
    import torch

    if device.type == "cuda":
        if torch.cuda.is_initialized():  # else nothing was allocated yet, and resetting raises
            torch.cuda.reset_peak_memory_stats(device)
        return True
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def resident_peak_bytes() -> int:
    """The process's peak resident memory since it started or since :func:`reset_peak_memory`:
    Linux's high-water mark, or `getrusage` where there is no /proc."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    import resource

    peak = int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB elsewhere
