"""Peak memory of a run process: always-on agents train a HAR run on their sample stores and
export ONNX for a live inference member; the run processes' RSS is sampled every 50 ms.

Starts mosquitto, ``--nodes`` signed always-on ``dfl-agent run`` processes (no
``[algorithm]``: they wait for runs; ``data.dataset = "store"`` with HAR windows, 3 x 128,
6 classes, the default model and profile, mDNS off) and one inference member
(``dfl-infer run``, enrolled, signing), each agent's spool holding the windows of its share
of the HAR pool's users.  Once every agent is idle and sees the member, it submits ``--runs``
fedavg runs of ``--rounds`` rounds to all of them, one after the other, with ``dflctl run submit``
and an operator key.  A sampler thread reads, every ``--every`` seconds, the RSS of every
process under each supervisor (psutil): the run process, and any process it starts.  Each mode
starts fresh agents:

* ``live``: ``deploy.enabled = false``: the run exports its improved model to ONNX after
  each evaluated round that improved it while the member is live (the live export);
* ``deploy``: deployment on, with ONNX: the run exports the deployed candidate after its
  last round (and the supervisor delivers it to the member); the second run starts from the
  deployed model (the warm start, with its probe fit).

For each run and node: the run process's peak RSS, when it happened, the agent's last log line
before it (the phase), and the ``peak_rss_mb`` the run recorded in its ledger entry (where the
package records one); per node the supervisor's peak and the peak of its process tree.
Writes ``--name`` (JSON) in ``--out``.

    nice -n 10 .venv/bin/python bench/operations/run_peak.py --out bench/operations
    python bench/operations/run_peak.py --report bench/operations/run_peak*.json > bench/operations/run_peak.md

``--agent-pythonpath DIR`` runs the agents and the member from another copy of the package
(an earlier commit laid out as installed, ``DIR/dfl_agent``; see README.md).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import psutil
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from idle import commit, machine
from runs_timing import invocation, node_config, operator_dir, start_agent, submit

from dfl_agent.cli.broker import start_broker
from dfl_agent.cli.observer import Observer
from dfl_agent.security.keys import enroll_local, public_key_b64

MB = 2**20
MODES = ("live", "deploy")


class Sampler(threading.Thread):
    """RSS of every descendant of the ``supervisors`` (pid -> psutil.Process) every ``every``
    seconds: per descendant its peak and a 0.5 s timeline; per supervisor its own peak and the
    peak of the sum over its descendants."""

    def __init__(self, supervisors: dict[str, psutil.Process], every: float):
        super().__init__(daemon=True)
        self.sups, self.every = supervisors, every
        self.halt = threading.Event()
        self.procs: dict[int, dict[str, Any]] = {}
        self.sup_peak = {n: 0.0 for n in supervisors}
        self.tree_peak = {n: 0.0 for n in supervisors}
        self.samples = 0

    def run(self) -> None:
        while not self.halt.is_set():
            now = time.time()
            for node, sup in self.sups.items():
                try:
                    self.sup_peak[node] = max(self.sup_peak[node], sup.memory_info().rss / MB)
                    kids = sup.children(recursive=True)
                except psutil.Error:
                    continue
                total = 0.0
                for k in kids:
                    try:
                        rss = k.memory_info().rss / MB
                        info = self.procs.get(k.pid)
                        if info is None:
                            info = self.procs[k.pid] = {
                                "node": node, "pid": k.pid, "parent": k.ppid(), "started": k.create_time(),
                                "kind": "", "peak_rss_mb": 0.0, "peak_at": 0.0, "timeline": []}
                        if info["kind"] != "run process":  # the parent's command line until the exec
                            cmd = k.cmdline()
                            info["kind"] = "run process" if "dfl_agent.runtime.run.run_process" in cmd else " ".join(cmd[:4])
                    except psutil.Error:
                        continue
                    total += rss
                    if rss > info["peak_rss_mb"]:
                        info["peak_rss_mb"], info["peak_at"] = rss, now
                    tl = info["timeline"]
                    if not tl or now - info["started"] - tl[-1][0] >= 0.5:
                        tl.append([round(now - info["started"], 2), round(rss, 1)])
                self.tree_peak[node] = max(self.tree_peak[node], total)
            self.samples += 1
            self.halt.wait(self.every)


def log_lines(path: Path) -> list[tuple[float, str]]:
    """The agent log's timestamped lines (``YYYY-mm-dd HH:MM:SS,mmm LEVEL name: text``) as
    (epoch seconds, text)."""
    out = []
    for ln in path.read_text(errors="replace").splitlines():
        try:
            t = datetime.datetime.strptime(ln[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
        except ValueError:
            continue
        out.append((t, ln[24:]))
    return out


def phase(lines: list[tuple[float, str]], at: float) -> str:
    """The last log line at or before ``at`` (what the agent was doing at its peak)."""
    before = [text for t, text in lines if t <= at]
    return before[-1][:200] if before else ""


def har_shares(nodes: int) -> list[tuple[list[int], np.ndarray, np.ndarray]]:
    """The HAR pool's users dealt round-robin to ``nodes`` nodes: per node (users, x, y)."""
    from dfl_agent.data import load_dataset

    pool = load_dataset("har").pool
    users = [int(u) for u in np.unique(pool.groups)]
    out = []
    for i in range(nodes):
        mine = users[i::nodes]
        m = np.isin(pool.groups, mine)
        out.append((mine, pool.x[m].astype(np.float32), pool.y[m].astype(np.int64)))
    return out


