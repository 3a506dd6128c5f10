"""The on-device sample store: validation, exactly-once ingestion, retention, snapshots."""

from __future__ import annotations

import io
import json
import os
import time
from pathlib import Path

import numpy as np
import pytest

from dfl_agent.durations import parse_optional_duration as parse_duration
from dfl_agent.store import (
    SampleStore,
    Schema,
    StoreError,
    validation_mask,
)
from dfl_agent.store.sqlite import copy_into_spool

SCHEMA = Schema((3, 8), 4, ("a", "b", "c", "d"))


def npz_bytes(**arrays) -> bytes:
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    return buf.getvalue()


def good(n=10, seed=0, label=None, t=None):
    rng = np.random.default_rng(seed)
    y = np.full(n, label) if label is not None else rng.integers(0, 4, n)
    out = {"x": rng.normal(size=(n, 3, 8)).astype(np.float32), "y": y.astype(np.int64)}
    if t is not None:
        out["t"] = np.asarray(t, dtype=np.float64)
    return out


def drop(spool: Path, name: str, data: bytes, age: float = 10.0) -> Path:
    spool.mkdir(parents=True, exist_ok=True)
    tmp = spool / f".{name}.tmp"
    tmp.write_bytes(data)
    os.replace(tmp, spool / name)
    old = time.time() - age
    os.utime(spool / name, (old, old))
    return spool / name


def snapshot_state(store: SampleStore):
    ids, x, y, _ = store.load(store.snapshot())
    return ids.tolist(), x.tobytes(), y.tolist()


def test_load_returns_present_ids_once_in_id_order_across_chunks(tmp_path):
    """Ids in any order, repeated, or no longer in the store: the rows present, each once, by id,
    also past the 900 ids of one query (the windows go straight into one array)."""
    s = SampleStore(tmp_path, SCHEMA)
    data = good(1000, seed=3)
    drop(s.spool_dir, "a.npz", npz_bytes(**data))
    s.ingest_spool()
    ids = s.snapshot()
    ask = np.concatenate([ids[::-1], ids[:5], [int(ids.max()) + 100]])
    got, x, y, _ = s.load(ask)
    assert got.tolist() == ids.tolist() and x.flags.c_contiguous and x.dtype == np.float32
    np.testing.assert_array_equal(x, data["x"])
    np.testing.assert_array_equal(y, data["y"])
    empty = s.load([])
    assert [len(a) for a in empty] == [0, 0, 0, 0] and empty[1].shape == (0, 3, 8)


def test_ingest_and_exactly_once(tmp_path):
    s = SampleStore(tmp_path, SCHEMA)
    data = npz_bytes(**good(10))
    drop(s.spool_dir, "a.npz", data)
    res = s.ingest_spool()
    assert res["ingested"] == 1 and res["samples"] == 10 and s.count() == 10
    assert not (s.spool_dir / "a.npz").exists()
    # the same content again (e.g. left behind by a crash after the commit): not added twice
    drop(s.spool_dir, "a-again.npz", data)
    res = s.ingest_spool()
    assert res["duplicates"] == 1 and s.count() == 10 and not (s.spool_dir / "a-again.npz").exists()
    _, x, y, _ = s.load(s.snapshot())
    want = good(10)
    np.testing.assert_array_equal(x, want["x"])
    np.testing.assert_array_equal(y, want["y"])


