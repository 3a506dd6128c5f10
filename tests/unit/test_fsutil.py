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
    for rel in ("agent/runtime/node/metrics.py", "agent/runtime/shared/run_config.py", "agent/runtime/node/checkpoint.py",
                "agent/security/keys.py", "agent/inference/member.py", "agent/models/onnx_export.py"):
        text = (ROOT / rel).read_text(encoding="utf-8")
        assert "dfl_agent.fsutil" in text, rel
        assert "os.replace" not in text and "os.fsync" not in text, rel


def test_no_module_replaces_or_renames_files_itself() -> None:
    """Every atomic replace, move into place and symlink switch goes through dfl_agent.fsutil:
    no other module of the package (agent/ and tools/) calls os.replace / os.rename or makes
    its own temporary file for it."""
    import re

    call = re.compile(r"\bos\.(replace|rename)\s*\(|\btempfile\.mkstemp\s*\(")
    offenders = []
    for folder in ("agent", "tools"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path == ROOT / "agent" / "fsutil.py":
                continue
            for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                code = line.split("#", 1)[0]
                if call.search(code) and "``" not in code:
                    offenders.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert offenders == [], "\n".join(offenders)


def test_atomic_writer_streams_and_keeps_the_old_file_on_error(tmp_path: Path) -> None:
    from dfl_agent.fsutil import atomic_writer

    p = tmp_path / "data.bin"
    with atomic_writer(p, mode=0o640) as f:
        f.write(b"a" * 10)
        f.write(b"b")
        assert not p.exists()  # nothing visible before the block ends
    assert p.read_bytes() == b"a" * 10 + b"b" and stat.S_IMODE(p.stat().st_mode) == 0o640
    with pytest.raises(RuntimeError), atomic_writer(p) as f:
        f.write(b"half")
        raise RuntimeError("killed half way")
    assert p.read_bytes() == b"a" * 10 + b"b" and sorted(x.name for x in tmp_path.iterdir()) == ["data.bin"]


def test_rename_and_atomic_symlink(tmp_path: Path) -> None:
    from dfl_agent.fsutil import atomic_symlink, rename

    (tmp_path / "v1").mkdir()
    (tmp_path / "v2").mkdir()
    atomic_symlink("v1", tmp_path / "current")
    assert (tmp_path / "current").resolve() == (tmp_path / "v1").resolve()
    atomic_symlink("v2", tmp_path / "current")  # switched in one step, no temporary left
    assert (tmp_path / "current").resolve() == (tmp_path / "v2").resolve()
    assert sorted(x.name for x in tmp_path.iterdir()) == ["current", "v1", "v2"]
    src = tmp_path / ".staged"
    src.write_text("x")
    rename(src, tmp_path / "v1" / "file")
    assert (tmp_path / "v1" / "file").read_text() == "x" and not src.exists()
    with pytest.raises(FileNotFoundError):
        rename(src, tmp_path / "again")