def ledger(state: Path) -> dict:
    try:
        return json.loads((state / "runs" / "ledger.json").read_text())
    except (OSError, ValueError):
        return {}


def one_mode(mode: str, a: argparse.Namespace, shares: list) -> dict[str, Any]:
    """Fresh agents and member, one run in ``mode``; the figures of its run processes."""
    tmp = Path(tempfile.mkdtemp(prefix=f"dfl-runpeak-{mode}-"))
    fed, fed_key = "runpeak", Ed25519PrivateKey.generate()
    op = operator_dir(tmp, fed_key, fed)
    ids = [f"p{i}" for i in range(a.nodes)]
    env = None if a.agent_pythonpath is None else {**os.environ, "PYTHONPATH": a.agent_pythonpath}
    deploy = "" if mode == "deploy" else "[deploy]\nenabled = false\n"
    out: dict[str, Any] = {"mode": mode, "nodes": {}}
    with start_broker("mosquitto") as broker:
        procs, logs = {}, {}
        for nid, (users, x, y) in zip(ids, shares):
            path = node_config(tmp, fed_key, fed, nid, broker.endpoint,
                               '[data]\ndataset = "store"\ninput_shape = [3, 128]\nnum_classes = 6\n'
                               f'spool_interval = 0.5\n{deploy}'
                               f'[discovery]\nmin_peers = {a.nodes - 1}\nmdns = false\n')
            (tmp / nid / "spool").mkdir(parents=True, exist_ok=True)
            np.savez(tmp / nid / "spool" / "har.npz", x=x, y=y)
            out["nodes"][nid] = {"users": users, "windows": len(y)}
            logs[nid] = tmp / f"{nid}.log"
            procs[nid] = start_agent(path, logs[nid], a.agent_pythonpath)
        member_state = tmp / "member"
        enroll_local(fed_key, fed, "member", member_state)
        (tmp / "member.toml").write_text(
            f'federation = "{fed}"\nnode_id = "member"\nstate_dir = "{member_state}"\n[mqtt]\nbroker = '
            f'"{broker.endpoint}"\n[security]\nrequire_signatures = true\nfederation_key = "{public_key_b64(fed_key)}"\n')
        member = subprocess.Popen([sys.executable, "-m", "dfl_agent.cli.infer", "run", "--config",
                                   str(tmp / "member.toml")], stdout=open(tmp / "member.log", "w"),
                                  stderr=subprocess.STDOUT, env=env)
        obs = Observer(broker.endpoint, fed).start()
        sampler = Sampler({n: psutil.Process(p.pid) for n, p in procs.items()}, a.every)
        try:
            def wait(cond: Any, timeout: float, what: str) -> None:
                end = time.monotonic() + timeout
                while not cond():
                    dead = [n for n, p in procs.items() if p.poll() is not None]
                    if dead or time.monotonic() > end:
                        tails = {n: logs[n].read_text()[-2000:] for n in ids}
                        raise RuntimeError(f"{mode}: {what}: {'agents exited ' + str(dead) if dead else 'timeout'}"
                                           f"\n{json.dumps(tails, indent=1)}")
                    time.sleep(0.1)

            wait(lambda: all(obs.snapshot()[0].get(n, {}).get("state") == "idle" for n in ids)
                 and "member" in obs.snapshot()[0], 300, "agents idle and the member seen")
            # every window ingested before the run (its snapshot is the whole share)
            wait(lambda: all(not any((tmp / n / "spool").glob("*.npz")) for n in ids), 120, "spools ingested")
            sampler.start()
            runs: list[dict[str, Any]] = []
            for k in range(1, a.runs + 1):
                load0 = os.getloadavg()
                t0 = time.time()
                rid = submit(broker.endpoint, fed, op, "--algorithm", "fedavg", "--rounds", str(a.rounds),
                             "--min-members", str(a.nodes), "--name", f"peak-{mode}-{k}")
                wait(lambda: all(ledger(tmp / n).get(rid, {}).get("state") in ("finished", "failed", "cancelled")
                                 for n in ids), a.timeout, f"run {k} ended")
                wait(lambda: not any(psutil.Process(p.pid).children() for p in procs.values()), 120,
                     "run processes exited")
                runs.append({"run": k, "run_id": rid, "started": t0, "wall_s": round(time.time() - t0, 1),
                             "load_average": [round(x, 1) for x in (*load0, *os.getloadavg())], "nodes": {}})
                time.sleep(1.0)
            sampler.halt.set()
            sampler.join()
        finally:
            obs.stop()
            for p in (*procs.values(), member):
                p.send_signal(signal.SIGTERM)
            for p in (*procs.values(), member):
                try:
                    p.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    p.kill()
    out |= {"runs": runs, "samples": sampler.samples, "member_holds_a_model": (member_state / "model.onnx").exists(),
            "state_dir": str(tmp)}
    for nid in ids:
        lines = log_lines(logs[nid])
        mine = sorted((p for p in sampler.procs.values() if p["node"] == nid), key=lambda p: p["started"])
        rps = [p for p in mine if p["kind"] == "run process"]
        out["nodes"][nid] |= {"supervisor_peak_rss_mb": round(sampler.sup_peak[nid], 1),
                              "tree_peak_rss_mb": round(sampler.tree_peak[nid], 1),
                              "other_processes": [{k: p[k] for k in ("kind", "pid", "peak_rss_mb")}
                                                  for p in mine if p["kind"] != "run process"]}
        for run in runs:  # a run's run process: the first one started after its submission
            entry = ledger(tmp / nid).get(run["run_id"], {})
            p = next((p for p in rps if p["started"] >= run["started"] - 1.0), None)
            node: dict[str, Any] = {"ledger_state": entry.get("state"), "ledger_peak_rss_mb": entry.get("peak_rss_mb"),
                                    "started_from": entry.get("started_from")}
            if p is not None:
                rps.remove(p)
                node |= {"run_process_peak_rss_mb": round(p["peak_rss_mb"], 1),
                         "peak_after_start_s": round(p["peak_at"] - p["started"], 2),
                         "phase_at_peak": phase(lines, p["peak_at"]), "timeline": p["timeline"]}
            run["nodes"][nid] = node
            print(json.dumps({"mode": mode, "run": run["run"], "node": nid,
                              **{k: v for k, v in node.items() if k != "timeline"}}), flush=True)
    return out


