"""Hostile spool entries: decompression bombs are refused from the archive's headers before
any array is allocated, every refusal gives its true reason, symbolic links are never
followed, and anything that is not a regular ``.npz`` file is moved to ``rejected/`` and
counted."""

from __future__ import annotations

import io
import os
import time
import tracemalloc
import zipfile
from pathlib import Path

import numpy as np
import pytest

from dfl_agent.store import SampleStore, Schema

SCHEMA = Schema((3, 32), 4)


def _age(p: Path, seconds: float = 10.0) -> None:
    """Make a spool entry old enough to be taken (its own mtime, a link's too)."""
    old = time.time() - seconds
    os.utime(p, (old, old), follow_symlinks=False)


def _npz(**arrays) -> bytes:
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    return buf.getvalue()


def _good(n: int = 5) -> bytes:
    rng = np.random.default_rng(0)
    return _npz(x=rng.normal(size=(n, 3, 32)).astype(np.float32), y=rng.integers(0, 4, n))


def _bomb(path: Path, n: int) -> None:
    """A deflated ``x`` of ``n`` x 3 x 32 float32 zeros (and no ``y``), streamed so that the
    test never holds the array: what ``np.savez_compressed`` writes for the same zeros."""
    zero = bytes(1 << 22)
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED, compresslevel=1) as zf, \
            zf.open("x.npy", "w", force_zip64=True) as f:
        np.lib.format.write_array_header_1_0(f, {"descr": "<f4", "fortran_order": False, "shape": (n, 3, 32)})
        left = n * 3 * 32 * 4
        while left:
            f.write(zero[:min(left, len(zero))])
            left -= min(left, len(zero))


def _reason(store: SampleStore, name: str) -> str:
    return (store.rejected_dir / f"{name}.reason").read_text(encoding="utf-8").strip()


def test_bomb_refused_from_headers_before_allocation(tmp_path):
    """1.2 MB on disk, 276 MB of float32 once decompressed: above the default 256 MiB limit.
    The refusal names the limit and the peak of traced allocations stays near the file size."""
    s = SampleStore(tmp_path, SCHEMA)
    _bomb(s.spool_dir / "bomb.npz", 720_000)
    assert (s.spool_dir / "bomb.npz").stat().st_size < 2 << 20
    _age(s.spool_dir / "bomb.npz")
    tracemalloc.start()
    try:
        res = s.ingest_spool()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert res["rejected"] == 1 and s.count() == 0
    reason = _reason(s, "bomb.npz")
    assert "arrays need 276480000 bytes uncompressed (x (720000, 3, 32) float32)" in reason and "ingest limit of 268435456" in reason, reason
    assert "data.store_max_ingest_bytes" in reason
    assert peak < 16 << 20, f"peak {peak} bytes traced: the arrays were decompressed"
    assert s.status()["rejected_by_kind"] == {"arrays_too_large": 1}


def test_ingest_limit_is_configurable_and_counts_every_read_array(tmp_path):
    """A small ``max_ingest_bytes``: refused; an int8 ``x`` counts as float32 (its converted
    size); the same file under a large enough limit is ingested."""
    data = _npz(x=np.zeros((100, 3, 32), np.int8), y=np.zeros(100, np.int64))
    small = SampleStore(tmp_path / "a", SCHEMA, max_ingest_bytes=100 * 3 * 32 * 4)  # x alone fits, y does not
    (small.spool_dir / "f.npz").write_bytes(data)
    _age(small.spool_dir / "f.npz")
    assert small.ingest_spool()["rejected"] == 1
    assert "arrays need 39200 bytes" in _reason(small, "f.npz")
    big = SampleStore(tmp_path / "b", SCHEMA, max_ingest_bytes=39200)
    (big.spool_dir / "f.npz").write_bytes(data)
    _age(big.spool_dir / "f.npz")
    assert big.ingest_spool()["ingested"] == 1 and big.count() == 100


def test_open_store_takes_the_limit_from_the_configuration(tmp_path):
    from dfl_agent.runtime.shared.config import ConfigError, config_from_dict
    from dfl_agent.runtime.shared.sample_store import open_store

    raw = {"federation": "f", "state_dir": str(tmp_path), "data": {
        "dataset": "store", "input_shape": [3, 32], "num_classes": 4, "store_max_ingest_bytes": 4096}}
    store = open_store(config_from_dict(raw))
    assert store.max_ingest_bytes == 4096
    store.close()
    raw["data"]["store_max_ingest_bytes"] = 0
    with pytest.raises(ConfigError, match=r"^data\.store_max_ingest_bytes: must be >= 1"):
        config_from_dict(raw)


