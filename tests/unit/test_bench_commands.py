"""The transport and round-share benchmarks record the command exactly as it was run, and the
transport benchmark's raw-paho baseline carries the same bytes in the agent's chunks, with the
documented chunk header, and reassembles them.

The transport run is real: a short run of ``bench/scale/transport.py`` over a real mosquitto,
started under ``nice -n 3``; its record must say so.
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


def test_pieces_carry_the_payload_in_the_agents_chunks() -> None:
    t = _load("bench/scale/transport.py")
    from dfl_agent.runtime.shared.config import MqttSection
    from dfl_agent.transport import chunking
    from dfl_agent.transport.link_rate import derive

    m = MqttSection()  # the agent's chunk size on a fast network (no link_rate)
    assert derive(m.link_rate, chunk_size=m.chunk_size).chunk_size == t.CHUNK_SIZE
    payload = bytes(range(256)) * 4096 + b"tail"  # 1 MiB + 4 bytes
    tid = bytes(range(16))
    parts = t.pieces(payload, transfer_id=tid)
    # byte for byte the chunks the agent's transport makes of the same bytes (the documented header)
    assert parts == chunking.split(payload, t.CHUNK_SIZE, transfer_id=tid)
    assert t.PIECE_HEADER == chunking.HEADER_LEN == 36

    got: list[bytes] = []
    rx = t.RawAssembler(lambda buf: got.append(bytes(buf)))
    for part in parts:
        rx.on_message(None, None, type("Msg", (), {"payload": part})())
    assert got == [payload]  # reassembled into one buffer, reported once, at the last piece
    one = t.pieces(b"x" * 1000)
    assert len(one) == 1 and len(one[0]) == 1036


def test_ratio_summary_is_median_min_max_of_the_messages() -> None:
    t = _load("bench/scale/transport.py")
    assert t.ratio_summary([3.0, 1.0, 2.0, 10.0]) == {"median": 2.5, "min": 1.0, "max": 10.0, "n": 4}


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
def test_transport_run_records_its_command_and_the_paired_ratios(tmp_path: Path) -> None:
    out = tmp_path / "t.jsonl"
    args = ["bench/scale/transport.py", "--sizes", "600000", "--n", "3", "--warmup", "1",
            "--paths", "signed", "--label", "test run", "--out", str(out)]
    subprocess.run(["nice", "-n", "3", sys.executable, *args], cwd=ROOT, check=True, capture_output=True, timeout=120)
    rec = json.loads(out.read_text().splitlines()[-1])
    exe = os.path.relpath(sys.executable, ROOT)
    exe = exe if not exe.startswith("..") else sys.executable
    assert rec["command"] == f"nice -n {os.nice(0) + 3} " + shlex.join([exe, *args])
    assert rec["paths"] == ["raw", "signed"] and rec["chunk_size"] == 256 * 1024
    assert len(rec["load_before"]) == 3 and rec["commit"] and rec["machine"]
    row = rec["results"]["600000"]
    # each signed message over the raw message of its round; median, min and max of those
    ratios = [a / b for a, b in zip(row["signed"]["samples"], row["raw"]["samples"], strict=True)]
    assert len(ratios) == 3 and row["signed"]["ratios"] == pytest.approx(ratios)
    assert row["signed"]["ratio"]["max"] == pytest.approx(max(ratios))
    report = subprocess.run([sys.executable, "bench/scale/transport.py", "--report", str(out)], cwd=ROOT,
                            check=True, capture_output=True, text=True).stdout
    assert "ratio to raw: median" in report and "| raw |" in report and "| signed |" in report
