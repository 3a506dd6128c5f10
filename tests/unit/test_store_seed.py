"""The store's seed file (``data.path/train.npz``): ingested once in the store's life, its
samples and its record in one SQLite transaction - across restarts, with the same file or
another one, and across a process killed in the middle of the transaction."""

from __future__ import annotations

import io
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from dfl_agent.runtime.shared.config import config_from_dict
from dfl_agent.runtime.shared.sample_store import open_store, seed_store
from dfl_agent.store import SampleStore, Schema, StoreError

SCHEMA = Schema((3, 8), 4)


def write_seed(folder, n, seed=0):
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    np.savez(buf, x=rng.normal(size=(n, 3, 8)).astype(np.float32), y=rng.integers(0, 4, n))
    (folder / "train.npz").write_bytes(buf.getvalue())
    return folder / "train.npz"


def config(tmp_path, seed_dir):
    return config_from_dict({"state_dir": str(tmp_path / "state"), "data": {
        "dataset": "store", "input_shape": [3, 8], "num_classes": 4, "path": str(seed_dir)}})


def test_the_seed_file_is_ingested_once_across_restarts_and_other_files(tmp_path):
    write_seed(tmp_path / "seed", 400)
    cfg = config(tmp_path, tmp_path / "seed")
    store = open_store(cfg)
    assert seed_store(store, cfg.data.path) == 400
    rec = store.status()["seed"]
    assert rec["name"] == "train.npz" and rec["samples"] == 400 and len(rec["sha256"]) == 64
    store.close()
    store = open_store(cfg)  # a restart: same file
    assert seed_store(store, cfg.data.path) == 0 and store.count() == 400
    store.close()
    write_seed(tmp_path / "seed", 50, seed=1)  # the file was replaced: still the first seed only
    store = open_store(cfg)
    assert seed_store(store, cfg.data.path) == 0 and store.count() == 400
    assert store.status()["seed"] == rec and store.status()["ingested_files"] == 1


def test_a_seed_already_in_the_store_is_recorded_without_new_samples(tmp_path):
    seed = write_seed(tmp_path / "seed", 30)
    store = SampleStore(tmp_path / "state", SCHEMA)
    assert store.ingest_file(seed)["status"] == "ingested"  # e.g. an older agent ingested it
    assert store.seeded() is None
    assert store.seed(seed)["status"] == "duplicates" and store.count() == 30
    assert store.seeded()["sha256"] == store.status()["seed"]["sha256"]


def test_a_rejected_seed_file_names_itself_and_leaves_no_record(tmp_path):
    (tmp_path / "seed").mkdir()
    (tmp_path / "seed" / "train.npz").write_bytes(b"not an archive")
    cfg = config(tmp_path, tmp_path / "seed")
    store = open_store(cfg)
    with pytest.raises(StoreError, match=r"train\.npz: not an \.npz archive"):
        seed_store(store, cfg.data.path)
    assert store.seeded() is None and store.count() == 0
    write_seed(tmp_path / "seed", 25)  # corrected: taken at the next start
    assert seed_store(store, cfg.data.path) == 25


KILL_IN_TRANSACTION = """
import os, signal, sys
from dfl_agent.store import SampleStore, Schema
from dfl_agent.store import sqlite as m

def killed(self, now):  # runs inside the insert's transaction, after the rows and the record
    print(self.db.execute("SELECT COUNT(*) FROM samples").fetchone()[0],
          self.db.execute("SELECT COUNT(*) FROM meta WHERE key='seed'").fetchone()[0], flush=True)
    os.kill(os.getpid(), signal.SIGKILL)

if sys.argv[2] == "kill":
    m.SampleStore._evict = killed
store = SampleStore(sys.argv[1], Schema((3, 8), 4))
print(store.seed(sys.argv[3])["status"], flush=True)
"""


@pytest.mark.parametrize("kill", [True, False])
def test_a_process_killed_while_seeding_leaves_the_store_seeded_or_not(tmp_path, kill):
    seed = write_seed(tmp_path / "seed", 400)
    state = tmp_path / "state"
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(KILL_IN_TRANSACTION), str(state),
                        "kill" if kill else "no", str(seed)], capture_output=True, text=True, timeout=120)
    store = SampleStore(state, SCHEMA)
    if kill:
        assert r.returncode == -9 and r.stdout.split() == ["400", "1"], r.stderr  # both were in the transaction
        assert store.count() == 0 and store.seeded() is None  # ... and neither committed
        assert store.seed(seed)["status"] == "ingested"  # so the next start seeds
    else:
        assert r.returncode == 0 and r.stdout.split() == ["ingested"], r.stderr
        assert store.seed(seed)["status"] == "seeded_before"
    assert store.count() == 400 and store.seeded()["samples"] == 400
