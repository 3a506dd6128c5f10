"""Fleet queries answer from the broker, right after the agents start (real mosquitto, three real
``dfl-agent run`` processes with signatures required, ``dflctl`` as a subprocess): as soon as the
three agents' statuses are retained on the broker, 20 consecutive ``dflctl peers --config`` all
exit 0 with three verified rows - never "no presence or status from federation ...".  Every
other query goes through a slow link: a TCP relay that holds each connection's first bytes for
0.6 s (a WAN, a TLS handshake on a loaded gateway), longer than a settle window timed from
before the connection."""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from dfl_agent.cli.broker import start_broker
from dfl_agent.cli.observer import Observer
from tests.system.conftest import needs_mosquitto
from tests.system.test_runs import IDS, _config, _start

pytestmark = [pytest.mark.slow, pytest.mark.integration, needs_mosquitto, pytest.mark.timeout(180)]


@contextlib.contextmanager
def slow_link(upstream: str, delay: float = 0.6) -> Iterator[str]:
    """A TCP relay to ``upstream`` (``host:port``) on 127.0.0.1 that forwards each connection's
    first bytes ``delay`` s late (then everything as it comes); yields its ``host:port``."""
    host, port = upstream.rsplit(":", 1)
    srv = socket.create_server(("127.0.0.1", 0))
    srv.settimeout(0.2)
    done = threading.Event()

    def pump(a: socket.socket, b: socket.socket, hold: float) -> None:
        with contextlib.suppress(OSError):
            while data := a.recv(65536):
                time.sleep(hold)
                hold = 0.0
                b.sendall(data)
        with contextlib.suppress(OSError):
            b.shutdown(socket.SHUT_WR)

    def serve() -> None:
        while not done.is_set():
            try:
                client, _ = srv.accept()
            except TimeoutError:
                continue
            up = socket.create_connection((host, int(port)))
            threading.Thread(target=pump, args=(client, up, delay), daemon=True).start()
            threading.Thread(target=pump, args=(up, client, 0.0), daemon=True).start()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        yield f"127.0.0.1:{srv.getsockname()[1]}"
    finally:
        done.set()
        t.join()
        srv.close()


def test_twenty_consecutive_peers_right_after_three_agents_start(tmp_path):
    fed = "peers-" + str(int(time.time() * 1000) % 100000)
    fed_key = Ed25519PrivateKey.generate()
    with start_broker("mosquitto") as broker, slow_link(broker.endpoint) as slow:
        paths = {nid: _config(tmp_path, fed, nid, i, broker.endpoint, fed_key) for i, nid in enumerate(IDS)}
        far = tmp_path / "a0-far.toml"  # a0's configuration, over the slow link
        far.write_text(paths["a0"].read_text().replace(broker.endpoint, slow))
        procs = {nid: _start(tmp_path, nid, paths[nid]) for nid in IDS}
        obs = Observer(broker.endpoint, fed).start()
        try:
            end = time.monotonic() + 90
            while set(obs.snapshot()[0]) != set(IDS):  # the three statuses are retained on the broker
                assert time.monotonic() < end, "\n".join((tmp_path / f"{n}.log").read_text()[-2000:] for n in IDS)
                assert all(p.poll() is None for p in procs.values())
                time.sleep(0.05)
            answers = []
            for i in range(20):
                r = subprocess.run([sys.executable, "-m", "dfl_agent.cli.dflctl", "peers", "--config",
                                    str(far if i % 2 else paths["a0"]), "--json"], capture_output=True, text=True,
                                   timeout=60)
                answers.append((r.returncode, r.stderr.strip(),
                                [(p["node_id"], p["trust"]) for p in json.loads(r.stdout)["peers"]]
                                if r.returncode == 0 else []))
            assert answers == [(0, "", [(n, "device") for n in IDS])] * 20, answers
        finally:
            obs.stop()
            for p in procs.values():
                p.send_signal(signal.SIGTERM)
            for p in procs.values():
                p.wait(timeout=60)
    for n in IDS:
        assert "Traceback" not in (tmp_path / f"{n}.log").read_text()
