"""One line per job for a meshplan error under torchrun.

A user script ``torchrun --nproc-per-node 4 train.py`` that calls ``meshplan.init`` with a layout that does not
fit raises the same :class:`~meshplan.errors.PlanError` on every rank. Uncaught, Python prints a traceback per
rank: 4 interleaved tracebacks (about 60 lines) for one line that says exactly what to do. :func:`install` (called
by ``meshplan.init`` and ``meshplan.parallelize``, only under torchrun) sets a ``sys.excepthook`` that, for an
uncaught meshplan error, prints ``meshplan: error (rank R): …`` on ONE rank — the first rank to claim it in the
torchrun agent's store (``TORCHELASTIC_USE_AGENT_STORE``; rank 0 when there is no store) — and nothing on the
others. Every rank still exits with Python's status for an uncaught exception, 1, so the job fails with the same
status everywhere. Other exceptions go to the hook that was there before (a traceback, as usual), and so does a
:class:`~meshplan.errors.RankFailure`: it is not one error of the job but each rank's own report (which peer it
waited for, in which collective; logged when found, :mod:`meshplan.faults.watch`), and a hook that hid it would
leave a rank whose logging is configured away with no word at all.

torchrun's own summary (``ChildFailedError``, one block per failed rank) is printed by the launcher process when a
child exits non-zero; nothing a child does can remove it short of exiting 0, which would hide the failure. A child
that writes torchrun's error file (``TORCHELASTIC_ERROR_FILE``, what ``@record`` does) only changes the block's
``traceback :`` field from a link to the text of the error, a second copy of the line: meshplan writes none.
"""

from __future__ import annotations

import datetime
import os
import sys
from typing import Any

from meshplan.errors import PlanError

__all__ = ["install", "under_torchrun"]

#: how long the hook waits for the agent's store before falling back to "rank 0 prints"
_STORE_TIMEOUT = datetime.timedelta(seconds=5)


def under_torchrun() -> bool:
    """True in a worker that torchrun (torch.distributed.elastic) started."""
    return "TORCHELASTIC_RUN_ID" in os.environ and "RANK" in os.environ


def _first_to_report() -> bool:
    """Whether this rank is the first of the job to report an error (one atomic ``add`` in the agent's store)."""
    try:
        from meshplan.mesh.elastic import restart_store
        store = restart_store(_STORE_TIMEOUT)
        if store is not None:
            return store.add("one_error", 1) == 1
    except Exception:  # the agent is gone or unreachable: fall back to rank 0
        pass
    return os.environ.get("RANK") == "0"


def _hook(previous: Any) -> Any:
    def meshplan_excepthook(kind: type[BaseException], value: BaseException, tb: Any) -> None:
        if not issubclass(kind, PlanError):
            previous(kind, value, tb)
            return
        if _first_to_report():
            text = " ".join(str(value).split())
            sys.stderr.write(f"meshplan: error (rank {os.environ.get('RANK', '?')}): {text}\n")
            sys.stderr.flush()
    meshplan_excepthook.meshplan = True  # type: ignore[attr-defined]
    return meshplan_excepthook


def install() -> None:
    """Install the one-line hook in a torchrun worker (no-op elsewhere, and when already installed)."""
    if under_torchrun() and not getattr(sys.excepthook, "meshplan", False):
        sys.excepthook = _hook(sys.excepthook)
