"""The one atomic-write helper of the package: every module that replaces a file, moves one
into place or switches a symlink goes through here (``tests/unit/test_fsutil.py`` checks
that no other module calls ``os.replace`` or ``os.rename``).

A crash (or a full disk) never leaves a half-written file behind: the data goes to a
temporary file in the same folder, is fsynced, renamed over the target (``os.replace``,
atomic on POSIX) and the folder is fsynced, so a reader sees the old complete file or the
new complete one.

- :func:`atomic_write`: bytes or text to a file.
- :func:`atomic_writer`: the same for a writer that needs a file object (``np.savez``,
  ``shutil.copyfileobj``).
- :func:`rename`: move a finished file or folder into place (and make the move durable).
- :func:`atomic_symlink`: point a symlink somewhere else in one step (deployed model's
  ``current``).
- :func:`crash_point`: the test-only switch that kills the process at an exact point.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO


def _temporary(p: Path, what: str = "tmp") -> Path:
    """A hidden temporary name beside ``p``, unique per call (a spool scanner skips dot files)."""
    return p.with_name(f".{p.name}.{what}{os.getpid()}-{secrets.token_hex(4)}")


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """fsync folder ``path`` so that a rename inside it survives a power cut (no-op where
    folders cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover - file systems that refuse fsync on folders
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_writer(path: str | os.PathLike[str], mode: int | None = None) -> Iterator[BinaryIO]:
    """A binary file object whose content replaces ``path`` atomically when the block ends.

    The data goes to a hidden temporary file beside ``path``; at the end of the ``with``
    block it is flushed, fsynced, renamed over ``path`` and the folder is fsynced.  When the
    block raises, ``path`` is untouched and the temporary file removed.

    Args:
        path: target file; its folder must exist.
        mode: permission bits of the new file (set exactly, whatever the umask); None:
            0o666 less the umask, like ``open()``.

    Raises:
        OSError: the file system refused (disk full, permissions).
    """
    p = Path(path)
    tmp = _temporary(p)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_EXCL, 0o666 if mode is None else mode)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        if mode is not None:
            os.chmod(tmp, mode)
        crash_point("write", p.name)  # the crash tests: a kill with the new content still under its temporary name
        os.replace(tmp, p)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(p.parent)


def atomic_write(path: str | os.PathLike[str], data: bytes | str, mode: int | None = None) -> None:
    """Write ``data`` (str: UTF-8) to ``path`` atomically: temporary file, fsync, rename,
    fsync folder.

    Args:
        path: target file; its folder must exist.
        data: the whole new content.
        mode: permission bits of the new file (set exactly, whatever the umask); None:
            0o666 less the umask, like ``open()``.

    Raises:
        OSError: the file system refused (disk full, permissions); ``path`` is untouched and
            the temporary file removed.
        TypeError: ``data`` is neither bytes nor str (nothing is written).
    """
    with atomic_writer(path, mode) as f:
        f.write(data.encode("utf-8") if isinstance(data, str) else data)  # a buffered write writes it all or raises


def rename(src: str | os.PathLike[str], dst: str | os.PathLike[str], *, sync: bool = True) -> None:
    """Move ``src`` to ``dst`` in one step (``rename(2)``; both on one file system).

    A file at ``dst`` is replaced; a folder ``src`` may replace an empty folder ``dst``.  Used
    to publish a finished temporary file or folder, or to move one out of sight before
    deleting it.

    Args:
        sync: fsync the folder of ``dst`` (and of ``src`` when another) so that the move
            survives a power cut.

    Raises:
        OSError: ``src`` is missing (FileNotFoundError), ``dst`` is a non-empty folder, or the
            two lie on different file systems (errno EXDEV).
    """
    os.replace(src, dst)
    if sync:
        fsync_dir(Path(dst).parent)
        if Path(src).parent != Path(dst).parent:
            fsync_dir(Path(src).parent)


def atomic_symlink(target: str, link: str | os.PathLike[str]) -> None:
    """Make ``link`` a symlink to ``target`` in one step: a reader sees the old link or the
    new one, never none (a temporary symlink renamed over ``link``; the folder fsynced).

    Args:
        target: what the link points to (relative to the link's folder, e.g. ``"v3"``).
        link: the symlink; its folder must exist; an existing link or file is replaced.

    Raises:
        OSError: the file system refused; ``link`` is untouched.
    """
    p = Path(link)
    tmp = _temporary(p, "link")
    os.symlink(target, tmp)
    try:
        os.replace(tmp, p)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(p.parent)


def sha256_file(path: str | os.PathLike[str]) -> str:
    """The SHA-256 of a file's bytes, read in 1 MiB blocks (64 lowercase hex digits).

    Raises:
        OSError: the file cannot be read.
    """
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


#: the test-only crash switch: ``DFL_TEST_CRASH_AT=<state>:<before|after>`` (the crash tests)
CRASH_ENV = "DFL_TEST_CRASH_AT"


def crash_point(state: str, when: str) -> None:
    """SIGKILL this process when ``DFL_TEST_CRASH_AT`` is ``{state}:{when}``: the crash tests'
    switch, a kill at an exact point of a run's life instead of after a sleep.

    The run manager calls it around each ledger write (``when`` ``before`` and ``after``:
    the ledger does not yet, or already, record ``state``); the deployment calls it with
    ``deploying:mid`` once a new version's files are written under ``models/.tmp-*``, before
    they are moved into place; every atomic write with ``write:{file name}`` once the new
    content is fsynced under its temporary name, before the rename; the run ledger with
    ``run-ledger:before-commit`` inside each transaction.  A process that leads its process group (the tests start the
    always-on agent so) is killed with its group, its run process included, and so is a run
    process whose parent leads its group.  Unset (always, outside the tests) it does nothing.
    """
    if os.environ.get(CRASH_ENV) == f"{state}:{when}":
        import signal

        group = os.getpgrp()
        if group in (os.getpid(), os.getppid()):  # a supervisor that leads its group, or its run process:
            os.killpg(group, signal.SIGKILL)  # both die together, as in a power cut
        os.kill(os.getpid(), signal.SIGKILL)


@contextlib.contextmanager
def folder_lock(folder: Path) -> Iterator[None]:
    """An exclusive ``flock`` on ``folder`` while the block runs (for example the creation or
    migration of a ledger there, which another process opening the same state directory may
    attempt at the same time); the folder is created if missing.

    Raises:
        OSError: the folder cannot be created or opened.
    """
    folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock
