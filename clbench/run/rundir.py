"""The run directory: what identifies a run, refusing a folder that holds another, checkpoints.

`run.json` holds the identity (the suite and its hash, method and config, model, seed); a fresh
run needs an empty folder and `--resume` needs this very run, so results are never overwritten by
another. The identity is compared as the current schemas read it: a field that a newer clbench
added, at its default, does not make a run folder from before "another run" (a new field's
default keeps the old behaviour), while any value that differs still does, named by its path.
`checkpoints/stage{t}/` holds the student, the method's state and the RNG states of the last
stage trained (written as soon as it is trained, before its row is evaluated);
`checkpoints/stage{t}-step{k}/` the same after k optimizer steps of a stage in progress, with the
method's progress (optimizer, schedule, ...). Both are written into a temp folder and renamed
into place.
"""

from __future__ import annotations

import contextlib
import json
import logging
import pickle
import re
import shlex
import shutil
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from clbench import migrations
from clbench.atomic import (
    atomic_dir,
    atomic_write_json,
    lock_is_held,
    os_errors_of,
    try_file_lock,
)
from clbench.errors import UserError
from clbench.models import absolute_model_name
from clbench.results import RESULTS_FILENAME, RunResult, read_results
from clbench.seeding import rng_states
from clbench.spec.schema import MEASURED_EXCLUDES, ModelSpec, RunSpec, SuiteSpec

if TYPE_CHECKING:
    from clbench.train.addons import AddOn
    from clbench.train.api import Method

IDENTITY_FILE = "run.json"
#: Locked (flock) by the process that runs the run, so a second one is refused.
LOCK_FILE = ".running"
#: The student's weights in a checkpoint (state dict only; see clbench.run.model_export).
STUDENT_WEIGHTS = "student.safetensors"


class RunDirError(UserError):
    """The run directory holds something this run must not overwrite."""


# ---------------------------------------------------------------------------------------------
# Run directory: identity and refusal
# ---------------------------------------------------------------------------------------------

def run_identity(run: RunSpec) -> dict[str, Any]:
    """What makes two runs the same run: suite content, method and config (the config in
    force: :func:`clbench.plugins.runspec.build_run_spec` records it whole), add-ons and
    theirs, model, seed."""
    identity = {"suite": run.suite.name, "suite_hash": run.suite.content_hash(),
                "suite_spec": run.suite.model_dump(mode="json"),
                "method": run.method.name, "method_config": run.method.params,
                "model": run.model.model_dump(mode="json"), "seed": run.seed}
    # only when there are some: the identities of runs made before these existed match
    if run.addons:
        identity["addons"] = [a.model_dump(mode="json") for a in run.addons]
    if run.joint:
        identity["joint"] = True
    return identity


def current_reading(identity: dict[str, Any], run_dir: Path | None = None,
                    stored: bool = True) -> dict[str, Any]:
    """`identity` as the current schemas read it: suite, model and method config re-validated,
    so fields added since it was written appear at their defaults; a `stored` identity (one
    written by a run) goes through :mod:`clbench.migrations` first. A part that no longer
    validates is kept as written (it then differs, which is the truth)."""
    from pydantic import ValidationError

    out = dict(identity)
    suite = identity.get("suite_spec")
    if stored and suite is None and run_dir is not None:
        suite = migrations.identity_suite(identity, _recorded_suite(run_dir))
    if stored:
        suite = migrations.suite(suite)
    if isinstance(suite, dict):
        try:
            spec = SuiteSpec.model_validate(suite)
            out["suite_spec"] = spec.model_dump(mode="json", exclude=MEASURED_EXCLUDES)
            out["suite_hash"] = spec.content_hash()
        except ValidationError:
            out["suite_spec"] = suite
    recorded = identity.get("model")
    out["model"] = model_as_read(migrations.model(recorded) if stored else recorded)
    out["method_config"] = method_config_as_read(identity.get("method", ""),
                                                 identity.get("method_config"), stored)
    return out


def _recorded_suite(run_dir: Path) -> Any:
    """The suite as the run's results.json holds it, if it can be read."""
    if not (run_dir / RESULTS_FILENAME).is_file():
        return None
    try:
        return read_results(run_dir / RESULTS_FILENAME).suite
    except UserError:
        return None


