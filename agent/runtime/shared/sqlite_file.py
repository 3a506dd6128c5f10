"""Checks of an SQLite file that SQLite itself does not make: what says it was cut short or
zeroed (an SD card that lost power mid-write), from its size and its header.  Torch-free.

SQLite opens a 0-byte file as an empty database and reads a truncated one until it reaches a
missing page, so a state file kept in SQLite (the run ledger, the privacy ledger) is checked
with :func:`cut_short` before it is opened.
"""

from __future__ import annotations

from pathlib import Path

#: the first 16 bytes of every SQLite database file
MAGIC = b"SQLite format 3\0"


def journal_holds_pages(path: Path) -> bool:
    """Whether the write-ahead log beside ``path`` (``PATH-wal``) holds pages not yet folded into
    the file (the file's own size and header may then lag behind)."""
    wal = path.with_name(path.name + "-wal")
    try:
        return wal.stat().st_size > 0
    except OSError:
        return False


def cut_short(path: Path) -> str | None:
    """What says the SQLite file ``path`` was cut short or zeroed, or None when nothing does.

    A 0-byte file, a file of zeros, a size that is not a whole number of its pages, or fewer pages
    than its header counts (page size at byte 16, page count at byte 28, valid while bytes 92 and
    24 agree: SQLite's file format, section 1.3).  None while the write-ahead log holds pages
    (the file may lag behind it), and for a file that is not SQLite at all (SQLite names that).

    Raises:
        OSError: the file cannot be read.
    """
    if journal_holds_pages(path):
        return None
    size = path.stat().st_size
    if size == 0:
        return "is 0 bytes (truncated)"
    with open(path, "rb") as f:
        hdr = f.read(100)
    if not hdr.strip(b"\0"):
        return f"begins with zero bytes where SQLite's header belongs ({size} bytes: zeroed)"
    if len(hdr) < 100 or not hdr.startswith(MAGIC):
        return None
    page = int.from_bytes(hdr[16:18], "big")
    page = 65536 if page == 1 else page
    if page < 512 or size % page:
        return f"is {size} bytes, not a whole number of its {page}-byte pages (truncated)"
    pages = int.from_bytes(hdr[28:32], "big")
    if hdr[92:96] == hdr[24:28] and pages * page > size:
        return f"is {size} bytes, but its header counts {pages} pages of {page} bytes (truncated)"
    return None
