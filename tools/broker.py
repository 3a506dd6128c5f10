"""Launch a local MQTT broker (mosquitto or amqtt) for the demo and the tests.

:func:`start_broker` runs the broker as a child process bound to a loopback address
and returns a :class:`BrokerHandle` (a context manager) once the port accepts TCP
connections.  Brokers are killed on :meth:`BrokerHandle.stop`, when the ``with``
block ends, and at interpreter exit (``atexit``).

* mosquitto (MQTT 5 and 3.1.1): a temporary configuration file with one listener on
  ``host:port``, anonymous access, no persistence, log to the process's stderr,
  which is captured into a temporary file (:attr:`BrokerHandle.log_path`).
* amqtt (MQTT 3.1.1 only): ``python -m dfl_agent.cli.broker --amqtt --host H --port N``
  runs :class:`amqtt.broker.Broker` on ``H:N`` (this module's command line entry);
  the child exits by itself when its parent process disappears.

Usage::

    with start_broker() as broker:           # mosquitto if installed, else amqtt
        transport = MqttTransport(..., broker=broker.endpoint, protocol=broker.protocols[0])
"""

from __future__ import annotations

import argparse
import atexit
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from dfl_agent.extras import extra_hint

log = logging.getLogger(__name__)

KINDS = ("auto", "mosquitto", "amqtt")
_MOSQUITTO_FALLBACK = "/usr/sbin/mosquitto"

_live: set[BrokerHandle] = set()
_live_lock = threading.Lock()


def mosquitto_path() -> str | None:
    """Path of the mosquitto executable (``PATH`` or /usr/sbin), or ``None``."""
    found = shutil.which("mosquitto")
    if found:
        return found
    if os.access(_MOSQUITTO_FALLBACK, os.X_OK):
        return _MOSQUITTO_FALLBACK
    return None


def amqtt_available() -> bool:
    """True when the ``amqtt`` package can be imported."""
    import importlib.util

    return importlib.util.find_spec("amqtt") is not None


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that was free a moment ago (bind to port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _port_open(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.2):
            return True
    except OSError:
        return False


class BrokerHandle:
    """A running local broker (child process).

    Attributes:
        kind: ``"mosquitto"`` or ``"amqtt"``.
        host, port: where it listens; ``endpoint`` is ``"host:port"``.
        protocols: MQTT versions it speaks, e.g. ``("5", "3.1.1")``.
        log_path: file receiving the broker's log output.
    """

    def __init__(self, kind: str, host: str, port: int, max_packet_size: int | None,
                 start_timeout: float = 10.0):
        self.kind = kind
        self.host = host
        self.port = port
        self.max_packet_size = max_packet_size
        self.start_timeout = start_timeout
        self.protocols: tuple[str, ...] = ("5", "3.1.1") if kind == "mosquitto" else ("3.1.1",)
        self._dir = tempfile.TemporaryDirectory(prefix=f"dfl-{kind}-")
        self.log_path = Path(self._dir.name) / "broker.log"
        self._proc: subprocess.Popen | None = None
        self._log_file = None

    @property
    def endpoint(self) -> str:
        """``"host:port"`` for :class:`~dfl_agent.transport.mqtt.MqttTransport`."""
        return f"{self.host}:{self.port}"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def _command(self) -> list[str]:
        if self.kind == "mosquitto":
            exe = mosquitto_path()
            if exe is None:
                raise FileNotFoundError("mosquitto is not installed")
            conf = Path(self._dir.name) / "mosquitto.conf"
            lines = [
                f"listener {self.port} {self.host}",
                "allow_anonymous true",
                "persistence false",
                "log_dest stderr",
                "log_type error",
                "log_type warning",
                "log_type notice",
                "log_type information",
            ]
            if self.max_packet_size is not None:
                lines.append(f"max_packet_size {self.max_packet_size}")
            conf.write_text("\n".join(lines) + "\n")
            return [exe, "-c", str(conf)]
        return [sys.executable, "-m", "dfl_agent.cli.broker", "--amqtt",
                "--host", self.host, "--port", str(self.port), "--parent-pid", str(os.getpid())]

    def log_tail(self, lines: int = 20) -> str:
        """The last ``lines`` lines of the broker's log."""
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def start(self) -> BrokerHandle:
        """Start the process and wait until the port accepts connections.

        Raises:
            RuntimeError: the broker exited or did not listen within ``start_timeout``
                seconds (the message includes the log tail).
        """
        if self.running:
            return self
        cmd = self._command()
        env = dict(os.environ)
        self._log_file = open(self.log_path, "ab")
        self._proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=self._log_file,
                                      stderr=subprocess.STDOUT, env=env)
        with _live_lock:
            _live.add(self)
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                code = self._proc.returncode
                self._cleanup_process()
                raise RuntimeError(f"{self.kind} broker on {self.endpoint} exited with code {code}:\n"
                                   f"{self.log_tail()}")
            if _port_open(self.host, self.port):
                log.debug("%s broker listening on %s", self.kind, self.endpoint)
                return self
            time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"{self.kind} broker did not listen on {self.endpoint} within "
                           f"{self.start_timeout} s:\n{self.log_tail()}")

    def _cleanup_process(self) -> None:
        self._proc = None
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        with _live_lock:
            _live.discard(self)

    def stop(self, timeout: float = 5.0) -> None:
        """Terminate the broker (SIGTERM, then SIGKILL after ``timeout`` s). Idempotent."""
        proc = self._proc
        if proc is not None:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            self._cleanup_process()

    def kill(self) -> None:
        """SIGKILL the broker (simulates a crash). Idempotent."""
        proc = self._proc
        if proc is not None:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            self._cleanup_process()

    def restart(self) -> BrokerHandle:
        """Stop and start again on the same port (state such as retained messages is lost)."""
        self.stop()
        deadline = time.monotonic() + 5.0
        while _port_open(self.host, self.port) and time.monotonic() < deadline:
            time.sleep(0.02)
        return self.start()

    def close(self) -> None:
        """Stop the broker and remove its temporary files."""
        self.stop()
        self._dir.cleanup()

    def __enter__(self) -> BrokerHandle:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"BrokerHandle({self.kind!r}, {self.endpoint!r}, running={self.running})"


