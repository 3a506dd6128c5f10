#!/usr/bin/env python3
"""Every measured figure in the user documentation names where it comes from.

Scans ``README.md``, ``docs/*.md`` and ``docs/tutorials/*.md`` for figures: numbers with a unit of time, size, rate,
share or ratio (``2.5 minutes``, ``49.6 MB``, ``0.25 ms``, ``93 %``, ``0.61×``). Each block
(a paragraph, a list, a table) that holds one must name a committed file under ``bench/``
(the benchmark that measured it or its results), or a block next to it in the same section
must (the sentence that introduces a table or a list, or the note under it). Code blocks, inline code and
HTML comments are not read for figures.

A figure that is not a measurement (a configuration default, a protocol limit, a unit in a
worked example) is listed in :data:`ALLOWED` with the reason; an allowance whose text is no
longer on its page is an error too, so the list stays short.

Usage: ``python scripts/check_doc_figures.py [--root DIR]``. Prints one line per unsourced
block (``page:line: figures ... - text``) and exits 1 when there is any, else 0.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

#: a number and a unit that makes it a measured quantity
FIGURE = re.compile(
    r"(?<![\w.])(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:\s?[–-]\s?\d+(?:\.\d+)?)?"
    r"(?:\s?(?:%|×(?!\s?\d))|\s?(?:ms|µs|s|sec|seconds?|min|minutes?|h|hours?|[kKMGT]i?B|B/s|MB/s|GB/s)(?![\w/]))"
)
#: a committed source: a path under bench/
SOURCE = re.compile(r"\bbench/[\w./-]*[\w/]")
INLINE_CODE = re.compile(r"``.+?``|`[^`\n]+`")
COMMENT = re.compile(r"<!--.*?-->", re.S)

#: (page, text in the block, reason): figures that are not measurements
ALLOWED: list[tuple[str, str, str]] = [
    ("docs/algorithms-on-devices.md", "plus 64 MiB for",
     "the admission rule's fixed allowance for activations and the runtime (runtime.admission)"),
    ("docs/data-and-models.md", "Files above 512 MiB on disk", "limits of the sample store (configuration defaults)"),
    ("docs/data-and-models.md", "`file_too_large` (above 512 MiB", "a limit of the sample store"),
    ("docs/data-and-models.md", "gets it again after 15 s", "the delivery's resend waits (member_delivery)"),
    ("docs/operations.md", "(default 600 s)", "a default of dflctl run submit"),
    ("docs/operations.md", "does not fit `compute.memory_budget_mb`", "worked example of a decline message"),
    ("docs/operations.md", "kind is `run:{run_id}`", "the control envelope's size limit"),
    ("docs/operations.md", "at most one answer every 15 s", "the model hand-over's answer interval and wait (model_handover)"),
    ("docs/operations.md", "(1024 MiB by default)", "the default of runtime.disk_warn_mb"),
    ("docs/results.md", "24 GB of memory", "the machine the page was measured on"),
    ("docs/security.md", "larger than 64 KiB", "the control documents' size limit"),
    ("docs/security.md", "checked for size and nesting depth", "the JSON size limits"),
]


@dataclass
class Block:
    page: str
    line: int
    section: str
    text: str  # without code and comments

    def figures(self) -> list[str]:
        return [m.group(0) for m in FIGURE.finditer(INLINE_CODE.sub(" ", self.text))]


def committed(root: Path) -> set[str]:
    """Paths of the files under bench/ that git tracks (the working tree's when not a checkout)."""
    try:
        out = subprocess.run(["git", "-C", str(root), "ls-files", "bench"], capture_output=True, text=True,
                             check=True).stdout
        files = set(out.split())
    except (OSError, subprocess.CalledProcessError):
        files = set()
    if not files:
        files = {p.relative_to(root).as_posix() for p in (root / "bench").rglob("*") if p.is_file()}
    return files


def blocks(root: Path, page: Path) -> list[Block]:
    """The blocks of a Markdown page outside code fences, with their first line and section."""
    rel = page.relative_to(root).as_posix()
    text = COMMENT.sub(lambda m: "\n" * m.group(0).count("\n"), page.read_text(encoding="utf-8"))
    out: list[Block] = []
    section = ""
    cur: list[str] = []
    start = 0
    fence = False

    def flush() -> None:
        if cur:
            out.append(Block(rel, start, section, "\n".join(cur)))
            cur.clear()

    for n, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith(("```", "~~~")):
            flush()
            fence = not fence
            continue
        if fence:
            continue
        if line.startswith("#"):
            flush()
            section = line.strip("# ").strip()
            continue
        if not line.strip() or (line.startswith("    ") and not cur):  # blank, or an indented code block
            flush()
            continue
        if not cur:
            start = n
        cur.append(line)
    flush()
    return out


def names_source(text: str, files: set[str]) -> bool:
    """Whether ``text`` names a committed file (or a folder holding one) under bench/."""
    for m in SOURCE.finditer(text):
        path = m.group(0).rstrip("/.")
        if path in files or any(f.startswith(path + "/") for f in files):
            return True
    return False


def pages(root: Path) -> list[Path]:
    """README.md, the pages of docs/ and the tutorials (a reader reproduces their figures step by step)."""
    return [root / "README.md", *sorted((root / "docs").glob("*.md")), *sorted((root / "docs" / "tutorials").glob("*.md"))]


def check(root: Path, allowed: list[tuple[str, str, str]] | None = None) -> list[str]:
    """One message per unsourced block and per stale allowance (default: :data:`ALLOWED`);
    empty when every figure is sourced."""
    allowed = ALLOWED if allowed is None else allowed
    files = committed(root)
    problems: list[str] = []
    used: set[int] = set()
    for page in pages(root):
        bl = blocks(root, page)
        for k, b in enumerate(bl):
            figs = b.figures()
            near = [bl[j] for j in (k - 1, k + 1) if 0 <= j < len(bl) and bl[j].section == b.section]
            sourced = any(names_source(x.text, files) for x in (b, *near))
            if figs and not sourced:
                hits = [i for i, (p, frag, _) in enumerate(allowed) if p == b.page and frag in b.text]
                if hits:
                    used.update(hits)
                else:
                    first = " ".join(b.text.split())[:100]
                    problems.append(f"{b.page}:{b.line}: figures {', '.join(figs[:4])} without a source "
                                    f"under bench/ - {first}")
    for i, (p, frag, reason) in enumerate(allowed):
        page = root / p
        if i not in used and not (page.exists() and any(frag in b.text for b in blocks(root, page) if b.figures())):
            problems.append(f"{p}: allowance no longer needed ({reason}): {frag!r}")
    return problems


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[1], help="repository root")
    a = ap.parse_args(argv)
    problems = check(a.root)
    for line in problems:
        print(line)
    if problems:
        print(f"{len(problems)} block(s) with figures and no committed source under bench/ "
              "(name the benchmark or its results, or add an allowance with its reason)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