def report(paths: list[str]) -> str:
    """Markdown tables of result files: one row per file, mode, run and node."""
    lines = []
    for path in paths:
        res = json.loads(Path(path).read_text())
        lines += [f"`{Path(path).name}` ({res['label'] or 'no label'}): commit {res['commit']}, "
                  f"agents from {res['agent_pythonpath'] or 'the checkout'}, {res['machine']}, {res['time']}", "",
                  "    " + res["command"], "",
                  "| mode | run | node | windows | run process peak RSS (sampled) | `peak_rss_mb` recorded "
                  "| at (s after its start) | what the agent logged last before the peak | load average |",
                  "|" + "---|" * 9]
        for m in res["modes"]:
            for r in m["runs"]:
                for nid, n in r["nodes"].items():
                    rec = n.get("ledger_peak_rss_mb")
                    lines.append(f"| {m['mode']} | {r['run']} | {nid} | {m['nodes'][nid]['windows']} "
                                 f"| {n.get('run_process_peak_rss_mb')} MB | {'-' if rec is None else f'{rec} MB'} "
                                 f"| {n.get('peak_after_start_s')} | {n.get('phase_at_peak', '')[:110]} "
                                 f"| {' '.join(map(str, r['load_average'][:1] + r['load_average'][3:4]))} |")
        sups = [n["supervisor_peak_rss_mb"] for m in res["modes"] for n in m["nodes"].values()]
        lines += ["", f"Largest run process peak: **{res['max_run_process_peak_rss_mb']} MB**; supervisors "
                      f"{min(sups)}-{max(sups)} MB (MB = 2^20 bytes).", ""]
    return "\n".join(lines)


def main() -> int:
    if sys.argv[1:2] == ["--report"]:
        print(report(sys.argv[2:]))
        return 0
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=2, help="always-on agents (the HAR pool's users dealt among them)")
    p.add_argument("--rounds", type=int, default=3, help="rounds of each run")
    p.add_argument("--runs", type=int, default=2, help="runs one after the other (the second starts from the "
                   "model the first deployed, in mode deploy)")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {MODES}")
    p.add_argument("--every", type=float, default=0.05, help="seconds between RSS samples")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds the run may take")
    p.add_argument("--agent-pythonpath", default=None, help="PYTHONPATH of the agents and the member")
    p.add_argument("--label", default="", help="what this measures (e.g. before, after)")
    p.add_argument("--out", default="bench/operations", help="folder for the results")
    p.add_argument("--name", default="run_peak.json", help="file name of the results in --out")
    a = p.parse_args()
    host = machine()
    shares = har_shares(a.nodes)
    res: dict[str, Any] = {"command": invocation(), "commit": commit(), "label": a.label, "machine": host,
                           "agent_pythonpath": a.agent_pythonpath, "time": time.strftime("%Y-%m-%d %H:%M:%S"),
                           "target": "run process peak RSS at most 400 MB (MB = 2^20 bytes)", "modes": []}
    for mode in a.modes.split(","):
        res["modes"].append(one_mode(mode.strip(), a, shares))
    peaks = [n.get("run_process_peak_rss_mb", 0) for m in res["modes"] for r in m["runs"] for n in r["nodes"].values()]
    res["max_run_process_peak_rss_mb"] = max(peaks) if peaks else None
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / a.name).write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps({k: v for k, v in res.items() if k != "modes"}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
