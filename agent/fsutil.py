"""The one atomic-write helper of the package.

A crash (or a full disk) never leaves a half-written file behind: the data goes to a
temporary file in the same folder, is fsynced, renamed over the target (``os.replace``,
atomic on POSIX) and the folder is fsynced, so a reader sees the old complete file or the
new complete one.
"""

from __future__ import annotations

import os
from pathlib import Path


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
    """
    p = Path(path)
    raw = data.encode("utf-8") if isinstance(data, str) else data
    tmp = p.with_name(f".{p.name}.tmp{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666 if mode is None else mode)
    try:
        try:
            view = memoryview(raw)
            while view:
                n = os.write(fd, view)
                view = view[n:]
            os.fsync(fd)
        finally:
            os.close(fd)
        if mode is not None:
            os.chmod(tmp, mode)
        os.replace(tmp, p)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(p.parent)
