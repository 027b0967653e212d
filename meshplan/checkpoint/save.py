"""``meshplan.save``: one sharded, atomic, optionally asynchronous checkpoint on ``torch.distributed.checkpoint``.

Each rank writes only its shards (DCP; replicated tensors once, by one rank), into ``<path>.partial``, which the
coordinator renames to ``<path>`` when every rank is done (:mod:`meshplan.checkpoint.commit`). An asynchronous save
copies this rank's shards to CPU memory (the only time the training loop waits), then DCP's ``async_save`` writes
and commits them in a background thread over a gloo process group of its own, so its collectives never interleave
with the training's.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn

from meshplan.checkpoint.chunks import BoxSavePlanner, as_boxes

#: the largest box a checkpoint stores (bytes): a loading rank reads at most one beyond its slice (chunks.as_boxes)
SAVE_BOX_BYTES = 32 * 1024 * 1024
from meshplan.checkpoint.commit import CommitWriter, Prestaged, SaveHandle, stage
from meshplan.checkpoint.directory import partial_dir
from meshplan.checkpoint.manifest import DataState, Manifest
from meshplan.checkpoint.state import gather_state
from meshplan.errors import PlanError

__all__ = ["save", "run_layout", "group_rank"]


def run_layout(model: nn.Module) -> tuple[int, str | None, str | None]:
    """``(world size, layout fingerprint, plan fingerprint)`` of the run ``model`` belongs to."""
    from meshplan.mesh.runtime import plan_fingerprint
    from meshplan.state import parallel_state
    world = dist.get_world_size() if dist.is_initialized() else 1
    state = parallel_state(model)
    layout = state.topology.layout.fingerprint() if state is not None and state.topology is not None else None
    plan = plan_fingerprint(state.plan) if state is not None and state.plan is not None else None
    return world, layout, plan


def group_rank(group: Any = None) -> int:
    """This process's rank in ``group`` (0 without a process group)."""
    return dist.get_rank(group) if dist.is_initialized() else 0


def _optimizer_kind(optimizer: Any) -> str:
    """``"none"``, ``"empty"`` (no step taken: nothing to save, and torch's state-dict API would take a
    zero-learning-rate step to create its state, advancing AdamW's step counts) or ``"saved"``."""
    return "none" if optimizer is None else "saved" if optimizer.state else "empty"


def _manifest(model: nn.Module, optimizer: Any, step: int, extra: Any, data: DataState | None,
              where: str) -> dict:
    try:
        json.dumps(extra, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise PlanError(f"meshplan.save({where}): extra must be JSON data (dicts, lists, strings, finite numbers): "
                        f"{e}") from None
    from meshplan.version import __version__
    world, layout, plan = run_layout(model)
    return Manifest(step=step, extra=dict(extra or {}), data=data, world_size=world, layout=layout, plan=plan,
                    optimizer=_optimizer_kind(optimizer), rng=True, torch=torch.__version__,
                    meshplan=__version__).to_json()


def _fresh_partial(final: Path, group: Any) -> Path:
    """``final``'s ``.partial`` folder, emptied of an earlier torn attempt by the coordinator before anyone
    writes."""
    partial = partial_dir(final)
    if group_rank(group) == 0:
        shutil.rmtree(partial, ignore_errors=True)
        final.parent.mkdir(parents=True, exist_ok=True)
    if dist.is_initialized():
        dist.barrier(group=group)
    return partial


def save(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *, step: int,
         extra: dict | None = None, data: DataState | None = None, async_save: bool = False,
         process_group: Any = None, on_commit: Any = None) -> SaveHandle:
    """Save a sharded checkpoint of ``model`` (and ``optimizer``) to the folder ``path``, atomically.

    Every rank calls it. The folder holds DCP's shards (each rank writes its own; tensors keyed by the model's
    parameter names, so any plan loads them: :func:`meshplan.load`), each rank's RNG state and the manifest
    ``meshplan.json`` (step, ``extra``, ``data``, the layout), written last; the folder gets its name
    only when all of it is on disk.

    Args:
        path: the checkpoint folder (``ckpt/step-00000100``); written as ``path.partial`` first.
        model: parallelized by meshplan (any plan: tp, pp stages, FSDP2, ep, …) or plain.
        optimizer: its state (AdamW moments, step counts, hyperparameters) is saved per parameter name.
        step: optimizer steps done.
        extra: JSON data to keep with it (an LR scheduler's ``state_dict()``, a tokens counter, …).
        data: the data position (:class:`~meshplan.checkpoint.manifest.DataState`).
        async_save: copy the shards to CPU memory and write them in the background; the returned handle's
            ``wait()`` blocks until the checkpoint is complete. Needs ``process_group`` (a gloo group that
            the training loop does not use; :class:`meshplan.CheckpointManager` keeps one) or makes one.
        process_group: the group DCP coordinates over (default: the default group).
        on_commit: called on the coordinator after the checkpoint is complete (keep-last-K).

    Returns:
        A :class:`~meshplan.checkpoint.commit.SaveHandle` (already done when synchronous).

    Raises:
        PlanError: ``extra`` is not JSON data.

    Example::

        >>> meshplan.save("ckpt/step-00000100", model, opt, step=100, extra={"lr_scheduler": sched.state_dict()})
    """
    final = Path(path)
    manifest = _manifest(model, optimizer, step, extra, data, str(final))
    cleanup = None
    if async_save and process_group is None and dist.is_initialized():
        process_group = dist.new_group(backend="gloo")
        cleanup = lambda: dist.destroy_process_group(process_group)  # noqa: E731
    partial = _fresh_partial(final, process_group)
    kind = _optimizer_kind(optimizer)
    state = as_boxes(gather_state(model, optimizer if kind == "saved" else None, group_rank()), SAVE_BOX_BYTES)
    writer = CommitWriter(partial, final, manifest, on_commit)
    if not async_save:
        dcp.save(state, storage_writer=writer, planner=BoxSavePlanner(), process_group=process_group)
        return SaveHandle(final, step)
    future = dcp.async_save(stage(state), storage_writer=writer, planner=BoxSavePlanner(),
                            process_group=process_group, async_stager=Prestaged())
    return SaveHandle(final, step, future, cleanup)
