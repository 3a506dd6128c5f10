"""The on-disk cache of converted datasets (plain ``.npz`` files).

Location: the ``cache_dir`` argument, else the environment variable
``DFL_CACHE_DIR``, else the platform user cache folder (``~/.cache/dfl-agent``
on Linux, ``$XDG_CACHE_HOME`` honoured).  Files are written atomically
(``dfl_agent.fsutil``: temporary file in the same directory, ``fsync``, rename), so a reader
sees either the old complete file or the new complete one, and several
processes converting at once are harmless (the last rename wins; all write the
same content).  Cached files are always read with ``allow_pickle=False``.
"""

from __future__ import annotations

import os
import zipfile
import zlib
from pathlib import Path

import numpy as np

from dfl_agent.fsutil import atomic_writer

CACHE_ENV = "DFL_CACHE_DIR"


def resolve_cache_dir(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """The cache directory to use (not created here).

    Order: ``cache_dir`` argument, ``$DFL_CACHE_DIR``, the user cache directory of the
    platform (platformdirs; ``$XDG_CACHE_HOME/dfl-agent``, by default ``~/.cache/dfl-agent``
    on Linux).
    """
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env).expanduser()
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("dfl-agent", appauthor=False))


def atomic_savez(path: Path, arrays: dict[str, np.ndarray]) -> None:
    """Write ``arrays`` as an uncompressed ``.npz`` at ``path``, atomically.

    Creates the parent directory if needed.

    Raises:
        OSError: the directory cannot be created or written.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_writer(path) as f:
        np.savez(f, **arrays)  # type: ignore[arg-type]  # (numpy's stub types **kwds like allow_pickle)


def read_npz(path: Path, keys: tuple[str, ...] | None = None) -> dict[str, np.ndarray]:
    """Read every array (or just ``keys``) of an ``.npz`` with ``allow_pickle=False``.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: the file is not a readable npz, holds an object array, or
            lacks one of ``keys`` (the message names the file and the key).
    """
    path = Path(path)
    # We open the file ourselves: np.load leaks its handle when the zip is corrupt.
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        raise
    except OSError as e:
        raise ValueError(f"{path}: cannot be opened ({e})") from None
    with f:
        head = f.read(6)
        f.seek(0)
        if head[:4] not in (b"PK\x03\x04", b"PK\x05\x06") and not head.startswith(b"\x93NUMPY"):
            # numpy would guess at a pickle here and suggest loading it unsafely: say what it is
            raise ValueError(f"{path}: not an .npz archive (no zip header; the file is damaged or of another "
                             "format)")
        try:
            z = np.load(f, allow_pickle=False)
        except (ValueError, zipfile.BadZipFile, EOFError, OSError) as e:
            why = "not a valid zip archive" if "pickle" in str(e) else str(e)
            raise ValueError(f"{path}: not a readable .npz file ({why})") from None
        if not isinstance(z, np.lib.npyio.NpzFile):
            raise ValueError(f"{path}: is a single .npy array, not an .npz archive")
        with z:
            names = list(z.files) if keys is None else list(keys)
            out: dict[str, np.ndarray] = {}
            for k in names:
                if k not in z.files:
                    raise ValueError(f"{path}: missing array {k!r} (has {sorted(z.files)})")
                try:
                    out[k] = z[k]
                except ValueError as e:  # object arrays need pickle: refused
                    raise ValueError(f"{path}: array {k!r} cannot be read without "
                                     f"pickle ({e})") from None
                except (zipfile.BadZipFile, zlib.error, EOFError, OSError, KeyError) as e:
                    raise ValueError(f"{path}: array {k!r} is unreadable ({e})") from None
            return out


def read_npy_headers(path: Path, keys: tuple[str, ...]) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """``{key: (shape, dtype)}`` of arrays ``keys`` of an ``.npz``, from each member's
    ``.npy`` header only: no array data is read.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: not a zip archive, a key missing, a member that is not a ``.npy``
            array, or an object array (the message names the file and the key).
    """
    path = Path(path)
    fmt = np.lib.format
    try:
        zf = zipfile.ZipFile(path)
    except FileNotFoundError:
        raise
    except (OSError, zipfile.BadZipFile, EOFError) as e:
        raise ValueError(f"{path}: not a readable .npz file ({e})") from None
    out: dict[str, tuple[tuple[int, ...], np.dtype]] = {}
    with zf:
        names = set(zf.namelist())
        for key in keys:
            member = f"{key}.npy" if f"{key}.npy" in names else key if key in names else None
            if member is None:
                raise ValueError(f"{path}: missing array {key!r}")
            try:
                with zf.open(member) as f:  # decompresses the header only
                    version = fmt.read_magic(f)
                    if version == (1, 0):
                        shape, _fortran, dtype = fmt.read_array_header_1_0(f)
                    elif version == (2, 0):
                        shape, _fortran, dtype = fmt.read_array_header_2_0(f)
                    else:
                        raise ValueError(f"unsupported .npy version {version}")
            except (ValueError, zipfile.BadZipFile, zlib.error, EOFError, OSError) as e:
                raise ValueError(f"{path}: array {key!r} has no readable .npy header ({e})") from None
            if dtype.hasobject:
                raise ValueError(f"{path}: array {key!r} is an object array")
            out[key] = (tuple(int(d) for d in shape), dtype)
    return out
