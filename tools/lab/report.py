"""The lab's report: ``report.json``, ``report.md``, plots where matplotlib is installed,
and the scenario's checks (see docs/how-to/field-lab.md for every key)."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dfl_agent.cli.lab.scenario import Scenario
from dfl_agent.runtime.shared.degraded import peer_updates_used

if TYPE_CHECKING:
    from dfl_agent.cli.lab.runner import LabRun

#: events after which the affected devices were cut off themselves (their rounds alone
#: inside the event's window are not counted in rounds_alone)
_CUTS_DEVICE = ("partition", "flap", "power_cut")


def _records(state: Path) -> dict[str, list[dict[str, Any]]]:
    out = {}
    for m in sorted((state / "runs").glob("*/metrics.jsonl")):
        recs = []
        for line in m.read_text().splitlines():
            try:
                recs.append(json.loads(line))
            except ValueError:
                continue
        out[m.parent.name] = recs
    return out


def _used_peers(rec: dict[str, Any]) -> int:
    """The peers a round heard from, by the node's own rule
    (:func:`~dfl_agent.runtime.shared.degraded.peer_updates_used`, which its ``round_alone``
    counts): 0 for a round that was not meant to use any."""
    return peer_updates_used(rec) or 0


def recovery_start(end: float, spans: list[tuple[float, float]]) -> float | None:
    """When a device can recover from an event that ended at ``end`` (monotonic s): ``end``
    when its run was in progress then, else the submission of the next run.  ``spans``:
    ``(submitted, the device's last round in it)`` of each submitted run.  None: no run of
    the device was in progress or came after, so there was nothing to recover in (a fast
    run can end before a scenario's event does)."""
    if any(sub <= end <= last for sub, last in spans):
        return end
    later = [sub for sub, _ in spans if sub > end]
    return min(later) if later else None


def event_recovery(end: float | None, affected: list[str], spans: dict[str, list[tuple[float, float]]],
                   recs: dict[str, dict[str, list[dict[str, Any]]]]) -> tuple[float | None, bool]:
    """How long after an event the devices it affected recovered, each against its own runs.

    Args:
        end: when the event ended (monotonic s); None: it never ended.
        affected: the devices the event cut off or slowed.
        spans: device -> ``(submitted, its last round)`` of each run (:func:`recovery_start`).
        recs: device -> run id -> its round records (``time``: monotonic s; the peers used).

    Returns:
        ``(seconds, no_run_after)``: the seconds until the last affected device that had a
        run to recover in closed a round with a peer's update (from :func:`recovery_start`),
        rounded to 0.1; None when one of them never did, or none had a run.  ``no_run_after``
        is True when the event ended and no affected device had a run in progress or after.
    """
    starts = {n: None if end is None else recovery_start(end, spans.get(n, [])) for n in affected}
    per: list[float | None] = []
    for n, start in starts.items():
        if start is None:  # this device had no run left to recover in
            continue
        after = [r["time"] for rs in recs.get(n, {}).values() for r in rs
                 if r.get("time", 0) > start and _used_peers(r) > 0]
        per.append(min(after) - start if after else None)
    rec_s = None if not per or None in per else round(max(p for p in per if p is not None), 1)
    return rec_s, end is not None and all(start is None for start in starts.values())


def _store(state: Path) -> dict[str, Any]:
    from dfl_agent.store.sqlite import SampleStore, StoreError

    try:
        s = SampleStore(state, None, create=False)
    except (StoreError, OSError):
        return {}
    try:
        return s.status()
    finally:
        s.close()


def _torch_accuracy(col: dict[str, Any], states: dict[str, Path], test: Any) -> None:
    """Where a deployed version has no ``model.onnx`` (``deploy.onnx = false``, or no onnx
    extra), its held-out accuracy from the torch model (``models.load_deployed``)."""
    for n, node in col["nodes"].items():
        for r in node["runs"]:
            if r["deployed_version"] is None or r["heldout_accuracy"] is not None:
                continue
            try:
                import torch

                from dfl_agent.models import load_deployed

                torch.set_num_threads(1)
                model = load_deployed(states[n] / "models" / f"v{r['deployed_version']}")
                with torch.no_grad():
                    pred = model(torch.from_numpy(test.x.astype("float32"))).argmax(1).numpy()
                r["heldout_accuracy"] = float((pred == test.y).mean())
            except Exception:  # noqa: BLE001 - no torch or an unloadable version: no figure
                continue
            for d in col["deployments"]:
                if d["node"] == n and d["version"] == r["deployed_version"]:
                    d["heldout_accuracy"] = r["heldout_accuracy"]


def evaluate_checks(sc: Scenario, rep: dict[str, Any]) -> list[str]:
    """The scenario's checks against a report: the failures, each one line."""
    failed = []
    c = sc.checks
    devs = [d for d in rep["devices"] if d["role"] == "train"]
    if "samples_lost" in c:
        lost = sum(d.get("samples_lost") or 0 for d in devs)
        if lost > c["samples_lost"]:
            failed.append(f"samples_lost: {lost} samples lost (at most {c['samples_lost']})")
    if "oom_kills" in c:
        n = sum(int(d.get("oom_kills") or 0) for d in devs)
        if n > c["oom_kills"]:
            failed.append(f"oom_kills: {n} OOM kill(s) (at most {c['oom_kills']})")
    if "max_rounds_alone" in c:
        worst = {d["id"]: d["rounds_alone"] for d in devs if (d["rounds_alone"] or 0) > c["max_rounds_alone"]}
        if worst:
            failed.append("max_rounds_alone: " + ", ".join(f"{k} closed {v} round(s) alone" for k, v in worst.items())
                          + f" (at most {c['max_rounds_alone']})")
    if "max_recovery_s" in c:
        for e in rep["events"]:
            r = e.get("recovered_after_s")
            if "started_s" in e and e["started_s"] is None:
                failed.append(f"max_recovery_s: {e['kind']} {e['target']} did not happen (its run never trained)")
            elif e.get("no_run_after"):
                continue  # it ended after the last run had: nothing to recover in (the report says so)
            elif r is None or r > c["max_recovery_s"]:
                failed.append(f"max_recovery_s: {e['kind']} {e['target']} at {e['at_s']:.0f} s "
                              + ("never recovered" if r is None else f"recovered after {r:.0f} s")
                              + f" (at most {c['max_recovery_s']} s)")
    if c.get("all_runs_deployed"):
        for r in rep["runs"]:
            # a device whose deploy gate kept its deployed model still ends the run with one
            missing = sorted(set(r["members"] or []) - set(r["deployed_on"]) - set(r.get("kept_on", [])))
            if r["state"] != "finished" or missing or not r["members"]:
                failed.append(f"all_runs_deployed: run {r['run_id']} {r['state']}"
                              + (f", not deployed on {', '.join(missing)}" if missing else ""))
    if "discovery_via" in c:
        via = rep["discovery"]["via"]
        # mdns: every pair of devices of a site found each other through mDNS on its lab address
        missing = rep["discovery"].get("mdns_missing") or [] if c["discovery_via"] == "mdns" else []
        if c["discovery_via"] not in via or rep["discovery"]["seconds_to_full_membership"] is None or missing:
            failed.append(f"discovery_via: membership did not form through {c['discovery_via']} (seen: "
                          f"{', '.join(via) or 'nothing'}"
                          + (f"; not through mdns on the lab address: {', '.join(missing)}" if missing else "")
                          + ")")
    if c.get("runs_trained"):  # on by default: a run declined everywhere, or that trained no round, is no pass
        for i, r in enumerate(rep["runs"]):
            if r["members"] and r["rounds"]:
                continue
            what = ("was not submitted" if r["state"] == "not submitted" else f"{r['state']} on every device"
                    if not r["members"] else f"trained no round ({r['state']})")
            failed.append(f"runs_trained: run {r['run_id'] or i} ({r['algorithm']}) {what}")
    if c.get("all_upgraded"):
        failed += upgrade_checks(sc, rep)
    from dfl_agent.cli.lab.members import member_checks

    failed += member_checks(c, rep)  # inference_received
    if "min_final_accuracy" in c:
        acc = rep.get("final_accuracy_mean")
        if acc is None or acc < c["min_final_accuracy"]:
            failed.append(f"min_final_accuracy: final deployed accuracy "
                          f"{'none' if acc is None else f'{acc:.3f}'} (at least {c['min_final_accuracy']})")
    return failed


def upgrade_rows(upgrades: list[dict[str, Any]], recs: dict[str, dict[str, list[dict[str, Any]]]],
                 t0: float) -> list[dict[str, Any]]:
    """The report's ``upgrades``: each device upgrade as it happened, with the seconds since the
    agents started (``stopped_s``, ``started_s``), its ``dfl-agent --version`` before and after,
    and ``back_after_s``: from its start on the new release to its first round closed with a
    peer's update (None: it closed none)."""
    rows = []
    for u in upgrades:
        back = None
        if u.get("started") is not None:
            after = [r["time"] for rs in recs.get(u["device"], {}).values() for r in rs
                     if r.get("time", 0) > u["started"] and _used_peers(r) > 0]
            back = round(min(after) - u["started"], 1) if after else None
        rows.append({"device": u["device"], "from": u.get("from"), "to": u["to"],
                     "version_before": u.get("version_before"), "version_after": u.get("version_after"),
                     "running_before": u.get("running_before"),
                     "stopped_s": round(u["stopped"] - t0, 1) if u.get("stopped") else None,
                     "stop_took_s": u.get("stop_took_s"),
                     "started_s": round(u["started"] - t0, 1) if u.get("started") else None,
                     "back_after_s": back})
    return rows


def upgrade_checks(sc: Scenario, rep: dict[str, Any]) -> list[str]:
    """``all_upgraded = true``: every upgrade of the scenario happened (the device was running,
    was stopped and started on the new release), the device ends on that release, and it
    closed a round with a peer's update after its start; the failures, one line each."""
    from dfl_agent.cli.lab.scenario import upgrade_steps

    failed = []
    done = {(u["device"], u["to"]): u for u in rep.get("upgrades", [])}
    last = {st.device: st.release for st in upgrade_steps(sc)}
    release = {d["id"]: d.get("release") for d in rep["devices"]}
    for st in upgrade_steps(sc):
        u = done.get((st.device, st.release))
        if u is None or u.get("started_s") is None:
            failed.append(f"all_upgraded: {st.device} was not upgraded to {st.release}")
        elif not u.get("running_before"):
            failed.append(f"all_upgraded: {st.device} was not running when its upgrade came")
        elif u.get("back_after_s") is None:
            failed.append(f"all_upgraded: {st.device} closed no round with a peer after its upgrade to {st.release}")
    for dev, rel in last.items():
        if release.get(dev) != rel:
            failed.append(f"all_upgraded: {dev} ends on release {release.get(dev)}, not {rel}")
    return failed


def copy_logs(run: LabRun) -> None:
    """Every agent's metrics next to its log (``metrics/<device>/<run>.jsonl``)."""
    for a in run.agents.values():
        for m in (a.state / "runs").glob("*/metrics.jsonl"):
            dst = run.out / "metrics" / a.device.id / f"{m.parent.name}.jsonl"
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(m, dst)



def run_membership(entries: dict[str, Any]) -> tuple[list[str], list[str], set[str]]:
    """A run's members, its late decliners and the states its members recorded, from each
    device's ledger entry of it (None: the device never knew the run).  A device that
    declined it as ``late:`` (it came after the run had ended on its members) is not a
    member and its decline is no failure; any other decline is a state of the run."""
    members, late, states = [], [], set()
    for n, entry in entries.items():
        if not entry:
            continue
        if entry.get("state") == "declined" and str(entry.get("reason", "")).startswith("late:"):
            late.append(n)
            continue
        states.add(entry.get("state"))
        if entry.get("state") != "declined":
            members.append(n)
    return members, late, states


def run_peaks(state_dir: Path) -> dict[str, float]:
    """run id -> the peak resident memory of the device's run process for it (MiB), as the
    device's run ledger recorded it (``peak_rss_mb``; runs without one are left out)."""
    from dfl_agent.cli.lab.releases import ledger_entries

    return {rid: float(e["peak_rss_mb"]) for rid, e in ledger_entries(state_dir).items()
            if isinstance(e, dict) and isinstance(e.get("peak_rss_mb"), (int, float))
            and not isinstance(e.get("peak_rss_mb"), bool)}


def build_report(run: LabRun, feeder: Any, bundle: Any, started: float) -> dict[str, Any]:
    """Everything measurable from the run's folders, the checks, and the files."""
    from dfl_agent.cli.demo_feed import collect
    from dfl_agent.cli.lab.accuracy import accuracy_curve, measure_lab, time_to_accuracy
    from dfl_agent.cli.lab.releases import ledger_entries
    from dfl_agent.cli.lab.traffic import summarize

    sc: Scenario = run.sc
    copy_logs(run)
    run_ids = [r for r in run.run_ids if r]
    states = {n: a.state for n, a in run.agents.items()}
    col = collect(states, run_ids, bundle.test)
    _torch_accuracy(col, states, bundle.test)
    recs = {n: _records(a.state) for n, a in run.agents.items()}
    round_acc = measure_lab(run, recs, bundle.test)  # every round's model, from its checkpoint
    # windows of time in which a device was cut off itself (monotonic)
    cut: dict[str, list[tuple[float, float]]] = {n: [] for n in run.agents}
    for h in run.happened:
        if h.event.kind in _CUTS_DEVICE and h.start:
            cut[h.event.target].append((h.start, h.end or time.monotonic()))
        elif h.event.kind == "wan_down" and h.start:  # cut off: a device with no other on its site
            for n in cut:
                if [d.site for d in sc.training()].count(run.agents[n].device.site) == 1:
                    cut[n].append((h.start, h.end or time.monotonic()))
    fed_names: dict[str, dict[str, int]] = {}
    for ev in feeder.events:
        fed_names.setdefault(ev["node"], {})[f"feed-{ev['total'] - ev['windows']:06d}.npz"] = ev["windows"]

    devices = []
    for d in sc.devices:
        if d.role == "inference":  # a dfl-infer member: what it received (lab.members)
            from dfl_agent.cli.lab.members import member_row

            devices.append(member_row(run, d, bundle.test))
            continue
        a = run.agents.get(d.id)
        cg = run.cgroups.get(d.id, {})
        st = _store(a.state) if a else {}
        all_recs = [r for rs in recs.get(d.id, {}).values() for r in rs]
        alone = [r for r in all_recs if _used_peers(r) == 0
                 and not any(s <= r.get("time", 0) <= e for s, e in cut.get(d.id, []))]
        rejected_files = {f["name"] for f in st.get("rejected_files", [])}
        rejected = sum(w for name, w in fed_names.get(d.id, {}).items() if name in rejected_files)
        fed = int(feeder.pos.get(d.id, 0))
        stored, evicted = st.get("samples"), st.get("evicted_samples")
        node = col["nodes"].get(d.id, {})
        versions = [r["deployed_version"] for r in node.get("runs", []) if r["deployed_version"] is not None]
        devices.append({
            "id": d.id, "class": d.cls.name, "role": d.role, "site": d.site, "address": run.lab_hosts[d.id],
            "start_s": d.start_s, "peak_rss_mb": round(a.peak_rss_mb, 1) if a else None,
            # each run's run process, as the device recorded it in its run ledger
            "run_peak_rss_mb": run_peaks(a.state) if a else {},
            "cgroup_peak_mb": cg.get("peak_mb"), "memory_limit_mb": cg.get("limit_mb"),
            "oom_killed": bool(cg.get("oom_kills")), "oom_kills": cg.get("oom_kills", 0),
            "samples_fed": fed, "samples_stored": stored, "samples_evicted": evicted,
            "samples_rejected": rejected,
            "samples_lost": None if stored is None else fed - stored - (evicted or 0) - rejected,
            "deployed_versions": versions, "current_version": node.get("current"),
            "rounds_trained": len(all_recs), "rounds_alone": len(alone),
            "rounds_alone_at": [round(r["time"] - run.t0, 1) for r in alone],
            "rounds_cut_off": sum(1 for r in all_recs if _used_peers(r) == 0) - len(alone),
            "agent_starts": len(a.starts) if a else 0,
            "round_accuracy": sorted(p for s in round_acc.get(d.id, {}).values() for p in s),
            # the release its agent ran last, and that release's dfl-agent --version
            "release": a.release if a else d.release,
            "agent_version": run.releases[a.release].version_line if a and a.release in run.releases else None,
        })

    runs = []
    for i, rid in enumerate(run.run_ids):
        if rid is None:
            runs.append({"run_id": None, "algorithm": sc.runs[i].algorithm, "state": "not submitted",
                         "members": [], "rounds": 0, "deployed_on": [], "final_accuracy_mean": None,
                         "accuracy_curve": [], "time_to_accuracy": time_to_accuracy([], None)})
            continue
        deployed, accs, rounds = [], [], 0
        members, late, states_seen = run_membership({n: ledger_entries(a.state).get(rid)
                                                     for n, a in run.agents.items()})
        kept: list[str] = []
        for n in members:
            rounds = max(rounds, len(recs[n].get(rid, [])))
            for r in col["nodes"][n]["runs"]:
                if r["run_id"] != rid:
                    continue
                if r["deployed_version"] is not None:
                    deployed.append(n)
                    acc = r["heldout_accuracy"]
                else:  # the deploy gate kept the version deployed before: the device's model
                    before = [x for x in col["deployments"] if x["node"] == n and r.get("run_end")
                              and x["time"] <= r["run_end"]]
                    if not before:
                        continue
                    kept.append(n)
                    acc = before[-1]["heldout_accuracy"]
                if acc is not None:
                    accs.append(acc)
        state = ",".join(sorted(s for s in states_seen if s)) or "unknown"  # "finished" where all finished
        peaks = {d["id"]: d["run_peak_rss_mb"][rid] for d in devices if rid in d.get("run_peak_rss_mb", {})}
        runs.append({"run_id": rid, "algorithm": sc.runs[i].algorithm, "state": state, "members": sorted(members),
                     "rounds": rounds, "deployed_on": sorted(deployed), "kept_on": sorted(kept),
                     "peak_rss_mb": dict(sorted(peaks.items())),
                     "declined_late": sorted(late),
                     "final_accuracy_mean": round(sum(accs) / len(accs), 4) if accs else None,
                     "submitted_s": round(run.run_submitted[i] - run.t0, 1)})
        runs[-1]["accuracy_curve"] = accuracy_curve({n: round_acc[n][rid] for n in members if rid in round_acc.get(n, {})})
        runs[-1]["time_to_accuracy"] = time_to_accuracy(runs[-1]["accuracy_curve"], runs[-1]["submitted_s"])

    # each device's runs, (submission, its last round): recovery is counted from an event's end
    # only while the device's run is in progress, else from the next run's submission
    spans = {d.id: [(sub, max((r.get("time", 0) for r in recs.get(d.id, {}).get(rid, [])), default=sub))
                    for rid, sub in zip(run.run_ids, run.run_submitted) if rid is not None and sub]
             for d in sc.training()}
    events = []
    for h in run.happened:
        e = h.event
        if h.event.kind == "broker_outage":
            affected = [d.id for d in sc.training() if d.site == e.target]
        elif e.kind == "wan_down" or (e.kind == "upgrade" and e.target == "all"):
            affected = [d.id for d in sc.training()]
        else:
            affected = [e.target]
        rec_s, no_run_after = event_recovery(h.end, affected, spans, recs)
        events.append({"kind": e.kind, "target": e.target, "at_s": e.at_s, "duration_s": e.duration_s,
                       "value": e.value, "affected": affected, "recovered_after_s": rec_s,
                       "no_run_after": no_run_after,
                       "started_s": round(h.start - run.t0, 1) if h.start else None,
                       "ended_s": round(h.end - run.t0, 1) if h.end else None})

    discovery = _discovery(run, recs)
    for dev in devices:  # how the device found each peer first
        dev["peers_found_via"] = {p: min(ways, key=lambda w: ways[w]["at_s"])
                                  for p, ways in discovery["peers_found"].get(dev["id"], {}).items()}
    bytes_total = 0
    for rs in recs.values():
        for r in rs.values():
            if r:
                bytes_total += int(max(x.get("bytes_sent", 0) for x in r))
    final = [r for r in runs if r["final_accuracy_mean"] is not None]
    rep: dict[str, Any] = {
        "scenario": sc.name, "scenario_file": str(sc.path), "lab_id": run.lab_id, "seed": sc.seed,
        "perfect": sc.perfect, "mechanisms": run.mechanisms, "passed": False, "failed_checks": [],
        "checks": sc.checks, "devices": devices, "runs": runs, "events": events, "discovery": discovery,
        "host": {"cores": os.cpu_count(), "load_avg": [round(x, 2) for x in os.getloadavg()]},
        "bytes_total": bytes_total, "links": summarize(run.traffic.samples, run.t0) if run.traffic else {},
        "final_accuracy_mean": final[-1]["final_accuracy_mean"] if final else None,
        "compression": run.compression, "wall_seconds": round(time.time() - started, 1),
        "releases": {n: r.as_dict() for n, r in getattr(run, "releases", {}).items()},
        "upgrades": upgrade_rows(getattr(run, "upgrades", []), recs, run.t0),
        "notes": run.notes,
    }
    rep["failed_checks"] = evaluate_checks(sc, rep)
    rep["passed"] = not rep["failed_checks"]
    rep["plots"] = _plots(run, rep, recs, col)
    (run.out / "report.json").write_text(json.dumps(rep, indent=2, default=float) + "\n")
    (run.out / "report.md").write_text(markdown(rep))
    return rep


#: how a peer can be found (the agent's ``peers_found``), in the order the report lists them
_VIA = ("mdns", "presence", "bridged-presence", "static")


def _findings(recs: dict[str, dict[str, list[dict[str, Any]]]]) -> dict[str, dict[str, dict[str, tuple[float, str]]]]:
    """device -> peer -> how -> (monotonic time, address) of its first finding that way, from
    the ``peers_found`` of the device's round records (every run in ``recs``)."""
    out: dict[str, dict[str, dict[str, tuple[float, str]]]] = {}
    for n, runs in recs.items():
        for rs in runs.values():
            for r in rs:
                for peer, ways in (r.get("peers_found") or {}).items():
                    mine = out.setdefault(n, {}).setdefault(peer, {})
                    for how, f in ways.items():
                        if how not in mine or f["t"] < mine[how][0]:
                            mine[how] = (float(f["t"]), str(f.get("address") or ""))
    return out


def _discovery(run: LabRun, recs: dict[str, dict[str, list[dict[str, Any]]]]) -> dict[str, Any]:
    """How the devices found each other, as their agents recorded it: every way each peer was
    found (``via``), the first one per peer, the same-site pairs not found through multicast
    mDNS on the peer's lab address (``mdns_missing``), and when the first run's members had
    all found each other (from its submission). ``advertised``: what the lab's mDNS browser
    on the first site's bridge saw."""
    found = _findings(recs)
    site = {d.id: d.site for d in run.sc.training()}
    ran = [n for n in run.agents if recs.get(n)]
    via = [w for w in _VIA if any(w in ways for peers in found.values() for ways in peers.values())]
    missing = []
    for n in ran:
        for p in ran:
            f = found.get(n, {}).get(p, {}).get("mdns")
            if p != n and site[n] == site[p] and (f is None or f[1].rsplit(":", 1)[0] != run.lab_hosts[p]):
                missing.append(f"{n} -> {p}")
    full = None
    rid = run.run_ids[0] if run.run_ids else None
    if rid and run.run_submitted[0]:
        first = _findings({n: {rid: recs[n][rid]} for n in ran if rid in recs[n]})
        members = [n for n in ran if rid in recs[n]]
        times = [min((t for t, _ in first.get(n, {}).get(p, {}).values()), default=None)
                 for n in members for p in members if p != n]
        if members and None not in times:
            full = round(max([t for t in times if t is not None], default=run.run_submitted[0])
                         - run.run_submitted[0], 1)
    advertised: dict[str, list[str]] = {}
    path = run.out / "logs" / "mdns-browse.jsonl"
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            doc = json.loads(line)
        except ValueError:
            continue
        for n in run.agents:
            if doc.get("name", "").startswith(f"{run.fed}--{n}."):
                advertised[n] = doc.get("addresses", [])
    return {"seconds_to_full_membership": full, "via": via, "mdns_missing": missing,
            "peers_found": {n: {p: {how: {"at_s": round(t - run.t0, 1), "address": a} for how, (t, a) in ways.items()}
                                for p, ways in sorted(peers.items())} for n, peers in sorted(found.items())},
            "advertised": advertised,
            "measured": "the agents' records (peers_found), from the first run's submission"}


def _plots(run: LabRun, rep: dict[str, Any], recs: dict[str, Any], col: dict[str, Any]) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        from dfl_agent.extras import extra_hint

        rep["notes"].append(f"no plots: matplotlib is not installed ({extra_hint('plot')})")
        return []
    made = []
    for name, ylabel in (("accuracy.png", "held-out accuracy (lines: rounds, o: deployed)"),
                         ("traffic.png", "MB on the link (solid: to the host, dashed: from it)")):
        fig, ax = plt.subplots(figsize=(8, 4))
        for h in rep["events"]:
            if h["started_s"] is not None:
                ax.axvspan(h["started_s"], h["ended_s"] or h["started_s"] + 1, alpha=0.15, color="red")
        if name == "accuracy.png":
            _accuracy_lines(ax, run, rep, col)
        else:
            _traffic_lines(ax, run, rep, recs)
        ax.set_xlabel("seconds since the agents started")
        ax.set_ylabel(ylabel)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small")
        fig.tight_layout()
        fig.savefig(run.out / name)
        plt.close(fig)
        made.append(name)
    return made


def _accuracy_lines(ax: Any, run: LabRun, rep: dict[str, Any], col: dict[str, Any]) -> None:
    """accuracy.png: each device's round models (a line) and deployed models (markers)."""
    wall_t0 = time.time() - (time.monotonic() - run.t0)
    for k, d in enumerate(dev for dev in rep["devices"] if dev["id"] in run.agents):
        color = f"C{k % 10}"
        rounds = d.get("round_accuracy") or []
        if rounds:
            ax.plot([p[0] for p in rounds], [p[2] for p in rounds], color=color, lw=1, label=d["id"])
        pts = sorted((x["time"] - wall_t0, x["heldout_accuracy"]) for x in col["deployments"]
                     if x["node"] == d["id"] and x["heldout_accuracy"] is not None)
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o", color=color, ms=7,
                    label=None if rounds else d["id"])


def _traffic_lines(ax: Any, run: LabRun, rep: dict[str, Any], recs: dict[str, Any]) -> None:
    """traffic.png: each link's cumulative bytes to and from its host (the agents' own
    count of bytes sent where no link was sampled)."""
    if not rep.get("links"):
        for n in run.agents:
            pts = sorted((r["time"] - run.t0, r.get("bytes_sent", 0) / 1e6) for rs in recs[n].values() for r in rs)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{n} (sent)")
        return
    for k, (host, link) in enumerate(sorted(rep["links"].items())):
        pts = link["series"]
        ax.plot([p[0] for p in pts], [p[1] / 1e6 for p in pts], color=f"C{k % 10}", lw=1, label=host)
        ax.plot([p[0] for p in pts], [p[2] / 1e6 for p in pts], color=f"C{k % 10}", lw=1, ls="--")


def _accuracy_traffic_md(rep: dict[str, Any]) -> list[str]:
    """report.md: each run's time to the target accuracy, and the bytes on each link."""
    lines = ["", "| run | rounds measured | best mean accuracy | time to target from submission |", "|" + "---|" * 4]
    for r in rep["runs"]:
        tta = r.get("time_to_accuracy") or {}
        best = tta.get("best")
        reached = (f"{tta['seconds']} s (round {tta['round']})" if tta.get("seconds") is not None
                   else "never" if best is not None else "-")
        lines.append(f"| {r['run_id']} | {len(r.get('accuracy_curve') or [])} "
                     f"| {'-' if best is None else f'{best:.3f}'} | {tta.get('target', '')}: {reached} |")
    if rep.get("links"):
        lines += ["", "| link | MB to the host | MB from the host |", "|---|---|---|"]
        for host, link in sorted(rep["links"].items()):
            lines.append(f"| {host} | {link['bytes_to_host'] / 1e6:.2f} | {link['bytes_from_host'] / 1e6:.2f} |")
    return lines


def markdown(rep: dict[str, Any]) -> str:
    """``report.md``: the report for people."""
    lines = [f"# Lab report: {rep['scenario']}", "",
             f"**{'PASSED' if rep['passed'] else 'FAILED'}** in {rep['wall_seconds']} s "
             f"(lab {rep['lab_id']}, {rep['host']['cores']} cores, load {rep['host']['load_avg']})", ""]
    for f in rep["failed_checks"]:
        lines.append(f"- failed: {f}")
    lines += ["", "Mechanisms: " + ", ".join(f"{k} {v}" for k, v in rep["mechanisms"].items()), ""]
    rels = [r for r in (rep.get("releases") or {}).values() if r.get("dfl_agent_version")]
    if rels:
        lines += ["Releases: " + "; ".join(f"{r['name']} = {r['dfl_agent_version']} ({r['source'] or 'the lab'})"
                                           for r in rels), ""]
    lines += [
              "| device | class | address | peak RSS MB | run peak MB | limit MB | OOM | fed | stored | evicted "
              "| rejected | rounds | alone | deployed |", "|" + "---|" * 14]
    for d in rep["devices"]:
        runs_mb = d.get("run_peak_rss_mb") or {}
        run_peak = f"{max(runs_mb.values()):.0f}" if runs_mb else "-"
        lines.append(f"| {d['id']} | {d['class']} | {d['address']} | {d['peak_rss_mb']} | {run_peak} "
                     f"| {d['memory_limit_mb']} "
                     f"| {d['oom_kills']} | {d['samples_fed']} | {d['samples_stored']} | {d['samples_evicted']} "
                     f"| {d['samples_rejected']} | {d['rounds_trained']} | {d['rounds_alone']} "
                     f"| {', '.join(map(str, d['deployed_versions'])) or '-'} |")
    lines += ["", "| run | algorithm | state | members | rounds | deployed on | accuracy | run process peak MB |",
              "|" + "---|" * 8]
    for r in rep["runs"]:
        peaks = ", ".join(f"{n} {mb:.0f}" for n, mb in (r.get("peak_rss_mb") or {}).items()) or "-"
        lines.append(f"| {r['run_id']} | {r['algorithm']} | {r['state']} | {', '.join(r['members'])} | {r['rounds']} "
                     f"| {', '.join(r['deployed_on'])} | {r['final_accuracy_mean']} | {peaks} |")
    lines += ["", "| event | target | at s | duration s | recovered after s |", "|" + "---|" * 5]
    for e in rep["events"]:
        rec = "no run after it" if e.get("no_run_after") else e["recovered_after_s"]
        lines.append(f"| {e['kind']} | {e['target']} | {e['at_s']} | {e['duration_s']} | {rec} |")
    if rep.get("upgrades"):
        lines += ["", "| upgraded | from | to | stopped at s | started at s | back with a peer after s |",
                  "|" + "---|" * 6]
        for u in rep["upgrades"]:
            lines.append(f"| {u['device']} | {u['from']}: {u['version_before']} | {u['to']}: {u['version_after']} "
                         f"| {u['stopped_s']} | {u['started_s']} | {u['back_after_s']} |")
    lines += _accuracy_traffic_md(rep)
    disc = rep["discovery"]
    lines += ["", f"Discovery: {', '.join(disc['via']) or 'none'}; full membership after "
                  f"{disc['seconds_to_full_membership']} s. Bytes sent in all: {rep['bytes_total']}.", ""]
    lines += [f"- {d['id']} found " + ", ".join(f"{p} by {w}" for p, w in d["peers_found_via"].items())
              for d in rep["devices"] if d.get("peers_found_via")]
    lines += [""] if any(d.get("peers_found_via") for d in rep["devices"]) else []
    lines += [f"- {n}" for n in rep["notes"]]
    return "\n".join(lines) + "\n"
