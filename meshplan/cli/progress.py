"""Progress of a long command on stderr: one status line, rewritten in place, only when stderr is a terminal.

The rule is git's and pip's (``git clone --progress`` defaults to "when stderr is a terminal"; pip's progress bar
is on only on a TTY): a person watching a terminal learns that ``solve``/``check``/``convert`` are working, while a
script that reads stderr (the ``dropped``/``assumed`` lines of ``convert``, one error line) gets exactly what it got
before, no carriage returns. The line appears after :data:`DELAY_S` (a command that ends sooner shows nothing),
says the current stage and the seconds so far, and is erased before anything else is written to stderr and when
the command ends. ``MESHPLAN_PROGRESS=0`` turns it off on a terminal too.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any, TextIO

__all__ = ["Progress", "DELAY_S"]

#: seconds before the status line appears
DELAY_S = 1.0
_TICK_S = 0.5


class _Erasing:
    """stderr while a status line may be drawn: every write erases the line first."""

    def __init__(self, stream: TextIO, progress: "Progress"):
        self._stream, self._progress = stream, progress

    def write(self, text: str) -> int:
        with self._progress.lock:
            self._progress.erase()
            return self._stream.write(text)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


class Progress:
    """The status line of one command (``with Progress("meshplan solve") as p: p.stage("searching")``).

    Args:
        command: what the line starts with, e.g. ``"meshplan solve"``.
        stream: where it goes (default ``sys.stderr``); nothing is drawn unless it is a terminal.
    """

    def __init__(self, command: str, stream: TextIO | None = None):
        self.command = command
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = bool(getattr(self.stream, "isatty", lambda: False)()) and \
            os.environ.get("MESHPLAN_PROGRESS", "1") != "0" and os.environ.get("TERM") != "dumb"
        self.lock = threading.Lock()
        self.drawn = False
        self._stage = "working"
        self._start = time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._saved: Any = None

    def stage(self, text: str) -> None:
        """Name what the command does now (shown from the next tick)."""
        self._stage = text

    def erase(self) -> None:
        """Erase the status line if it is drawn (the caller holds :attr:`lock`)."""
        if self.drawn:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
            self.drawn = False

    def _run(self) -> None:
        if self._stop.wait(DELAY_S):
            return
        while True:
            with self.lock:
                seconds = time.monotonic() - self._start
                self.stream.write(f"\r\x1b[K{self.command}: {self._stage}… {seconds:.0f} s")
                self.stream.flush()
                self.drawn = True
            if self._stop.wait(_TICK_S):
                return

    def __enter__(self) -> "Progress":
        if self.enabled:
            self._saved, sys.stderr = sys.stderr, _Erasing(self.stream, self)
            self._thread = threading.Thread(target=self._run, name="meshplan-progress", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            sys.stderr = self._saved
            with self.lock:
                self.erase()
