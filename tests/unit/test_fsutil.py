"""The single atomic-write helper, dfl_agent.fsutil.atomic_write."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from dfl_agent.fsutil import atomic_write

ROOT = Path(__file__).resolve().parents[2]


def test_atomic_write_replaces_whole_file_and_leaves_no_temporary(tmp_path: Path) -> None:
    p = tmp_path / "f.json"
    atomic_write(p, "old")
    atomic_write(p, b"new bytes")
    assert p.read_bytes() == b"new bytes"
    atomic_write(p, "secret", mode=0o600)
    assert stat.S_IMODE(p.stat().st_mode) == 0o600 and p.read_text() == "secret"
    assert sorted(x.name for x in tmp_path.iterdir()) == ["f.json"]


def test_failed_write_keeps_the_old_file(tmp_path: Path) -> None:
    p = tmp_path / "f"
    atomic_write(p, "old")

    with pytest.raises(TypeError):  # fails after the temporary file was opened
        atomic_write(p, 12345)  # type: ignore[arg-type]
    assert p.read_text() == "old" and sorted(x.name for x in tmp_path.iterdir()) == ["f"]


def test_the_former_copies_use_the_helper() -> None:
    """metrics, the daemon's node id, checkpoints, keys, the inference member and the ONNX
    export each had its own temp-file-and-rename; they now call dfl_agent.fsutil."""
    for rel in ("agent/runtime/metrics.py", "agent/runtime/daemon.py", "agent/runtime/checkpoint.py",
                "agent/security/keys.py", "agent/inference/member.py", "agent/models/onnx_export.py"):
        text = (ROOT / rel).read_text(encoding="utf-8")
        assert "dfl_agent.fsutil" in text, rel
        assert "os.replace" not in text and "os.fsync" not in text, rel