def start_broker(kind: str = "auto", host: str = "127.0.0.1", port: int = 0,
                 max_packet_size: int | None = None, start_timeout: float = 10.0) -> BrokerHandle:
    """Start a local broker and return its handle once it accepts connections.

    Args:
        kind: ``"mosquitto"``, ``"amqtt"`` or ``"auto"`` (mosquitto when installed,
            else amqtt).
        host: address to listen on (keep it a loopback address).
        port: TCP port; 0 picks a free one.
        max_packet_size: broker's limit on incoming packets in bytes (mosquitto only).
        start_timeout: seconds to wait for the port to accept connections.

    Raises:
        ValueError: unknown ``kind``, or ``max_packet_size`` with amqtt.
        FileNotFoundError: the requested broker is not installed.
        RuntimeError: the broker did not come up (message includes its log tail).
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if kind == "auto":
        kind = "mosquitto" if mosquitto_path() else "amqtt"
    if kind == "mosquitto" and mosquitto_path() is None:
        raise FileNotFoundError("mosquitto is not installed")
    if kind == "amqtt":
        if not amqtt_available():
            raise FileNotFoundError(f"amqtt is not installed ({extra_hint('broker')})")
        if max_packet_size is not None:
            raise ValueError("max_packet_size is only supported with mosquitto")
    if not isinstance(port, int) or not 0 <= port <= 65535:
        raise ValueError(f"port must be an int in 0..65535, got {port!r}")
    if port == 0:
        port = free_port(host)
    return BrokerHandle(kind, host, port, max_packet_size, start_timeout).start()


@atexit.register
def _stop_all() -> None:
    with _live_lock:
        handles = list(_live)
    for handle in handles:
        try:
            handle.kill()
        except Exception:  # noqa: BLE001 - best effort at exit
            pass


# ---------------------------------------------------------------------------
# amqtt child process entry: python -m dfl_agent.cli.broker --amqtt --port N


def amqtt_config(host: str, port: int) -> dict:
    """amqtt 0.12 broker configuration: one TCP listener, anonymous access, no $SYS."""
    return {
        "listeners": {"default": {"type": "tcp", "bind": f"{host}:{port}"}},
        "plugins": {"amqtt.plugins.authentication.AnonymousAuthPlugin": {"allow_anonymous": True}},
    }


async def _serve_amqtt(host: str, port: int, parent_pid: int | None) -> None:
    import asyncio
    import signal

    from amqtt.broker import Broker

    broker = Broker(amqtt_config(host, port))
    await broker.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    while not stop.is_set():
        if parent_pid is not None and os.getppid() != parent_pid:
            break  # orphaned: the launching process is gone
        try:
            await asyncio.wait_for(stop.wait(), 0.5)
        except asyncio.TimeoutError:
            pass
    try:
        await asyncio.wait_for(broker.shutdown(), 3.0)
    except Exception:  # noqa: BLE001 - exiting anyway
        pass


def main(argv: list[str] | None = None) -> int:
    """Command line: ``python -m dfl_agent.cli.broker [--amqtt|--mosquitto] [--port N]``."""
    import asyncio

    parser = argparse.ArgumentParser(description="run a local MQTT broker")
    parser.add_argument("--amqtt", action="store_true", help="run amqtt in this process")
    parser.add_argument("--mosquitto", action="store_true", help="run mosquitto (child process)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=1883)
    parser.add_argument("--parent-pid", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.amqtt:
        logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
        asyncio.run(_serve_amqtt(args.host, args.port, args.parent_pid))
        return 0
    with start_broker("mosquitto" if args.mosquitto else "auto", args.host, args.port) as handle:
        print(f"{handle.kind} broker on {handle.endpoint}; Ctrl-C to stop", flush=True)
        try:
            while handle.running:
                time.sleep(0.5)
        except KeyboardInterrupt:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
