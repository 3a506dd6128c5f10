"""Build the wheel of a committed release of dfl-agent, for the field lab's ``[releases]``.

The lab's rolling-upgrade scenario (``tools/lab/scenarios/rolling-upgrade.toml``) starts its
devices on the previous release's wheel and upgrades them one at a time to this one.  This
script makes such a wheel from any commit or tag of this repository, with no network: the
commit's tree from ``git archive``, built with ``pip wheel --no-deps --no-build-isolation``
(the build backend, setuptools, is the one of this environment)::

    python bench/lab/release_wheel.py v0.1.0            # -> dist/lab/v0.1.0/dfl_agent-0.1.0-py3-none-any.whl
    python bench/lab/release_wheel.py HEAD --out dist/lab/this

It prints the wheel's path. Each ref gets its own folder (two commits of one version have wheels
of the same name). Exit code 0, or 2 when git cannot read the ref or the build fails (one line).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tarfile
import tempfile
from io import BytesIO
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def build_wheel(ref: str, out: Path) -> Path:
    """Build ``ref``'s wheel into ``out`` (created); returns the wheel's path.

    Raises:
        RuntimeError: git cannot read ``ref`` (a shallow clone: ``git fetch --tags``), or pip
            could not build it; the message says which.
    """
    try:
        tar = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", ref], check=True,
                             capture_output=True).stdout
        commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", f"{ref}^{{commit}}"], check=True,
                                capture_output=True, text=True).stdout.strip()
    except subprocess.CalledProcessError as e:
        raise RuntimeError(f"git cannot read {ref!r} in {ROOT} (a shallow clone? git fetch --tags): "
                           f"{e.stderr.decode(errors='replace').strip() if isinstance(e.stderr, bytes) else e.stderr}"
                           ) from None
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="dfl-release-") as tmp:
        src = Path(tmp) / "src"
        src.mkdir()
        with tarfile.open(fileobj=BytesIO(tar)) as t:
            t.extractall(src, filter="data") if sys.version_info >= (3, 12) else t.extractall(src)  # noqa: S202
        r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                            "-w", str(out), str(src)], capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"pip wheel of {ref} ({commit}) failed: {(r.stderr or r.stdout).strip()[-2000:]}")
    wheels = sorted(out.glob("dfl_agent-*.whl"), key=lambda p: p.stat().st_mtime)
    if not wheels:
        raise RuntimeError(f"pip wheel of {ref} ({commit}) wrote no dfl_agent wheel in {out}")
    (out / "COMMIT").write_text(f"{ref} {commit}\n")
    return wheels[-1]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("ref", help="a tag, branch or commit of this repository (v0.1.0, HEAD, ...)")
    p.add_argument("--out", help="folder for the wheel (default: dist/lab/<ref>)")
    args = p.parse_args(argv)
    out = Path(args.out) if args.out else ROOT / "dist" / "lab" / re.sub(r"[^A-Za-z0-9._-]", "_", args.ref)
    try:
        wheel = build_wheel(args.ref, out)
    except RuntimeError as e:
        print(f"release_wheel: {e}", file=sys.stderr)
        return 2
    print(wheel)
    return 0


if __name__ == "__main__":
    sys.exit(main())
