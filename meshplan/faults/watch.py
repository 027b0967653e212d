"""FaultWatch: the plan's timeouts on every process group, the heartbeat, and one translation of a failed
collective into a :class:`~meshplan.errors.RankFailure`.

``meshplan.init`` starts one per job (``topology.job.watch``: :class:`~meshplan.mesh.runtime.Job` owns it). Until
the first ``meshplan.train_step`` has finished every group waits ``faults.init_timeout_s``, then
``faults.timeout_s`` (torchtitan's two timeouts).
``translating()`` wraps what meshplan runs (``init``'s exchange, ``parallelize``, ``train_step``, the end of
``with meshplan.init(...)``): a collective error there (gloo's ``Timed out waiting 20000ms`` or ``Connection
closed by peer``, NCCL's watchdog, a ``DistError``) becomes one RankFailure saying which rank is silent and which
mesh axis this rank was waiting on (:mod:`meshplan.faults.report`).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import re
import time
import warnings
from typing import Any, Iterator

from meshplan.errors import RankFailure
from meshplan.faults.terminate import TermGuard, Terminated
from meshplan.plan_file.faults import Faults

#: torch's warning for a forward hook registered with ``always_call=True`` that raised while another error unwound
_SILENCED_HOOK = r"module forward hook with ``always_call=True`` raised an exception that was silenced"

__all__ = ["FaultWatch", "translating", "is_collective_failure", "collective_cause"]

_LOG = logging.getLogger("meshplan.faults")
_COLLECTIVE_ERROR = re.compile(
    r"Timed out waiting \d+ ?ms|Application timeout caused pair closure|Connection (closed|reset) by peer|"
    r"Broken pipe|gloo/transport/|Watchdog caught collective operation timeout|NCCL communicator was aborted|"
    r"ProcessGroup\w* .*(aborted|timed out)", re.I)


def is_collective_failure(exc: BaseException) -> bool:
    """Is ``exc`` a collective that failed for lack of a peer (not a bug in the step)?"""
    import torch.distributed as dist
    if isinstance(exc, RankFailure):
        return False
    return isinstance(exc, dist.DistError) or (isinstance(exc, RuntimeError)
                                               and _COLLECTIVE_ERROR.search(str(exc)) is not None)


def collective_cause(exc: BaseException) -> BaseException | None:
    """The failed collective behind ``exc``: ``exc`` itself, or one in its chain of causes (a pipeline stage
    re-raises a failed send as ``RuntimeError("Failed to run stage backward …") from e``; SIGTERM arriving while a
    failed collective unwinds raises :class:`Terminated` in its context); else None."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, RankFailure):  # translated already
            return None
        if is_collective_failure(exc):
            return exc
        exc = exc.__cause__ or exc.__context__
    return None


