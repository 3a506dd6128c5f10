"""idx: MNIST-format (IDX) files from a directory the user names.

Directory layout: the four files of MNIST (or Fashion-MNIST, KMNIST, ...)::

    train-images-idx3-ubyte   train-labels-idx1-ubyte
    t10k-images-idx3-ubyte    t10k-labels-idx1-ubyte

each optionally gzipped (``.gz``), and with either ``-`` or ``.`` before
``idx`` (``train-images.idx3-ubyte``), as the various mirrors name them.

IDX format: magic = two zero bytes, a type byte (0x08 uint8, 0x09 int8, 0x0B
int16, 0x0C int32, 0x0D float32, 0x0E float64), a byte with the number of
dimensions d; then d big-endian uint32 sizes; then the data, big-endian, C
order.  Images must be uint8 ``(N, H, W)``, labels uint8 ``(N,)``.

Result: ``x`` = pixels / 255, float32 ``(N, 1, H, W)``; ``y`` int64;
``groups`` = -1.  pool = the train files, test = the t10k files.
``num_classes`` = largest label + 1 (10 for MNIST), class names ``"0".."9"``.
"""

from __future__ import annotations

import gzip
import os
from pathlib import Path

import numpy as np

from dfl_agent.data.dataset import Dataset, DatasetBundle

_IDX_DTYPES = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


def read_idx(path: str | os.PathLike[str]) -> np.ndarray:
    """Parse one IDX file (plain, or gzip when the name ends in ``.gz``).

    Returns:
        The array in native byte order, with the file's dtype and shape.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: bad magic number, unknown type byte, or a data size that
            does not match the header (the message names the file).
    """
    path = Path(path)
    opener = gzip.open if path.name.endswith(".gz") else open
    try:
        with opener(path, "rb") as f:
            data = f.read()
    except (OSError, EOFError) as e:
        if isinstance(e, FileNotFoundError):
            raise
        raise ValueError(f"{path}: cannot read ({e})") from None
    if len(data) < 4 or data[0] != 0 or data[1] != 0 or data[2] not in _IDX_DTYPES:
        raise ValueError(f"{path}: bad IDX magic number {data[:4].hex() or '(empty)'}; "
                         "expected 00 00 <type 08/09/0b/0c/0d/0e> <ndim>")
    dtype = np.dtype(_IDX_DTYPES[data[2]])
    ndim = data[3]
    header = 4 + 4 * ndim
    if len(data) < header:
        raise ValueError(f"{path}: truncated IDX header ({ndim} dimensions)")
    shape = tuple(int(v) for v in np.frombuffer(data, dtype=">u4", count=ndim, offset=4))
    count = int(np.prod(shape, dtype=np.int64))
    if len(data) - header != count * dtype.itemsize:
        raise ValueError(f"{path}: IDX header says shape {shape} of {dtype.name} "
                         f"({count * dtype.itemsize} bytes) but the file has "
                         f"{len(data) - header} data bytes")
    arr = np.frombuffer(data, dtype=dtype, count=count, offset=header).reshape(shape)
    return arr.astype(dtype.newbyteorder("="))


def find_idx_file(directory: Path, stem: str, kind: str) -> Path:
    """The file for ``stem`` (e.g. ``train-images``) and ``kind`` (``idx3-ubyte``).

    Tries ``{stem}-{kind}``, ``{stem}.{kind}``, each with and without ``.gz``.

    Raises:
        FileNotFoundError: none exists (the message names the expected file).
    """
    for sep in ("-", "."):
        for suffix in ("", ".gz"):
            p = directory / f"{stem}{sep}{kind}{suffix}"
            if p.is_file():
                return p
    raise FileNotFoundError(
        f"IDX file {stem}-{kind} (or {stem}.{kind}, optionally .gz) not found in {directory}")


def _load_part(directory: Path, prefix: str) -> tuple[np.ndarray, np.ndarray, Path]:
    img_path = find_idx_file(directory, f"{prefix}-images", "idx3-ubyte")
    lab_path = find_idx_file(directory, f"{prefix}-labels", "idx1-ubyte")
    images, labels = read_idx(img_path), read_idx(lab_path)
    if images.dtype != np.uint8 or images.ndim != 3:
        raise ValueError(f"{img_path}: expected uint8 images (N, H, W), got "
                         f"{images.dtype} {images.shape}")
    if labels.dtype != np.uint8 or labels.ndim != 1:
        raise ValueError(f"{lab_path}: expected uint8 labels (N,), got "
                         f"{labels.dtype} {labels.shape}")
    if images.shape[0] != labels.shape[0]:
        raise ValueError(f"{img_path} has {images.shape[0]} images but {lab_path} has "
                         f"{labels.shape[0]} labels")
    x = np.ascontiguousarray(images[:, None, :, :], dtype=np.float32) / np.float32(255.0)
    return x, labels.astype(np.int64), img_path


def load_idx(path: str | os.PathLike[str]) -> DatasetBundle:
    """Load the four IDX files in directory ``path`` (see module docstring).

    Raises:
        FileNotFoundError: ``path`` or one of the files is missing.
        ValueError: malformed file, or train/test image sizes differ.
    """
    directory = Path(path).expanduser()
    if not directory.is_dir():
        raise FileNotFoundError(f"IDX data directory {directory} does not exist")
    x_tr, y_tr, p_tr = _load_part(directory, "train")
    x_te, y_te, p_te = _load_part(directory, "t10k")
    if x_tr.shape[1:] != x_te.shape[1:]:
        raise ValueError(f"image size differs: {p_tr} {x_tr.shape[2:]} vs {p_te} {x_te.shape[2:]}")
    k = int(max(y_tr.max(initial=0), y_te.max(initial=0))) + 1
    names = [str(i) for i in range(k)]
    shape = tuple(x_tr.shape[1:])

    def make(x: np.ndarray, y: np.ndarray) -> Dataset:
        return Dataset(name="idx", x=x, y=y, groups=np.full(y.shape, -1, np.int64),
                       num_classes=k, class_names=names, input_shape=shape,
                       meta={"source": str(directory)})

    return DatasetBundle(pool=make(x_tr, y_tr), test=make(x_te, y_te))
