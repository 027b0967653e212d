"""The diagnosis of a failed collective: which rank is silent, what this rank was waiting in, on which mesh axis.

Who is silent: a peer on this host whose process is gone, a zombie or stopped (``/proc``, at once); any peer
whose heartbeat is older than ``STALE_BEATS × heartbeat_s``. A peer that wrote ``fail/<rank>`` (a fault of its
own: it is a victim) is not blamed; one that ended with another error is named with it. A killed peer closes its
connections before its heartbeat goes stale, so the diagnosis polls for up to ``STALE_BEATS`` heartbeats; a
timeout finds the stopped rank silent for the whole timeout already. What this rank waited in comes from the
flight recorder (:mod:`meshplan.faults.flight`), its group's mesh axis from the topology.
"""

from __future__ import annotations

import math
import re
import time
import traceback
from typing import Any

from meshplan.errors import RankFailure
from meshplan.plan_file.faults import STALE_BEATS

__all__ = ["diagnose", "diagnose_terminated", "ranks_text"]

_TIMEOUT = re.compile(r"Timed out waiting (\d+) ?ms|Timeout\(ms\)=(\d+)")


def ranks_text(ranks: tuple[int, ...] | list[int]) -> str:
    """``0-3``, ``0, 2, 4``, ``0, 8, 16, … 56 (8 ranks)``."""
    ranks = sorted(ranks)
    if not ranks:
        return "?"
    if ranks == list(range(ranks[0], ranks[-1] + 1)) and len(ranks) > 2:
        return f"{ranks[0]}-{ranks[-1]}"
    if len(ranks) <= 6:
        return ", ".join(map(str, ranks))
    return f"{', '.join(map(str, ranks[:3]))}, … {ranks[-1]} ({len(ranks)} ranks)"


def _timeout_of(exc: BaseException, current: float) -> float | None:
    """The timeout ``exc`` reports (``current``, the group's, when it says only that one fired), else None."""
    m = _TIMEOUT.search(str(exc))
    if m:
        return int(m.group(1) or m.group(2)) / 1000
    return current if re.search(r"timeout|timed out", str(exc), re.I) else None


#: ``fail/<rank>`` kinds of ranks that are not the cause: they lost a peer themselves, or torchrun stopped them
_VICTIMS = ("fault", "terminated")
_LEFT = {"error": "ended with an error", "exit": "had finished (it left `with meshplan.init(...)`)"}
_GONE = {"gone": "its process is gone", "zombie": "its process exited (a zombie, not yet reaped)",
         "stopped": "its process is stopped (SIGSTOP?)"}


def _long_wait(beat: dict | None, beats: float = 1.0) -> str | None:
    """``all_gather #7 over dp_shard`` when the heartbeat caught its rank waiting for at least ``beats`` seconds (a
    blocked rank, not one between two quick collectives), else None."""
    wait = (beat or {}).get("wait")
    if not wait or beat["t"] - wait["issued"] < beats:
        return None
    return f"{wait['op']} #{wait['seq']} over {wait['axis']}"


def _peer_text(rank: int, state: str | None, beat: dict | None, fail: dict | None, now: float) -> str:
    """``rank 1 stopped answering (its process is stopped (SIGSTOP?); last heartbeat 20.3 s ago, then waiting in
    all_gather #7 over dp_shard)``."""
    kind = (fail or {}).get("kind")
    if kind in _LEFT:
        head = f"rank {rank} {_LEFT[kind]}" + (f": {fail['text']}" if fail.get("text") else "")
    else:
        head = f"rank {rank} {'died' if state in ('gone', 'zombie') else 'stopped answering'}"
    parts = [_GONE[state]] if state in _GONE and kind not in _LEFT else []
    if beat is None:
        parts.append("no heartbeat")
    else:
        wait = _long_wait(beat)
        parts.append(f"last heartbeat {now - beat['t']:.1f} s ago"
                     + (f", then waiting in {wait} for {beat['t'] - beat['wait']['issued']:.0f} s" if wait else ""))
    return f"{head} ({'; '.join(parts)})"


def _find_silent(watch: Any, ranks: list[int], deadline: float) -> tuple[list[int], dict, dict, dict, float]:
    """Poll the store and ``/proc`` until a peer is silent or ``deadline``: ``(silent, beats, fails, states, now)``."""
    from meshplan.faults.heartbeat import process_state, read_records
    procs = read_records(watch.store, "proc", ranks)
    stale = STALE_BEATS * watch.settings.heartbeat_s
    while True:
        now = time.time()
        beats, fails = read_records(watch.store, "hb", ranks), read_records(watch.store, "fail", ranks)
        states = {r: process_state(procs.get(r)) for r in ranks}
        silent = [r for r in ranks if r != watch.rank and fails.get(r, {}).get("kind") not in _VICTIMS and (
            states[r] in ("gone", "zombie", "stopped") or (r in fails) or
            (r in beats and now - beats[r]["t"] > stale))]
        if silent or now >= deadline:
            return silent, beats, fails, states, now
        time.sleep(min(0.2, watch.settings.heartbeat_s / 4))


