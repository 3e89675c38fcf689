"""Atomic file and folder writes (a reader sees the old one or the new one, never half of either)
and an exclusive file lock for work that several processes may try to do at once.

Each write goes to a temporary file in the target's folder (same file system, so the final
rename is atomic), is flushed and fsynced, then renamed over the target with `os.replace`; the
folder is fsynced afterwards so the rename itself survives a power cut. A failure at any point
removes the temporary file and leaves the target untouched.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

_DEFAULT_MODE = 0o644  # new files are readable by the leaderboard builder and other users


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> Path:
    """Write `data` to `path` atomically, creating parent folders; returns the path."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        mode = target.stat().st_mode & 0o777  # keep the permissions of the file replaced
    except FileNotFoundError:
        mode = _DEFAULT_MODE
    try:
        fd, tmp_name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.",
                                        suffix=".tmp")
    except OSError as exc:
        raise _naming(exc, target) from None
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp_name, mode)
        os.replace(tmp_name, target)
    except BaseException as exc:
        # Also on KeyboardInterrupt: never leave a stray temporary file behind.
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp_name)
        if isinstance(exc, OSError):
            raise _naming(exc, target) from None
        raise
    _fsync_dir(target.parent)
    return target


def _naming(exc: OSError, target: Path) -> OSError:
    """`exc`, now about `target`: the user asked for that file, not for its temporary neighbour
    (the CLI's one-line message names `filename`)."""
    exc.filename, exc.filename2 = str(target), None
    return exc


def atomic_write_text(path: str | os.PathLike[str], text: str, encoding: str = "utf-8") -> Path:
    """Write `text` to `path` atomically."""
    return atomic_write_bytes(path, text.encode(encoding))


def atomic_write_json(path: str | os.PathLike[str], data: Any, indent: int | None = 2) -> Path:
    """Write `data` as JSON atomically. NaN and infinity are refused: they are not JSON.

    The document is serialised completely before anything touches the disk, so an object that
    cannot be encoded leaves the old file as it was.
    """
    text = json.dumps(data, indent=indent, ensure_ascii=False, allow_nan=False)
    return atomic_write_text(path, text + "\n")


@contextlib.contextmanager
def os_errors_of(path: str | os.PathLike[str]) -> Iterator[None]:
    """A library's own file writer failing for the system's reasons (safetensors raises its
    SafetensorError on a full disk or a file-size limit) raises the OSError it is, naming
    `path`: the command then says "PATH: No space left on device" instead of a traceback."""
    try:
        yield
    except Exception as exc:
        # Newer safetensors say "(os error 28)"; 0.4 says "IoError(Os { code: 28, ... })".
        code = re.search(r"os error (\d+)|Os \{ code: (\d+)", str(exc)) \
            if type(exc).__name__ == "SafetensorError" else None
        if code is None:
            raise
        number = int(code.group(1) or code.group(2))
        raise OSError(number, os.strerror(number), str(path)) from None


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Build a folder in a temporary folder beside `path`, then rename it into place.

    The `with` block writes into the yielded folder. On success the folder is made readable by
    everyone (a cache may be shared), an older `path` is replaced and the rename is fsynced; on
    an error (Ctrl-C included) the temporary folder is removed and `path` is left as it was.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        yield tmp
        _make_readable(tmp)
        old = None
        if target.exists():
            # Moved aside, not deleted first: between two renames there is no moment worth
            # speaking of without a `path`, where deleting a large folder would leave one.
            old = Path(tempfile.mkdtemp(prefix=f".{target.name}-old-", dir=target.parent))
            os.replace(target, old / target.name)
        try:
            os.replace(tmp, target)
        except BaseException:  # Ctrl-C included: the old folder goes back, as it was
            if old is not None:
                os.replace(old / target.name, target)
                shutil.rmtree(old, ignore_errors=True)
            raise
        _fsync_dir(target.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _make_readable(folder: Path) -> None:
    """mkdtemp makes folders 0700; files inside keep the process umask's mode."""
    folder.chmod(0o755)
    for item in folder.rglob("*"):
        item.chmod(0o755 if item.is_dir() else 0o644)


@contextlib.contextmanager
def file_lock(path: str | os.PathLike[str],
              on_wait: Callable[[], None] | None = None) -> Iterator[None]:
    """Hold an exclusive advisory lock on `path` (created if missing) for the `with` block;
    other processes asking for the same lock wait (calling `on_wait` first, so a long wait can
    be announced). Released when the process dies."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target, "w") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if on_wait is not None:
                on_wait()
            fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def try_file_lock(path: str | os.PathLike[str]) -> IO[str] | None:
    """Take an exclusive advisory lock on `path` (created if missing) without waiting: the open
    file that holds it (close it to release; the process dying releases it too), or None when
    another process holds it.

    A lock file may be removed by its holder (a run that stopped before writing anything), so a
    lock taken on a file that is no longer at `path` is dropped and taken again on the new one:
    otherwise two processes could each hold "the" lock on different files. A lock held for an
    instant (:func:`lock_is_held` probing it, e.g. `clbench report`) is waited out briefly."""
    deadline = time.monotonic() + 0.5
    while True:
        handle = open(path, "a")  # "a": creating it must not truncate what a holder wrote
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.close()
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)
            continue
        with contextlib.suppress(FileNotFoundError):  # unlinked meanwhile: try again below
            if os.fstat(handle.fileno()).st_ino == os.stat(path).st_ino:
                return handle
        handle.close()  # locked a file already unlinked from `path`: try the current one


def lock_is_held(path: str | os.PathLike[str]) -> bool:
    """Whether some process holds :func:`try_file_lock`'s lock on `path`. Probed with a shared
    lock on a read-only handle, so it works in a folder this process may not write to (a
    results folder made read-only); unreadable or absent means not held."""
    try:
        handle = open(path)
    except OSError:
        return False
    with handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        except OSError:
            return False
        return False


def _fsync_dir(folder: Path) -> None:
    """Persist a rename in `folder` (best effort: not every platform can open a folder)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        with contextlib.suppress(OSError):  # best effort, as above
            os.fsync(fd)
    finally:
        os.close(fd)
