"""``meshplan.load``: a checkpoint saved under any plan, into a model parallelized under any other.

DCP reads, for every tensor this rank holds under the NEW layout, the pieces of the saved shards that overlap it
(resharding is DCP's read planning: tp 2 → 4, pp 2 → 1, FSDP 4 → 2, ep 2 → 4, packed projections, …). Before any
tensor moves, the keys and shapes this rank asks for are checked against the checkpoint's metadata and the
verdict is shared by all ranks (one ``all_gather_object``), so a checkpoint of another model fails on every rank
with the names, instead of hanging the ranks that had nothing to complain about.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn

from meshplan.checkpoint.chunks import BoxLoadPlanner, Boxes, as_boxes
from meshplan.checkpoint.directory import MANIFEST, is_complete
from meshplan.checkpoint.manifest import DataState, Manifest, check_resume, read_manifest_file
from meshplan.checkpoint.safe_read import dcp_load, read_metadata
from meshplan.checkpoint.save import group_rank, run_layout
from meshplan.checkpoint.state import MODEL, RNG, apply_state, gather_state
from meshplan.errors import PlanError

__all__ = ["load", "Saved", "read_manifest"]

_SHOWN = 6  # names spelled out per kind of problem


@dataclass(frozen=True)
class Saved:
    """What :func:`load` restored.

    Attributes:
        path: the checkpoint folder; ``step``: its step; ``extra``: the JSON data saved with it.
        data: the data position to continue from (``samples_seen`` of the checkpoint, this run's batch size),
            or None when none was saved.
        rng_restored: each rank's RNG state was restored (same world size, layout and plan); else untouched.
        manifest: the whole :class:`~meshplan.checkpoint.manifest.Manifest`.
    """

    path: Path
    step: int
    extra: dict
    data: DataState | None
    rng_restored: bool
    manifest: Manifest


def read_manifest(path: str | Path) -> Manifest:
    """The manifest of the complete checkpoint ``path``.

    Raises:
        PlanError: ``path`` is not a complete checkpoint (missing, torn, or not written by meshplan.save).
    """
    path = Path(path)
    if not is_complete(path):
        raise PlanError(f"{path}: not a complete checkpoint: expected a folder with DCP's .metadata and "
                        f"{MANIFEST} (a folder ending in .partial is a save that did not finish)")
    return read_manifest_file(path / MANIFEST)


def _problems(targets: dict[str, Any], metadata: Any) -> dict[str, list[str]]:
    """This rank's missing keys and shape mismatches against the checkpoint's metadata."""
    saved = metadata.state_dict_metadata
    missing = [k for k in targets if k not in saved]
    shapes = [f"{k}: checkpoint {tuple(saved[k].size)}, model {tuple(v.size())}" for k, v in targets.items()
              if k in saved and hasattr(saved[k], "size") and hasattr(v, "size") and tuple(saved[k].size) !=
              tuple(v.size())]
    return {"missing": missing, "shape": shapes}


def _check_keys(targets: dict[str, Any], metadata: Any, where: str, strict: bool, group: Any) -> None:
    """Raise the same PlanError on every rank when any rank's keys or shapes do not fit the checkpoint."""
    mine = (_problems(targets, metadata), sorted(k for k in targets if k.startswith(MODEL)))
    everyone = [mine]
    if dist.is_initialized():
        everyone = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, mine, group=group)
    missing = sorted({k for p, _ in everyone for k in p["missing"]})
    shapes = sorted({s for p, _ in everyone for s in p["shape"]})
    held = {k for _, keys in everyone for k in keys}
    unexpected = sorted(k for k in metadata.state_dict_metadata if k.startswith(MODEL) and k not in held)
    parts = []
    if missing:
        parts.append(f"missing from the checkpoint: {missing[:_SHOWN]}{' …' if len(missing) > _SHOWN else ''}")
    if shapes:
        parts.append(f"shape mismatch: {'; '.join(shapes[:_SHOWN])}")
    if strict and unexpected:
        parts.append(f"in the checkpoint but in no rank's model: {unexpected[:_SHOWN]}"
                     f"{' …' if len(unexpected) > _SHOWN else ''}")
    if parts:
        raise PlanError(f"meshplan.load({where}): the checkpoint does not fit the model: {'; '.join(parts)}")


def load(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
         data: DataState | None = None, allow_batch_change: bool = False, strict: bool = True,
         process_group: Any = None) -> Saved:
    """Load the checkpoint ``path`` (from :func:`meshplan.save`, under any plan) into ``model`` and ``optimizer``.

    Every rank calls it, with the model parallelized under the plan it trains with now: each rank reads just
    the pieces of its own shards. Each rank's RNG state is restored when the world size, layout and plan are
    the ones that saved it (elsewhere a rank's stream has no counterpart; see ``docs/checkpoints.md``).

    Args:
        path: a complete checkpoint folder (``ckpt/step-00000100``).
        model: parallelized (or not) like the run that continues; materialized (not on the meta device).
        optimizer: built over ``model``'s parameters; its state and hyperparameters are replaced by the saved.
        data: this run's ``global_batch`` and ``seed``: checked against the saved ones, see ``allow_batch_change``.
        allow_batch_change: continue at the saved sample index with another global batch size (otherwise
            refused: the resumed run would not see the batches the uninterrupted one saw).
        strict: model entries the checkpoint holds and no rank's model asks for are an error.
        process_group: the group DCP coordinates over (default: the default group).

    Returns:
        :class:`Saved`: step, extra, the data position to continue from, whether RNG states were restored.

    Raises:
        PlanError: not a complete checkpoint; a model on the meta device; another seed or global batch size;
            missing keys, shape mismatches or (``strict``) unexpected model keys, named, on every rank; no
            optimizer state saved.

    Example::

        >>> saved = meshplan.load("ckpt/step-00000100", model, opt)   # any plan; the next step continues exactly
        >>> start = saved.step
    """
    path = Path(path)
    manifest = read_manifest(path)
    if any(t.is_meta for t in model.parameters()):
        raise PlanError(f"meshplan.load({path}): {type(model).__name__} is on the meta device; its tensors are filled "
                        f"in place, so materialize it first (meshplan.materialize(model, seed=0), or build it on "
                        f"the device) and build the optimizer over the materialized parameters")
    resumed = manifest.data
    if data is not None and manifest.data is not None:
        resumed = check_resume(manifest.data, data, str(path), allow_batch_change)
    if optimizer is not None and manifest.optimizer == "none":
        raise PlanError(f"meshplan.load({path}): the checkpoint holds no optimizer state (saved without an "
                        f"optimizer); pass optimizer=None to load the model only")
    if manifest.optimizer != "saved":
        optimizer = None  # "empty": saved before the first step, a fresh optimizer is the saved one
    same = manifest.rng and manifest.same_layout(*run_layout(model))
    state = gather_state(model, optimizer, group_rank() if same else None, aliases=False)
    metadata = read_metadata(path)  # the restricted unpickler: a crafted .metadata runs nothing
    state = {k: v for k, v in state.items() if not k.startswith(RNG) or k in metadata.state_dict_metadata}
    targets = as_boxes(state)
    _check_keys(targets, metadata, str(path), strict, process_group)
    dcp_load(targets, path, BoxLoadPlanner(), process_group=process_group)
    state.update({k: v for k, v in targets.items() if not isinstance(v, Boxes)})  # values DCP replaced
    apply_state(model, optimizer, state)
    return Saved(path=path, step=manifest.step, extra=manifest.extra, data=resumed, rng_restored=same,
                 manifest=manifest)
