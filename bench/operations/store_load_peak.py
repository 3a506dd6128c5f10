"""Memory of loading a run's data snapshot from the sample store: the peak of Python and numpy
allocations (tracemalloc) while ``store_data`` loads the snapshot and splits it into training and
validation arrays, against the size of the windows themselves.

Fills a sample store (HAR windows, 3 x 128 float32: the pool and the test users, ``--copies``
times, each copy shifted so that no file is a duplicate), then measures ``store_data`` on its
whole snapshot.  Appends one JSON line to ``--out``.  Run with ``PYTHONPATH`` set to another copy
of the package to measure that one (``package`` in the line says which was measured).

    python bench/operations/store_load_peak.py --copies 4 --label after --out bench/operations/store_load_peak.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

import numpy as np
from idle import commit, machine
from runs_timing import invocation


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--copies", type=int, default=1, help="copies of the HAR windows (10,411 each) in the store")
    p.add_argument("--label", default="", help="what this measures (e.g. before, after)")
    p.add_argument("--out", default="bench/operations/store_load_peak.jsonl", help="JSON lines to append to")
    a = p.parse_args()
    import dfl_agent
    from dfl_agent.data import load_dataset
    from dfl_agent.runtime.shared.config import config_from_dict
    from dfl_agent.runtime.shared.sample_store import open_store, store_data

    state = Path(tempfile.mkdtemp(prefix="dfl-storeload-"))
    cfg = config_from_dict({"federation": "f", "state_dir": str(state),
                            "data": {"dataset": "store", "input_shape": [3, 128], "num_classes": 6}})
    store = open_store(cfg)
    har = load_dataset("har")
    x, y = np.concatenate([har.pool.x, har.test.x]), np.concatenate([har.pool.y, har.test.y])
    spool = Path(store.spool_dir)
    spool.mkdir(parents=True, exist_ok=True)
    store.settle_seconds = 0
    for c in range(a.copies):
        np.savez(spool / f"har{c}.npz", x=x + np.float32(c * 1e-3), y=y)
        store.ingest_spool()
    ids = store.snapshot()
    windows_mb = len(ids) * int(np.prod(x.shape[1:])) * 4 / 2**20
    tracemalloc.start()
    t0 = time.perf_counter()
    _, data = store_data(store, ids, cfg.data.validation_share)
    seconds = time.perf_counter() - t0
    kept, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    rec = {"label": a.label, "command": invocation(), "commit": commit(), "machine": machine(),
           "package": str(Path(dfl_agent.__file__).parent), "time": time.strftime("%Y-%m-%d %H:%M:%S"),
           "samples": int(len(ids)), "train": int(len(data.train_y)), "validation": int(len(data.val_y)),
           "windows_mb": round(windows_mb, 1), "peak_mb": round(peak / 2**20, 1), "kept_mb": round(kept / 2**20, 1),
           "peak_over_windows": round(peak / 2**20 / windows_mb, 2), "seconds": round(seconds, 2)}
    with open(a.out, "a", encoding="utf-8") as f:
        f.write(json.dumps(rec) + "\n")
    print(json.dumps(rec))
    return 0


if __name__ == "__main__":
    sys.exit(main())
