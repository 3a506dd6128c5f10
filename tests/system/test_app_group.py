"""The device's application, another user in the agent's group, can write the spool and
read the deployed model; a user outside the group can do neither.

Needs root (creates a group and two users).  The agent side runs as root with the
shipped unit's settings that matter here: primary group ``Group=`` (the test's group),
``UMask=0027`` and a state directory of mode ``StateDirectoryMode=0750``.  The other users
run no Python: only ``sh``, ``cp``, ``mv``, ``cat`` and ``ls`` through ``runuser``.
"""

from __future__ import annotations

import grp
import io
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.slow

AGENT = textwrap.dedent("""
    import json, sys
    from dfl_agent.store import SampleStore, Schema
    from dfl_agent.deploy import ModelStore
    state = sys.argv[1]
    s = SampleStore(state, Schema((2, 3), 2), settle_seconds=0)
    if sys.argv[2] == "setup":
        ModelStore(state).install({"model.safetensors": b"weights", "spec.json": b"{}"}, {"run_id": "r1"})
    else:
        print(json.dumps({"pass": s.ingest_spool(), "samples": s.count()}))
""")


def _unit_settings():
    """``UMask`` and ``StateDirectoryMode`` of the shipped unit (the test applies them)."""
    from dfl_agent.resources import resource_dir

    text = (Path(resource_dir("systemd")) / "dfl-agent.service").read_text(encoding="utf-8")
    keys = dict(line.split("=", 1) for line in text.splitlines() if "=" in line and not line.startswith("#"))
    return int(keys["UMask"], 8), int(keys["StateDirectoryMode"], 8)


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0
                    or not all(shutil.which(c) for c in ("useradd", "groupadd", "runuser")),
                    reason="needs root, useradd, groupadd and runuser")
def test_application_in_the_group_writes_the_spool_and_reads_the_model():
    umask, state_mode = _unit_settings()
    assert (umask, state_mode) == (0o027, 0o750)
    tag = f"{os.getpid() % 100000:05d}"
    group, app, outsider = f"dflg{tag}", f"dflapp{tag}", f"dflout{tag}"
    base = Path(tempfile.mkdtemp(prefix="dfl-app-group-", dir="/tmp"))  # reachable by other users
    os.chmod(base, 0o755)
    made: list[str] = []
    try:
        subprocess.run(["groupadd", group], check=True)
        for user, extra in ((app, ["-G", group]), (outsider, [])):
            subprocess.run(["useradd", "-M", "-N", "-s", "/bin/sh", *extra, user], check=True)
            made.append(user)
        gid = grp.getgrnam(group).gr_gid
        # what systemd does with StateDirectory=: the folder, owned by the agent's group
        state = base / "state"
        state.mkdir()
        os.chown(state, 0, gid)
        os.chmod(state, state_mode)

        def agent(step):  # the agent: Group= the group, UMask= the unit's
            r = subprocess.run([sys.executable, "-c", AGENT, str(state), step], group=gid, extra_groups=[],
                               umask=umask, capture_output=True, text=True, check=False, timeout=120)
            assert r.returncode == 0, r.stderr
            return r.stdout

        def as_user(user, script):
            return subprocess.run(["runuser", "-u", user, "--", "sh", "-c", script], cwd=str(base),
                                  capture_output=True, text=True, check=False, timeout=60)

        agent("setup")
        spool, models, store = state / "spool", state / "models", state / "store"
        for path, want in ((spool, 0o2770), (models, 0o750), (models / "v1", 0o750),
                           (models / "v1" / "manifest.json", 0o640), (store, 0o700)):
            st = os.stat(path)
            assert stat.S_IMODE(st.st_mode) == want and st.st_gid == gid, (path, oct(st.st_mode), st.st_gid)
        buf = io.BytesIO()
        np.savez(buf, x=np.zeros((4, 2, 3), np.float32), y=np.array([0, 1, 0, 1]))
        (base / "x.npz").write_bytes(buf.getvalue())
        os.chmod(base / "x.npz", 0o644)

        # the application: writes under a temporary name, renames; reads the deployed model
        r = as_user(app, "cp x.npz state/spool/.app.npz.tmp && mv state/spool/.app.npz.tmp state/spool/app.npz")
        assert r.returncode == 0, r.stderr
        r = as_user(app, "cat state/models/current/manifest.json")
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["run_id"] == "r1"
        r = as_user(app, "cat state/models/current/model.safetensors")
        assert r.returncode == 0 and r.stdout == "weights", r.stderr
        r = as_user(app, "ls state/store")  # the sample store itself stays private to the agent
        assert r.returncode != 0 and "Permission denied" in r.stderr

        # a user outside the group can neither write the spool nor read the model
        r = as_user(outsider, "cp x.npz state/spool/.out.npz.tmp")
        assert r.returncode != 0 and "Permission denied" in r.stderr
        r = as_user(outsider, "cat state/models/current/manifest.json")
        assert r.returncode != 0 and "Permission denied" in r.stderr
        assert sorted(p.name for p in spool.iterdir() if p.is_file()) == ["app.npz"]

        # the agent ingests the application's file
        out = json.loads(agent("ingest"))
        assert out["pass"]["ingested"] == 1 and out["samples"] == 4, out
        assert not (spool / "app.npz").exists()
    finally:
        for user in made:
            subprocess.run(["userdel", user], check=False, capture_output=True)
        subprocess.run(["groupdel", group], check=False, capture_output=True)
        shutil.rmtree(base, ignore_errors=True)
