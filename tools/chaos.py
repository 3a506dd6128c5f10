"""Fault injection on a real federation: agent processes, a real mosquitto, SIGKILL.

``python -m dfl_agent.cli.chaos --out DIR [options]`` starts N signed ``dfl-agent``
processes (fedavg by default, ``runtime.rejoin = true``, discovery by MQTT presence)
on a local mosquitto and, during a chaos window, kills one random agent with SIGKILL
every ``--kill-every`` seconds and restarts it ``--restart-delay`` seconds later
(same state directory: same key, metrics appended), and restarts the broker once at
``--broker-restart-at`` seconds into the window.  ``--no-faults`` runs the same
federation without faults (the reference).  With ``--netem "delay 200ms loss 10%"``
(root only) every agent runs in its own network namespace behind a veth whose egress
has that ``tc netem`` qdisc; the broker listens on the host side of a bridge.  A kernel
without ``sch_netem`` (many container and cloud kernels) cannot run ``--netem``: the tool
says so in one line and exits 2.  The field lab (``dflctl lab run``, events ``loss`` and
``rate``) emulates loss and link rates without netem (iptables ``statistic``, ``tbf``).

Writes ``DIR/chaos.json``: options, events (kills, restarts, broker restart),
per node the rounds completed and exit code, the longest round (``max_round_seconds``;
a round that lasts longer than two round deadlines counts as a *stall*; the first
round of each start or restart also holds the agent's start-up and is reported
separately in ``max_round_seconds``), the final
global test accuracy per node and its mean.  Exit code 0 when every agent finished
all rounds.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import secrets
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from dfl_agent.algorithms.protocols.stragglers import REPRODUCTION_MODE
from dfl_agent.cli.demo import stop_processes
from dfl_agent.runtime.node import metrics
from dfl_agent.runtime.shared.config import config_from_dict, dump_toml


@dataclasses.dataclass
class ChaosOptions:
    """See the module docstring and ``python -m dfl_agent.cli.chaos --help``."""

    out: str = "chaos"
    nodes: int = 6
    rounds: int = 30
    algorithm: str = "fedavg"
    dataset: str = "har"
    model_size: str = "small"
    epochs: int = 1
    round_timeout: float = 10.0
    kill_every: float = 30.0
    chaos_seconds: float = 180.0
    restart_delay: float = 2.0
    broker_restart_at: float | None = 90.0
    faults: bool = True
    seed: int = 0
    netem: str | None = None
    #: run every agent in its own network namespace (implied by ``netem``)
    netns: bool = False
    #: "time": kill_every, chaos_seconds, broker_restart_at are seconds; "rounds": they
    #: count rounds of the federation (the lowest round completed by a running agent),
    #: which keeps short CI runs independent of the machine's speed
    schedule: str = "time"
    start_timeout: float = 180.0
    #: give up after this many seconds (0: a budget from rounds and round_timeout); a
    #: run that stops here reports ``completed = false`` with every node's state
    max_seconds: float = 0.0
    straggler: str = REPRODUCTION_MODE  # runtime.straggler of every agent


def _config(o: ChaosOptions, fed: str, nid: str, i: int, broker: str, state: Path, fed_pub: str) -> dict[str, Any]:
    opts: dict[str, Any] = {"round_timeout": o.round_timeout} if o.algorithm == "fedavg" else {}
    return {
        "federation": fed, "node_id": nid, "state_dir": str(state), "seed": o.seed,
        "algorithm": {"name": o.algorithm, "rounds": o.rounds, "options": opts},
        "training": {"epochs": o.epochs, "threads": 1},
        "data": {"dataset": o.dataset, "partition": "by-user" if o.dataset == "har" else "iid",
                 "num_nodes": o.nodes, "node_index": i},
        "model": {"size": o.model_size},
        "mqtt": {"broker": broker, "keepalive": 5, "heartbeat_interval": 2.0},
        "discovery": {"mdns": False, "min_peers": o.nodes - 1, "start_timeout": o.start_timeout,
                      "heartbeat_timeout": 20.0},
        "runtime": {"metrics_file": str(state / "metrics.jsonl"), "rejoin": True, "straggler": o.straggler},
        "security": {"require_signatures": True, "federation_key": fed_pub},
    }


class _Netns:
    """A bridge on the host and one namespace per agent behind a netem'd veth (root only)."""

    def __init__(self, n: int, netem: str):
        self.tag = secrets.token_hex(2)
        self.bridge = f"dflbr{self.tag}"
        self.names = [f"dfl{self.tag}n{i}" for i in range(n)]
        self.host_ip = "10.77.0.1"
        self.netem = netem

    @staticmethod
    def _ip(*args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True)

    def up(self) -> None:
        self._ip("link", "add", self.bridge, "type", "bridge")
        self._ip("addr", "add", f"{self.host_ip}/24", "dev", self.bridge)
        self._ip("link", "set", self.bridge, "up")
        for i, ns in enumerate(self.names):
            host_end, ns_end = f"vh{self.tag}{i}", f"vn{self.tag}{i}"
            self._ip("netns", "add", ns)
            self._ip("link", "add", host_end, "type", "veth", "peer", "name", ns_end)
            self._ip("link", "set", ns_end, "netns", ns)
            self._ip("link", "set", host_end, "master", self.bridge)
            self._ip("link", "set", host_end, "up")
            self._ip("-n", ns, "addr", "add", f"10.77.0.{10 + i}/24", "dev", ns_end)
            self._ip("-n", ns, "link", "set", ns_end, "up")
            self._ip("-n", ns, "link", "set", "lo", "up")
            if not self.netem:
                continue
            # netem on both directions of the agent's link
            subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", ns_end, "root", "netem",
                            *self.netem.split()], check=True, capture_output=True)
            subprocess.run(["tc", "qdisc", "add", "dev", host_end, "root", "netem", *self.netem.split()],
                           check=True, capture_output=True)

    def down(self) -> None:
        for ns in self.names:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)