def model_as_read(spec: Any) -> Any:
    """A recorded model spec as the current schema reads it (fields added since at their
    defaults). Runs recorded a local folder as given, relative to where they ran, before it was
    recorded absolute: it is read from here, as resuming from there always did. As written when
    it no longer validates."""
    from pydantic import ValidationError

    try:
        model = ModelSpec.model_validate(spec)
    except ValidationError:
        return spec
    model.name = absolute_model_name(model.name)
    return model.model_dump(mode="json")


def method_config_as_read(name: str, config: Any, stored: bool = True) -> Any:
    """A method config as the installed method reads it: every field, those added since at
    their defaults or, for a `stored` config (written by a run), as :mod:`clbench.migrations`
    reads it (at the value that does what the run did). As written when the method is not
    installed or no longer takes it."""
    from clbench.plugins import registry

    try:
        if stored:
            config = migrations.method_config(name, config)
        return registry.validate_method_params(name, config).model_dump(mode="json")
    except UserError:  # an unknown method or a config it no longer takes
        return config


def check_run_dir(run_dir: Path, identity: dict[str, Any], resume: bool,
                  locked_by_us: bool = False) -> RunResult | None:
    """Refuse a directory of another run; return the existing result when resuming.

    Fresh start: the directory must be absent or empty. Resume: it must hold this very run
    (same suite, method config, model and seed, as the current schemas read them) or be empty.
    `locked_by_us`: this run already holds the folder's lock (a held lock is then not taken
    for another process running it).
    """
    id_file = run_dir / IDENTITY_FILE
    if not run_dir.exists() or not any(p.name != LOCK_FILE for p in run_dir.iterdir()):
        return None
    if not id_file.is_file():
        raise RunDirError(f"{run_dir} is not empty and holds no clbench run ({IDENTITY_FILE} "
                          "missing); choose another --out")
    try:
        stored = json.loads(id_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        stored = exc
    if not isinstance(stored, dict):
        why = stored if isinstance(stored, Exception) else "not a JSON object"
        raise RunDirError(f"{id_file} is damaged ({why}), so {run_dir} cannot be told apart from "
                          "another run; restore it or choose another --out")
    found = current_reading(stored, run_dir)
    # The suite is compared field by field when both sides have it, else by its hash alone.
    drop = "suite_hash" if "suite_spec" in found else "suite_spec"
    diffs = _differences({k: v for k, v in found.items() if k != drop},
                         {k: v for k, v in current_reading(identity, stored=False).items()
                          if k != drop})
    if diffs:
        diffs = _as_typed(diffs)
        detail = "; ".join(f"{path}: {_short(there)} there, {_short(now)} now"
                           for path, there, now in diffs[:4])
        more = f" and {len(diffs) - 4} more" if len(diffs) > 4 else ""
        hint = "" if locked_by_us else _start_over_hint(run_dir)
        raise RunDirError(f"{run_dir} holds another run ({detail}{more}); "
                          f"{_sets_hint(stored, diffs)}{hint}choose another --out")
    if not resume:
        if not locked_by_us and run_is_live(run_dir):
            # "pass --resume" would only lead to the lock's refusal
            raise RunDirError(f"another clbench process is running this run in {run_dir} right "
                              "now; let it finish, or choose another --out")
        raise RunDirError(f"{run_dir} already holds this run; pass --resume to continue it (or "
                          "print its results with `clbench report`), or choose another --out")
    path = run_dir / RESULTS_FILENAME
    return read_results(path) if path.is_file() else None


class ClaimedFolder:
    """A run folder this process holds (see :func:`claimed_run_folder`): `previous` is the run's
    result so far (None for a fresh run); :meth:`start` marks it as this run's."""

    def __init__(self, run_dir: Path, previous: RunResult | None, main: bool) -> None:
        self.run_dir, self.previous, self.main = run_dir, previous, main
        self.log_handler: logging.Handler | None = None

    @property
    def started(self) -> bool:
        return self.log_handler is not None

    def start(self, identity: dict[str, Any]) -> None:
        """Write the run's identity and log to its `run.log` (the main process): from here on
        the folder holds this run."""
        if not self.main:
            return
        atomic_write_json(self.run_dir / IDENTITY_FILE, identity)
        handler = logging.FileHandler(self.run_dir / "run.log", encoding="utf-8")
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        root = logging.getLogger("clbench")
        root.addHandler(handler)
        root.setLevel(min(root.level or logging.INFO, logging.INFO))
        self.log_handler = handler


@contextlib.contextmanager
def claimed_run_folder(run_dir: Path, identity: dict[str, Any], resume: bool,
                       dist: Any) -> Iterator[ClaimedFolder]:
    """Hold `run_dir` for this run: refused when it holds another run (or this one without
    `resume`); created and locked by the main process (every process is told a refusal); read
    again under the lock, since a process that held it may have finished the run since. On
    leaving, the log is detached and the lock released; a folder the run never started in
    (:meth:`ClaimedFolder.start`) is removed again, so a corrected command can use it."""
    created = first_missing_folder(run_dir)  # what locking creates, removed if unused
    lock, refusal = None, None
    if dist.is_main:
        try:
            lock = lock_run_dir(run_dir)
        except RunDirError as exc:
            refusal = str(exc)
        except OSError as exc:  # e.g. a read-only folder: said to every rank, none left waiting
            refusal = (f"cannot create or lock the run folder {run_dir} "
                       f"({exc.strerror or exc}); choose another --out")
    refusal = dist.broadcast(refusal)
    if refusal is not None:
        raise RunDirError(refusal)
    folder = ClaimedFolder(run_dir, None, dist.is_main)
    try:
        folder.previous = check_run_dir(run_dir, identity, resume, locked_by_us=True)
        dist.wait()
        yield folder
    finally:
        if folder.log_handler is not None:
            logging.getLogger("clbench").removeHandler(folder.log_handler)
            folder.log_handler.close()
        if lock is not None:
            if not folder.started:  # stopped before it held anything: leave no trace
                release_unused_run_dir(run_dir, created)
            lock.close()


def lock_run_dir(run_dir: Path) -> IO[str]:
    """Create `run_dir` and lock it for this process (released when the returned file is closed
    or the process dies). Refuses a directory another process is running a run in: two
    processes resuming one run would write over each other's stages."""
    run_dir.mkdir(parents=True, exist_ok=True)
    handle = try_file_lock(run_dir / LOCK_FILE)
    if handle is None:
        raise RunDirError(f"another clbench process is running the run in {run_dir} right now; "
                          "let it finish (or stop it) before resuming, or choose another --out")
    return handle


def run_is_live(run_dir: Path) -> bool:
    """Whether a process is running the run in `run_dir` now (it holds the folder's lock)."""
    return lock_is_held(run_dir / LOCK_FILE)


def _start_over_hint(run_dir: Path) -> str:
    """The way out when a refused folder provably holds nothing worth keeping: a run that
    failed or stopped before completing a stage (its row 0 is cached, see baserow), no
    checkpoint, and no process running it. Anything unclear (unreadable results, a results
    schema from another version) gets no such suggestion."""
    if run_is_live(run_dir) or any((run_dir / "checkpoints").glob("stage*")):
        return ""
    status = "partial"
    if (run_dir / RESULTS_FILENAME).exists():
        try:
            result = read_results(run_dir / RESULTS_FILENAME)
        except UserError:
            return ""
        if result.status == "complete" or len(result.matrix) > 1:
            return ""
        status = result.status
    return (f"it is {'a failed' if status == 'failed' else 'an unfinished'} run that completed no "
            f"stage: delete it (rm -r {shlex.quote(str(run_dir))}) to start over there, or ")


def first_missing_folder(run_dir: Path) -> Path | None:
    """The outermost folder of `run_dir` (itself included) that does not exist yet, i.e. what
    :func:`lock_run_dir` will create; None when `run_dir` exists."""
    missing = None
    for folder in [run_dir, *run_dir.parents]:
        if folder.exists():
            break
        missing = folder
    return missing


def release_unused_run_dir(run_dir: Path, created: Path | None) -> None:
    """Undo :func:`lock_run_dir` for a run that stopped before writing anything (a mistake
    found before the model loaded): the lock file goes, and the folders made for the run, from
    `run_dir` up to `created` (see :func:`first_missing_folder`), when they are empty."""
    with contextlib.suppress(OSError):  # already gone, or (folder) not empty: leave it
        (run_dir / LOCK_FILE).unlink()
        if created is not None:
            for folder in [run_dir, *run_dir.parents]:
                folder.rmdir()
                if folder == created:
                    break


def _differences(found: Any, wanted: Any, path: str = "") -> list[tuple[str, Any, Any]]:
    """(path, value there, value now) of every leaf where `wanted` differs from `found`, so a
    message names `model.mixed_precision` or `suite_spec.stages[0].budget.steps`, not the whole
    model or suite."""
    if isinstance(found, dict) and isinstance(wanted, dict):
        out = []
        for key in wanted.keys() | found.keys():
            sub = f"{path}.{key}" if path else str(key)
            out += _differences(found.get(key, "(absent)"), wanted.get(key, "(absent)"), sub)
        return sorted(out, key=lambda d: d[0])
    if isinstance(found, list) and isinstance(wanted, list) and len(found) == len(wanted):
        # `stages[0].budget.steps`, the spelling `--set` takes
        return [d for i, (a, b) in enumerate(zip(found, wanted))
                for d in _differences(a, b, f"{path}[{i}]")]
    return [] if found == wanted else [(path, found, wanted)]


def _as_typed(diffs: list[tuple[str, Any, Any]]) -> list[tuple[str, Any, Any]]:
    """The differences as a user would name them: fields by their `--set` spelling
    (`method.lr`, `stages[1].budget.steps`; the suite file's own model as `the suite's
    model.X`); under another method or suite, that alone (its config or content differs as a
    consequence)."""
    names = {path for path, _, _ in diffs}
    implied = tuple(p for key, p in (("method", "method_config."), ("suite", "suite_spec."))
                    if key in names)
    out: list[tuple[str, Any, Any]] = []
    for path, there, now in diffs:
        if path.startswith(implied):
            continue
        # the suite file's own `model` is no `--set model.*` (that sets the run's model)
        for internal, typed in (("method_config.", "method."), ("suite_spec.model.",
                                                                "the suite's model."),
                                ("suite_spec.", "")):
            if path.startswith(internal):
                path = typed + path[len(internal):]
                break
        out.append((path, there, now))
    return out


def _sets_hint(stored: dict[str, Any], diffs: list[tuple[str, Any, Any]]) -> str:
    """When every difference is a setting (a method, model or suite field), the `--set`s that
    continue the stored run, noting a method setting the run did not record because it
    predates the field. Another seed, method or suite is named, not hinted: that folder is
    most likely the wrong one."""
    if not all(path not in ("seed", "method", "suite", "joint", "suite_hash", "method_config")
               and not path.startswith("the suite's model.")
               and "(absent)" not in (there, now) and _set_value(there) is not None
               for path, there, now in diffs):
        return ""
    unrecorded = set(migrations.fields_before(stored.get("method", ""),
                                              stored.get("method_config")))
    sets = []
    for path, there, _ in diffs:
        sets.append("--set " + shlex.quote(f"{path}={_set_value(there)}"))
    note = ""
    if unrecorded & {path.removeprefix("method.") for path, _, _ in diffs
                     if path.startswith("method.")}:
        note = (" (a setting this run predates and did not record: runs before it was added "
                "behaved as shown 'there')")
    return f"to continue it, add {' '.join(sets)}{note}; or "


def _set_value(value: Any) -> str | None:
    """`value` as a `--set` VALUE that reads back as it (`"2"` for the string 2), or None when
    it is no short scalar or list of scalars (a hint the user could not type)."""
    from clbench.spec.reading import parse_override

    scalars = (str, int, float, bool, type(None))
    if not isinstance(value, scalars) and not (
            isinstance(value, list) and all(isinstance(v, scalars) for v in value)):
        return None
    for text in ([value] if isinstance(value, str) else []) + [json.dumps(value)]:
        with contextlib.suppress(UserError):  # not YAML as written: try it JSON-quoted
            if parse_override(f"x={text}")[1] == value and len(text) <= 60:
                return text
    return None


def _short(value: Any) -> str:
    text = json.dumps(value, sort_keys=True) if not isinstance(value, str) else value
    return text if len(text) <= 60 else text[:57] + "..."


# ---------------------------------------------------------------------------------------------
# Checkpoints
# ---------------------------------------------------------------------------------------------

def save_checkpoint(run_dir: Path, stage: int, model: Any, method: Method,
                    addons: Sequence[AddOn] = ()) -> Path:
    """Write `checkpoints/stage{stage}` atomically (:func:`clbench.atomic.atomic_dir`), with
    the add-ons' state."""
    return _write_checkpoint(run_dir / "checkpoints" / f"stage{stage}", model, method,
                             {"stage": stage, "addons": [a.state_dict() for a in addons]})


def has_checkpoint(run_dir: Path, stage: int) -> bool:
    """True when the checkpoint of `stage` is on disk (it is renamed into place complete)."""
    return (run_dir / "checkpoints" / f"stage{stage}" / "state.pt").is_file()


def load_checkpoint(run_dir: Path, stage: int, model: Any, method: Method,
                    addons: Sequence[AddOn] = ()) -> None:
    """Restore student weights, method and add-on state of `stage` (RNGs are re-seeded per
    stage)."""
    folder = run_dir / "checkpoints" / f"stage{stage}"
    if not has_checkpoint(run_dir, stage):
        raise RunDirError(f"{run_dir}: results say stage {stage} is done but its checkpoint "
                          f"{folder} is missing; the run cannot be resumed")
    state = _read_checkpoint(folder, model, method)
    saved = state.get("addons", [])
    if len(saved) != len(addons):
        raise RunDirError(f"{folder} holds the state of {len(saved)} add-ons, this run has "
                          f"{len(addons)}; the run cannot be resumed")
    for addon, addon_state in zip(addons, saved):
        addon.load_state_dict(_to_device(addon_state, model.device))


def save_progress_checkpoint(run_dir: Path, stage: int, step: int, model: Any, method: Method,
                             progress: dict[str, Any]) -> Path:
    """Write `checkpoints/stage{stage}-step{step + 1}` (student, method state, the method's
    `progress` after 0-based optimizer step `step`, RNG states) atomically, then drop the
    stage's earlier ones."""
    final = _write_checkpoint(run_dir / "checkpoints" / f"stage{stage}-step{step + 1}", model,
                              method, {"progress": progress, "stage": stage, "step": step})
    for older in (run_dir / "checkpoints").glob(f"stage{stage}-step*"):
        if older != final:
            shutil.rmtree(older, ignore_errors=True)
    return final


def progress_checkpoint(run_dir: Path, stage: int) -> tuple[int, Path] | None:
    """(steps done, folder) of the latest checkpoint in the middle of `stage`, if any."""
    found = []
    for folder in (run_dir / "checkpoints").glob(f"stage{stage}-step*"):
        match = re.fullmatch(rf"stage{stage}-step(\d+)", folder.name)
        if match and (folder / "state.pt").is_file():
            found.append((int(match.group(1)), folder))
    return max(found) if found else None


def load_progress_checkpoint(folder: Path, model: Any, method: Method) -> dict[str, Any]:
    """Restore student weights and method state from a :func:`save_progress_checkpoint`
    folder; returns the training loop's progress (the add-ons' state in it, put back by the
    loop once the stage has started), with the RNG states under "rng"."""
    state = _read_checkpoint(folder, model, method)
    progress = {**migrations.progress_state(state["progress"]), "rng": state["rng"]}
    progress["hooks"] = _to_device(progress["hooks"], model.device)
    return progress


def _write_checkpoint(final: Path, model: Any, method: Method, extra: dict[str, Any]) -> Path:
    """One checkpoint folder, atomically: the student's weights, and `state.pt` with the
    method's state, the RNG states and `extra`."""
    import torch
    from safetensors.torch import save_model

    with atomic_dir(final) as tmp:
        with os_errors_of(final / STUDENT_WEIGHTS):
            save_model(model, str(tmp / STUDENT_WEIGHTS))
        torch.save({"method": method.state_dict(), "rng": rng_states(), **extra},
                   tmp / "state.pt")
    return final


def _read_checkpoint(folder: Path, model: Any, method: Method) -> dict[str, Any]:
    """Load a checkpoint folder's weights into `model` and its method state into `method`
    (on the model's device); returns its `state.pt` (RNG states and the rest on the CPU,
    where torch takes RNG states; optimizer states move to their parameters when loaded)."""
    from safetensors.torch import load_model

    state = load_state(folder / "state.pt")  # first: a damaged checkpoint leaves `model` as is
    weights = folder / STUDENT_WEIGHTS
    try:  # the file is read whole before any weight is set
        load_model(model, str(weights), device=str(model.device))
    except Exception as exc:  # safetensors' own error, or the system's
        if not (isinstance(exc, OSError) or type(exc).__name__ == "SafetensorError"):
            raise
        raise RunDirError(f"{weights}: damaged, it cannot be read ({exc}); it is not "
                          "loaded") from None
    method.load_state_dict(_to_device(state["method"], model.device))
    return state


def load_state(path: Path) -> Any:
    """A checkpoint's `state.pt`, read as data only (`weights_only=True`: tensors, numbers,
    strings and their containers; nothing a file names is imported or run). NumPy arrays are
    data too: checkpoints of earlier versions kept NumPy's RNG state as one."""
    import numpy as np
    import torch

    core = getattr(np, "_core", None) or np.core
    arrays = [core.multiarray._reconstruct, np.ndarray, np.dtype,
              *(t for t in vars(np.dtypes).values() if isinstance(t, type))]
    try:
        with torch.serialization.safe_globals(arrays):
            return torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise RunDirError(f"{path}: not a checkpoint clbench can read as data ({first[:120]}); "
                          "it is not loaded") from None


def _to_device(value: Any, device: Any) -> Any:
    """`value` with every tensor in its dicts, lists and tuples moved to `device`."""
    import torch

    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):
        return {k: _to_device(v, device) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_device(v, device) for v in value)
    return value


