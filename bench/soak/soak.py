"""Soak: always-on agents over many recurring runs with power cuts and truncated files; checks
that nothing is lost and that the state stays bounded.

**Agents.**  Starts mosquitto and ``--agents`` signed ``dfl-agent run`` service processes (the
production path: supervisor, run manager, a run process per run; ``security.require_signatures``,
mDNS off) in one federation, each on its own sample store (a seed file of 200 samples of shape
[3, 16], 4 classes) with a default run that recurs every ``--every`` seconds (``--algorithm``,
1 round of ``--steps`` steps, deployment on without ONNX export, ``runtime.keep_runs =
--keep-runs``).  The first ``--dp-agents`` agents train under DP-SGD (``privacy.dp``, σ 1.0,
a lifetime ε no run reaches), so their privacy ledgers grow with every run.

**Live data.**  Every ``--feed-every`` seconds each agent's spool gets a ``.npz`` of
``--feed-n`` samples (written aside and renamed in, as a producer should); every sample's
``x[0, 0]`` is a unique id, so a sample stored twice or lost shows in the store.

**Power cuts.**  ``--cuts`` times, at random moments spread over the soak (after a random number
of ended runs, then a random delay within one period), one agent at random loses power: SIGKILL
of its service and its run process at once, off for 0.2-2 s, then started again.  With
probability ``--truncate-share`` the cut also damages what an SD card may leave half-written:
the newest checkpoint, round records and members file of an unended run (truncated to a random
length) and a torn spool file (a producer cut mid-write; rejected by the agent, not counted as
data).  The agent must come back by itself (no operator command).

**Records** every ``--sample-every`` seconds per agent: runs ended, the ledger's entries and
bytes, ``state_dir`` bytes per part (as ``dflctl doctor``), samples in the store, the privacy
ledger's rows and composed ε, and the service process's RSS, fds and threads (the service only,
not its run process; its pid changes at each restart).

**Checks** at the end (the agents stopped with SIGTERM): every fed sample stored once (none lost,
none twice); every deployed version seen verifies (manifest SHA-256 of each file) and no run was
deployed twice; every run ended once (ledger, ``run X finished`` at most once in the log, no
ended run admitted again); ``dflctl state check`` clean; the privacy ledger never decreased,
sample to sample and across every cut; after the retention window ``state_dir`` (the store
aside) grows by at most 1 kB a run (least squares over the minimum per run count); service RSS
within ±10 MB of its value after the agent's first 20 runs (samples 30 s or more after a
(re)start); fds and threads flat (the last third's maximum at most 2 over the first third's).

Writes ``OUT/soak-<tag>.json`` (command, commit, machine, load, the series, the cuts, the checks)
and ``OUT/soak-<tag>.md``; the series is also written every minute, so a soak stopped early
leaves its partial series (``"complete": false``).

    nice -n 10 .venv/bin/python bench/soak/soak.py --agents 3 --runs 500 --cuts 25 --seed 0 --out bench/soak/results
"""

from __future__ import annotations

import argparse
import io
import json
import os
import random
import re
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import psutil
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "operations"))
from idle import commit, machine  # noqa: E402
from runs_timing import invocation, node_config  # noqa: E402

from dfl_agent.cli.broker import start_broker  # noqa: E402
from dfl_agent.deploy.versions import verify_folder  # noqa: E402
from dfl_agent.runtime.service.ledger import read_entries  # noqa: E402
from dfl_agent.runtime.service.retention import usage  # noqa: E402
from dfl_agent.runtime.shared.descriptor import TERMINAL  # noqa: E402
from dfl_agent.runtime.shared.privacy_ledger import PrivacyLedger  # noqa: E402

SHAPE = (3, 16)
MB = 2**20
DELTA = 1e-5


