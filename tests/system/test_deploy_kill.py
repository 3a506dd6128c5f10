"""Deployment under SIGKILL, with an application reading ``models/current/`` meanwhile.

A torch-free process installs pre-exported models (two different ones, alternating,
each with a unique spec.json) in a loop and is SIGKILLed at random moments; a reader
process resolves ``current`` and checks every file against its manifest's SHA-256 in a
loop.  Neither ever sees a partial or mismatched version."""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from dfl_agent.deploy import ModelStore, verify_folder  # noqa: E402

pytestmark = pytest.mark.slow

INSTALL = textwrap.dedent("""
    import json, sys, time
    from pathlib import Path
    from dfl_agent.deploy import ModelStore
    assert "torch" not in sys.modules
    src, state = Path(sys.argv[1]), sys.argv[2]
    models = {m: {p.name: p.read_bytes() for p in (src / m).iterdir()} for m in ("a", "b")}
    store = ModelStore(state, keep=3)
    i = 0
    while True:
        files = dict(models["ab"[i % 2]])
        spec = json.loads(files["spec.json"]); spec["nonce"] = time.time_ns()
        files["spec.json"] = json.dumps(spec).encode()
        store.install(files, {"run_id": f"r{i}", "round": i, "algorithm": "fedavg", "accuracy": 0.5})
        i += 1
""")

READER = textwrap.dedent("""
    import hashlib, json, os, sys, time
    root = os.path.join(sys.argv[1], "models")
    end = time.time() + float(sys.argv[2])
    reads = mismatches = vanished = 0
    seen = set()
    while time.time() < end:
        try:
            folder = os.path.realpath(os.path.join(root, "current"))
            manifest = json.load(open(os.path.join(folder, "manifest.json")))
            for name, info in manifest["files"].items():
                data = open(os.path.join(folder, name), "rb").read()
                if hashlib.sha256(data).hexdigest() != info["sha256"] or len(data) != info["bytes"]:
                    mismatches += 1
            json.load(open(os.path.join(folder, "spec.json")))
            reads += 1
            seen.add(manifest["version"])
        except FileNotFoundError:
            vanished += 1   # not deployed yet, or pruned while read: resolve again
    print(json.dumps({"reads": reads, "mismatches": mismatches, "vanished": vanished, "versions": len(seen)}))
""")


def test_sigkill_during_deploy_and_reader_never_sees_a_partial_version(tmp_path):
    from dfl_agent.deploy.gate import model_files
    from dfl_agent.models import build_model, default_spec

    spec = default_spec((3, 16), 4, "small")
    x = np.random.default_rng(0).normal(size=(8, 3, 16)).astype(np.float32)
    for i, m in enumerate("ab"):
        torch.manual_seed(i)
        files = model_files(build_model(spec), spec, (3, 16), list("abcd"), x, onnx=None if m == "a" else False)
        (tmp_path / m).mkdir()
        for name, data in files.items():
            (tmp_path / m / name).write_bytes(data)
    state = tmp_path / "state"
    reader = subprocess.Popen([sys.executable, "-c", READER, str(state), "17"], stdout=subprocess.PIPE, text=True)
    rnd = random.Random(7)
    kills = 0
    models = ModelStore(state, keep=3)
    deadline = time.time() + 14
    while time.time() < deadline:
        proc = subprocess.Popen([sys.executable, "-c", INSTALL, str(tmp_path), str(state)])
        time.sleep(rnd.uniform(0.3, 1.2))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        kills += 1
        # after every kill: each kept version is complete, current points at one
        for v in models.versions():
            m = verify_folder(models.folder(v))
            assert m["version"] == v
        if models.versions():
            assert models.current_version() in models.versions()
            verify_folder(state / "models" / "current")
    out, _ = reader.communicate(timeout=60)
    stats = json.loads(out)
    assert kills >= 8
    assert stats["mismatches"] == 0, stats
    assert stats["reads"] > 50 and stats["versions"] > 5, stats
    assert models._last_version() >= 8
