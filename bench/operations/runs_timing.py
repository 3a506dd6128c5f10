"""Run latency on always-on agents: time from ``dflctl run submit`` until every member
trains, from a run's last round until every member is idle, and (``--cancels``) from
``dflctl run cancel`` until every member stopped.

Starts mosquitto and ``--nodes`` signed ``dfl-agent run`` processes (no ``[algorithm]``
section), waits until all are idle, then submits ``--runs`` fedavg runs one after the
other with an operator key, polling the retained statuses every 50 ms.  Writes
``runs_timing.json``.  With ``--cancels N`` it then submits N long runs (200 steps per
round), cancels each once every member trained 2 rounds, and writes
``cancel_timing.json``: the cancel command's own time, cancel -> every member's status
says cancelled, and per member the round completed when the cancel arrived versus the
last round in its metrics.

    nice -n 10 python bench/operations/runs_timing.py --out bench/operations
    nice -n 10 python bench/operations/runs_timing.py --runs 0 --cancels 3 --out bench/operations
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from dfl_agent.cli.broker import start_broker
from dfl_agent.cli.observer import Observer
from dfl_agent.runtime.shared.descriptor import operator_certificate
from dfl_agent.security.keys import enroll_local, public_key_b64, save_certificate, save_private_key


def invocation(argv: list[str] | None = None) -> str:
    """The command line of this process as it was run: ``nice -n N`` when it runs niced,
    the interpreter (relative to the working directory when inside it) and ``argv``
    (default ``sys.argv``), shell-quoted."""
    exe = sys.executable or "python"
    rel = os.path.relpath(exe)
    exe = rel if not rel.startswith("..") else exe
    niceness = os.nice(0)
    return (f"nice -n {niceness} " if niceness > 0 else "") + shlex.join([exe, *(sys.argv if argv is None else argv)])


def operator_dir(tmp: Path, fed_key: Ed25519PrivateKey, fed: str) -> Path:
    """An operator's key and certificate (signed by the federation key) under ``tmp/op``,
    as ``dflctl run submit --operator-dir`` reads them."""
    op = tmp / "op"
    op.mkdir()
    key = Ed25519PrivateKey.generate()
    save_private_key(key, op / "operator_key.pem")
    save_certificate(operator_certificate(fed_key, fed, "bench", public_key_b64(key)), op / "operator_cert.json")
    return op


def node_config(tmp: Path, fed_key: Ed25519PrivateKey, fed: str, nid: str, broker: str, body: str,
                heartbeat: float | None = 1.0) -> Path:
    """Enroll ``nid`` (state directory ``tmp/nid``) and write ``tmp/nid.toml``: a signed
    federation, no ``[algorithm]`` (the agent waits for runs), ``body`` in between; the
    status heartbeat every ``heartbeat`` seconds (None: the default)."""
    enroll_local(fed_key, fed, nid, tmp / nid)
    path = tmp / f"{nid}.toml"
    hb = "" if heartbeat is None else f"heartbeat_interval = {heartbeat}\n"
    path.write_text(f'federation = "{fed}"\nnode_id = "{nid}"\nstate_dir = "{tmp / nid}"\n{body}'
                    f'[mqtt]\nbroker = "{broker}"\n{hb}'
                    f'[security]\nrequire_signatures = true\nfederation_key = "{public_key_b64(fed_key)}"\n')
    return path


def start_agent(path: Path, log: Path, pythonpath: str | None = None) -> subprocess.Popen:
    """``dfl-agent run --config path`` (always-on), stdout and stderr to ``log``; with
    ``pythonpath``, the agent's ``PYTHONPATH`` (another version of the package)."""
    env = None if pythonpath is None else {**os.environ, "PYTHONPATH": pythonpath}
    return subprocess.Popen([sys.executable, "-m", "dfl_agent.runtime.service.daemon", "run", "--config", str(path)],
                            stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env)


