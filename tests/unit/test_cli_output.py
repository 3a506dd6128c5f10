"""dflctl's output contract: exit codes, JSON documents with schema_version, no line
wrapping without a terminal, shell completion."""

from __future__ import annotations

import io
import json
import subprocess

import pytest

from dfl_agent.cli.broker import free_port
from dfl_agent.cli.dflctl import main
from dfl_agent.cli.output import SCHEMA_VERSION, console, json_doc
from dfl_agent.cli.tables import PEER_COLUMNS, peer_rows, render_table


def test_unreachable_broker_exits_3(capsys: pytest.CaptureFixture[str]) -> None:
    port = free_port()  # nothing listens there
    for cmd in ("peers", "status"):
        assert main([cmd, "--broker", f"127.0.0.1:{port}", "--timeout", "2"]) == 3
        assert f"127.0.0.1:{port}" in capsys.readouterr().err


def test_usage_and_config_errors_exit_2(tmp_path) -> None:
    with pytest.raises(SystemExit) as e:
        main(["peers", "--timeout", "not-a-number"])
    assert e.value.code == 2
    bad = tmp_path / "bad.toml"
    bad.write_text("federation = \n")
    assert main(["peers", "--config", str(bad)]) == 2


def test_json_doc_carries_schema_version() -> None:
    assert json.loads(json_doc({"a": 1, "schema_version": 7}))["schema_version"] == SCHEMA_VERSION == 1
    assert json.loads(json_doc([1, 2], key="peers")) == {"schema_version": 1, "peers": [1, 2]}


