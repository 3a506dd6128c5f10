"""A newcomer's walkthrough, timed: a fresh clone, the first-federation and live-data tutorials'
blocks as written (the install blocks included), and a small onnxruntime application written
from the example in ``docs/data-and-models.md``, using the model the live tutorial deployed.

    nice -n 10 .venv/bin/python bench/newcomer/walkthrough.py --repo . --work /tmp/newcomer --out bench/results/newcomer.json

``HOME`` is a fresh folder under ``--work`` (the tutorials' ``~/dfl-venv`` lies there); pip keeps
this machine's configuration and cache (``XDG_CONFIG_HOME``, ``XDG_CACHE_HOME``). The blocks run in
one bash script (``set -euo pipefail``), in order, in the clone's root, as one reader's shell: a
failing block stops there, and the walk goes on with the next block in the folder and with the
``PATH`` the shell had (as a reader who reads the error and carries on). Each step's start is
stamped with the time and the load average; the results file holds every step's wall time, the
steps that failed with their last lines, and the output's tail.
Reading the pages is not timed: the figures are the machine's part of the walk.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

APP_NOTE = "the example of docs/data-and-models.md with the tutorial's models folder and node 0's windows"


def blocks(page: Path) -> list[str]:
    return re.findall(r"```bash\n(.*?)```", page.read_text(encoding="utf-8"), flags=re.S)


def app_source(clone: Path) -> str:
    """The application a reader writes from the onnxruntime example of data-and-models.md: the
    example as it stands, pointed at the live tutorial's node 0 and fed that node's windows."""
    page = (clone / "docs" / "data-and-models.md").read_text(encoding="utf-8")
    m = re.search(r"### Example: predict with onnxruntime.*?```python\n(.*?)```", page, flags=re.S)
    if not m:
        raise SystemExit("docs/data-and-models.md has no onnxruntime example")
    src = m.group(1).replace('"/var/lib/dfl-agent/models"', '"node0/models"')
    return re.sub(r"^windows = .*$", 'windows = np.load("samples-node0.npz")["x"][:8].astype(np.float32)',
                  src, flags=re.M)


def user_env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
    env["XDG_CONFIG_HOME"] = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    env["XDG_CACHE_HOME"] = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    env["HOME"] = str(home)
    skip = {str(Path(sys.executable).parent), str(Path(sys.prefix) / "bin")}
    env["PATH"] = os.pathsep.join([p for p in env.get("PATH", "").split(os.pathsep) if p and p not in skip]
                                  + ["/usr/sbin"])
    env["PYTHONUNBUFFERED"] = "1"
    return env


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repo", default=".", help="the repository to clone (its checked-out branch)")
    p.add_argument("--work", type=Path, required=True, help="an empty folder for the clone and HOME")
    p.add_argument("--out", type=Path, required=True, help="the results file (JSON)")
    a = p.parse_args()
    a.work.mkdir(parents=True, exist_ok=False)
    home, clone = a.work / "home", a.work / "dfl-agent"
    home.mkdir()
    repo = str(Path(a.repo).resolve())
    branch = subprocess.run(["git", "-C", repo, "rev-parse", "--abbrev-ref", "HEAD"], capture_output=True,
                            text=True, check=True).stdout.strip()
    t0, load0 = time.time(), os.getloadavg()
    subprocess.run(["git", "clone", "-q", "--branch", branch, repo, str(clone)], check=True)
    commit = subprocess.run(["git", "-C", str(clone), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, check=True).stdout.strip()
    ff, live = blocks(clone / "docs/tutorials/first-federation.md"), blocks(clone / "docs/tutorials/live-data.md")
    app = app_source(clone)
    plan = [(f"first-federation {i + 1}", b) for i, b in enumerate(ff)]
    plan += [(f"live-data {i}" if i else "live-data install", b) for i, b in enumerate(live[:-1])]
    # the reader writes app.py in the live tutorial's folder (the shell is there after its blocks)
    plan += [("app.py (onnxruntime)", f"cat > app.py <<'PY'\n{app}PY\npython3 app.py\n"),
             (f"live-data {len(live) - 1} (stop)", live[-1])]
    env, cwd, start, runs = user_env(home), clone, 0, []
    state = a.work / "shell-state"
    while start < len(plan):  # a failed block: the reader reads its error and goes on with the next one
        script = ["set -euo pipefail"]
        for k, (label, block) in enumerate(plan[start:], start):
            script.append(f'printf "%s\\n%s" "$PWD" "$PATH" > {shlex.quote(str(state))}')
            script.append(f'echo "@@ {k}|{label}|$(date +%s.%N)|$(cut -d" " -f1 /proc/loadavg)"')
            script.append(block)
        script.append('echo "@@ end|end|$(date +%s.%N)|$(cut -d" " -f1 /proc/loadavg)"')
        proc = subprocess.run(["bash", "-c", "\n".join(script)], cwd=cwd, env=env, capture_output=True, text=True,
                              start_new_session=True)
        marks = [(int(m.group(1)) if m.group(1) != "end" else None, m.group(2), float(m.group(3)), float(m.group(4)))
                 for m in re.finditer(r"^@@ (\w+)\|(.*?)\|([\d.]+)\|([\d.]+)$", proc.stdout, flags=re.M)]
        runs.append({"from_step": plan[start][0], "exit_code": proc.returncode, "marks": marks,
                     "stdout": proc.stdout, "stderr": proc.stderr})
        if proc.returncode == 0 or not marks or marks[-1][0] is None:
            break
        failed = marks[-1][0]
        cwd_s, path = state.read_text().split("\n", 1)
        cwd, env = Path(cwd_s), {**env, "PATH": path}
        start = failed + 1
    end_t = time.time()
    flat = [m for r in runs for m in r["marks"]]
    failed_steps = {r["marks"][-1][1]: r["stderr"].strip().splitlines()[-3:] for r in runs
                    if r["exit_code"] and r["marks"] and r["marks"][-1][0] is not None}
    rows = []
    for (k, label, t, load), nxt in zip([(None, "clone", t0, load0[0]), *flat], [*flat, (None, "", end_t, 0.0)]):
        if label == "end":
            continue
        rows.append({"step": label, "wall_s": round(nxt[2] - t, 1), "load_at_start": round(load, 2),
                     "failed": failed_steps.get(label)})
    out = "".join(r["stdout"] for r in runs)
    app_out = re.search(r"^@@ \d+\|app\.py.*?\n(.*?)^@@ ", out, flags=re.M | re.S)
    stop_t = next((m[2] for m in flat if "(stop)" in m[1]), end_t)
    res = {"command": shlex.join([os.path.relpath(sys.executable), *sys.argv]), "branch": branch, "commit": commit,
           "machine": f"{os.uname().machine}, {os.cpu_count()} cores", "exit_code": runs[-1]["exit_code"],
           "clone_to_app_s": round(stop_t - t0, 1), "steps": rows, "app": app, "app_note": APP_NOTE,
           "app_output": app_out.group(1).strip() if app_out else None,
           "stdout_tail": out[-8000:], "stderr_tails": [r["stderr"][-3000:] for r in runs]}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(res, indent=1))
    for r in rows:
        print(f"{r['step']:<32} {r['wall_s']:>7.1f} s   load {r['load_at_start']}"
              + (f"   FAILED: {r['failed'][-1]}" if r["failed"] else ""))
    print(f"clone to the app's output: {res['clone_to_app_s']} s; app printed: {res['app_output']}")
    return 1 if failed_steps or res["exit_code"] else 0


if __name__ == "__main__":
    sys.exit(main())