def _p2p(watch: Any, exc: BaseException, timeout: float | None, now: float) -> Any:
    """The pipeline send or receive ``exc`` ended, over the pp group (gloo records no point-to-point operation in
    the flight recorder): a pipeline schedule waiting on its point-to-point works in ``exc``'s traceback; the
    message says which (``for recv operation``). None otherwise."""
    from meshplan.faults.flight import Collective
    frames = traceback.extract_tb(exc.__traceback__) if exc.__traceback__ is not None else []
    if not any(f.name == "_wait_batch_p2p" or ("pipelining" in f.filename and "p2p" in f.name) for f in frames):
        return None
    m = re.search(r"for (send|recv) operation", str(exc))
    return Collective(op=f"a pipeline {m.group(1) if m else 'send/recv'}", group=getattr(watch, "p2p_group", None)
                      or "?", seq=-1, issued=now - timeout if timeout is not None else math.nan, waiting=False)


def _own_text(watch: Any, entry: Any, exc: BaseException, timeout: float | None, now: float) -> str:
    """``rank 0 was waiting in all_reduce #41 over mesh axis tp (ranks 0-1) for 20.0 s, issued from …``."""
    if entry is None:
        return (f"rank {watch.rank}'s collective failed (the flight recorder is off, so meshplan cannot say which: "
                f"faults.flight_recorder, set before meshplan.init creates the process group)")
    axis, group = watch.axis_of(entry.group)
    where = "the whole world" if axis == "world" else f"mesh axis {axis}"
    seq = f" #{entry.seq}" if entry.seq >= 0 else ""
    waited = f" for {entry.waited_s(now):.1f} s" if not math.isnan(entry.issued) else ""
    text = f"rank {watch.rank} was waiting in {entry.op}{seq} over {where} (ranks {ranks_text(group)}){waited}"
    return text + (f", issued from {entry.caller}" if entry.caller else "")


def _cause_text(watch: Any, exc: BaseException, timeout: float | None) -> str:
    """``timed out after 4 s (faults.timeout_s = 4 s, plans/x.yaml)``: the setting whose value fired (a pipeline
    send waits ``timeout_s`` in the first step too), else the current one; or the error's first sentence."""
    if timeout is not None:
        s = watch.settings
        key = next((k for k, v in (("faults.timeout_s", s.timeout_s), ("faults.init_timeout_s", s.init_timeout_s))
                    if abs(timeout - v) <= 0.5), watch.timeout_key)
        value = s.timeout_s if key == "faults.timeout_s" else s.init_timeout_s
        return f"timed out after {timeout:g} s ({key} = {value:g} s, {watch.origin})"
    first = re.sub(r"^\[[^\]]*\]\s*", "", " ".join(str(exc).split()))
    first = re.split(r"(?<=[a-z0-9\]])\. ", first)[0][:200]
    return f"the collective failed: {type(exc).__name__}: {first}"


def diagnose(watch: Any, exc: BaseException) -> RankFailure:
    """The :class:`RankFailure` for ``exc``, a collective error on this rank (see the module docstring)."""
    from meshplan import _torch
    from meshplan.faults import flight
    timeout = _timeout_of(exc, watch.timeout_s)
    p2p = _p2p(watch, exc, timeout, time.time())
    entry = p2p or flight.failed_entry(_torch.flight_recorder_dump(stack_traces=True), timeout)
    axis, group = watch.axis_of(entry.group) if entry is not None else (None, ())
    everyone = list(range(watch.world))
    deadline = time.time() + STALE_BEATS * watch.settings.heartbeat_s + 1.0
    silent, beats, fails, states, now = _find_silent(watch, everyone, deadline)
    in_group = [r for r in silent if r in group] or silent
    if in_group:
        who = "; ".join(_peer_text(r, states[r], beats.get(r), fails.get(r), now) for r in in_group)
    else:
        alive = [r for r in (group or everyone) if r != watch.rank][:4]
        waits = [f"rank {r} in {w}" for r in alive if (w := _long_wait(beats.get(r)))]
        who = (f"no rank missed its heartbeat (every rank is alive: the ranks issued different collectives, "
               f"e.g. a rank-dependent branch or a rank that skipped a step"
               + (f"; waiting now: {', '.join(waits)})" if waits else ")"))
    cause = _cause_text(watch, exc, timeout)
    message = f"{who}; {_own_text(watch, entry, exc, timeout, now)}; {cause}"
    return RankFailure(message, silent=tuple(in_group), axis=axis, group_ranks=group,
                       op=entry.op if entry is not None else None,
                       waited_s=entry.waited_s(now) if entry is not None else None)


def diagnose_terminated(watch: Any) -> RankFailure | None:
    """The :class:`RankFailure` of a rank that torchrun stopped (SIGTERM) before any collective of its own failed,
    when a peer is silent (torchrun stops the group 0.1 s after a worker died: a rank computing then would end
    without naming it); None when every peer is alive (the job is being stopped for another reason)."""
    everyone = list(range(watch.world))
    deadline = time.time() + STALE_BEATS * watch.settings.heartbeat_s + 1.0
    silent, beats, fails, states, now = _find_silent(watch, everyone, deadline)
    if not silent:
        return None
    who = "; ".join(_peer_text(r, states[r], beats.get(r), fails.get(r), now) for r in silent)
    return RankFailure(f"{who}; rank {watch.rank} was stopped by torchrun (SIGTERM) before a collective of its own "
                       f"failed", silent=tuple(silent))