def netns_available() -> bool:
    """True when network namespaces with ``tc netem`` work here (see :func:`netem_blocker`)."""
    return netem_blocker() is None


def netem_blocker() -> str | None:
    """Why ``--netem`` cannot run here (one line), or None: it needs root, ``ip`` and ``tc``
    installed, and a kernel with the netem qdisc (probed in a throw-away namespace;
    containers often lack ``sch_netem``: "Specified qdisc kind is unknown")."""
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None:
        return "--netem needs root, ip and tc"
    if not _netem_probe():
        return ("--netem needs the kernel's netem qdisc (sch_netem), missing here; the field lab "
                "emulates loss and link rates without it: dflctl lab run (events loss, rate)")
    return None


def _netem_probe() -> bool:
    ns = f"dflprobe{secrets.token_hex(3)}"
    try:
        if subprocess.run(["ip", "netns", "add", ns], capture_output=True).returncode != 0:
            return False
        r = subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "lo", "root", "netem",
                            "delay", "1ms"], capture_output=True)
        return r.returncode == 0
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def run_chaos(o: ChaosOptions, log=print) -> dict[str, Any]:
    """Run one federation with (or without) faults; return and write ``chaos.json``.

    Raises:
        RuntimeError: ``o.netem`` where it cannot run (:func:`netem_blocker`'s line).
    """
    if o.netem and (why := netem_blocker()):
        raise RuntimeError(why)
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from dfl_agent.cli.broker import start_broker
    from dfl_agent.security.keys import enroll_local, public_key_b64

    out = Path(o.out)
    if out.exists():
        shutil.rmtree(out)
    (out / "logs").mkdir(parents=True)
    rng = random.Random(o.seed)
    fed = "chaos-" + secrets.token_hex(3)
    fed_key = Ed25519PrivateKey.generate()
    ids = [f"node{i:02d}" for i in range(o.nodes)]
    netns = _Netns(o.nodes, o.netem) if (o.netem or o.netns) else None
    if netns:
        netns.up()
    started = time.time()
    events: list[dict[str, Any]] = []
    procs: dict[str, subprocess.Popen] = {}
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    try:
        host = netns.host_ip if netns else "127.0.0.1"
        with start_broker("mosquitto", host=host) as broker:
            paths = {}
            for i, nid in enumerate(ids):
                state = (out / "nodes" / nid).resolve()
                enroll_local(fed_key, fed, nid, state)
                path = state / "node.toml"
                path.write_text(dump_toml(config_from_dict(
                    _config(o, fed, nid, i, broker.endpoint, state, public_key_b64(fed_key)))))
                paths[nid] = path

            def launch(nid: str) -> None:
                cmd = [sys.executable, "-m", "dfl_agent.runtime.service.daemon", "run", "--once", "--config", str(paths[nid])]
                if netns:
                    cmd = ["ip", "netns", "exec", netns.names[ids.index(nid)], *cmd]
                logf = open(out / "logs" / f"{nid}.log", "a")
                procs[nid] = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env)
                logf.close()

            def rounds_done(nid: str) -> int:
                p = out / "nodes" / nid / "metrics.jsonl"
                recs = metrics.read_jsonl(p) if p.exists() else []
                return max((r["round"] for r in recs), default=0)

            for nid in ids:
                launch(nid)
            budget = o.max_seconds or o.start_timeout + o.rounds * (2 * o.round_timeout + 30) + o.chaos_seconds
            deadline = time.monotonic() + budget
            while time.monotonic() < deadline and not all(rounds_done(n) >= 1 for n in ids):
                if any(p.poll() is not None for p in procs.values()):
                    break
                time.sleep(0.5)
            t0 = time.monotonic()

            def progress() -> float:
                if o.schedule == "time":
                    return time.monotonic() - t0
                alive = [rounds_done(n) for n, p in procs.items() if p.poll() is None]
                return float(min(alive, default=0))

            log(f"all {o.nodes} agents past round 1 after {time.time() - started:.0f}s; "
                f"{'chaos' if o.faults else 'no faults'} for {o.chaos_seconds:.0f}s")
            next_kill = o.kill_every
            restarts: dict[str, float] = {}
            broker_done = o.broker_restart_at is None
            while time.monotonic() < deadline:
                now = time.monotonic()
                prog = progress()
                for nid, at in list(restarts.items()):
                    if now >= at:
                        launch(nid)
                        del restarts[nid]
                        events.append({"t": round(now - t0, 1), "event": "restart", "node": nid})
                        log(f"  t={now - t0:5.1f}s restart {nid}")
                # kills at kill_every, 2*kill_every, ... up to and including chaos_seconds
                if o.faults and next_kill <= o.chaos_seconds and prog >= next_kill:
                    # never a node about to finish: a restart after the federation ended has no peers
                    running = [n for n, p in procs.items()
                               if p.poll() is None and n not in restarts and rounds_done(n) < o.rounds - 2]
                    if running:
                        victim = rng.choice(running)
                        procs[victim].send_signal(signal.SIGKILL)
                        procs[victim].wait()
                        restarts[victim] = now + o.restart_delay
                        events.append({"t": round(now - t0, 1), "event": "kill", "node": victim,
                                       "round": rounds_done(victim)})
                        log(f"  t={now - t0:5.1f}s SIGKILL {victim} after its round {rounds_done(victim)}")
                    next_kill += o.kill_every
                if o.faults and not broker_done and prog >= o.broker_restart_at:
                    broker.restart()
                    broker_done = True
                    events.append({"t": round(time.monotonic() - t0, 1), "event": "broker_restart"})
                    log(f"  t={now - t0:5.1f}s broker restarted")
                if not restarts and all(p.poll() is not None for p in procs.values()):
                    break
                time.sleep(0.2)
            stop_processes(procs.values())
    finally:
        for p in procs.values():  # also on SIGTERM / Ctrl-C: leave no agent behind
            if p.poll() is None:
                p.kill()
                p.wait()
        if netns:
            netns.down()
    return _report(o, out, ids, procs, events, time.time() - started)