class Agent:
    """One always-on agent: its config, state directory, log, the live service process, and
    what the soak fed it and saw of it."""

    def __init__(self, nid: str, cfg: Path, state: Path, log: Path):
        self.nid, self.cfg, self.state, self.log = nid, cfg, state, log
        self.proc: subprocess.Popen | None = None
        self.started = 0.0
        self.fed: dict[str, int] = {}  # spool file name -> samples in it
        self.next_id = 0
        self.versions: dict[int, dict[str, Any]] = {}  # version -> {"run_id", "valid", "problem"}
        self.exits: list[dict[str, Any]] = []  # the service ended without being cut

    def start(self) -> None:
        with open(self.log, "a") as f:
            f.write(f"---- soak: start at {time.time():.3f}\n")
        self.proc = start_agent_append(self.cfg, self.log)
        self.started = time.monotonic()

    def cut(self) -> list[int]:
        """SIGKILL of the service and its run process at once (a power cut); their pids."""
        assert self.proc is not None
        try:
            kids = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            kids = []
        pids = [self.proc.pid, *(k.pid for k in kids)]
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()
        for k in kids:
            try:
                k.wait(timeout=10)
            except (psutil.NoSuchProcess, psutil.TimeoutExpired):
                pass
        return pids


def start_agent_append(cfg: Path, log: Path) -> subprocess.Popen:
    """``dfl-agent run --config cfg`` (always-on), its output appended to ``log``."""
    return subprocess.Popen([sys.executable, "-m", "dfl_agent.runtime.service.daemon", "run", "--config", str(cfg)],
                            stdout=open(log, "a"), stderr=subprocess.STDOUT)


def npz_bytes(ids: np.ndarray, seed: int) -> bytes:
    """``len(ids)`` windows of a learnable toy task, ``x[i, 0, 0] = ids[i]`` (unique)."""
    rng = np.random.default_rng(seed)
    n = len(ids)
    y = rng.integers(0, 4, n)
    x = rng.normal(size=(n, *SHAPE)).astype(np.float32)
    for i, c in enumerate(y):
        x[i, c % 3, 8:16] += 2.0
    x[:, 0, 0] = ids.astype(np.float32)
    buf = io.BytesIO()
    np.savez(buf, x=x, y=y, t=np.full(n, time.time()))
    return buf.getvalue()


def feed(a: Agent, n: int, seed: int) -> None:
    """A spool file of ``n`` new samples, written aside and renamed in."""
    spool = a.state / "spool"
    spool.mkdir(parents=True, exist_ok=True)
    name = f"f{a.next_id:07d}.npz"
    data = npz_bytes(np.arange(a.next_id, a.next_id + n), seed)
    (spool / f".{name}.tmp").write_bytes(data)
    os.replace(spool / f".{name}.tmp", spool / name)
    a.fed[name] = n
    a.next_id += n


def store_counts(state: Path) -> dict[str, Any]:
    """Rows, distinct ``x[0, 0]`` ids and rows per file name of the store (read-only)."""
    db = state / "store" / "samples.sqlite"
    if not db.exists():
        return {"rows": 0, "per_file": {}, "fed_ids": []}
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=30)
    try:
        rows = con.execute("SELECT COUNT(*) FROM samples").fetchone()[0]
        per_file = dict(con.execute("SELECT f.name, COUNT(s.id) FROM files f LEFT JOIN samples s ON s.file = f.sha256 "
                                    "GROUP BY f.sha256").fetchall())
        ids = [np.frombuffer(r[0][:4], np.float32)[0] for r in con.execute(
            "SELECT x FROM samples WHERE file IN (SELECT sha256 FROM files WHERE name LIKE 'f%.npz')")]
    finally:
        con.close()
    return {"rows": rows, "per_file": per_file, "fed_ids": ids}


def spool_ids(spool: Path) -> set[float]:
    """The sample ids of the intact fed files still in the spool (ingested at the next start)."""
    out: set[float] = set()
    for f in spool.glob("f*.npz"):
        try:
            with np.load(f) as z:
                out |= set(z["x"][:, 0, 0].astype(np.float64).tolist())
        except (OSError, ValueError, KeyError):
            pass
    return out


