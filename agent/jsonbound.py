"""The one bounded JSON parser of the package: every JSON value that arrives from outside
(the broker, the spool, a file another program may have written) goes through
:func:`loads` before any other use.

Python's :func:`json.loads` recurses once per nesting level: 100,000 ``[`` raise
:class:`RecursionError` (not a :class:`ValueError`), which escapes the usual
``except ValueError`` and ends whatever thread was parsing.  :func:`loads` checks the size
first, then the nesting depth with a scan that does not recurse, and only then hands the
text to :func:`json.loads`.  Every failure is a :class:`JSONBoundError` (a
:class:`ValueError`) whose :attr:`~JSONBoundError.reason` is a drop counter key:

- ``oversized``: more bytes than the message kind allows (:data:`LIMITS`);
- ``too_deep``: arrays/objects nested more than ``max_depth`` levels (default
  :data:`MAX_DEPTH`);
- ``malformed``: not JSON (or not UTF-8/16/32 text).
"""

from __future__ import annotations

import json
import logging
import math
import re
import sys
import threading
import time
from collections.abc import Callable
from itertools import accumulate, repeat
from typing import Any

#: deepest nesting of arrays/objects accepted (a top-level object is depth 1)
MAX_DEPTH = 32
KIB = 1024
#: size limit (bytes) per message kind, checked before parsing
LIMITS: dict[str, int] = {
    "presence": 64 * KIB,       # dfl/{fed}/node/{id}/presence
    "status": 64 * KIB,         # dfl/{fed}/node/{id}/status
    "descriptor": 64 * KIB,     # dfl/{fed}/run/{run_id}
    "announcement": 64 * KIB,   # a deployed model's retained announcement
    "control": 256 * KIB,       # any other signed control envelope
    "manifest": 1024 * KIB,     # manifest.json / spec.json of a model version or checkpoint
    "state": 16 * 1024 * KIB,   # this node's own state files (run ledger, sequence numbers)
}
#: the ``reason`` values of :class:`JSONBoundError`
REASONS = ("oversized", "too_deep", "malformed")

# a complete JSON string literal (escapes included), unrolled so that it never backtracks
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
#: str.translate table deleting every ASCII character but brackets, quotes and backslashes
#: (other characters count 0 in :data:`_STEP`)
_MARKS = {c: None for c in range(128) if chr(c) not in '[]{}"\\'}
_STEP = {"[": 1, "{": 1, "]": -1, "}": -1}


