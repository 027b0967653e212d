"""Reading torch's flight recorder: which collective a rank is (or was) waiting in, on which group, from where.

torch 2.13 records every collective of every process group (gloo included) when ``TORCH_FR_BUFFER_SIZE`` > 0
(meshplan sets it from ``faults.flight_recorder``). On gloo an entry stays ``retired: False`` while it waits and
all entries read ``state: scheduled``; after a failure the failed entry is retired too, so the heartbeat thread
reports the entry still waiting, and the failed rank itself finds its entry by age (:func:`failed_entry`).
"""

from __future__ import annotations

import logging
import os
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["Collective", "collectives", "waiting", "failed_entry", "enable"]

_SKIP_DIRS = tuple(str(Path(p).resolve()) for p in (
    Path(__file__).resolve().parents[1], Path(os.path.dirname(os.__file__)), sysconfig.get_paths()["stdlib"]))


def enable(entries: int, dump_dir: str | None = None) -> bool:
    """Turn the flight recorder on for process groups created from now on (``TORCH_FR_BUFFER_SIZE``; a value
    already in the environment wins). With ``dump_dir``, NCCL's watchdog writes its own trace there too on a
    timeout (``TORCH_NCCL_DUMP_ON_TIMEOUT``, ``TORCH_FR_DUMP_TEMP_FILE``: the files meshplan writes on gloo).
    Returns whether the recorder is on."""
    if entries > 0:
        os.environ.setdefault("TORCH_FR_BUFFER_SIZE", str(entries))
    if dump_dir is not None and entries > 0:
        try:
            Path(dump_dir).mkdir(parents=True, exist_ok=True)
        except OSError as e:  # reported again, with the path, if a collective fails
            logging.getLogger("meshplan.faults").warning("meshplan: faults.dump_dir %s: %s", dump_dir, e)
        os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
        os.environ.setdefault("TORCH_FR_DUMP_TEMP_FILE", str(Path(dump_dir) / "meshplan_fr_rank"))
    return int(os.environ.get("TORCH_FR_BUFFER_SIZE", "0") or 0) > 0


@dataclass(frozen=True)
class Collective:
    """One flight-recorder entry: ``op`` (``all_reduce``), the group's name, its sequence number on that group,
    when it was issued (``time.time()`` seconds), whether it still waits, the innermost caller outside torch and
    meshplan (``examples/llama.py:88 (forward)``) when stacks were recorded, and the first input's shape."""

    op: str
    group: str
    seq: int
    issued: float
    waiting: bool
    caller: str | None = None
    shape: tuple[int, ...] | None = None

    def waited_s(self, now: float | None = None) -> float:
        return max(0.0, (time.time() if now is None else now) - self.issued)


def _caller(frames: list[dict] | None) -> str | None:
    for f in frames or ():
        name = str(f.get("filename", ""))
        if not name or name.startswith("<"):
            continue
        path = str(Path(name).resolve())
        if "site-packages/torch/" in path or path.startswith(_SKIP_DIRS):
            continue
        try:
            shown = os.path.relpath(path)
        except ValueError:
            shown = path
        shown = path if shown.startswith("../..") else shown
        return f"{shown}:{f.get('line')} ({f.get('name')})"
    return None


def _entry(e: dict, done: dict[str, int]) -> Collective | None:
    """``done``: each process group's (by ``pg_id``) last completed collective, from ``pg_status``."""
    if e.get("is_p2p") and not e.get("profiling_name"):
        return None
    group = e.get("process_group") or ("?", "")
    sizes = e.get("input_sizes") or [[]]
    seq = int(e.get("collective_seq_id") or e.get("p2p_seq_id") or 0)
    finished = e.get("retired", True) or e.get("state") == "completed" or seq <= done.get(str(e.get("pg_id")), -1)
    return Collective(op=str(e.get("profiling_name", "?")).split(":")[-1], group=str(group[0]), seq=seq,
                      issued=int(e.get("time_created_ns") or 0) / 1e9, waiting=not finished,
                      caller=_caller(e.get("frames")), shape=tuple(sizes[0]) if sizes and sizes[0] else None)


def collectives(dump: dict[str, Any]) -> list[Collective]:
    """The entries of a :func:`meshplan._torch.flight_recorder_dump`, oldest first."""
    done = {str(k): int(v.get("last_completed_collective", -1)) for k, v in (dump.get("pg_status") or {}).items()}
    out = [_entry(e, done) for e in sorted(dump.get("entries") or (), key=lambda e: e.get("record_id", 0))]
    return [c for c in out if c is not None]


def waiting(dump: dict[str, Any]) -> Collective | None:
    """The oldest collective still waiting, or None."""
    return next((c for c in collectives(dump) if c.waiting), None)


def failed_entry(dump: dict[str, Any], timeout_s: float | None, now: float | None = None) -> Collective | None:
    """The collective a failed wait was in, read after the failure (gloo has retired it by then).

    A blocked rank issues nothing after the collective it waits in (async ones issued before it may be newer), and
    gloo times a collective out ``timeout_s`` after it was issued: so the newest entry issued at least
    ``timeout_s`` ago (less a second of slack), or, for a closed connection (``timeout_s`` None), the newest.
    """
    entries = collectives(dump)
    now = time.time() if now is None else now
    if timeout_s is not None:
        old = [c for c in entries if c.issued <= now - timeout_s + 1.0]
        if old:
            return old[-1]
    return entries[-1] if entries else None
