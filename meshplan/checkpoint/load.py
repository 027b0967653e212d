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
from meshplan.checkpoint.fit import misfit
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
    """This rank's missing keys, shape mismatches and dtypes that cannot be cast, against the checkpoint's
    metadata (sizes and dtypes only: a meta model's tensors are enough)."""
    saved = metadata.state_dict_metadata
    missing = [k for k in targets if k not in saved]
    unfit = [misfit(k, saved[k].size, getattr(getattr(saved[k], "properties", None), "dtype", None), v.size(),
                    getattr(v, "dtype", None))
             for k, v in targets.items() if k in saved and hasattr(saved[k], "size") and hasattr(v, "size")]
    return {"missing": missing, "shape": [u for u in unfit if u is not None]}


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
        parts.append(f"shape or dtype mismatch: {'; '.join(shapes[:_SHOWN])}"
                     f"{f' … ({len(shapes)} tensors)' if len(shapes) > _SHOWN else ''}")
    if strict and unexpected:
        parts.append(f"in the checkpoint but in no rank's model: {unexpected[:_SHOWN]}"
                     f"{' …' if len(unexpected) > _SHOWN else ''}")
    if parts:
        raise PlanError(f"meshplan.load({where}): the checkpoint does not fit the model: {'; '.join(parts)}; "
                        f"refused before loading any tensor: load it into a model of the config that saved it")


def load(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
         data: DataState | None = None, allow_batch_change: bool = False, strict: bool = True,
         process_group: Any = None, device: Any = None) -> Saved:
    """Load the checkpoint ``path`` (from :func:`meshplan.save`, under any plan) into ``model`` and ``optimizer``.

    Every rank calls it, with the model parallelized under the plan it trains with now: each rank reads just
    the pieces of its own shards. Each rank's RNG state is restored when the world size, layout and plan are
    the ones that saved it (elsewhere a rank's stream has no counterpart; see ``docs/checkpoints.md``).

    A model on the meta device (built under ``with torch.device("meta")`` and parallelized, pipeline stages
    included) is checked against the checkpoint's metadata first, on every rank alike; then only this rank's
    shards are allocated (``to_empty``, as :func:`meshplan.materialize` does), its non-persistent buffers (RoPE
    tables, …) computed by the model's initializer on meta parameters, and the shards filled by DCP. An
    ``optimizer`` built over the meta parameters is pointed at the allocated ones.

    Args:
        path: a complete checkpoint folder (``ckpt/step-00000100``).
        model: parallelized (or not) like the run that continues; materialized, or on the meta device.
        optimizer: built over ``model``'s parameters; its state and hyperparameters are replaced by the saved.
        data: this run's ``global_batch`` and ``seed``: checked against the saved ones, see ``allow_batch_change``.
        allow_batch_change: continue at the saved sample index with another global batch size (otherwise
            refused: the resumed run would not see the batches the uninterrupted one saw).
        strict: model entries the checkpoint holds and no rank's model asks for are an error.
        process_group: the group DCP coordinates over (default: the default group).
        device: where a meta model's shards are allocated. Default: the tp mesh's device type.

    Returns:
        :class:`Saved`: step, extra, the data position to continue from, whether RNG states were restored.

    Raises:
        PlanError: not a complete checkpoint; another seed or global batch size; missing keys, shape mismatches,
            dtypes that cannot be cast or (``strict``) unexpected model keys, named, on every rank (for a meta
            model before anything is allocated); no optimizer state saved; a pipelined model pruned off the
            meta device while its parameters are meta.

    Example::

        >>> saved = meshplan.load("ckpt/step-00000100", model, opt)   # any plan; the next step continues exactly
        >>> start = saved.step
    """
    path = Path(path)
    manifest = read_manifest(path)
    resumed = manifest.data
    if data is not None and manifest.data is not None:
        resumed = check_resume(manifest.data, data, str(path), allow_batch_change)
    if optimizer is not None and manifest.optimizer == "none":
        raise PlanError(f"meshplan.load({path}): the checkpoint holds no optimizer state (saved without an "
                        f"optimizer); pass optimizer=None to load the model only")
    metadata = read_metadata(path)  # the restricted unpickler: a crafted .metadata runs nothing
    if any(t.is_meta for t in [*model.parameters(), *model.buffers()]):
        _check_keys(gather_state(model, None, None), metadata, str(path), strict, process_group)
        allocate(model, optimizer, device, f"meshplan.load({path})")
    if manifest.optimizer != "saved":
        optimizer = None  # "empty": saved before the first step, a fresh optimizer is the saved one
    same = manifest.rng and manifest.same_layout(*run_layout(model))
    state = gather_state(model, optimizer, group_rank() if same else None, aliases=False)
    state = {k: v for k, v in state.items() if not k.startswith(RNG) or k in metadata.state_dict_metadata}
    targets = as_boxes(state)
    _check_keys(targets, metadata, str(path), strict, process_group)
    dcp_load(targets, path, BoxLoadPlanner(), process_group=process_group)
    state.update({k: v for k, v in targets.items() if not isinstance(v, Boxes)})  # values DCP replaced
    apply_state(model, optimizer, state)
    return Saved(path=path, step=manifest.step, extra=manifest.extra, data=resumed, rng_restored=same,
                 manifest=manifest)


def allocate(model: nn.Module, optimizer: torch.optim.Optimizer | None, device: Any, where: str) -> None:
    """Allocate a meta model's shards on ``device`` (this rank's only: ``to_empty`` keeping ties, as
    :func:`meshplan.materialize`), compute its non-persistent buffers with its initializer on meta parameters
    (a pipeline's other stages put back for the walk), and point ``optimizer``'s parameter groups at the
    allocated parameters (``to_empty`` replaces a plain parameter object).

    Raises:
        PlanError: a pipelined model pruned off the meta device (its initializer cannot walk the whole model);
            an optimizer that already holds state for meta parameters.
    """
    from meshplan.weights.materialize import _device, _init_buffers, _to_empty, whole_of
    whole = whole_of(model, where, "a model built on the CPU")
    if optimizer is not None and optimizer.state:
        raise PlanError(f"{where}: the optimizer already holds state for meta parameters; build it over the meta "
                        f"model's parameters without stepping it (the checkpoint's state replaces it)")
    names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
    dev = _device(model, device)
    _to_empty(model, dev)
    with whole:
        _init_buffers(model, dev)
    if optimizer is not None:
        now = dict(model.named_parameters(remove_duplicate=False))
        for group in optimizer.param_groups:
            group["params"] = [now[names[id(p)]] if id(p) in names else p for p in group["params"]]
