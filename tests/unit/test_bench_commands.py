"""The transport and round-share benchmarks record the command exactly as it was run, and the
transport benchmark's chunked raw-paho baseline carries the same bytes in the agent's chunk size.

The transport run is real: a one-message run of ``bench/scale/transport.py`` over a real
mosquitto, started under ``nice -n 3`` and without nice; its record must say so.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load(rel: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_" + Path(rel).stem, ROOT / rel)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_pieces_carry_the_payload_in_the_agents_chunk_size() -> None:
    t = _load("bench/scale/transport.py")
    from dfl_agent.runtime.config import MqttSection
    from dfl_agent.transport.link_rate import derive

    m = MqttSection()  # the agent's chunk size on a fast network (no link_rate)
    assert derive(m.link_rate, chunk_size=m.chunk_size).chunk_size == t.CHUNK_SIZE
    payload = bytes(range(256)) * 4096 + b"tail"  # 1 MiB + 4 bytes
    parts = t.pieces(payload)
    assert all(len(p) <= t.CHUNK_SIZE for p in parts) and len(parts) == 5
    assert b"".join(p[t.PIECE_HEADER:] for p in parts) == payload
    assert [int.from_bytes(p[:4], "big") for p in parts] == list(range(5))
    assert {int.from_bytes(p[4:8], "big") for p in parts} == {5}
    assert len(t.pieces(b"x" * 1000)) == 1


@pytest.mark.parametrize("rel", ["bench/scale/transport.py", "bench/operations/round_share.py"])
def test_invocation_is_the_command_as_run(rel: str) -> None:
    code = (f"import importlib.util, sys; spec = importlib.util.spec_from_file_location('m', {str(ROOT / rel)!r}); "
            "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); "
            "print(m.invocation([sys.argv[1], '--label', 'a b']))")
    plain = subprocess.run([sys.executable, "-c", code, rel], cwd=ROOT, capture_output=True, text=True, check=True)
    niced = subprocess.run(["nice", "-n", "3", sys.executable, "-c", code, rel], cwd=ROOT, capture_output=True,
                           text=True, check=True)
    base = os.nice(0)
    exe = os.path.relpath(sys.executable, ROOT)
    exe = exe if not exe.startswith("..") else sys.executable
    expect = f"{exe} {rel} --label 'a b'"
    assert plain.stdout.strip() == (f"nice -n {base} " if base > 0 else "") + expect
    assert niced.stdout.strip() == f"nice -n {base + 3} {expect}"


@pytest.mark.skipif(shutil.which("mosquitto") is None and not Path("/usr/sbin/mosquitto").exists(),
                    reason="needs mosquitto")
def test_transport_run_records_its_command_and_the_chunked_ratio(tmp_path: Path) -> None:
    out = tmp_path / "t.jsonl"
    args = ["bench/scale/transport.py", "--sizes", "600000", "--n", "2", "--repeats", "1", "--processes", "1",
            "--paths", "raw", "ours", "--label", "test run", "--out", str(out)]
    subprocess.run(["nice", "-n", "3", sys.executable, *args], cwd=ROOT, check=True, capture_output=True, timeout=120)
    rec = json.loads(out.read_text().splitlines()[-1])
    exe = os.path.relpath(sys.executable, ROOT)
    exe = exe if not exe.startswith("..") else sys.executable
    assert rec["command"] == f"nice -n {os.nice(0) + 3} " + shlex.join([exe, *args])
    row = rec["results"]["600000"]
    assert rec["paths"] == ["raw", "raw_chunked", "ours"] and rec["chunk_size"] == 256 * 1024
    assert row["raw_chunked"]["median"] > 0 and row["ours_ratio_chunked"] > 0
    assert row["ours_ratio_chunked"] == pytest.approx(max(
        a / b for a, b in zip(row["ours"]["medians"], row["raw_chunked"]["medians"], strict=True)))
    report = subprocess.run([sys.executable, "bench/scale/transport.py", "--report", str(out)], cwd=ROOT,
                            check=True, capture_output=True, text=True).stdout
    assert "ratio to chunked raw paho" in report and "| raw_chunked |" in report
