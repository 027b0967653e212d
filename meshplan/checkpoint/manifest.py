"""What a checkpoint says about itself (``meshplan.json``) and the data position a resumed run continues from.
Torch-free.

The data position is keyed by the global sample index, as ``examples/train.py`` draws sample ``i`` from
``(seed, i)`` alone: a run that saved after ``samples_seen`` samples resumes at sample ``samples_seen``, on any
layout, and sees exactly the batches the uninterrupted run would have. With another global batch size it would
not (the steps would cut the stream elsewhere), so :func:`check_resume` refuses that unless the caller opts in,
and refuses another seed always (another stream).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any

from meshplan.errors import PlanError

__all__ = ["DataState", "Manifest", "check_resume", "FORMAT"]

#: version of the manifest's layout; :meth:`Manifest.from_json` refuses a newer one
FORMAT = 1


@dataclass(frozen=True)
class DataState:
    """Where a run is in its data stream.

    Attributes:
        global_batch: samples per optimizer step over all data-parallel ranks.
        seed: the seed of the sample stream (sample ``i`` is a function of ``(seed, i)``).
        samples_seen: global samples consumed so far (the next step starts at this index).
    """

    global_batch: int
    seed: int = 0
    samples_seen: int = 0

    def advanced(self, steps: int = 1) -> "DataState":
        """This state after ``steps`` more optimizer steps."""
        return dataclasses.replace(self, samples_seen=self.samples_seen + steps * self.global_batch)

    def to_json(self) -> dict[str, int]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "DataState":
        return cls(**{k: int(data[k]) for k in ("global_batch", "seed", "samples_seen")})


def check_resume(saved: DataState, current: DataState, where: str, allow_batch_change: bool = False) -> DataState:
    """The data state a run configured as ``current`` continues from, after ``saved``.

    Args:
        saved: the checkpoint's data state.
        current: this run's ``global_batch`` and ``seed`` (its ``samples_seen`` is ignored).
        where: the checkpoint folder, for the message.
        allow_batch_change: continue at ``saved.samples_seen`` with ``current.global_batch``.

    Returns:
        ``current`` with ``samples_seen`` taken from ``saved``.

    Raises:
        PlanError: another seed; another global batch size unless ``allow_batch_change``.
    """
    if saved.seed != current.seed:
        raise PlanError(f"{where}: the data seed was {saved.seed} when saved, {current.seed} now: the resumed run "
                        f"would draw another sample stream; resume with seed {saved.seed}")
    if saved.global_batch != current.global_batch and not allow_batch_change:
        raise PlanError(
            f"{where}: the global batch size was {saved.global_batch} when saved, {current.global_batch} now: the "
            f"resumed steps would cut the sample stream at other places than the uninterrupted run's (from sample "
            f"{saved.samples_seen} on, {current.global_batch} per step instead of {saved.global_batch}); resume "
            f"with global batch {saved.global_batch}, or opt in to the change (allow_batch_change=True; "
            f"examples/train.py: --allow-batch-change)")
    return dataclasses.replace(current, samples_seen=saved.samples_seen)


@dataclass(frozen=True)
class Manifest:
    """The coordinator's record of one checkpoint, written last (``meshplan.json``).

    Attributes:
        step: optimizer steps done when saved.
        extra: the caller's JSON data (an LR scheduler's state, …).
        data: the data position, or None.
        world_size: ranks that saved it; ``layout``: their layout (``ResolvedLayout.fingerprint()``) or None.
        plan: the plan's fingerprint (None: no plan), for telling whether RNG states may be restored.
        optimizer: ``"saved"`` (its state and hyperparameters are in it), ``"empty"`` (it had taken no step: a
            fresh optimizer is the same), ``"none"`` (saved without one); ``rng``: each rank's RNG state is in it.
        torch: torch's version; ``meshplan``: meshplan's; ``saved_at``: Unix time; ``format``: :data:`FORMAT`.
    """

    step: int
    extra: dict[str, Any] = field(default_factory=dict)
    data: DataState | None = None
    world_size: int = 1
    layout: str | None = None
    plan: str | None = None
    optimizer: str = "none"
    rng: bool = False
    torch: str = ""
    meshplan: str = ""
    saved_at: float = field(default_factory=time.time)
    format: int = FORMAT

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["data"] = self.data.to_json() if self.data is not None else None
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any], where: str) -> "Manifest":
        """Raises: PlanError: a manifest of a newer format or with fields this version does not know."""
        if int(data.get("format", 0)) > FORMAT:
            raise PlanError(f"{where}: manifest format {data['format']} is newer than this meshplan's ({FORMAT})")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise PlanError(f"{where}: unknown manifest fields {unknown}; expected {sorted(names)}")
        values = dict(data)
        if values.get("data") is not None:
            values["data"] = DataState.from_json(values["data"])
        return cls(**values)

    def same_layout(self, world_size: int, layout: str | None, plan: str | None) -> bool:
        """Was it saved on this world size, layout and plan (so each rank's RNG state means the same)?"""
        return (self.world_size, self.layout, self.plan) == (world_size, layout, plan)
