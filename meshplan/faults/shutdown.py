"""The end of a job's distributed state, so that a finished run exits 0 every time.

The race (torch 2.13, gloo): a gloo worker thread (``pt_gloo_runloop``) releases each collective's work object
after marking it complete, so a moment after the caller's ``wait()`` returned. The work holds tensors that have
Python objects and the thread-local state captured when it was issued (saved-tensor hooks, the context copy that
backward stashes): releasing them takes the GIL. If the main thread has begun interpreter finalization by then,
taking the GIL ends the C++ thread inside a ``noexcept`` destructor: ``terminate called without an active
exception``, SIGABRT, and torchrun reports the run failed after every rank finished. A collective issued with
``async_op=True`` and never waited widens the window to the whole exit. ``tests/dist/exit_worker.py`` makes it
happen on purpose.

:func:`shutdown` (the end of ``with meshplan.init(...)``) closes the window: a barrier on every group of the
topology (gloo's barrier waits for every earlier collective of its group, on every rank), then it releases the
GIL until no gloo worker thread has run for a few milliseconds (their last releases done), then destroys the
process groups, all while the interpreter is fully alive.

:func:`release` does the same for the groups of one topology when ``meshplan.init`` did not create the process
group (a worker or a benchmark that runs many ``init`` blocks in one launch): each of its groups held two
``pt_gloo_runloop`` threads and a ``gloo_tcp_loop`` thread until the process ended (measured: 596 threads per rank
after a world-4 calibration launch of 13 layouts).
"""

from __future__ import annotations

import os
import time
from typing import Any

__all__ = ["shutdown", "release", "wait_gloo_idle"]

_QUIET_POLLS = 3      #: consecutive polls without a gloo worker running = idle
_POLL_S = 0.002


def _gloo_threads() -> dict[str, tuple[str, ...]]:
    """``{tid: (state, voluntary, involuntary switches)}`` of this process's gloo worker threads (Linux ``/proc``)."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().strip() != "pt_gloo_runloop":
                    continue
            with open(f"/proc/self/task/{tid}/status") as f:
                out[tid] = tuple(line.split()[1] for line in f if line.startswith(("State", "voluntary_ctxt",
                                                                                      "nonvoluntary_ctxt")))
        except OSError:  # the thread ended meanwhile
            continue
    return out


def wait_gloo_idle(limit_s: float = 2.0) -> bool:
    """Release the GIL until no gloo worker thread has run for :data:`_QUIET_POLLS` polls (or ``limit_s``).

    Returns:
        True when they went quiet (or there is no ``/proc`` to watch: then it waited 50 ms), False at the limit.
    """
    if not os.path.isdir("/proc/self/task"):
        time.sleep(0.05)
        return True
    deadline, quiet, last = time.monotonic() + limit_s, 0, None
    while time.monotonic() < deadline:
        now = _gloo_threads()
        quiet = quiet + 1 if now == last else 0
        if quiet >= _QUIET_POLLS:
            return True
        last = now
        time.sleep(_POLL_S)
    return False


def shutdown(groups: list[Any], clean: bool = True) -> None:
    """End the distributed state that ``meshplan.init`` created.

    Args:
        groups: the topology's process groups (barriered in this order on every rank; the world last).
        clean: the ``with`` block ended without an exception; after a failure no barrier is tried (a peer is
            gone) and only the wait and the destruction happen.
    """
    import torch.distributed as dist
    if not dist.is_initialized():
        return
    if clean and dist.get_world_size() > 1:
        for group in groups:
            dist.barrier(group=group)
    wait_gloo_idle()
    dist.destroy_process_group()


def release(groups: list[Any], clean: bool = True) -> None:
    """Destroy ``groups`` (one topology's own, never the world group), leaving the rest of the process group.

    Args:
        groups: this rank's groups, each once, in the same order on every rank (barriered in that order, then
            destroyed).
        clean: as in :func:`shutdown`: after a failure no barrier is tried.
    """
    import torch.distributed as dist
    if not dist.is_initialized():
        return
    if clean and dist.get_world_size() > 1 and dist.get_backend() != "fake":
        for group in groups:
            dist.barrier(group=group)
    wait_gloo_idle()
    for group in groups:
        dist.destroy_process_group(group)