def privacy(state: Path) -> dict[str, Any]:
    """The privacy ledger's rows and composed ε (read-only); ``error`` when it does not check."""
    try:
        _, st = PrivacyLedger(state).check()
        if st is None:
            return {"rows": None, "epsilon": None, "error": "unchained"}
        return {"rows": st.runs_spent(), "epsilon": round(st.epsilon(DELTA), 6)}
    except Exception as exc:  # a damaged or busy ledger: recorded, not fatal to the soak
        return {"rows": None, "epsilon": None, "error": str(exc)[:200]}


def ended(state: Path) -> dict[str, dict[str, Any]]:
    return {r: e for r, e in read_entries(state).items() if e.get("state") in TERMINAL}


def observe_versions(a: Agent) -> None:
    """Verify each version folder not seen before (manifest SHA-256 of every file)."""
    models = a.state / "models"
    if not models.is_dir():
        return
    for v in models.glob("v*"):
        if not v.name[1:].isdigit() or int(v.name[1:]) in a.versions:
            continue
        try:
            m = verify_folder(v)
            a.versions[int(v.name[1:])] = {"run_id": m.get("run_id"), "valid": True}
        except Exception as exc:
            if v.exists():  # not removed by pruning while read
                a.versions[int(v.name[1:])] = {"run_id": None, "valid": False, "problem": str(exc)[:200]}


def sample(a: Agent, t0: float) -> dict[str, Any]:
    ends = ended(a.state)
    entries = read_entries(a.state)
    u = usage(a.state)
    s: dict[str, Any] = {"t": round(time.monotonic() - t0, 2), "agent": a.nid, "runs_ended": len(ends),
                         "ledger_entries": len(entries),
                         "ledger_bytes": sum(f.stat().st_size for f in (a.state / "runs").glob("ledger.sqlite*")),
                         "run_folders": sum(1 for p in (a.state / "runs").glob("*") if p.is_dir()),
                         **{f"bytes_{k}": v for k, v in u.items()}, "bytes_no_store": u["total"] - u["store"]}
    p = privacy(a.state)
    s["privacy_rows"], s["privacy_epsilon"] = p["rows"], p["epsilon"]
    if "error" in p:
        s["privacy_error"] = p["error"]
    try:
        con = sqlite3.connect(f"file:{a.state / 'store' / 'samples.sqlite'}?mode=ro", uri=True, timeout=30)
        s["store_rows"] = con.execute("SELECT COUNT(*) FROM samples").fetchone()[0]
        con.close()
    except sqlite3.Error:
        s["store_rows"] = None
    if a.proc is not None and a.proc.poll() is None:
        try:
            ps = psutil.Process(a.proc.pid)
            s |= {"pid": a.proc.pid, "service_age_s": round(time.monotonic() - a.started, 1),
                  "rss_mb": round(ps.memory_info().rss / MB, 2), "fds": ps.num_fds(), "threads": ps.num_threads(),
                  "children": len(ps.children())}
        except psutil.NoSuchProcess:
            pass
    observe_versions(a)
    return s


def truncate(path: Path, rng: random.Random) -> dict[str, Any]:
    size = path.stat().st_size
    keep = rng.randrange(0, max(1, size))
    with open(path, "r+b") as f:
        f.truncate(keep)
    return {"file": str(path), "bytes": size, "kept": keep}


def damage(a: Agent, rng: random.Random) -> list[dict[str, Any]]:
    """After a cut: truncate what may have been in flight (an unended run's newest checkpoint,
    round records and members file) and leave a torn spool file."""
    done = ended(a.state)
    out = []
    for run in sorted((a.state / "runs").glob("*")):
        if not run.is_dir() or run.name in done:
            continue
        cks = sorted((run / "checkpoints").glob("round-*.safetensors"), key=lambda p: p.stat().st_mtime)
        for f in [*cks[-1:], run / "metrics.jsonl", run / "members.json"]:
            if f.is_file() and rng.random() < 0.7:
                out.append(truncate(f, rng))
    spool = a.state / "spool"
    spool.mkdir(parents=True, exist_ok=True)
    data = npz_bytes(np.arange(10**6, 10**6 + 8), rng.randrange(10**6))  # ids out of the fed range
    torn = spool / f"torn{rng.randrange(10**9):09d}.npz"
    torn.write_bytes(data[: rng.randrange(1, len(data) - 1)])
    out.append({"file": str(torn), "bytes": len(data), "kept": torn.stat().st_size, "torn_spool": True})
    return out


