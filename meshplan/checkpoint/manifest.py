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
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from meshplan.errors import PlanError

__all__ = ["DataState", "Manifest", "check_resume", "read_manifest_file", "FORMAT", "MAX_MANIFEST_BYTES"]

#: version of the manifest's layout; :meth:`Manifest.from_json` refuses a newer one
FORMAT = 1
#: a manifest larger than this is refused unread (meshplan writes a few hundred bytes plus the caller's ``extra``)
MAX_MANIFEST_BYTES = 16 << 20
_OPTIMIZER = ("saved", "empty", "none")
_MAX_TIME = 1e11  # Unix seconds (year 5138): a saved_at past it is not a time


def _int(v: Any, lo: int = 0) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and lo <= v < 2 ** 63


def _field_problem(name: str, v: Any) -> str | None:
    """What is wrong with manifest field ``name`` = ``v`` (its expected type and range), or None."""
    expected = {
        "step": ("an integer >= 0", _int(v)), "world_size": ("an integer >= 1", _int(v, 1)),
        "format": ("an integer >= 0", _int(v)), "extra": ("a mapping", isinstance(v, dict)),
        "data": ("a mapping of global_batch, seed, samples_seen (integers) or null",
                 v is None or (isinstance(v, dict) and set(v) == {"global_batch", "seed", "samples_seen"}
                               and all(_int(x) for x in v.values()) and v["global_batch"] >= 1)),
        "layout": ("a string or null", v is None or isinstance(v, str)),
        "plan": ("a string or null", v is None or isinstance(v, str)),
        "optimizer": (f"one of {list(_OPTIMIZER)}", v in _OPTIMIZER and isinstance(v, str)),
        "rng": ("true or false", isinstance(v, bool)),
        "torch": ("a string", isinstance(v, str)), "meshplan": ("a string", isinstance(v, str)),
        "saved_at": (f"Unix seconds in [0, {_MAX_TIME:.0e}]",
                     isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v <= _MAX_TIME),
    }[name]
    if expected[1]:
        return None
    try:
        shown = repr(v)
    except ValueError:  # an int past 4,300 digits
        shown = f"an integer of {v.bit_length()} bits"
    shown = shown if len(shown) <= 60 else f"{shown[:60]}… ({len(shown)} characters)"
    return f"field {name!r}: expected {expected[0]}, got {shown}"


def read_manifest_file(path: str | Path) -> "Manifest":
    """The manifest in the file ``path`` (``meshplan.json``), every field checked.

    Raises:
        PlanError: unreadable, too large, not JSON, not a mapping, or a field of the wrong type or range (one
            line: the file and the field, what it holds and what is expected).
    """
    from meshplan.plan_file.reading import read_text
    path = Path(path)
    text = read_text(path, "checkpoint manifest", MAX_MANIFEST_BYTES)  # bounded, regular files, UTF-8
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as e:  # not JSON, nested too deep, an int past 4,300 digits
        raise PlanError(f"{path}: not a JSON manifest: {' '.join(str(e).split())[:200]}") from None
    if not isinstance(data, dict):
        raise PlanError(f"{path}: expected a JSON mapping (the checkpoint manifest), got {type(data).__name__}")
    return Manifest.from_json(data, str(path))


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
        """Raises: PlanError: a manifest of a newer format, with fields this version does not know, or a field of
        the wrong type or range (named, with its value and what it should be)."""
        fmt = data.get("format", 0)
        if _int(fmt) and fmt > FORMAT:
            raise PlanError(f"{where}: manifest format {fmt} is newer than this meshplan's ({FORMAT})")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(map(str, set(data) - names))
        if unknown:
            raise PlanError(f"{where}: unknown manifest fields {unknown[:10]}; expected {sorted(names)}")
        if "step" not in data:
            raise PlanError(f"{where}: the manifest has no field 'step'")
        for name, value in data.items():
            problem = _field_problem(name, value)
            if problem:
                raise PlanError(f"{where}: {problem}")
        values = dict(data)
        if values.get("data") is not None:
            values["data"] = DataState.from_json(values["data"])
        return cls(**values)

    def same_layout(self, world_size: int, layout: str | None, plan: str | None) -> bool:
        """Was it saved on this world size, layout and plan (so each rank's RNG state means the same)?"""
        return (self.world_size, self.layout, self.plan) == (world_size, layout, plan)
