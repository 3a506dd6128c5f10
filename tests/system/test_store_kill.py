"""SIGKILL during ingestion, repeated: no sample is lost or duplicated (torch-free ingest process)."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from dfl_agent.store import SampleStore, Schema

pytestmark = pytest.mark.slow
SCHEMA = Schema((3, 8), 4)

INGEST = textwrap.dedent("""
    import sys, time
    assert "torch" not in sys.modules
    from dfl_agent.store import SampleStore
    s = SampleStore(sys.argv[1], None, settle_seconds=0.0)
    while True:
        s.ingest_spool()
        assert "torch" not in sys.modules
        time.sleep(0.001)
""")


def test_sigkill_during_ingestion_loses_and_duplicates_nothing(tmp_path):
    SampleStore(tmp_path, SCHEMA).close()
    spool = tmp_path / "spool"
    spool.mkdir(exist_ok=True)  # the store creates its spool (group-writable)
    files, per_file = 60, 200
    rng = np.random.default_rng(0)
    kills = 0
    proc = None
    deadline = time.time() + 60
    for i in range(files):
        x = rng.normal(size=(per_file, 3, 8)).astype(np.float32)
        x[:, 0, 0] = i * 10_000 + np.arange(per_file)  # identifies each sample
        buf = io.BytesIO()
        np.savez(buf, x=x, y=rng.integers(0, 4, per_file))
        (spool / f".f{i}.tmp").write_bytes(buf.getvalue())
        os.replace(spool / f".f{i}.tmp", spool / f"f{i}.npz")
        if proc is None:
            proc = subprocess.Popen([sys.executable, "-c", INGEST, str(tmp_path)])
        time.sleep(float(rng.uniform(0.02, 0.12)))
        if i % 3 == 2:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            proc = None
            kills += 1
    if proc is None:
        proc = subprocess.Popen([sys.executable, "-c", INGEST, str(tmp_path)])
    while list(spool.glob("*.npz")) and time.time() < deadline:
        time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not list(spool.glob("*.npz")), "spool not drained"
    s = SampleStore(tmp_path, None)
    _, x, _, _ = s.load(s.snapshot())
    keys = np.sort(x[:, 0, 0].astype(np.int64))
    want = np.sort(np.concatenate([i * 10_000 + np.arange(per_file) for i in range(files)]))
    assert kills >= 15
    np.testing.assert_array_equal(keys, want)  # every sample exactly once
    assert s.status()["ingested_files"] == files and s.status()["rejected"] == 0
    assert s.db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
