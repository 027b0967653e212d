"""The checkpoint folder on disk: step folders, atomic completion, the latest complete one, keep-last-K. Torch-free.

A checkpoint directory holds one folder per saved step::

    ckpt/step-00000040/          complete: DCP's shards and .metadata, then meshplan.json
    ckpt/step-00000060.partial/  being written (or torn: a rank died mid-save)

Every rank writes into ``step-N.partial``; when DCP has every rank's shards and has written ``.metadata``, the
coordinator writes ``meshplan.json`` (the manifest, fsynced) and renames the folder to ``step-N`` (one
``rename``: atomic on POSIX file systems). So a folder named ``step-N`` is complete, and a crash at any moment
leaves at worst a ``.partial`` folder, which discovery ignores and the next commit removes. A folder counts as
complete only with both files and a manifest naming its own step (a copy edited by hand, or a file system that
renamed without the files, is skipped, not trusted).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

__all__ = ["MANIFEST", "DCP_METADATA", "PARTIAL", "step_dir", "partial_dir", "step_of", "complete_steps",
           "latest_complete", "outside_last", "commit", "prune", "write_json_durably", "is_complete"]

#: the manifest meshplan writes last into a checkpoint folder (step, data position, layout, …)
MANIFEST = "meshplan.json"
#: the file DCP's coordinator writes once every rank's shards are written
DCP_METADATA = ".metadata"
#: suffix of a folder being written
PARTIAL = ".partial"
_STEP = re.compile(r"^step-(\d+)$")


def step_dir(root: str | Path, step: int) -> Path:
    """``root/step-00000040``: the folder of step ``step`` (8 digits, so names sort like steps)."""
    return Path(root) / f"step-{step:08d}"


def partial_dir(final: str | Path) -> Path:
    """The folder a checkpoint is written in before it is renamed to ``final``."""
    final = Path(final)
    return final.with_name(final.name + PARTIAL)


def step_of(path: str | Path) -> int | None:
    """The step of a ``step-N`` folder name, else None."""
    m = _STEP.match(Path(path).name)
    return int(m.group(1)) if m else None


def is_complete(path: str | Path) -> bool:
    """Has ``path`` DCP's metadata and a readable manifest (whose ``step`` matches a ``step-N`` name)?"""
    path = Path(path)
    if not (path.is_dir() and (path / DCP_METADATA).is_file() and (path / MANIFEST).is_file()):
        return False
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    named = step_of(path)
    return isinstance(manifest, dict) and (named is None or manifest.get("step") == named)


def complete_steps(root: str | Path) -> list[tuple[int, Path]]:
    """``[(step, folder), …]`` of the complete checkpoints under ``root``, oldest first (none: ``[]``)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(step_of(p), p) for p in root.iterdir() if step_of(p) is not None]
    return sorted((s, p) for s, p in found if is_complete(p))


def latest_complete(root: str | Path) -> Path | None:
    """The complete checkpoint of the highest step under ``root``; torn (``.partial``) folders are ignored."""
    steps = complete_steps(root)
    return steps[-1][1] if steps else None


def outside_last(steps: list[int], keep: int | None) -> list[int]:
    """The steps that keep-last-``keep`` deletes: all but the ``keep`` highest (``None`` or 0: keep all).

    Example::

        >>> outside_last([10, 20, 30, 40], 2)
        [10, 20]
    """
    if not keep:
        return []
    return sorted(steps)[:-keep] if len(steps) > keep else []


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # a file system without directory handles
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_json_durably(path: str | Path, data: dict) -> None:
    """Write ``data`` to ``path`` through a temporary file, fsynced, then renamed over it."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def commit(partial: str | Path, final: str | Path) -> None:
    """Rename the written ``partial`` folder to ``final`` (replacing an older ``final`` of the same step).

    The old folder is moved aside first and deleted after the rename, so at every moment the step either has
    its old complete folder, or none, or the new one.
    """
    partial, final = Path(partial), Path(final)
    old = final.with_name(final.name + ".replaced")
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(partial, final)
    _fsync_dir(final.parent)
    shutil.rmtree(old, ignore_errors=True)


def prune(root: str | Path, keep: int | None) -> list[Path]:
    """Delete the complete checkpoints outside the last ``keep`` and every leftover folder (torn ``.partial``
    or ``.replaced``) of a step below the newest complete one. Returns what was deleted."""
    root = Path(root)
    steps = complete_steps(root)
    if not steps:
        return []
    doomed = set(outside_last([s for s, _ in steps], keep))
    gone = [p for s, p in steps if s in doomed]
    newest = steps[-1][0]
    for p in root.iterdir():
        base, dot, suffix = p.name.partition(".")
        step = step_of(base)
        if dot and step is not None and step < newest and suffix in ("partial", "replaced"):
            gone.append(p)
    for p in gone:
        shutil.rmtree(p, ignore_errors=True)
    return gone
