"""Full, unsharded safetensors files of a parallelized model (or of a checkpoint), loadable without meshplan.

:func:`export_safetensors` writes the model's shards with :func:`meshplan.save` (so every layout meshplan makes,
the ones DCP cannot describe included, lands in the right rows: :mod:`meshplan.checkpoint.chunks`), then
:func:`checkpoint_to_safetensors` turns that folder into ``model.safetensors`` (or ``model-0000i-of-0000n``
files and ``model.safetensors.index.json``, transformers' sharded layout), each rank writing its share of the files
and holding one file's tensors at a time. The names are the model's own: a transformers model keeps
transformers' names (meshplan never renames a parameter), so ``from_pretrained`` reads the folder, and a plain
model's ``load_state_dict(safetensors.torch.load_file(...))`` too. Tied parameters are written under every name.
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

from meshplan.checkpoint.safe_read import SafeLoadPlanner, dcp_load, read_metadata
from meshplan.checkpoint.save import group_rank, save
from meshplan.checkpoint.state import MODEL
from meshplan.errors import PlanError

__all__ = ["export_safetensors", "checkpoint_to_safetensors", "pack_files", "INDEX"]

#: transformers' name for the index of a sharded safetensors checkpoint
INDEX = "model.safetensors.index.json"
_DEFAULT_SHARD = 5 * 2 ** 30  # transformers' default max_shard_size


def pack_files(sizes: list[tuple[str, int]], max_bytes: int) -> list[list[str]]:
    """Keys in order, cut into files of at most ``max_bytes`` (a bigger tensor gets a file of its own).

    Example::

        >>> pack_files([("a", 4), ("b", 4), ("c", 9), ("d", 1)], 8)
        [['a', 'b'], ['c'], ['d']]
    """
    files: list[list[str]] = []
    used = 0
    for key, n in sizes:
        if not files or used + n > max_bytes:
            files.append([])
            used = 0
        files[-1].append(key)
        used += n
    return files


def _file_names(n: int) -> list[str]:
    return ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]


def checkpoint_to_safetensors(checkpoint: str | Path, out: str | Path, *, max_shard_bytes: int = _DEFAULT_SHARD,
                              rank: int = 0, world_size: int = 1) -> list[Path]:
    """The model entries of a :func:`meshplan.save` folder as full safetensors files (no model, no process group).

    Args:
        checkpoint: a checkpoint folder (any plan saved it).
        out: the output folder.
        max_shard_bytes: bytes per file at most (one tensor larger than it gets a file of its own).
        rank, world_size: this process writes files ``rank, rank + world_size, …``; rank 0 writes the index.

    Returns:
        The files this process wrote.

    Raises:
        PlanError: the folder holds no model entries.
    """
    checkpoint, out = Path(checkpoint), Path(out)
    entries = {k[len(MODEL):]: md for k, md in read_metadata(checkpoint).state_dict_metadata.items()
               if k.startswith(MODEL) and hasattr(md, "size")}  # tensors (non-tensor extra states are left out)
    if not entries:
        raise PlanError(f"{checkpoint}: no model tensors in this checkpoint")
    sizes = [(k, md.properties.dtype.itemsize * int(torch.Size(md.size).numel())) for k, md in entries.items()]
    files = pack_files(sizes, max_shard_bytes)
    names = _file_names(len(files))
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # a file of that name, no permission
        raise PlanError(f"{out}: cannot create the output folder: {e.strerror or e}") from None
    from safetensors.torch import save_file
    written = []
    for i in range(rank, len(files), world_size):
        tensors = {k: torch.empty(tuple(entries[k].size), dtype=entries[k].properties.dtype) for k in files[i]}
        dcp_load({MODEL + k: t for k, t in tensors.items()}, checkpoint, SafeLoadPlanner(), no_dist=True)
        save_file(tensors, str(out / names[i]), metadata={"format": "pt"})
        written.append(out / names[i])
    if rank == 0 and len(files) > 1:
        weight_map = {k: name for keys, name in zip(files, names) for k in keys}
        index = {"metadata": {"total_size": sum(n for _, n in sizes)}, "weight_map": weight_map}
        (out / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True))
    return written


def _save_config(model: nn.Module, out: Path) -> None:
    """A transformers model's ``config.json`` (and generation config), so ``from_pretrained`` reads the folder."""
    for name in ("config", "generation_config"):
        cfg = getattr(model, name, None)
        if cfg is not None and hasattr(cfg, "save_pretrained"):
            cfg.save_pretrained(str(out))


def export_safetensors(model: nn.Module, path: str | Path, *, max_shard_bytes: int = _DEFAULT_SHARD,
                       process_group: Any = None) -> Path:
    """Write ``model``'s full state dict as safetensors in the folder ``path``: usable without meshplan.

    Every rank calls it. Files of an earlier export in ``path`` (``model*.safetensors``, the index) are replaced.
    Each rank writes its shards once (a temporary :func:`meshplan.save` in
    ``path/.meshplan-shards``), then its share of the output files, each holding one file's full tensors at a
    time; the temporary folder is removed. A transformers model also gets its ``config.json``, so
    ``AutoModelForCausalLM.from_pretrained(path)`` loads it; any model's ``load_state_dict`` takes
    ``safetensors.torch.load_file(path / "model.safetensors")`` (or every file of the index).

    Args:
        model: parallelized under any plan (pipeline stages, FSDP2, tp/ep/etp, packed projections) or plain.
        path: the output folder.
        max_shard_bytes: bytes per file at most; more: ``model-0000i-of-0000n.safetensors`` + the index.
        process_group: the group the ranks coordinate over (default: the default group).

    Returns:
        ``path``.

    Example::

        >>> meshplan.export_safetensors(model, "out/llama")   # then, anywhere: model.load_state_dict(load_file(...))
    """
    path = Path(path)
    tmp = path / ".meshplan-shards"
    if group_rank(process_group) == 0 and path.is_dir():  # an earlier export's files (save() then syncs the ranks)
        for old in [*path.glob("model*.safetensors"), path / INDEX]:
            old.unlink(missing_ok=True)
    save(tmp, model, step=0, process_group=process_group)
    on = dist.is_initialized()
    world = dist.get_world_size(process_group) if on else 1
    checkpoint_to_safetensors(tmp, path, max_shard_bytes=max_shard_bytes, rank=group_rank(process_group),
                              world_size=world)
    if on:
        dist.barrier(group=process_group)
    if group_rank(process_group) == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        _save_config(model, path)
    if on:
        dist.barrier(group=process_group)
    return path
