"""Start-up of the always-on agent: CPU and wall seconds until it waits for runs.

Starts mosquitto and, ``--repeats`` times one after the other, ``dfl-agent run --config
node.toml`` (always-on, no ``[algorithm]`` section: no default run; signed federation,
mDNS on 127.0.0.1, the same node and state directory each time, so the first start is the
node's first boot).  For each start: the agent process's CPU seconds (utime + stime from
``/proc/PID/stat``, its children excluded) and the wall seconds from the exec until its log
says ``serving: waiting for runs`` (the log is polled every 10 ms), and whether libtorch is
in its memory maps then; the same two figures when its first idle status of this start
reaches the broker; then SIGTERM and wait.  Writes ``startup.json`` (each start, median
and max).

    nice -n 10 .venv/bin/python bench/operations/startup.py --repeats 5 --out bench/operations

``--agent-pythonpath DIR`` runs the agent from another copy of the package (as in
``idle.py``); ``--name`` names the results file.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import paho.mqtt.client as mqtt
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from idle import machine, torch_mapped
from runs_timing import invocation, node_config, start_agent

from dfl_agent.cli.broker import start_broker

READY = "serving: waiting for runs"


def cpu_seconds(pid: int) -> float:
    """utime + stime of ``pid`` (not its children), from ``/proc/PID/stat``."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) ": state is fields[0]
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5, help="starts, one after the other")
    p.add_argument("--timeout", type=float, default=180.0, help="seconds a start may take")
    p.add_argument("--out", default="bench/operations", help="folder for startup.json")
    p.add_argument("--name", default="startup.json", help="file name of the results in --out")
    p.add_argument("--agent-pythonpath", metavar="DIR",
                   help="PYTHONPATH of the agent only: measure another version of the package")
    a = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="dfl-startup-"))
    fed, fed_key, host = "startup", Ed25519PrivateKey.generate(), machine()
    starts = []
    with start_broker("mosquitto") as broker:
        cfg = node_config(tmp, fed_key, fed, "s0", broker.endpoint,
                          '[discovery]\nmdns = true\ninterfaces = ["127.0.0.1"]\n', heartbeat=None)
        status: dict = {}  # this start's pid, and (wall, cpu) at its first idle status
        heard = threading.Event()

        def on_status(c, u, m) -> None:
            try:
                state = json.loads(m.payload)["payload"]["state"]
            except (ValueError, KeyError, TypeError):
                return
            if not m.retain and state == "idle" and "pid" in status and not heard.is_set():
                status["at"] = (time.monotonic() - status["t0"], cpu_seconds(status["pid"]))
                heard.set()

        sub = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2)
        sub.on_connect = lambda c, *x: c.subscribe(f"dfl/{fed}/node/s0/status")
        sub.on_message = on_status
        bhost, bport = broker.endpoint.rsplit(":", 1)
        sub.connect(bhost, int(bport))
        sub.loop_start()
        time.sleep(0.5)
        for i in range(a.repeats):
            log = tmp / f"agent-{i}.log"
            status.clear()
            heard.clear()
            t0 = time.monotonic()
            proc = start_agent(cfg, log, a.agent_pythonpath)
            status |= {"t0": t0, "pid": proc.pid}
            try:
                while READY not in log.read_text():
                    if proc.poll() is not None or time.monotonic() - t0 > a.timeout:
                        print(log.read_text()[-3000:], file=sys.stderr)
                        return 1
                    time.sleep(0.01)
                wall, cpu = time.monotonic() - t0, cpu_seconds(proc.pid)
                mapped = torch_mapped(proc.pid)
                if not heard.wait(a.timeout):
                    print(log.read_text()[-3000:], file=sys.stderr)
                    return 1
                s_wall, s_cpu = status["at"]
                starts.append({"cpu_s": round(cpu, 2), "wall_s": round(wall, 2), "torch_mapped": mapped,
                               "first_status_cpu_s": round(s_cpu, 2), "first_status_wall_s": round(s_wall, 2),
                               "first_boot": i == 0})
            finally:
                proc.send_signal(signal.SIGTERM)
                proc.wait(timeout=60)
            print(starts[-1], flush=True)
            time.sleep(0.5)  # its last status is delivered before the next start
        sub.loop_stop()
        sub.disconnect()
    cpu = [s["cpu_s"] for s in starts]
    wall = [s["wall_s"] for s in starts]
    res = {"command": invocation(), "machine": host, "agent_pythonpath": a.agent_pythonpath,
           "agent": "python -m dfl_agent.runtime.service.daemon run --config node.toml",
           "ready_line": READY, "repeats": a.repeats,
           "cpu_s_median": statistics.median(cpu), "cpu_s_max": max(cpu),
           "wall_s_median": statistics.median(wall), "wall_s_max": max(wall),
           "first_status_cpu_s_median": statistics.median(s["first_status_cpu_s"] for s in starts),
           "first_status_cpu_s_max": max(s["first_status_cpu_s"] for s in starts),
           "first_status_wall_s_median": statistics.median(s["first_status_wall_s"] for s in starts),
           "first_status_wall_s_max": max(s["first_status_wall_s"] for s in starts),
           "target_cpu_s": 5.0, "within_target": max(cpu) <= 5.0,
           "torch_mapped": sorted({f for s in starts for f in s["torch_mapped"]}), "starts": starts}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / a.name).write_text(json.dumps(res, indent=1))
    print(json.dumps({k: v for k, v in res.items() if k != "starts"}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
