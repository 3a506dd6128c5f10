"""The agent's logging, the same in the supervisor and its run processes: lines on stderr, or
journald's priorities under systemd (:class:`JournalFormatter`)."""

from __future__ import annotations

import logging
import os
import sys

#: syslog priorities of the logging levels (journald's ``<N>`` prefix)
_PRIORITY = {logging.DEBUG: 7, logging.INFO: 6, logging.WARNING: 4, logging.ERROR: 3, logging.CRITICAL: 2}


def setup_logging(level: str, fmt: str = "auto") -> None:
    """Log to stderr at ``level``; with journald (``fmt`` ``journal``, or ``auto`` under
    journald) with its priorities; noisy libraries at WARNING."""
    logging.basicConfig(
        level=getattr(logging, level.upper()),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    if fmt == "journal" or (fmt == "auto" and under_journald()):  # operations: journald priorities
        for handler in logging.getLogger().handlers:
            handler.setFormatter(JournalFormatter())
    for noisy in ("zeroconf", "paho", "matplotlib", "PIL", "onnx_ir", "onnxscript"):  # ONNX export passes
        logging.getLogger(noisy).setLevel(logging.WARNING)


class JournalFormatter(logging.Formatter):
    """``<priority>logger: message`` lines: journald reads the ``<N>`` prefix as the
    syslog priority (``SyslogLevelPrefix=yes``, the default) and adds its own time
    stamp, so ``journalctl -p warning -u dfl-agent`` filters by level.  Tracebacks are
    folded into the same entry (newlines become `` | ``)."""

    def format(self, record: logging.LogRecord) -> str:
        prio = _PRIORITY.get(record.levelno, 6 if record.levelno < logging.WARNING else 3)
        text = f"{record.name}: {record.getMessage()}"
        if record.exc_info:
            text += " | " + self.formatException(record.exc_info).replace("\n", " | ")
        return f"<{prio}>{text.replace(chr(10), ' | ')}"


def under_journald() -> bool:
    """True when stderr is connected to the journal (systemd sets ``$JOURNAL_STREAM``
    to the device:inode of that stream)."""
    stream = os.environ.get("JOURNAL_STREAM", "")
    if not stream or ":" not in stream:
        return False
    try:
        st = os.fstat(sys.stderr.fileno())
    except (OSError, ValueError, AttributeError):
        return False
    dev, ino = stream.split(":", 1)
    return dev == str(st.st_dev) and ino == str(st.st_ino)
