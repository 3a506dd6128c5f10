"""Operator tooling: the shipped systemd units pass ``systemd-analyze verify``,
``dflctl install-service`` (dry run and staging root), ``doctor`` and the
``peers``/``status``/``watch`` views over a real broker."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dfl_agent.cli.cli_ops import default_exec
from dfl_agent.cli.dflctl import main as dflctl
from dfl_agent.cli.tables import peer_rows, status_rows
from dfl_agent.runtime.shared.config import config_from_dict, dump_toml

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]
needs_analyze = pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")


def _exe() -> str:
    exe = default_exec()
    return exe if Path(exe).exists() else sys.executable


def _verify(*units: Path) -> None:
    r = subprocess.run(["systemd-analyze", "verify", *map(str, units)], capture_output=True, text=True, timeout=60)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    for bad in ("Unknown key", "ignoring", "Invalid", "Failed to parse"):
        assert bad not in out, out


#: a user's configuration, with comments and keys in the user's order (installed byte for byte)
USER_CONFIG = """# greenhouse node: written by hand
federation = "greenhouse"
state_dir = "/var/lib/dfl-agent/greenhouse"   # the service's StateDirectory

[mqtt]
password = "x"   # mode 0640: readable by the dfl-agent group only
username = "u"
"""


def _stage(tmp_path, *extra, config_text=USER_CONFIG):
    cfg = tmp_path / "node.toml"
    cfg.write_text(config_text)
    prof = tmp_path / "pi4.toml"
    prof.write_text('name = "pi4"\n[resources]\nmemory_max = "1G"\ncpu_quota = 150\n')
    root = tmp_path / "root"
    rc = dflctl(["install-service", "--root", str(root), "--exec", _exe(), "--config", str(cfg),
                 "--profile", str(prof), *extra])
    assert rc == 0
    return root


@needs_analyze
def test_shipped_units_pass_systemd_analyze_verify(tmp_path):
    root = _stage(tmp_path)
    units = root / "etc/systemd/system"
    _verify(units / "dfl-agent.service")
    root2 = _stage(tmp_path, "--instance", "greenhouse")
    template = root2 / "etc/systemd/system/dfl-agent@.service"
    inst = template.with_name("dfl-agent@greenhouse.service")
    inst.write_text(template.read_text())
    _verify(inst)
    text = (units / "dfl-agent.service").read_text()
    for line in ("Type=notify", "WatchdogSec=", "Restart=on-failure", "StartLimitBurst=", "StateDirectory=dfl-agent",
                 "LogsDirectory=dfl-agent", "RuntimeDirectory=dfl-agent", "User=dfl-agent", "NoNewPrivileges=yes",
                 "ProtectSystem=strict", "ProtectHome=yes", "PrivateTmp=yes", "CapabilityBoundingSet=\n",
                 "RestrictAddressFamilies=AF_INET AF_INET6 AF_UNIX AF_NETLINK", "MemoryMax=", "CPUQuota="):
        assert line in text, line
    dropin = (units / "dfl-agent.service.d/50-resources.conf").read_text()
    assert "MemoryMax=1G" in dropin and "CPUQuota=150%" in dropin


def test_install_service_stages_user_config_and_dry_run_writes_nothing(tmp_path, capsys):
    root = _stage(tmp_path, "--instance", "greenhouse")
    cfg = root / "etc/dfl-agent/greenhouse.toml"
    assert cfg.stat().st_mode & 0o777 == 0o640  # holds the MQTT password
    from dfl_agent.runtime.shared.config import load_config

    assert cfg.read_bytes() == USER_CONFIG.encode()  # as written: comments kept, no dump of defaults
    installed = load_config(cfg)
    assert installed.state_dir == "/var/lib/dfl-agent/greenhouse" and installed.federation == "greenhouse"
    if shutil.which("systemd-sysusers"):
        r = subprocess.run(["systemd-sysusers", "--root", str(root), str(root / "etc/sysusers.d/dfl-agent.conf")],
                           capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        assert "dfl-agent:" in (root / "etc/passwd").read_text()
    capsys.readouterr()
    dry = tmp_path / "dry"
    assert dflctl(["install-service", "--dry-run", "--json", "--root", str(dry), "--exec", _exe()]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["dry_run"] and any(p.endswith("dfl-agent.service") for p in plan["files"])
    assert not dry.exists()
    capsys.readouterr()
    assert dflctl(["install-service", "--dry-run", "--exec", _exe()]) == 0  # the live system: plan only
    out = capsys.readouterr().out
    assert "would run: systemctl enable --now dfl-agent.service" in out


def test_install_service_warns_when_state_dir_is_not_the_services(tmp_path, capsys):
    text = USER_CONFIG.replace('"/var/lib/dfl-agent/greenhouse"', '"/srv/elsewhere"')
    root = _stage(tmp_path, config_text=text)  # no --instance: the service's state is /var/lib/dfl-agent
    assert (root / "etc/dfl-agent/node.toml").read_bytes() == text.encode()
    err = capsys.readouterr().err
    assert "state_dir = '/srv/elsewhere'" in err and 'set state_dir = "/var/lib/dfl-agent"' in err
    bad = tmp_path / "bad.toml"
    bad.write_text("[mqtt]\nchunk_size = 12\n")
    assert dflctl(["install-service", "--root", str(tmp_path / "r2"), "--exec", _exe(), "--config", str(bad)]) == 2
    assert "mqtt.chunk_size" in capsys.readouterr().err
    assert not (tmp_path / "r2").exists()


def test_doctor_json(tmp_path, mosquitto_broker, capsys):
    cfg = tmp_path / "node.toml"
    cfg.write_text(dump_toml(config_from_dict({"state_dir": str(tmp_path / "state"),
                                               "mqtt": {"broker": mosquitto_broker.endpoint}})))
    rc = dflctl(["doctor", "--config", str(cfg), "--json", "--timeout", "3"])
    checks = {c["check"]: c for c in json.loads(capsys.readouterr().out)["checks"]}
    assert set(checks) == {"config", "broker", "mdns", "clock", "disk", "permissions", "checkpoint"}
    assert checks["broker"]["status"] == "ok" and checks["mdns"]["status"] == "ok"
    assert rc == (1 if any(c["status"] == "fail" for c in checks.values()) else 0)
    rc = dflctl(["doctor", "--broker", "127.0.0.1:9", "--interface", "127.0.0.1", "--state-dir", str(tmp_path),
                 "--json", "--timeout", "1"])
    checks = {c["check"]: c for c in json.loads(capsys.readouterr().out)["checks"]}
    assert rc == 1 and checks["broker"]["status"] == "fail"


def test_peer_and_status_rows_tolerate_missing_fields():
    now = 1_800_000_000.0
    presence = {"a": {"state": "online", "time": now - 1, "descriptor": {"broker": "h:1", "algorithm": "dfml",
                                                                         "compatibility": "ok"}},
                "b": {"state": "offline"}, "c": {"state": "online", "time": now - 100}}
    statuses = {"a": {"round": 3, "time": now - 2, "alpha_n": 0.5, "role": "aggregator", "global_accuracy": 0.8,
                      "errors": {"malformed": 2}, "last_synchronization": 12.5, "rounds_skipped": 4,
                      "paused_disconnected_s": 1.5},
                "d": {}}
    rows = {r["node_id"]: r for r in peer_rows(statuses, presence, now=now)}
    assert rows["a"]["state"] == "online" and rows["a"]["compatibility"] == "ok"
    assert rows["a"]["address"] == "-" and rows["a"]["broker"] == "h:1"  # the device's address, never the broker's
    assert rows["b"]["state"] == "offline" and rows["b"]["last_seen_s"] is None
    assert rows["c"]["state"] == "stale" and rows["d"]["state"] == "unknown"
    st = {r["node_id"]: r for r in status_rows(statuses, now=now)}
    assert st["a"]["sync_state"] == {"alpha_n": 0.5} and st["a"]["errors"] == 2 and st["a"]["accuracy"] == 0.8
    assert st["a"]["rounds_skipped"] == 4 and st["a"]["paused_disconnected_s"] == 1.5
    assert st["d"]["round"] is None and st["d"]["rounds_skipped"] is None


def test_watch_json_and_status_views(mosquitto_broker, federation, capsys):
    import paho.mqtt.client as mqtt

    pub = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"fake-{federation}")
    pub.connect(mosquitto_broker.host, mosquitto_broker.port)
    pub.loop_start()
    base = f"dfl/{federation}/node/n1"
    pub.publish(f"{base}/presence", json.dumps({"state": "online", "node_id": "n1", "time": 1e9,
                                                "descriptor": {"broker": "h:1", "algorithm": "dfml"}}),
                qos=1, retain=True).wait_for_publish(5)
    pub.publish(f"{base}/status", json.dumps({"round": 4, "role": "sender", "alpha_n": 0.3, "state": "running"}),
                qos=1, retain=True).wait_for_publish(5)
    pub.loop_stop()
    pub.disconnect()
    args = ["--broker", mosquitto_broker.endpoint, "--federation", federation]
    assert dflctl(["watch", "--json", "--count", "2", "--interval", "0.1", *args]) == 0
    docs = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(docs) == 2 and docs[0]["peers"][0]["node_id"] == "n1" and docs[0]["schema_version"] == 1
    assert docs[0]["status"][0]["sync_state"] == {"alpha_n": 0.3}
    assert dflctl(["status", "--json", *args, "n1"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["schema_version"] == 1 and doc["nodes"]["n1"]["round"] == 4
    assert dflctl(["status", *args]) == 0  # the table
    assert "n1" in capsys.readouterr().out
    assert dflctl(["watch", "--count", "1", "--interval", "0", *args]) == 0  # the live view, once
