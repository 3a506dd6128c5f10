"""Ctrl-C while a command starts: one line and exit code 130, never a traceback.

A console script (``dflctl``, ``dfl-agent``, ``dfl-infer``) spends its first few hundred
milliseconds importing its modules and building its argument parser; Python's own SIGINT
handler would raise ``KeyboardInterrupt`` wherever an import happens to be, and the user
would see a traceback.  Each entry module calls :func:`during_startup` as its first
statement, before its other imports: from then on SIGINT prints ``{prog}: interrupted`` on
stderr and ends the process with exit code 130 (the shell's code for SIGINT) at once -
nothing has started yet that would need cleaning up.  When the program is ready to handle
Ctrl-C itself (a command catches ``KeyboardInterrupt``, or an event loop installs its own
handler) it calls :func:`end_startup`, which gives SIGINT back to Python's default handler.

Only the program being run is affected: a module that imports an entry module (a test, the
reference generator, the run process importing the daemon's helpers) keeps Python's handler.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from types import FrameType

#: exit code after SIGINT (128 + 2), as a shell reports a process ended by Ctrl-C
EXIT_INTERRUPTED = 130

_prog: str | None = None  # the program whose start-up handler is installed


def during_startup(prog: str, module: str) -> None:
    """Until :func:`end_startup`, SIGINT prints ``{prog}: interrupted`` and exits 130 at once,
    when this process runs ``prog``: its console script (``sys.argv[0]``'s name is ``prog``),
    or the entry module as ``python -m`` (``module``, the caller's ``__name__``, is
    ``"__main__"``), and SIGINT has Python's default handler.  Elsewhere (the module imported
    by another program, SIGINT ignored as in a script's background job) nothing changes."""
    global _prog
    if module != "__main__" and os.path.basename(sys.argv[0] if sys.argv else "") != prog:
        return
    try:
        if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
            return  # SIGINT ignored (a background job of a script, nohup) or handled by the caller
        signal.signal(signal.SIGINT, _exit_interrupted)
    except ValueError:  # not the main thread: signals belong to the main thread
        return
    _prog = prog


def _exit_interrupted(signum: int, frame: FrameType | None) -> None:
    """The start-up SIGINT handler: one line on stderr, exit 130 (no cleanup: nothing started)."""
    try:
        os.write(2, f"{_prog}: interrupted\n".encode())
    finally:
        os._exit(EXIT_INTERRUPTED)


def end_startup() -> None:
    """Give SIGINT back to Python's default handler (``KeyboardInterrupt``), which the program
    handles from here on; nothing happens when :func:`during_startup` installed nothing."""
    global _prog
    if _prog is not None and signal.getsignal(signal.SIGINT) is _exit_interrupted:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    _prog = None
