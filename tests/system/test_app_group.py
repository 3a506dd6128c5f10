"""The device's application, another user in the agent's group, can write the spool and
read the deployed model (needs root: creates a user and a group)."""

from __future__ import annotations

import grp
import os
import pwd
import shutil
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.slow

AGENT = textwrap.dedent("""
    import io, sys, numpy as np
    from dfl_agent.store import SampleStore, Schema
    from dfl_agent.deploy import ModelStore
    state = sys.argv[1]
    s = SampleStore(state, Schema((2, 3), 2), settle_seconds=0)
    if sys.argv[2] == "setup":
        ModelStore(state).install({"model.safetensors": b"weights", "spec.json": b"{}"}, {"run_id": "r1"})
    else:
        print(s.ingest_spool()["samples"])
""")

APP = textwrap.dedent("""
    import io, json, os, sys, numpy as np
    state = sys.argv[1]
    buf = io.BytesIO(); np.savez(buf, x=np.zeros((4, 2, 3), np.float32), y=np.array([0, 1, 0, 1]))
    tmp = os.path.join(state, "spool", ".app.npz.tmp")
    open(tmp, "wb").write(buf.getvalue())
    os.rename(tmp, os.path.join(state, "spool", "app.npz"))
    folder = os.path.realpath(os.path.join(state, "models", "current"))
    print(json.load(open(os.path.join(folder, "manifest.json")))["run_id"],
          open(os.path.join(folder, "model.safetensors"), "rb").read().decode())
    try:
        os.listdir(os.path.join(state, "store"))
        print("store readable")
    except PermissionError:
        print("store private")
""")


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("useradd") is None, reason="needs root and useradd")
def test_application_in_the_group_writes_the_spool_and_reads_the_model(tmp_path):
    tag = str(os.getpid())[-5:]
    group, agent, app = f"dflg{tag}", f"dfla{tag}", f"dflapp{tag}"
    subprocess.run(["groupadd", group], check=True)
    try:
        subprocess.run(["useradd", "-M", "-g", group, agent], check=True)
        subprocess.run(["useradd", "-M", "-G", group, app], check=True)
        gid = grp.getgrnam(group).gr_gid
        # what systemd does: StateDirectory owned by the agent, StateDirectoryMode=0750
        state = tmp_path / "state"
        state.mkdir()
        os.chown(state, pwd.getpwnam(agent).pw_uid, gid)
        os.chmod(state, 0o750)
        os.chmod(tmp_path, 0o755)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
        run = lambda user, code, *args, **kw: subprocess.run(  # noqa: E731
            [sys.executable, "-c", code, str(state), *args], user=user, umask=0o027, env=env, cwd="/",
            capture_output=True, text=True, check=False, **kw)
        try:
            probe = run(app, "import numpy, dfl_agent", extra_groups=[group])
        except PermissionError:
            probe = None
        if probe is None or probe.returncode != 0:
            pytest.skip("this Python or dfl_agent is not readable by other users (e.g. under /root)")
        r = run(agent, AGENT, "setup", group=group)
        assert r.returncode == 0, r.stderr
        r = run(app, APP, extra_groups=[group])
        assert r.returncode == 0, r.stderr
        assert r.stdout.split("\n")[0] == "r1 weights" and "store private" in r.stdout
        r = run(agent, AGENT, "ingest", group=group)
        assert r.returncode == 0 and r.stdout.strip() == "4", r.stderr
    finally:
        for u in (agent, app):
            subprocess.run(["userdel", u], check=False, capture_output=True)
        subprocess.run(["groupdel", group], check=False, capture_output=True)