def test_algorithms_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["algorithms", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["schema_version"] == 1 and "fedavg" in doc["algorithms"] and "dfml" in doc["algorithms"]


def test_keys_show_json(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    fed = tmp_path / "fed"
    assert main(["keys", "federation-init", "--dir", str(fed)]) == 0
    capsys.readouterr()
    assert main(["keys", "show", "--dir", str(fed), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["schema_version"] == 1 and len(doc["federation_key"]["fingerprint"]) > 0
    assert doc["node_key"] is None


def test_no_line_wrapping_without_a_terminal() -> None:
    long_id = "node-" + "x" * 150
    rows = peer_rows({long_id: {"round": 3, "time": 1.0}},
                     {long_id: {"state": "online", "descriptor": {"address": "10.0.0.1:1883" * 5}}}, now=2.0)
    buf = io.StringIO()  # not a TTY
    console(buf).print(render_table("peers", rows, PEER_COLUMNS))
    text = buf.getvalue()
    assert long_id in text and "10.0.0.1:1883" * 5 in text
    assert "…" not in text and "\x1b[" not in text  # neither truncated nor coloured
    assert sum(long_id in line for line in text.splitlines()) == 1


def _fleet(n: int = 3):
    now = 1_800_000_000.0
    presence = {f"greenhouse-node-{i:02d}": {
        "state": "online", "time": now - 1,
        "descriptor": {"address": f"192.168.100.{i}:1883", "profile": "raspberry-pi-4", "algorithm": "dfml",
                       "model_hash": "a1b2c3d4e5f6a7b8", "compatibility": "ok"}} for i in range(n)}
    statuses = {k: {"round": 12, "time": now - 2, "state": "running", "role": "aggregator", "alpha_n": 0.25,
                    "global_accuracy": 0.8123, "bytes_sent": 123456789, "bytes_received": 98765432,
                    "errors": {"malformed": 2, "status_forged": 1}, "last_synchronization": now - 5,
                    "run": {"id": "r-2026-11-23-abc", "state": "running", "round": 12}} for k in presence}
    return now, statuses, presence


def test_tables_fit_80_columns_without_cutting_values() -> None:
    from rich.console import Console

    from dfl_agent.cli.tables import STATUS_COLUMNS, status_rows

    now, statuses, presence = _fleet()
    presence["greenhouse-node-01"]["descriptor"]["compatibility"] = "incompatible: model hash " + "f" * 40
    buf = io.StringIO()
    con = Console(file=buf, width=80, no_color=True, highlight=False)  # an 80-column terminal
    con.print(render_table("peers", peer_rows(statuses, presence, now=now), PEER_COLUMNS))
    con.print(render_table("status", status_rows(statuses, now=now), STATUS_COLUMNS))
    text = buf.getvalue()
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= 80
    assert "…" not in text  # no value is cut short
    for i in range(3):  # the important columns, whole
        assert sum(f"greenhouse-node-{i:02d}" in line for line in lines) == 2  # one row per table
    head_peers, head_status = lines[2], next(line for line in lines[10:] if "node" in line and "┃" in line)
    for col in ("node", "state", "round", "seen_s"):
        assert col in head_peers, col
    for col in ("node", "state", "round", "acc"):
        assert col in head_status, col
    assert "0.812" in text and " 12 " in text
    assert "not shown: " in text and "model" in text.split("not shown: ")[1]  # what was left out is named
    # a warning is shown whatever its width: it wraps (fold) instead of being cut
    peers = lines[:lines.index(next(line for line in lines if line.startswith("└")))]
    compat = "".join(line.split("│")[-2].strip() for line in peers if line.startswith("│"))
    assert "incompatible:modelhash" + "f" * 40 in compat.replace(" ", "")


def test_tables_keep_every_column_where_they_fit() -> None:
    from rich.console import Console

    now, statuses, presence = _fleet()
    buf = io.StringIO()
    Console(file=buf, width=200, no_color=True).print(render_table("peers", peer_rows(statuses, presence, now=now),
                                                                  PEER_COLUMNS))
    text = buf.getvalue()
    assert all(col in text for col in PEER_COLUMNS) and "not shown" not in text


@pytest.mark.parametrize("shell", ["bash", "zsh"])
def test_completion_scripts_generate(shell: str, capsys: pytest.CaptureFixture[str], tmp_path) -> None:
    assert main(["completion", shell]) == 0
    script = capsys.readouterr().out
    assert "complete -o default -F _dflctl dflctl" in script
    for word in ("simulate", "peers", "install-service", "--json", "--broker"):
        assert word in script
    if shell == "bash":  # it parses, and completes "dflctl keys s" to "show"
        f = tmp_path / "c.bash"
        f.write_text(script)
        r = subprocess.run(["bash", "-c", f'source {f}; COMP_WORDS=(dflctl keys s); COMP_CWORD=2; _dflctl; '
                            'echo "${COMPREPLY[@]}"'], capture_output=True, text=True, check=False, timeout=30)
        assert r.returncode == 0 and r.stdout.split() == ["show"], r.stderr


def test_install_service_warns_when_execstart_is_hidden_from_the_service(tmp_path,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    stage = tmp_path / "stage"
    assert main(["install-service", "--dry-run", "--root", str(stage),
                 "--exec", "/home/alice/venv/bin/dfl-agent"]) == 0
    err = capsys.readouterr().err
    assert "warning" in err and "/home" in err and "ProtectHome" in err and "/opt/dfl-agent" in err
    assert main(["install-service", "--dry-run", "--root", str(stage), "--json",
                 "--exec", "/tmp/v/bin/dfl-agent"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["schema_version"] == 1 and any("PrivateTmp" in w for w in doc["warnings"])
    assert main(["install-service", "--dry-run", "--root", str(stage), "--exec", "/opt/dfl/bin/dfl-agent"]) == 0
    assert "warning" not in capsys.readouterr().err


def test_cache_dir_follows_xdg_and_dfl_cache_dir_wins(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    from dfl_agent.data.cache import resolve_cache_dir

    monkeypatch.delenv("DFL_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert resolve_cache_dir() == tmp_path / "xdg" / "dfl-agent"
    monkeypatch.setenv("DFL_CACHE_DIR", str(tmp_path / "mine"))
    assert resolve_cache_dir() == tmp_path / "mine"
    assert resolve_cache_dir(tmp_path / "arg") == tmp_path / "arg"


def test_status_last_sync_is_an_age() -> None:
    from dfl_agent.cli.tables import status_rows

    rows = status_rows({"a": {"last_synchronization": 1_500_000_000.0}, "b": {"last_synchronization": 4400.0}},
                       now=1_500_000_042.5)
    assert rows[0]["last_sync_s"] == 42.5  # seconds since the last round
    assert rows[1]["last_sync_s"] is None  # a monotonic reading is not an age


@pytest.mark.integration
def test_watch_count_prints_every_frame_without_a_terminal() -> None:
    import sys

    from dfl_agent.cli.broker import mosquitto_path, start_broker

    if not mosquitto_path():
        pytest.skip("mosquitto not installed")
    broker = start_broker("mosquitto")
    try:
        r = subprocess.run([sys.executable, "-m", "dfl_agent.cli.dflctl", "watch", "--broker", broker.endpoint,
                            "--count", "2", "--interval", "0.1", "--timeout", "10"],
                           capture_output=True, text=True, check=False, timeout=60)
    finally:
        broker.stop()
    assert r.returncode == 0, r.stderr
    titles = [line for line in r.stdout.splitlines() if line.strip().startswith("peers (")]
    assert len(titles) == 2, r.stdout