class FaultWatch:
    """The fault handling of one job (made by ``meshplan.init``; ``topology.job.watch``).

    Args:
        settings: the plan's ``faults`` section (defaults without one).
        origin: where the timeouts come from, for the report (``"plans/x.yaml"``).
    """

    def __init__(self, settings: Faults, origin: str):
        import torch.distributed as dist
        from meshplan import _torch
        from meshplan.faults.heartbeat import fault_store
        self.settings, self.origin = settings, origin
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.steady_state = False
        self._groups: dict[str, tuple[Any, str]] = {dist.group.WORLD.group_name: (dist.group.WORLD, "world")}
        self.store = fault_store(_torch.default_store(), max(60.0, 5 * settings.heartbeat_s))
        self.heartbeat = None
        self.p2p_group: str | None = None
        self.term = TermGuard()
        self._set_timeouts(settings.init_timeout_s)

    def adopt_topology(self, topology: Any) -> None:
        """Name the topology's groups by their mesh axes (the first key naming a group wins: tp over tp_cp when
        cp is 1, any key over ``world``) and give them the current timeout."""
        from meshplan.mesh.topology import MESH_KEYS
        if topology.layout.pp > 1:
            self.p2p_group = topology["pp"].get_group().group_name  # where the pipeline's sends and receives go
        for key in MESH_KEYS:
            group = topology[key].get_group()
            if self._groups.get(group.group_name, (None, "world"))[1] == "world":
                self._groups[group.group_name] = (group, key)
        self._set_timeouts(self.timeout_s)

    def adopt(self, group: Any, axis: str) -> None:
        """A group meshplan created beside the meshes (the pipeline's embedding group): named ``axis`` in
        reports, and given the current timeout."""
        self._groups.setdefault(group.group_name, (group, axis))
        self._set_timeouts(self.timeout_s, [group])

    @property
    def timeout_s(self) -> float:
        return self.settings.timeout_s if self.steady_state else self.settings.init_timeout_s

    @property
    def timeout_key(self) -> str:
        return "faults.timeout_s" if self.steady_state else "faults.init_timeout_s"

    def _set_timeouts(self, seconds: float, groups: list | None = None) -> None:
        from meshplan import _torch
        for group in groups if groups is not None else {id(g): g for g, _ in self._groups.values()}.values():
            _torch.set_group_timeout(group, seconds)

    def start(self) -> None:
        """Publish this rank's process record and first heartbeat; beat in the background."""
        from meshplan import _torch
        from meshplan.faults import flight
        from meshplan.faults.heartbeat import Heartbeat

        def waiting() -> dict | None:
            c = flight.waiting(_torch.flight_recorder_dump(only_active=True))
            return None if c is None else {"op": c.op, "axis": self.axis_of(c.group)[0], "seq": c.seq,
                                           "issued": c.issued}
        self.heartbeat = Heartbeat(self.store, self.rank, self.settings.heartbeat_s, waiting)
        self.heartbeat.start()
        self.term.install()
        atexit.register(self.close)  # a daemon thread inside the store's C++ at interpreter exit would abort

    def steady(self) -> None:
        """The first train_step has finished: every group now waits ``faults.timeout_s``."""
        if not self.steady_state:
            self.steady_state = True
            self._set_timeouts(self.settings.timeout_s)

    def axis_of(self, group_name: str) -> tuple[str, tuple[int, ...]]:
        """``(mesh axis, global ranks)`` of the group named ``group_name`` (``("?", ())`` when unknown)."""
        import torch.distributed as dist
        group, axis = self._groups.get(group_name, (None, "?"))
        if group is None:
            return axis, ()
        return axis, tuple(dist.get_process_group_ranks(group))

    @contextlib.contextmanager
    def translating(self) -> Iterator[None]:
        """Turn a failed collective raised inside into one RankFailure (``__cause__``: torch's error). While the
        failure unwinds, a module's ``always_call`` forward hook (FSDP2's, of a unit whose pre-forward the failed
        collective interrupted) raises in turn and torch warns that it silenced it: that consequence is muted here,
        so the report stays the rank's one line."""
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=_SILENCED_HOOK, category=UserWarning)
                yield
        except BaseException as exc:
            cause = collective_cause(exc)
            if cause is None:
                raise
            failure = self.failure(cause)
            if isinstance(exc, Terminated):
                self.term.die()  # torchrun is stopping the job: the report is out, leave as SIGTERM does
            raise failure from cause

    def failure(self, exc: BaseException) -> RankFailure:
        """The RankFailure for ``exc``, logged at once (torchrun SIGTERMs the other ranks 0.1 s after one died: a
        SIGTERM while the report is built is held until it is out) and, with ``faults.dump_dir``, written there
        beside this rank's flight-recorder trace."""
        from meshplan.faults.report import diagnose
        with self.term.hold():
            self.record_failure("fault", f"{type(exc).__name__}: {' '.join(str(exc).split())}")  # a victim
            error = diagnose(self, exc)
            _LOG.error("meshplan: %s", error)
            self.record_failure("fault", str(error))
            self._dump(str(error))
        return error

    def _dump(self, report: str) -> None:
        """``dump_dir/meshplan_fr_rank<R>`` (torch's trace pickle, for its fr_trace analyzer) and
        ``dump_dir/meshplan_report_rank<R>.txt``."""
        if self.settings.dump_dir is None:
            return
        import pickle
        from pathlib import Path
        from meshplan import _torch
        out = Path(self.settings.dump_dir)
        try:
            out.mkdir(parents=True, exist_ok=True)
            trace = _torch.flight_recorder_dump(True)
            trace["pg_config"] = {name: {"name": name, "desc": getattr(group, "group_desc", axis) or axis,
                                         "ranks": str(list(self.axis_of(name)[1]))}
                                  for name, (group, axis) in self._groups.items()}  # gloo records none
            (out / f"meshplan_fr_rank{self.rank}").write_bytes(pickle.dumps(trace))
            (out / f"meshplan_report_rank{self.rank}.txt").write_text(report + "\n")
        except OSError as e:
            _LOG.error("meshplan: cannot write the fault dump to %s: %s", out, e)

    def ending(self, exc: BaseException | None) -> RankFailure | None:
        """The end of ``with meshplan.init(...)`` with ``exc`` escaping (or None): a failed collective becomes the
        RankFailure returned, anything else is recorded for the peers' reports (``error``; ``terminated`` for
        SIGTERM; ``exit`` for a rank that finished). The caller closes the watch."""
        cause = collective_cause(exc) if exc is not None else None
        if cause is not None:
            failure = self.failure(cause)
            if isinstance(exc, Terminated):
                self.close()
                self.term.die()
            return failure
        if isinstance(exc, Terminated):
            self.record_failure("terminated", "stopped by SIGTERM")
            self._name_on_termination()
        elif exc is not None and not isinstance(exc, RankFailure):
            self.record_failure("error", f"{type(exc).__name__}: {exc}")
        elif exc is None:
            self.record_failure("exit", "")
        return None

    def _name_on_termination(self) -> None:
        """SIGTERM (torchrun stopping the group) reached this rank outside a failed collective: name a silent peer
        all the same, on this rank's one line, before the process ends."""
        from meshplan.faults.report import diagnose_terminated
        with self.term.hold():
            error = diagnose_terminated(self)
            if error is not None:
                _LOG.error("meshplan: %s", error)
                self._dump(str(error))

    def record_failure(self, kind: str, text: str) -> None:
        """``fail/<rank>`` in the store: peers count this rank as a victim (``fault``) or name its error."""
        try:
            self.store.set(f"fail/{self.rank}", json.dumps({"t": time.time(), "kind": kind, "text": text[:500]}))
        except Exception:  # noqa: BLE001 - best effort, the job is ending
            pass

    def close(self) -> None:
        """Stop the heartbeat (before the process group goes away); SIGTERM back to its action."""
        atexit.unregister(self.close)
        self.term.uninstall()
        if self.heartbeat is not None:
            self.heartbeat.stop()
            self.heartbeat = None


def translating(watch: "FaultWatch | None") -> contextlib.AbstractContextManager:
    """``watch.translating()``, or nothing to translate without a watch (a topology made without ``init``)."""
    return watch.translating() if watch is not None else contextlib.nullcontext()
