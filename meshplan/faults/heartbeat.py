"""Heartbeats in the c10d store, and what the store and the operating system say about a peer.

Each rank runs one daemon thread that writes ``hb/<rank>`` every ``heartbeat_s``: the wall time, a counter, and
the collective this rank is waiting in (from the flight recorder). A rank stopped by SIGSTOP or killed stops
writing (all its threads stop), a rank busy computing or waiting does not. ``proc/<rank>`` (host, pid, process
start time) lets a peer on the same host read the process's state from ``/proc`` at once: gone, a zombie, or
stopped. A rank that failed writes ``fail/<rank>`` before it leaves, so its peers count it as a victim, not the
cause. The keys live under ``meshplan/faults/<run id>/<restart>/`` in torchrun's store (the agent hosts it, so it
outlives any worker); a dedicated client connection keeps the thread off the main thread's store socket.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import socket
import threading
import time
from typing import Any, Callable

__all__ = ["fault_store", "Heartbeat", "read_records", "process_state"]

_LOG = logging.getLogger("meshplan.faults")


def _tcp_store(store: Any) -> Any:
    import torch.distributed as dist
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return store if isinstance(store, dist.TCPStore) else None


def fault_store(base: Any, timeout_s: float) -> Any:
    """A store for the fault keys: a new client of ``base``'s TCPStore (its own socket; ``timeout_s`` to connect
    and per operation) under ``meshplan/faults/<run>/<restart>/``; ``base`` itself (prefixed) when it is not a
    TCPStore or the new client cannot connect (a loaded machine: the job must not depend on it)."""
    import torch.distributed as dist
    tcp = _tcp_store(base)
    if tcp is not None:
        try:
            base = dist.TCPStore(tcp.host, tcp.port, is_master=False, wait_for_workers=False,
                                 timeout=datetime.timedelta(seconds=timeout_s))
        except (RuntimeError, ValueError) as e:  # DistNetworkError, DistStoreError
            _LOG.warning("meshplan: heartbeats share the process group's store (%s)", " ".join(str(e).split())[:200])
    run = os.environ.get("TORCHELASTIC_RUN_ID", "run")
    return dist.PrefixStore(f"meshplan/faults/{run}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/", base)


def _start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks (``/proc/<pid>/stat`` field 22): tells a reused pid apart."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def process_state(record: dict | None) -> str | None:
    """``"gone"``, ``"zombie"`` (killed, not yet reaped), ``"stopped"`` (SIGSTOP), ``"running"`` for a rank on
    this host (``record`` = its ``proc/<rank>``), None for one on another host or without ``/proc``."""
    if not record or record.get("host") != socket.gethostname() or not os.path.isdir("/proc/self"):
        return None
    pid = record.get("pid")
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return "gone"
    if record.get("start") is not None and int(fields[19]) != record["start"]:
        return "gone"  # the pid was reused
    return {"Z": "zombie", "X": "gone", "T": "stopped", "t": "stopped"}.get(fields[0], "running")


class Heartbeat:
    """This rank's heartbeat thread.

    Args:
        store: from :func:`fault_store`.
        rank: this process's global rank.
        interval_s: seconds between beats.
        waiting: called each beat: what this rank waits in (a JSON-able dict) or None.
    """

    def __init__(self, store: Any, rank: int, interval_s: float, waiting: Callable[[], dict | None]):
        self.store, self.rank, self.interval_s, self._waiting = store, rank, interval_s, waiting
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.beats = 0

    def start(self) -> None:
        """Publish ``proc/<rank>`` and the first beat (so every key exists once :func:`start` returns), then beat
        in the background. Never raises: a store that cannot be written leaves this rank without a heartbeat (a
        warning) and the job running."""
        pid = os.getpid()
        try:
            self.store.set(f"proc/{self.rank}", json.dumps({"host": socket.gethostname(), "pid": pid,
                                                            "start": _start_ticks(pid)}))
            self.beat()
        except Exception as e:  # noqa: BLE001 - the job goes on; its reports can say less
            _LOG.warning("meshplan: no heartbeat for rank %d: %s", self.rank, " ".join(str(e).split())[:200])
            return
        self._thread = threading.Thread(target=self._run, name=f"meshplan-heartbeat-{self.rank}", daemon=True)
        self._thread.start()

    def beat(self) -> None:
        try:
            wait = self._waiting()
        except Exception:  # noqa: BLE001 - the recorder is best effort; a beat must not die
            wait = None
        self.beats += 1
        self.store.set(f"hb/{self.rank}", json.dumps({"t": time.time(), "n": self.beats, "wait": wait}))

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.beat()
            except Exception:  # noqa: BLE001 - the store gone (job ending): stop beating quietly
                return

    def stop(self) -> None:
        """Stop beating (before the process group goes away)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.interval_s + 5)
        self._thread = None


def read_records(store: Any, kind: str, ranks: list[int]) -> dict[int, dict]:
    """``{rank: record}`` of the ``kind/<rank>`` keys that exist (``hb``, ``proc``, ``fail``); ``{}`` when the
    store does not answer."""
    keys = [f"{kind}/{r}" for r in ranks]
    try:
        present = ranks if store.check(keys) else [r for r, k in zip(ranks, keys) if store.check([k])]
        values = store.multi_get([f"{kind}/{r}" for r in present]) if present else []
    except Exception:  # noqa: BLE001 - store timeout or gone: the report says what it could not read
        return {}
    return {r: json.loads(v) for r, v in zip(present, values)}
