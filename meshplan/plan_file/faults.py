"""The ``faults`` plan section, as data: how long a rank waits for its peers and what it records for the report.

A rank that dies or stops answering leaves its peers blocked in a collective. Without this section torch waits 30
minutes in every DeviceMesh sub-group (they do not inherit ``init_process_group``'s timeout) and then raises an
error that names no rank. With it, every process group of the job times out after ``timeout_s`` and meshplan
turns the error into one :class:`~meshplan.errors.RankFailure` naming the silent rank and the mesh axis of the
collective (:mod:`meshplan.faults`). Torch-free.
"""

from __future__ import annotations

from pydantic import Field, model_validator

from meshplan.plan_file.strict import Strict

__all__ = ["Faults", "STALE_BEATS"]

#: a rank whose heartbeat is older than this many ``heartbeat_s`` is counted as silent
STALE_BEATS = 3


class Faults(Strict):
    """The ``faults`` plan section (torchtitan's ``comm.init_timeout_seconds`` / ``train_timeout_seconds``,
    ``comm.trace_buf_size``).

    Example (YAML)::

        faults:
          init_timeout_s: 300     # until the first train_step has finished (init, loading, compile)
          timeout_s: 60           # every collective after that
          heartbeat_s: 2
    """

    init_timeout_s: float = Field(
        600.0, gt=0, le=86400, allow_inf_nan=False,
        description="Seconds a collective may wait for its peers until the first meshplan.train_step has finished "
                    "(meshplan.init, parallelize, loading weights, the first step with its compilation); every "
                    "process group of the job, DeviceMesh sub-groups included.")
    timeout_s: float = Field(
        300.0, gt=0, le=86400, allow_inf_nan=False,
        description="Seconds a collective may wait for its peers once the first train_step has finished; then "
                    "every rank waiting on a silent or dead peer ends with a RankFailure naming it.")
    heartbeat_s: float = Field(
        2.0, gt=0, le=600, allow_inf_nan=False,
        description=f"Seconds between two heartbeats a background thread of each rank writes to the c10d store (what "
                    f"it is waiting in, if anything); a rank silent for {STALE_BEATS} heartbeats is named as stopped.")
    flight_recorder: int = Field(
        2000, ge=0, le=1_000_000,
        description="Entries of torch's flight recorder per rank (TORCH_FR_BUFFER_SIZE, which wins when set): the "
                    "collectives each rank issued, for the report; 0 turns it off. Takes effect when meshplan.init "
                    "creates the process group.")
    dump_dir: str | None = Field(
        None, min_length=1,
        description="Directory where each rank writes its flight-recorder trace (torch's pickle, for "
                    "`python -m torch.distributed.flight_recorder.fr_trace DIR -p meshplan_fr_rank`) and meshplan's "
                    "report when a collective fails; none by default.")

    @model_validator(mode="after")
    def _beats_before_timeout(self) -> "Faults":
        shortest = min(self.timeout_s, self.init_timeout_s)
        if STALE_BEATS * self.heartbeat_s > shortest:
            raise ValueError(f"heartbeat_s ({self.heartbeat_s:g}) × {STALE_BEATS} must not exceed the shortest "
                             f"timeout ({shortest:g} s): a silent rank would not be recognised before the timeout "
                             f"fires; lower heartbeat_s to at most {shortest / STALE_BEATS:g}")
        return self
