"""SIGTERM while a rank reports a failure: the report comes out first.

torchrun stops the other workers with SIGTERM 0.1 s after one died, and the default action ends a process at
once: a rank that had just lost a peer would die without saying which. While ``with meshplan.init(...)`` is
active (and SIGTERM still has its default action) meshplan's handler raises :class:`Terminated` instead, a
``SystemExit(143)`` that unwinds the stack as Ctrl-C does (``finally`` blocks and ``with`` exits run, nothing
is printed); while a rank builds its report the signal is held and delivered once the report is logged.
A rank blocked inside a collective handles the signal when the collective returns (at the latest after the
plan's timeout; torchrun kills after its 30 s grace).
"""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Any, Iterator

__all__ = ["Terminated", "TermGuard"]


class Terminated(SystemExit):
    """SIGTERM arrived (torchrun is stopping the job): unwinds like ``SystemExit(128 + 15)``."""


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


class TermGuard:
    """meshplan's SIGTERM handler for one topology: :meth:`install`, :meth:`hold` while reporting,
    :meth:`uninstall`."""

    def __init__(self) -> None:
        self._holding = False
        self._held = False
        self._previous: Any = None
        self.installed = False

    def _handler(self, signum: int, frame: Any) -> None:
        if self._holding:
            self._held = True
            return
        raise Terminated(128 + signum)

    def install(self) -> None:
        """Take over SIGTERM if it has its default action (a handler of the user's stays) and this is the main
        thread (where Python runs signal handlers)."""
        if _main_thread() and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            self._previous = signal.signal(signal.SIGTERM, self._handler)
            self.installed = True

    def uninstall(self) -> None:
        if self.installed and _main_thread() and signal.getsignal(signal.SIGTERM) == self._handler:
            signal.signal(signal.SIGTERM, self._previous)
        self.installed = False

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        """Hold SIGTERM inside; a SIGTERM that arrived is delivered on the way out (the process ends)."""
        temporary = not self.installed and _main_thread()
        previous = signal.signal(signal.SIGTERM, self._handler) if temporary else None
        self._holding = True
        try:
            yield
        finally:
            self._holding = False
            if temporary:
                signal.signal(signal.SIGTERM, previous)
            if self._held:
                self.die()

    def die(self) -> None:
        """End the process as SIGTERM's default action would (exit status -15 to torchrun)."""
        self.uninstall()
        if signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, self._handler):
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.raise_signal(signal.SIGTERM)