def _report(o, out: Path, ids, procs, events, wall) -> dict[str, Any]:
    nodes = {}
    stall_limit = 2 * o.round_timeout
    for nid in ids:
        p = out / "nodes" / nid / "metrics.jsonl"
        recs = metrics.read_jsonl(p) if p.exists() else []
        scored = [r for r in recs if "global_accuracy" in r]
        # the first round of each incarnation (start or restart: "wall" starts again) also
        # holds the start-up: the agent's first training while its peers still start
        steady = [r for prev, r in zip([None] + recs[:-1], recs) if prev is not None and r["wall"] > prev["wall"]]
        nodes[nid] = {
            "rounds_completed": max((r["round"] for r in recs), default=0),
            "rounds_recorded": len({r["round"] for r in recs}),
            "exit_code": procs[nid].returncode,
            "max_round_seconds": max((r["round_seconds"] for r in recs), default=0.0),
            "max_steady_round_seconds": max((r["round_seconds"] for r in steady), default=0.0),
            "stalls": sum(r["round_seconds"] > stall_limit for r in steady),
            "incarnations": len(recs) - len(steady),
            "final_global_accuracy": scored[-1]["global_accuracy"] if scored else None,
            "kills": sum(e.get("node") == nid and e["event"] == "kill" for e in events),
        }
    finals = [n["final_global_accuracy"] for n in nodes.values() if n["final_global_accuracy"] is not None]
    result = {
        "options": dataclasses.asdict(o),
        "wall_seconds": round(wall, 1),
        "events": events,
        "nodes": nodes,
        "completed": all(n["rounds_completed"] == o.rounds and n["exit_code"] == 0 for n in nodes.values()),
        "max_round_seconds": max(n["max_round_seconds"] for n in nodes.values()),
        "max_steady_round_seconds": max(n["max_steady_round_seconds"] for n in nodes.values()),
        "stall_limit_seconds": stall_limit,
        "stalls": sum(n["stalls"] for n in nodes.values()),
        "mean_final_accuracy": sum(finals) / len(finals) if finals else None,
    }
    (out / "chaos.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dfl_agent.cli.chaos", description=__doc__.split("\n\n")[0])
    d = ChaosOptions()
    for f in dataclasses.fields(ChaosOptions):
        flag = "--" + f.name.replace("_", "-")
        if f.name == "faults":
            p.add_argument("--no-faults", dest="faults", action="store_false")
        elif f.name == "netns":
            p.add_argument("--netns", action="store_true")
        elif f.name in ("broker_restart_at", "netem"):
            p.add_argument(flag, type=float if f.name == "broker_restart_at" else str, default=getattr(d, f.name))
        else:
            p.add_argument(flag, type=type(getattr(d, f.name)), default=getattr(d, f.name))
    o = ChaosOptions(**vars(p.parse_args(argv)))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # clean up agents and broker
    if o.netem and (why := netem_blocker()):
        print(f"chaos: {why}", file=sys.stderr)
        return 2
    r = run_chaos(o)
    print(json.dumps({k: r[k] for k in ("completed", "max_round_seconds", "max_steady_round_seconds", "stalls", "mean_final_accuracy",
                                        "wall_seconds")}))
    return 0 if r["completed"] else 1


if __name__ == "__main__":
    sys.exit(main())