def submit(broker: str, fed: str, op: Path, *args: str) -> str:
    """``dflctl run submit`` signed with the operator in ``op``; the run id."""
    return subprocess.run([sys.executable, "-m", "dfl_agent.cli.dflctl", "run", "submit", "--broker", broker,
                           "--federation", fed, "--operator-dir", str(op), *args], capture_output=True, text=True,
                          check=True).stdout.strip()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=3, help="agents")
    p.add_argument("--runs", type=int, default=3, help="runs submitted one after the other")
    p.add_argument("--rounds", type=int, default=3, help="rounds per run")
    p.add_argument("--cancels", type=int, default=0, help="long runs cancelled after 2 rounds (cancel_timing.json)")
    p.add_argument("--out", default="bench/operations", help="folder for runs_timing.json / cancel_timing.json")
    a = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="dfl-runs-"))
    fed, fed_key = "bench", Ed25519PrivateKey.generate()
    ids = [f"b{i}" for i in range(a.nodes)]
    op = operator_dir(tmp, fed_key, fed)
    results = []
    with start_broker("mosquitto") as broker:
        procs = []
        for i, nid in enumerate(ids):
            path = node_config(tmp, fed_key, fed, nid, broker.endpoint,
                               f'[data]\ndataset = "digits"\npartition = "iid"\nnum_nodes = {a.nodes}\n'
                               f'node_index = {i}\n[model]\nsize = "small"\n[training]\nsteps = 5\n'
                               f'[discovery]\nmin_peers = {a.nodes - 1}\nmdns = false\n')
            procs.append(start_agent(path, tmp / f"{nid}.log"))
        obs = Observer(broker.endpoint, fed).start()

        def runs_of(rid: str) -> dict:
            st = obs.snapshot()[0]
            return {n: st.get(n, {}).get("run") or {} for n in ids if (st.get(n, {}).get("run") or {}).get("id") == rid}

        def wait(cond, timeout: float) -> float:
            end = time.monotonic() + timeout
            while time.monotonic() < end:
                if cond():
                    return time.monotonic()
                time.sleep(0.05)
            raise TimeoutError

        wait(lambda: all(obs.snapshot()[0].get(n, {}).get("state") == "idle" for n in ids), 300)
        for _ in range(a.runs):
            t0 = time.monotonic()
            rid = submit(broker.endpoint, fed, op, "--algorithm", "fedavg", "--rounds", str(a.rounds))
            t_train = wait(lambda: len(runs_of(rid)) == a.nodes
                           and all(r.get("state") in ("training", "finished") for r in runs_of(rid).values()), 300)
            t_last = wait(lambda: len(runs_of(rid)) == a.nodes
                          and all(r.get("round") == a.rounds for r in runs_of(rid).values()), 300)
            t_idle = wait(lambda: all(obs.snapshot()[0].get(n, {}).get("state") == "idle" for n in ids), 300)
            results.append({"run_id": rid, "submit_to_all_training_s": round(t_train - t0, 2),
                            "last_round_to_all_idle_s": round(t_idle - t_last, 2)})
            print(results[-1], flush=True)
        cancels = []
        for _ in range(a.cancels):
            rid = submit(broker.endpoint, fed, op, "--algorithm", "fedavg", "--rounds", "1000", "--training",
                         "steps=200")
            wait(lambda: len(runs_of(rid)) == a.nodes and all(r.get("round", 0) >= 2 for r in runs_of(rid).values()),
                 600)
            t0 = time.monotonic()
            subprocess.run([sys.executable, "-m", "dfl_agent.cli.dflctl", "run", "cancel", rid, "--broker",
                            broker.endpoint, "--federation", fed, "--operator-dir", str(op)], capture_output=True,
                           text=True, check=True)
            t_cmd = time.monotonic()
            t_all = wait(lambda: len(runs_of(rid)) == a.nodes
                         and all(r.get("state") == "cancelled" for r in runs_of(rid).values()), 300)
            members = {}
            for n, r in runs_of(rid).items():
                lines = (tmp / n / "runs" / rid / "metrics.jsonl").read_text().splitlines()
                last = max(json.loads(x)["round"] for x in lines if "neighbour_ids" in x)
                members[n] = {"round_when_cancel_arrived": r.get("round"), "last_round_trained": last}
            cancels.append({"run_id": rid, "cancel_command_s": round(t_cmd - t0, 2),
                            "cancel_to_all_cancelled_s": round(t_all - t0, 2), "members": members})
            print(cancels[-1], flush=True)
            wait(lambda: all(obs.snapshot()[0].get(n, {}).get("state") == "idle" for n in ids), 300)
        obs.stop()
        for pr in procs:
            pr.send_signal(signal.SIGTERM)
        for pr in procs:
            pr.wait(timeout=60)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    command = invocation()
    if results:
        tr = sorted(r["submit_to_all_training_s"] for r in results)
        idl = sorted(r["last_round_to_all_idle_s"] for r in results)
        res = {"command": command, "nodes": a.nodes, "rounds": a.rounds, "runs": results,
               "median_submit_to_all_training_s": tr[len(tr) // 2],
               "median_last_round_to_all_idle_s": idl[len(idl) // 2]}
        (out / "runs_timing.json").write_text(json.dumps(res, indent=1))
        print(json.dumps(res, indent=1))
    if cancels:
        lat = sorted(c["cancel_to_all_cancelled_s"] for c in cancels)
        over = [m["last_round_trained"] - m["round_when_cancel_arrived"] for c in cancels for m in c["members"].values()]
        res = {"command": command, "nodes": a.nodes, "cancels": cancels,
               "median_cancel_to_all_cancelled_s": lat[len(lat) // 2],
               "max_rounds_trained_after_cancel_arrived": max(over)}
        (out / "cancel_timing.json").write_text(json.dumps(res, indent=1))
        print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
