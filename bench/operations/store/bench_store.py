"""Sample-store benchmark: ingestion throughput (samples/s) and size on disk per 10,000 HAR windows.

Usage: nice -n 10 python bench/operations/store/bench_store.py [--windows 10000] [--per-file 100] [--repeat 3]
Writes results.json beside this file.  HAR windows (3 x 128 float32) come from the installed
HAR data set when available, else random windows of the same shape (said in the results).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import numpy as np

from dfl_agent.store import SampleStore, Schema


def har_windows(n: int) -> tuple[np.ndarray, np.ndarray, str]:
    try:
        from dfl_agent.data import load_dataset

        pool = load_dataset("har").pool
        reps = -(-n // len(pool))
        x = np.concatenate([pool.x] * reps)[:n]
        y = np.concatenate([pool.y] * reps)[:n]
        return x, y, "UCI HAR windows (3 x 128)"
    except Exception as exc:  # noqa: BLE001
        rng = np.random.default_rng(0)
        return rng.normal(size=(n, 3, 128)).astype(np.float32), rng.integers(0, 6, n), f"random 3x128 ({exc})"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--windows", type=int, default=10_000, help="windows ingested per repetition")
    ap.add_argument("--per-file", type=int, default=100, help="windows per spool file")
    ap.add_argument("--repeat", type=int, default=3, help="repetitions (fresh store each)")
    a = ap.parse_args()
    x, y, source = har_windows(a.windows)
    runs = []
    for r in range(a.repeat):
        with tempfile.TemporaryDirectory() as tmp:
            store = SampleStore(tmp, Schema((3, 128), 6), settle_seconds=0.0)
            for i in range(0, a.windows, a.per_file):
                buf = io.BytesIO()
                np.savez(buf, x=x[i:i + a.per_file], y=y[i:i + a.per_file])
                name = Path(store.spool_dir) / f"f{i:07d}.npz"
                (name.parent / f".{name.name}.tmp").write_bytes(buf.getvalue())
                os.replace(name.parent / f".{name.name}.tmp", name)
            t0 = time.perf_counter()
            res = store.ingest_spool()
            dt = time.perf_counter() - t0
            assert res["samples"] == a.windows and store.count() == a.windows
            store.db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            size = sum(p.stat().st_size for p in Path(tmp, "store").iterdir())
            store.close()
            runs.append({"seconds": dt, "samples_per_s": a.windows / dt, "bytes": size})
            print(f"run {r}: {a.windows / dt:,.0f} samples/s, {size / 1e6:.1f} MB")
    raw = a.windows * 3 * 128 * 4
    out = {
        "command": "nice -n 10 python bench/operations/store/bench_store.py "
                   f"--windows {a.windows} --per-file {a.per_file} --repeat {a.repeat}",
        "source": source, "windows": a.windows, "per_file": a.per_file, "runs": runs,
        "samples_per_s_median": float(np.median([r["samples_per_s"] for r in runs])),
        "bytes_per_10000_windows": float(np.median([r["bytes"] for r in runs])) * 10_000 / a.windows,
        "raw_float32_bytes_per_10000_windows": raw * 10_000 / a.windows,
        "machine": f"{platform.machine()}, {os.cpu_count()} cpus (shared, loaded), python {platform.python_version()}",
        "sqlite": __import__("sqlite3").sqlite_version,
    }
    Path(__file__).with_name("results.json").write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps({k: out[k] for k in ("samples_per_s_median", "bytes_per_10000_windows")}))


if __name__ == "__main__":
    main()
