"""``meshplan.CheckpointManager``: the step folders of one training run (torchtitan's ``CheckpointManager``, on
meshplan's layouts): save every N steps, synchronously or in the background, keep the last K, resume from the
latest complete one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from meshplan.checkpoint.commit import SaveHandle
from meshplan.checkpoint.directory import latest_complete, prune, step_dir
from meshplan.checkpoint.load import Saved, load
from meshplan.checkpoint.manifest import DataState
from meshplan.checkpoint.save import save
from meshplan.errors import PlanError

__all__ = ["CheckpointManager"]


class CheckpointManager:
    """Checkpoints of one run under ``directory``: ``step-00000040/``, ``step-00000060/``, …

    Every rank constructs it (it makes a gloo process group of its own for DCP's coordination, which an
    asynchronous save uses from its background thread) and calls each method.

    Args:
        directory: where the step folders live (created on the first save).
        every: :meth:`save` saves when ``step % every == 0`` (None: only when forced).
        keep: keep the last ``keep`` complete checkpoints, delete older ones after each commit (None: all).
        async_save: write in the background (the loop waits only for a CPU copy of its shards); at most one
            save is in flight: the next one, :meth:`wait` and :meth:`close` wait for it.

    Raises:
        PlanError: ``every`` or ``keep`` below 1.

    Example::

        >>> ckpt = meshplan.CheckpointManager("ckpt", every=100, keep=3, async_save=True)
        >>> saved = ckpt.load_latest(model, opt, data=DataState(global_batch=512, seed=0))
        >>> start = saved.step if saved else 0
        >>> for step in range(start + 1, steps + 1):
        ...     train_step(...)
        ...     ckpt.save(step, model, opt, data=DataState(512, 0, samples_seen=step * 512))
        >>> ckpt.close()
    """

    def __init__(self, directory: str | Path, *, every: int | None = None, keep: int | None = None,
                 async_save: bool = False):
        for name, value in (("every", every), ("keep", keep)):
            if value is not None and value < 1:
                raise PlanError(f"CheckpointManager: {name} must be at least 1 (or None), got {value}")
        self.directory = Path(directory)
        self.every, self.keep, self.async_save = every, keep, async_save
        self.group = dist.new_group(backend="gloo") if dist.is_initialized() else None
        self.pending: SaveHandle | None = None

    def latest(self) -> Path | None:
        """The latest complete checkpoint (torn ``.partial`` folders ignored), as the coordinator sees it."""
        found = [latest_complete(self.directory) if dist.get_rank(self.group) == 0 else None] \
            if self.group is not None else [latest_complete(self.directory)]
        if self.group is not None:
            dist.broadcast_object_list(found, group_src=0, group=self.group)
        return found[0]

    def due(self, step: int) -> bool:
        """Does :meth:`save` save at ``step``?"""
        return self.every is not None and step % self.every == 0

    def save(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
             extra: dict | None = None, data: DataState | None = None, force: bool = False) -> SaveHandle | None:
        """Save ``step`` when it is due (or ``force``): :func:`meshplan.save` into ``step-<step>/``.

        Returns:
            The save's handle, or None when not due.
        """
        if not (force or self.due(step)):
            return None
        self.wait()
        handle = save(step_dir(self.directory, step), model, optimizer, step=step, extra=extra, data=data,
                      async_save=self.async_save, process_group=self.group, on_commit=self._prune)
        self.pending = handle if self.async_save else None
        return handle

    def _prune(self) -> None:
        prune(self.directory, self.keep)

    def wait(self) -> None:
        """Block until the save in flight (if any) is complete."""
        pending, self.pending = self.pending, None
        if pending is not None:
            pending.wait()

    def load_latest(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
                    data: DataState | None = None, allow_batch_change: bool = False) -> Saved | None:
        """:func:`meshplan.load` the latest complete checkpoint; None when there is none (a fresh run)."""
        path = self.latest()
        if path is None:
            return None
        return load(path, model, optimizer, data=data, allow_batch_change=allow_batch_change,
                    process_group=self.group)

    def close(self) -> None:
        """Wait for the save in flight, then release the process group."""
        self.wait()
        if self.group is not None:
            dist.destroy_process_group(self.group)
            self.group = None

    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