BAD = {
    "wrong shape": (lambda: npz_bytes(x=np.zeros((5, 3, 9), np.float32), y=np.zeros(5, np.int64)), "shape"),
    "nan": (lambda: npz_bytes(x=np.full((5, 3, 8), np.nan, np.float32), y=np.zeros(5, np.int64)), "non-finite"),
    "labels out of range": (lambda: npz_bytes(x=np.zeros((5, 3, 8), np.float32), y=np.full(5, 4)), "labels"),
    "truncated": (lambda: npz_bytes(**good(50))[:700], "truncated"),
    "object array": (lambda: npz_bytes(x=np.array([object()] * 5, dtype=object), y=np.zeros(5, np.int64)),
                     "object array"),
    "missing y": (lambda: npz_bytes(x=np.zeros((5, 3, 8), np.float32)), "y: missing"),
    "float labels": (lambda: npz_bytes(x=np.zeros((5, 3, 8), np.float32), y=np.zeros(5)), "integer"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_rejection_leaves_store_unchanged(tmp_path, case):
    s = SampleStore(tmp_path, SCHEMA)
    drop(s.spool_dir, "ok.npz", npz_bytes(**good(7)))
    s.ingest_spool()
    before = snapshot_state(s)
    make, reason = BAD[case]
    drop(s.spool_dir, "bad.npz", make())
    res = s.ingest_spool()
    assert res["rejected"] == 1 and res["ingested"] == 0
    assert snapshot_state(s) == before
    assert not (s.spool_dir / "bad.npz").exists()
    assert (s.rejected_dir / "bad.npz").exists()
    text = (s.rejected_dir / "bad.npz.reason").read_text()
    assert reason in text and "allow_pickle" not in text and "pickle" not in text.lower()
    st = s.status()
    assert st["rejected"] == 1 and reason in st["rejected_files"][0]["reason"]


def test_file_renamed_in_while_still_being_written(tmp_path):
    """A writer that renamed before finishing: left alone while it is fresh, rejected as
    truncated once it stops changing; never half-enters the store."""
    s = SampleStore(tmp_path, SCHEMA, settle_seconds=0.5)
    data = npz_bytes(**good(200))
    s.spool_dir.mkdir(parents=True, exist_ok=True)
    f = open(s.spool_dir / "early.npz", "wb")  # noqa: SIM115 - a writer that keeps it open
    f.write(data[: len(data) // 2])
    f.flush()
    res = s.ingest_spool()
    assert res["waiting"] == 1 and s.count() == 0 and (s.spool_dir / "early.npz").exists()
    time.sleep(0.7)  # the writer stalled (or died) half-way
    res = s.ingest_spool()
    f.close()
    assert res["rejected"] == 1 and s.count() == 0
    assert "truncated" in (s.rejected_dir / "early.npz.reason").read_text()


def test_retention_oldest_first_never_exceeds_cap(tmp_path):
    s = SampleStore(tmp_path, SCHEMA, max_samples=25)
    now = time.time()
    for i in range(6):
        s.ingest_file(drop(s.spool_dir, f"f{i}.npz", npz_bytes(**good(10, seed=i, t=np.full(10, now + i)))),
                      remove=True)
        assert s.count() <= 25
    assert s.count() == 25
    # the 25 newest remain: files 4, 5 completely and half of file 3
    t = [row[0] for row in s.db.execute("SELECT t FROM samples ORDER BY id")]
    assert min(t) == now + 3 and t.count(now + 5) == 10 and t.count(now + 3) == 5
    assert s.status()["evicted_samples"] == 35


def test_retention_largest_class_and_per_class_cap_and_age(tmp_path):
    s = SampleStore(tmp_path, SCHEMA, max_samples=30, eviction="largest-class")
    now = time.time()
    s.ingest_file(drop(s.spool_dir, "rare.npz", npz_bytes(**good(5, label=3, t=np.full(5, now - 100)))))
    s.ingest_file(drop(s.spool_dir, "freq.npz", npz_bytes(**good(40, label=0, t=np.full(40, now)))))
    per = s.status()["per_class"]
    assert per == {"0": 25, "3": 5}  # the old rare class survives; the frequent one is cut
    c = SampleStore(tmp_path / "c", SCHEMA, max_per_class=6, max_age=50)
    c.ingest_file(drop(c.spool_dir, "old.npz", npz_bytes(**good(4, label=1, t=np.full(4, now - 100)))))
    c.ingest_file(drop(c.spool_dir, "new.npz", npz_bytes(**good(10, label=2, t=np.full(10, now)))))
    assert c.status()["per_class"] == {"2": 6}


def test_validation_slice_stable_and_share():
    ids = np.arange(1, 20001)
    m = validation_mask(ids, 0.2)
    assert abs(m.mean() - 0.2) < 0.02
    np.testing.assert_array_equal(validation_mask(ids[5000:], 0.2), m[5000:])


def test_schema_mismatch_and_durations(tmp_path):
    SampleStore(tmp_path, SCHEMA).close()
    with pytest.raises(StoreError, match="holds samples of shape"):
        SampleStore(tmp_path, Schema((3, 9), 4))
    assert SampleStore(tmp_path, None).schema == SCHEMA
    assert parse_duration("30d") == 30 * 86400 and parse_duration("none") is None
    with pytest.raises(ValueError):
        parse_duration("soon")


def test_cli_add_and_status(tmp_path, capsys):
    from dfl_agent.cli.dflctl import main

    s = SampleStore(tmp_path, SCHEMA)
    src = tmp_path / "mine.npz"
    src.write_bytes(npz_bytes(**good(12)))
    assert main(["data", "add", str(src), "--state-dir", str(tmp_path)]) == 0
    (f,) = s.spool_files()
    old = time.time() - 5
    os.utime(f, (old, old))
    drop(s.spool_dir, "bad.npz", b"garbage")
    s.ingest_spool()
    capsys.readouterr()
    assert main(["data", "status", "--state-dir", str(tmp_path), "--json"]) == 0
    st = json.loads(capsys.readouterr().out)
    assert st["schema_version"] == 1 and st["samples"] == 12 and sum(st["per_class"].values()) == 12
    assert st["rejected"] == 1 and "not an .npz" in st["rejected_files"][0]["reason"]
    assert main(["data", "status", "--state-dir", str(tmp_path / "nothing")]) == 2


def test_copy_into_spool_is_atomic_name(tmp_path):
    src = tmp_path / "x.npz"
    src.write_bytes(npz_bytes(**good(3)))
    dest = copy_into_spool(src, tmp_path / "spool")
    assert dest.read_bytes() == src.read_bytes() and not list((tmp_path / "spool").glob(".*"))