def test_empty_file_gets_its_true_reason(tmp_path):
    s = SampleStore(tmp_path, SCHEMA)
    (s.spool_dir / "empty.npz").write_bytes(b"")
    _age(s.spool_dir / "empty.npz")
    assert s.ingest_spool()["rejected"] == 1
    reason = _reason(s, "empty.npz")
    assert reason.startswith("empty file (0 bytes)") and "larger" not in reason and "MiB" not in reason, reason
    assert s.status()["rejected_by_kind"] == {"not_npz": 1}


def test_non_regular_entries_are_moved_counted_and_never_followed(tmp_path):
    """A dangling link, a link to a valid file (outside the spool), a FIFO and a directory,
    all named ``*.npz``: each moved to rejected/ as it is, with a reason, and counted; the
    link's target is not read (nothing is ingested) and stays where it is."""
    s = SampleStore(tmp_path / "state", SCHEMA)
    target = tmp_path / "outside.npz"
    target.write_bytes(_good())
    _age(target)  # a link that is followed would be taken (and its target ingested) in this pass
    spool = s.spool_dir
    os.symlink(tmp_path / "nowhere.npz", spool / "dangling.npz")
    os.symlink(target, spool / "link.npz")
    os.mkfifo(spool / "fifo.npz")
    (spool / "dir.npz").mkdir()
    for name in ("dangling.npz", "link.npz", "fifo.npz", "dir.npz"):
        _age(spool / name)
    res = s.ingest_spool()
    assert s.count() == 0 and res["ingested"] == 0, res
    assert res["rejected"] == 4, res
    assert not [p for p in spool.iterdir() if p.name != "rejected"]
    rej = s.rejected_dir
    assert os.path.islink(rej / "dangling.npz") and os.path.islink(rej / "link.npz")
    assert (rej / "fifo.npz").is_fifo() and (rej / "dir.npz").is_dir()
    assert _reason(s, "dangling.npz").startswith("a symbolic link, not a regular file")
    assert "not followed" in _reason(s, "link.npz")
    assert _reason(s, "fifo.npz") == "a FIFO, not a regular file"
    assert _reason(s, "dir.npz") == "a directory, not a regular file"
    assert target.read_bytes() == _good()
    st = s.status()
    assert st["rejected"] == 4 and st["rejected_by_kind"] == {"not_regular_file": 4}
    assert st["spool_waiting"] == 0
    assert s.ingest_spool()["rejected"] == 0 and s.status()["rejected"] == 4  # moved: not counted again


def test_reason_file_is_never_written_through_a_link(tmp_path):
    """A link planted at ``rejected/NAME.reason`` is replaced, its target left untouched."""
    s = SampleStore(tmp_path / "state", SCHEMA)
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    os.symlink(victim, s.rejected_dir / "bad.npz.reason")
    (s.spool_dir / "bad.npz").write_bytes(b"garbage")
    _age(s.spool_dir / "bad.npz")
    assert s.ingest_spool()["rejected"] == 1
    assert victim.read_text() == "keep me"
    assert "not an .npz archive" in _reason(s, "bad.npz")


def test_member_that_is_not_an_array_is_rejected_and_the_pass_goes_on(tmp_path):
    """An ``x`` member holding raw bytes (not ``.npy``): rejected with its reason; the
    files after it in the same pass are still ingested."""
    s = SampleStore(tmp_path, SCHEMA)
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr("x.npy", b"not an array")
        zf.writestr("y.npy", b"nor this")
    (s.spool_dir / "a-raw.npz").write_bytes(buf.getvalue())
    _age(s.spool_dir / "a-raw.npz", 20)
    (s.spool_dir / "b-good.npz").write_bytes(_good())
    _age(s.spool_dir / "b-good.npz", 10)
    res = s.ingest_spool()
    assert res["rejected"] == 1 and res["ingested"] == 1 and s.count() == 5
    assert _reason(s, "a-raw.npz") == "x: not a .npy array"


def test_archive_with_too_many_members_is_refused(tmp_path):
    s = SampleStore(tmp_path, SCHEMA)
    rng = np.random.default_rng(0)
    arrays = {f"extra{i}": np.zeros(1) for i in range(100)}
    (s.spool_dir / "many.npz").write_bytes(_npz(x=rng.normal(size=(2, 3, 32)), y=np.zeros(2, np.int64), **arrays))
    _age(s.spool_dir / "many.npz")
    assert s.ingest_spool()["rejected"] == 1 and s.count() == 0
    assert _reason(s, "many.npz") == "archive has 102 members, at most 64 are accepted"