class JSONBoundError(ValueError):
    """A JSON value refused by :func:`loads`; ``reason`` is one of :data:`REASONS`."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


def _text(data: bytes | bytearray | memoryview | str) -> str:
    if isinstance(data, str):
        return data
    raw = bytes(data)
    try:
        return raw.decode(json.detect_encoding(raw), "strict")
    except (UnicodeDecodeError, LookupError) as exc:
        raise JSONBoundError("malformed", f"not UTF-8 text: {exc}") from None


def depth(text: str) -> int:
    """The deepest nesting of arrays/objects in JSON ``text`` (0 for a scalar), found
    without recursion: string literals are cut out, then the running count of the
    remaining brackets is taken.  Linear in ``len(text)``, at C speed (str methods).

    Raises:
        JSONBoundError: ``malformed`` for an unterminated string or unbalanced brackets.
    """
    if text.count("[") + text.count("{") == 0:
        return 0
    marks = text.translate(_MARKS)  # brackets, quotes and backslashes only: short
    if "\\" in marks:  # escapes: cut out whole string literals (an escaped quote ends none)
        marks = _STRING.sub("0", text).translate(_MARKS)
    if marks.count('"') % 2:
        raise JSONBoundError("malformed", "unterminated string")
    outside = "".join(marks.split('"')[::2])  # without escapes every quote opens or closes a string
    levels = list(accumulate(map(_STEP.get, outside, repeat(0))))
    if not levels:
        return 0
    if min(levels) < 0:
        raise JSONBoundError("malformed", "unbalanced brackets")
    return max(levels)


def loads(data: bytes | bytearray | memoryview | str, kind: str | None = None, *, max_bytes: int | None = None,
          max_depth: int = MAX_DEPTH) -> Any:
    """Parse JSON ``data`` received from outside, bounded in size and nesting depth.

    Args:
        data: the JSON text: bytes (UTF-8, or UTF-16/32 as :func:`json.loads` accepts) or str.
        kind: a key of :data:`LIMITS` giving the size limit (e.g. ``"status"``: 64 KiB).
        max_bytes: explicit size limit in bytes (overrides ``kind``); one of the two is needed
            (a str counts its UTF-8 bytes).
        max_depth: deepest nesting of arrays/objects accepted (default 32).

    Returns:
        The parsed value (any JSON type; callers check it is the shape they expect).

    Raises:
        JSONBoundError: ``oversized`` (size checked first, before decoding), ``too_deep``
            or ``malformed`` (not JSON, not text, or a number too long to convert).
        KeyError: ``kind`` is not in :data:`LIMITS` (a programming error).
    """
    if max_bytes is None:
        if kind is None:
            raise TypeError("loads() needs kind or max_bytes")
        max_bytes = LIMITS[kind]
    size = len(data) if not isinstance(data, str) else len(data.encode("utf-8", "surrogatepass"))
    if size > max_bytes:
        raise JSONBoundError("oversized", f"{size} bytes > {max_bytes}")
    text = _text(data)
    if text.count("[") + text.count("{") > max_depth:  # fewer brackets than the limit cannot nest deeper
        d = depth(text)
        if d > max_depth:
            raise JSONBoundError("too_deep", f"nested {d} levels > {max_depth}")
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as exc:  # RecursionError: cannot happen after the depth check; a guard
        raise JSONBoundError("malformed", str(exc)[:200]) from None


class LogLimit:
    """How often a recurring event is logged, per key: the first ``burst`` events of a key
    are logged, then at most one per ``every`` seconds, each saying how many were held back
    since the last.  Thread-safe; at most ``max_keys`` keys are kept (all are forgotten
    past that, so that keys taken from unverified input stay bounded).

    Args:
        every: seconds between two logged events of a key once ``burst`` were logged.
        burst: events of a key logged before the limit applies.
        max_keys: keys kept before all are forgotten.
        clock: monotonic seconds (default: ``time.monotonic``, looked up at each event).
    """

    def __init__(self, every: float = 60.0, burst: int = 5, max_keys: int = 1024,
                 clock: Callable[[], float] | None = None):
        self.every, self.burst, self.max_keys, self.clock = every, burst, max_keys, clock
        self._lock = threading.Lock()
        #: key -> (when last logged, events logged, events held back since)
        self._keys: dict[Any, tuple[float, int, int]] = {}

    def check(self, key: Any = None) -> tuple[bool, int, bool]:
        """Count an event of ``key``: ``(log it, events held back since the last logged,
        within the burst)``."""
        now = time.monotonic() if self.clock is None else self.clock()
        with self._lock:
            if len(self._keys) > self.max_keys:
                self._keys.clear()
            last, logged, held = self._keys.get(key, (-math.inf, 0, 0))
            if logged < self.burst or now - last >= self.every:
                self._keys[key] = (now, logged + 1, 0)
                return True, held, logged < self.burst
            self._keys[key] = (last, logged, held + 1)
            return False, held + 1, False


class RateLimitedLog:
    """Logs the errors of a long-lived message loop without flooding the log: the first
    ``burst`` with their traceback, then at most one line per ``every`` seconds saying how
    many were not logged (:class:`LogLimit`).  Used where a handler's exception is caught,
    counted and the loop goes on (``handler_error``).

    Args:
        logger: where to log.
        every: seconds between two lines once ``burst`` lines were logged.
        burst: lines logged with a traceback before the limit applies.
    """

    def __init__(self, logger: logging.Logger, every: float = 60.0, burst: int = 5):
        self.logger = logger
        self.limit = LogLimit(every, burst)

    def exception(self, msg: str, *args: Any) -> None:
        """Log ``msg % args`` at error level with the current exception, rate-limited."""
        log_it, suppressed, tb = self.limit.check()
        if not log_it:
            return
        if tb:
            self.logger.error(msg, *args, exc_info=True)
        else:  # one line: the exception, and how many were left out since the last line
            exc = sys.exc_info()[1]
            self.logger.error(msg + ": %r (%d more not logged)", *args, exc, suppressed)