def what_is_saved(run_dir: Path, rows: int, columns: int | None = None,
                  live: bool = False) -> str:
    """What a run that is not complete keeps in `run_dir`, read from the disk, given its number
    of complete rows of R (row 0 is the base) and of columns: the words of the stop message and
    of `clbench report` (`live`: a process is running it now)."""
    from clbench.run.rows import saved_column_names  # rows brings evaluation: not for every reader

    trained = rows > 0 and has_checkpoint(run_dir, rows)
    steps = progress_checkpoint(run_dir, rows) if rows and not trained else None
    saved = saved_column_names(run_dir, rows) if trained or rows == 0 else []
    return saved_rows(rows, run_dir, trained, steps[0] if steps else None, saved, columns, live)


def saved_rows(rows: int, run_dir: Path, trained: bool = False, steps: int | None = None,
               saved_columns: Sequence[str] = (), columns: int | None = None,
               live: bool = False) -> str:
    """What a run that is not complete (stopped, failed, or `live`: running now) keeps, from its
    number of complete rows of R (row 0 is the base), whether the next stage is trained (and
    checkpointed), or else how many of its steps its last checkpoint holds, and the columns of
    the row in progress saved so far."""
    done = ""
    if saved_columns:
        done = (f"; {len(saved_columns)}{f' of {columns}' if columns else ''} columns saved: "
                f"{', '.join(saved_columns)}")
    if rows == 0:
        return (f"no row was complete yet (row 0, the base model, was being evaluated{done}) "
                f"in {run_dir}")
    if rows == 1:
        kept = "row 0 (the base model) is saved"
    else:
        stages = "stage 1" if rows == 2 else f"stages 1..{rows - 1}"
        kept = f"row 0 and {stages} are saved"
    if trained:
        going = "is under way" if live else "continues where it stopped"
        kept += f", and stage {rows} is trained (its evaluation {going}{done})"
    elif steps:
        kept += f", and stage {rows} up to step {steps}"
    return f"{kept} in {run_dir}"


def prune_checkpoints(run_dir: Path, keep: int) -> None:
    """Keep `checkpoints/stage{keep}` only: earlier stages, step checkpoints, and the temp
    folders of writes cut short by a kill (`.stage*`)."""
    for pattern in ("stage*", ".stage*"):
        for old in (run_dir / "checkpoints").glob(pattern):
            if old.name != f"stage{keep}":
                shutil.rmtree(old, ignore_errors=True)