def slope(points: list[tuple[float, float]]) -> float | None:
    if len(points) < 3:
        return None
    x = np.array([p[0] for p in points], float)
    y = np.array([p[1] for p in points], float)
    if np.ptp(x) == 0:
        return None
    return float(np.polyfit(x, y, 1)[0])


def checks(agents: list[Agent], series: list[dict], cuts: list[dict], a: argparse.Namespace,
           final: dict[str, dict]) -> dict[str, Any]:
    res: dict[str, Any] = {}
    per = {ag.nid: [s for s in series if s["agent"] == ag.nid] for ag in agents}
    # state growth after the retention window: min bytes (store aside) per run count, least squares
    growth = {}
    for nid, ss in per.items():
        lowest: dict[int, int] = {}
        for s in ss:
            if s["runs_ended"] >= a.keep_runs + 5:
                lowest[s["runs_ended"]] = min(lowest.get(s["runs_ended"], 1 << 62), s["bytes_no_store"])
        pts = sorted(lowest.items())
        b = slope([(float(k), float(v)) for k, v in pts])
        growth[nid] = {"bytes_per_run": None if b is None else round(b, 1), "from_run": pts[0][0] if pts else None,
                       "to_run": pts[-1][0] if pts else None,
                       "bytes_first": pts[0][1] if pts else None, "bytes_last": pts[-1][1] if pts else None}
    res["state_growth"] = {"agents": growth, "target": "at most 1024 B a run (store aside) after the retention window",
                           "pass": all(g["bytes_per_run"] is not None and g["bytes_per_run"] <= 1024
                                       for g in growth.values())}
    # RSS, fds, threads of the service
    mem = {}
    for nid, ss in per.items():
        live = [s for s in ss if "rss_mb" in s]
        ref = next((s for s in live if s["runs_ended"] >= 20 and s["service_age_s"] >= 30), None)
        later = [s for s in live if ref is not None and s["t"] >= ref["t"] and s["service_age_s"] >= 30]
        if ref is None or len(later) < 3:
            mem[nid] = {"reference": None, "pass": None}
            continue
        rss = [s["rss_mb"] for s in later]
        third = max(1, len(later) // 3)
        fd_first, fd_last = max(s["fds"] for s in later[:third]), max(s["fds"] for s in later[-third:])
        th_first, th_last = max(s["threads"] for s in later[:third]), max(s["threads"] for s in later[-third:])
        mem[nid] = {"rss_ref_mb": ref["rss_mb"], "rss_min_mb": min(rss), "rss_max_mb": max(rss),
                    "rss_max_dev_mb": round(max(abs(r - ref["rss_mb"]) for r in rss), 2),
                    "fds_first_third_max": fd_first, "fds_last_third_max": fd_last,
                    "threads_first_third_max": th_first, "threads_last_third_max": th_last,
                    "fds_range": [min(s["fds"] for s in later), max(s["fds"] for s in later)],
                    "threads_range": [min(s["threads"] for s in later), max(s["threads"] for s in later)],
                    "samples": len(later)}
        mem[nid]["rss_pass"] = mem[nid]["rss_max_dev_mb"] <= 10
        mem[nid]["fds_pass"] = fd_last - fd_first <= 2
        mem[nid]["threads_pass"] = th_last - th_first <= 2
    res["service"] = {"agents": mem, "target": "RSS within ±10 MB of its value after the first 20 runs (samples >= 30 s "
                      "after a (re)start); fds and threads: last third's max <= first third's + 2",
                      "rss_pass": all(m.get("rss_pass") for m in mem.values()),
                      "fds_threads_pass": all(m.get("fds_pass") and m.get("threads_pass") for m in mem.values())}
    # samples
    smp = {}
    for ag in agents:
        sc = final[ag.nid]["store"]
        ids = sc.pop("fed_ids")
        expected = sum(ag.fed.values())
        got = np.array(ids, np.float64)
        uniq = np.unique(got)
        fed_per_file = {n: sc["per_file"].get(n) for n in ag.fed}
        pending = spool_ids(ag.state / "spool")  # fed last, not ingested yet: still there, intact
        held = set(uniq.tolist()) & set(range(ag.next_id))
        smp[ag.nid] = {"fed": expected, "fed_files": len(ag.fed), "stored_fed_rows": len(ids),
                       "pending_in_spool": len(pending - held),
                       "lost": int(expected - len(held | (pending & set(range(ag.next_id))))),
                       "duplicated": int(len(ids) - len(uniq)),
                       "files_not_ingested": sorted(n for n, c in fed_per_file.items() if c is None)[:20],
                       "files_wrong_count": sorted(n for n, c in fed_per_file.items() if c not in (None, ag.fed[n]))[:20],
                       "left_in_spool": sorted(p.name for p in (ag.state / "spool").glob("f*.npz")),
                       "store_rows": sc["rows"]}
    res["samples"] = {"agents": smp, "pass": all(s["lost"] == 0 and s["duplicated"] == 0 for s in smp.values())}
    # versions
    ver = {}
    for ag in agents:
        runs = [v["run_id"] for v in ag.versions.values() if v["valid"]]
        ver[ag.nid] = {"seen": len(ag.versions), "invalid": {k: v for k, v in ag.versions.items() if not v["valid"]},
                       "runs_deployed_twice": sorted({r for r in runs if runs.count(r) > 1})}
    res["versions"] = {"agents": ver, "pass": all(not v["invalid"] and not v["runs_deployed_twice"] for v in ver.values())}
    # runs recorded once
    rec = {}
    for ag in agents:
        text = ag.log.read_text(errors="replace")
        fin = re.findall(r"run (\S+) finished", text)
        twice = sorted({r for r in fin if fin.count(r) > 1})
        ents = final[ag.nid]["entries"]
        rec[ag.nid] = {"ledger_entries": len(ents), "ended": sum(1 for e in ents.values() if e.get("state") in TERMINAL),
                       "states": {st: sum(1 for e in ents.values() if e.get("state") == st)
                                  for st in sorted({e.get("state") for e in ents.values()})},
                       "finished_logged_twice": twice, "state_check": final[ag.nid]["state_check"],
                       # runs never ended here, but the one the SIGTERM at the end interrupted
                       "unended": sorted(r for r, e in ents.items() if e.get("state") not in TERMINAL)}
        rec[ag.nid]["unended_stale"] = rec[ag.nid]["unended"][:-1]
    res["runs"] = {"agents": rec, "total_ended": sum(r["ended"] for r in rec.values()),
                   "pass": all(not r["finished_logged_twice"] and not r["unended_stale"] and r["state_check"]["rc"] == 0
                               for r in rec.values())}
    # privacy ledger monotone: its composed ε, sample to sample and across each cut (the runs it
    # counts are informational: a reservation released, never trained, no longer counts)
    drops = []
    for nid, ss in per.items():
        last = None
        for s in ss:
            if s.get("privacy_epsilon") is None:
                continue
            cur = (s["privacy_rows"], s["privacy_epsilon"])
            if last is not None and cur[1] < last[1] - 1e-9:
                drops.append({"agent": nid, "t": s["t"], "before": last, "after": cur})
            last = cur
    across = [c for c in cuts if c.get("privacy_after") and c.get("privacy_before")
              and (c["privacy_after"]["epsilon"] or 0) < (c["privacy_before"]["epsilon"] or 0) - 1e-9]
    errors = [s for s in series if "privacy_error" in s]
    res["privacy"] = {"decreases": drops, "decreases_across_cuts": across, "unreadable_samples": len(errors),
                      "first_unreadable": errors[:3],
                      "pass": not drops and not across and all(c.get("privacy_after") for c in cuts
                                                                if c["agent"] in [g.nid for g in agents[:a.dp_agents]])}
    res["service_exits"] = {ag.nid: ag.exits for ag in agents}
    res["cuts"] = {"planned": a.cuts, "done": len(cuts), "with_truncation": sum(1 for c in cuts if c["damage"])}
    return res


def report(doc: dict[str, Any]) -> str:
    c = doc.get("checks") or {}
    yes = {True: "PASS", False: "FAIL", None: "n/a"}
    lines = [f"# Soak: {doc['tag']}", "", f"- command: `{doc['command']}`", f"- commit: {doc['commit']}",
             f"- machine: {doc['machine']}", f"- load average at the end: {doc.get('load_end')}",
             f"- agents: {doc['agents']}, algorithm {doc['algorithm']}, every {doc['every']} s, "
             f"{doc['steps']} steps, keep_runs {doc['keep_runs']}, DP on {doc['dp_agents']} agent(s)",
             f"- runs ended (all agents): {doc['runs_reached']} of {doc['runs_target']} "
             f"({'complete' if doc['complete'] else 'PARTIAL: the soak was stopped before its target'}), "
             f"in {doc['wall_s']:.0f} s",
             f"- power cuts: {len(doc['cuts'])} (with truncated files: "
             f"{sum(1 for x in doc['cuts'] if x['damage'])})", ""]
    if c:
        lines += ["| criterion | result | figures |", "|---|---|---|"]
        g = c["state_growth"]
        lines.append(f"| state_dir growth after the retention window ≤ 1 kB/run (store aside) | {yes[g['pass']]} | "
                     + "; ".join(f"{k}: {v['bytes_per_run']} B/run over runs {v['from_run']}-{v['to_run']} "
                                 f"({v['bytes_first']} → {v['bytes_last']} B)" for k, v in g["agents"].items()) + " |")
        s = c["service"]
        lines.append(f"| service RSS within ±10 MB of its value after 20 runs | {yes[s['rss_pass']]} | "
                     + "; ".join(f"{k}: ref {v.get('rss_ref_mb')} MB, {v.get('rss_min_mb')}-{v.get('rss_max_mb')} MB"
                                 for k, v in s["agents"].items()) + " |")
        lines.append(f"| fds and threads flat | {yes[s['fds_threads_pass']]} | "
                     + "; ".join(f"{k}: fds {v.get('fds_range')}, threads {v.get('threads_range')}"
                                 for k, v in s["agents"].items()) + " |")
        sm = c["samples"]
        lines.append(f"| 0 samples lost or duplicated | {yes[sm['pass']]} | "
                     + "; ".join(f"{k}: {v['fed']} fed, {v['lost']} lost, {v['duplicated']} twice, "
                                 f"{v['pending_in_spool']} still in the spool"
                                 for k, v in sm["agents"].items()) + " |")
        v = c["versions"]
        lines.append(f"| 0 invalid versions, no run deployed twice | {yes[v['pass']]} | "
                     + "; ".join(f"{k}: {x['seen']} seen, {len(x['invalid'])} invalid" for k, x in v["agents"].items())
                     + " |")
        r = c["runs"]
        lines.append(f"| every run recorded once, `dflctl state check` clean | {yes[r['pass']]} | "
                     + "; ".join(f"{k}: {x['states']}, {len(x['unended_stale'])} never ended"
                                 for k, x in r["agents"].items()) + " |")
        p = c["privacy"]
        lines.append(f"| privacy ledger monotone across every cut | {yes[p['pass']]} | "
                     f"{len(p['decreases'])} decreases, {len(p['decreases_across_cuts'])} across cuts |")
        ex = {k: len(v) for k, v in c["service_exits"].items()}
        lines.append(f"| the service never ended unless cut | {yes[not any(ex.values())]} | {ex} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--agents", type=int, default=3, help="always-on agents")
    p.add_argument("--runs", type=int, default=500, help="ended runs (all agents together) to reach")
    p.add_argument("--cuts", type=int, default=25, help="power cuts")
    p.add_argument("--seed", type=int, default=0, help="seeds the cut moments, the agents cut and the truncations")
    p.add_argument("--out", default="bench/soak/results", help="folder for the results")
    p.add_argument("--tag", default=None, help="results file name: soak-TAG.json / .md (default: RUNSxAGENTS)")
    p.add_argument("--algorithm", default="local", help="the default run's algorithm")
    p.add_argument("--every", type=float, default=2.0, help="the default run's period (s)")
    p.add_argument("--steps", type=int, default=2, help="training steps of the run's one round")
    p.add_argument("--keep-runs", type=int, default=20, help="runtime.keep_runs")
    p.add_argument("--dp-agents", type=int, default=1, help="agents training under DP-SGD")
    p.add_argument("--feed-every", type=float, default=10.0, help="seconds between spool files, per agent")
    p.add_argument("--feed-n", type=int, default=16, help="samples per spool file")
    p.add_argument("--truncate-share", type=float, default=0.5, help="share of cuts that also truncate files")
    p.add_argument("--sample-every", type=float, default=3.0, help="seconds between samples")
    p.add_argument("--max-minutes", type=float, default=0.0, help="stop (partial) after this long (0: no limit)")
    p.add_argument("--keep-tmp", action="store_true", help="keep the state directories and logs")
    a = p.parse_args()
    host, at, cmd = machine(), commit(), invocation()
    rng = random.Random(a.seed)
    tmp = Path(tempfile.mkdtemp(prefix="dfl-soak-"))
    fed, fed_key = "soak", Ed25519PrivateKey.generate()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = a.tag or f"{a.runs}x{a.agents}"
    # cut moments: after a random count of ended runs, then a random delay within a period
    marks = sorted(rng.uniform(max(10, a.runs * 0.04), a.runs * 0.95) for _ in range(a.cuts))
    series: list[dict] = []
    cuts: list[dict] = []
    t0 = time.monotonic()
    doc: dict[str, Any] = {"tag": tag, "command": cmd, "commit": at, "machine": host, "agents": a.agents,
                           "algorithm": a.algorithm, "every": a.every, "steps": a.steps, "keep_runs": a.keep_runs,
                           "dp_agents": a.dp_agents, "feed_every": a.feed_every, "feed_n": a.feed_n,
                           "runs_target": a.runs, "cuts_planned": a.cuts, "tmp": str(tmp)}

    def dump(complete: bool, final_checks: dict | None = None) -> None:
        doc.update({"complete": complete, "runs_reached": series[-1]["total_ended"] if series else 0,
                    "wall_s": time.monotonic() - t0, "load_end": " ".join(f"{x:.1f}" for x in os.getloadavg()),
                    "cuts": cuts, "checks": final_checks, "series": series})
        (out / f"soak-{tag}.json").write_text(json.dumps(doc, indent=0))
        (out / f"soak-{tag}.md").write_text(report(doc))

    agents: list[Agent] = []
    complete = False
    with start_broker("mosquitto") as broker:
        for i in range(a.agents):
            nid = f"s{i}"
            seed_dir = tmp / f"seed-{nid}"
            seed_dir.mkdir()
            (seed_dir / "train.npz").write_bytes(npz_bytes(np.arange(-200, 0), 1000 + i))
            dp = ('[privacy]\nlifetime_epsilon = 1000000.0\n[privacy.dp]\nmax_grad_norm = 1.0\n'
                  'noise_multiplier = 1.0\n') if i < a.dp_agents else ""
            body = (f'[data]\ndataset = "store"\npath = "{seed_dir}"\ninput_shape = {list(SHAPE)}\nnum_classes = 4\n'
                    f'spool_interval = 1.0\n[model]\nsize = "small"\n'
                    f'[training]\nsteps = {a.steps}\nbatch_size = 32\nthreads = 1\n'
                    f'[algorithm]\nname = "{a.algorithm}"\nrounds = 1\nevery = "{a.every:g}s"\n'
                    f'[deploy]\ntolerance = 1.0\nonnx = false\n'
                    f'[runtime]\nkeep_runs = {a.keep_runs}\n{dp}'
                    f'[discovery]\nmin_peers = 0\nmdns = false\n')
            cfg = node_config(tmp, fed_key, fed, nid, broker.endpoint, body)
            ag = Agent(nid, cfg, tmp / nid, tmp / f"{nid}.log")
            agents.append(ag)
            ag.start()
        next_feed = {ag.nid: time.monotonic() + rng.uniform(0, a.feed_every) for ag in agents}
        next_sample, next_dump = time.monotonic(), time.monotonic() + 60
        pending_cut: tuple[float, Agent] | None = None
        try:
            while True:
                now = time.monotonic()
                if a.max_minutes and now - t0 > a.max_minutes * 60:
                    break
                for ag in agents:
                    if ag.proc is not None and ag.proc.poll() is not None:  # ended without a cut
                        ag.exits.append({"t": round(now - t0, 1), "rc": ag.proc.returncode,
                                         "log_tail": ag.log.read_text(errors="replace")[-1500:]})
                        print(f"{ag.nid} exited rc {ag.proc.returncode}; started again", flush=True)
                        if len(ag.exits) > 5:
                            raise RuntimeError(f"{ag.nid} keeps exiting: {ag.exits[-1]}")
                        ag.start()
                    if now >= next_feed[ag.nid]:
                        feed(ag, a.feed_n, rng.randrange(10**9))
                        next_feed[ag.nid] = now + a.feed_every
                if now >= next_sample:
                    row = [sample(ag, t0) for ag in agents]
                    total = sum(s["runs_ended"] for s in row)
                    for s in row:
                        s["total_ended"] = total
                    series.extend(row)
                    next_sample = now + a.sample_every
                    print(f"t {now - t0:.0f}s runs {total} " + " ".join(
                        f"{s['agent']}:{s['runs_ended']}/{s['bytes_no_store']}B/{s.get('rss_mb')}MB/"
                        f"{s.get('fds')}fd/{s.get('threads')}th/eps{s['privacy_epsilon']}" for s in row), flush=True)
                    if total >= a.runs:
                        complete = True
                        break
                    if pending_cut is None and marks and total >= marks[0]:
                        marks.pop(0)
                        pending_cut = (now + rng.uniform(0, a.every), rng.choice(agents))
                if pending_cut is not None and now >= pending_cut[0]:
                    ag = pending_cut[1]
                    pending_cut = None
                    before = privacy(ag.state)
                    phase = "run process alive" if ag.proc and psutil.Process(ag.proc.pid).children() else "idle"
                    pids = ag.cut()
                    hurt = damage(ag, rng) if rng.random() < a.truncate_share else []
                    off = rng.uniform(0.2, 2.0)
                    time.sleep(off)
                    ag.start()
                    cut = {"t": round(time.monotonic() - t0, 1), "agent": ag.nid, "pids": pids, "phase": phase,
                           "off_s": round(off, 2), "damage": hurt, "privacy_before": before,
                           "runs_ended_before": len(ended(ag.state))}
                    time.sleep(4.0)  # the service's start checks
                    cut["privacy_after"] = privacy(ag.state)
                    cuts.append(cut)
                    print(f"cut {len(cuts)}: {ag.nid} ({phase}), {len(hurt)} files damaged, privacy "
                          f"{before} -> {cut['privacy_after']}", flush=True)
                if now >= next_dump:
                    dump(False)
                    next_dump = now + 60
                time.sleep(0.2)
        finally:
            for ag in agents:
                if ag.proc is not None and ag.proc.poll() is None:
                    ag.proc.send_signal(signal.SIGTERM)
            for ag in agents:
                if ag.proc is not None:
                    try:
                        ag.proc.wait(timeout=90)
                    except subprocess.TimeoutExpired:
                        ag.cut()
            dump(False)
    final = {}
    for ag in agents:
        observe_versions(ag)
        r = subprocess.run([sys.executable, "-m", "dfl_agent.cli.dflctl", "state", "check", "--config", str(ag.cfg)],
                           capture_output=True, text=True)
        final[ag.nid] = {"store": store_counts(ag.state), "entries": read_entries(ag.state),
                         "state_check": {"rc": r.returncode, "out": (r.stdout + r.stderr)[-1500:]}}
    res = checks(agents, series, cuts, a, final)
    dump(complete, res)
    print(report(doc))
    if not a.keep_tmp:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
