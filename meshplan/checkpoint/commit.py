"""How one checkpoint reaches the disk: staged copies (asynchronous saves), DCP's file writer that completes the
folder atomically when DCP is done, and the handle of a save in flight.

DCP's coordinator calls its storage writer's ``finish`` once every rank has written its shards; that is the one
moment the checkpoint is whole. :class:`CommitWriter` writes DCP's ``.metadata`` there (torch's writer), then the
manifest, then renames ``step-N.partial`` to ``step-N`` (:func:`meshplan.checkpoint.directory.commit`), and runs
the caller's ``on_commit`` (keep-last-K). No rank returns from a save before that (DCP broadcasts the coordinator's
result), and an asynchronous save commits in its background thread, without the training loop.
"""

from __future__ import annotations

from concurrent.futures import Future
from pathlib import Path
from typing import Any, Callable

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.tensor import DTensor

from meshplan.checkpoint.chunks import Boxes
from meshplan.checkpoint.directory import MANIFEST, commit, write_json_durably

__all__ = ["CommitWriter", "stage", "Prestaged", "SaveHandle"]


class CommitWriter(FileSystemWriter):
    """DCP's file writer into ``partial`` whose ``finish`` (coordinator only, after every rank wrote) writes the
    manifest and renames ``partial`` to ``final``.

    Args:
        partial: the folder every rank writes into; ``final``: its name once complete.
        manifest: the JSON written last (``meshplan.json``).
        on_commit: called after the rename (the coordinator's keep-last-K).
    """

    def __init__(self, partial: Path, final: Path, manifest: dict, on_commit: Callable[[], Any] | None = None):
        super().__init__(partial, sync_files=True)
        self.partial, self.final, self.manifest, self.on_commit = Path(partial), Path(final), manifest, on_commit

    def finish(self, metadata: Any, results: Any) -> None:
        super().finish(metadata, results)
        write_json_durably(self.partial / MANIFEST, self.manifest)
        commit(self.partial, self.final)
        if self.on_commit is not None:
            self.on_commit()


def _copy(v: Any) -> Any:
    if isinstance(v, DTensor):
        local = v.to_local().detach().to("cpu", copy=True)
        return DTensor.from_local(local, v.device_mesh, v.placements, run_check=False, shape=v.shape,
                                  stride=v.stride())
    if isinstance(v, Boxes):
        return Boxes(tuple(v.shape), [(o, s, t.detach().to("cpu", copy=True)) for o, s, t in v.boxes], v.dtype)
    if isinstance(v, torch.Tensor):
        return v.detach().to("cpu", copy=True)
    return v


def stage(state: dict[str, Any]) -> dict[str, Any]:
    """A CPU copy of a flat checkpoint state (what an asynchronous save writes while training goes on): each
    rank's shards only, plain values kept (the optimizer's hyperparameters are immutable numbers and tuples)."""
    return {k: _copy(v) for k, v in state.items()}


class Prestaged:
    """DCP's ``AsyncStager`` for a state :func:`stage` already copied: hands it over unchanged."""

    should_synchronize_after_execute = False

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        return state_dict

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass


class SaveHandle:
    """A save in flight (asynchronous) or done (synchronous).

    Attributes:
        path: the checkpoint's final folder; ``step``: its step.
    """

    def __init__(self, path: Path, step: int, future: Future | None = None,
                 cleanup: Callable[[], Any] | None = None):
        self.path, self.step = path, step
        self._future, self._cleanup = future, cleanup

    def done(self) -> bool:
        """Has the save finished (successfully or not)?"""
        return self._future is None or self._future.done()

    def wait(self) -> Path:
        """Block until the checkpoint is complete on every rank; return its folder.

        Raises:
            Exception: whatever the background save raised (the checkpoint then stays ``.partial``).
        """
        try:
            if self._future is not None:
                self._future.result()
        finally:
            self._future = None
            if self._cleanup is not None:
                self._cleanup()
                self._cleanup = None
        return self.path
