"""Reading a checkpoint folder without running its code: DCP's ``.metadata`` through a restricted unpickler.

torch's ``FileSystemReader.read_metadata`` reads ``.metadata`` with ``pickle.load``, and DCP's default load planner
reads non-tensor entries with ``torch.load(weights_only=False)``: a crafted checkpoint folder runs any code it
names (``os.system``) in ``meshplan export``, ``meshplan checkpoints`` or ``meshplan.load``. meshplan reads the
metadata with :class:`MetadataUnpickler`, which resolves only the classes DCP's metadata is made of
(:data:`PUBLIC_GLOBALS`, torch's dtypes, layouts and memory formats, and
:data:`meshplan._torch.CHECKPOINT_PRIVATE_GLOBALS`), and non-tensor entries (optimizer hyperparameters) with
``torch.load(weights_only=True)``; tensor data DCP already reads with ``weights_only=True``. Anything else is one
:class:`~meshplan.errors.PlanError` naming the file (docs/security.md).
"""

from __future__ import annotations

import io
import pickle
import re
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, Metadata, MetadataIndex, StorageMeta,
                                                   TensorStorageMetadata)

from meshplan._torch import CHECKPOINT_PRIVATE_GLOBALS
from meshplan.checkpoint.directory import DCP_METADATA
from meshplan.errors import PlanError

__all__ = ["read_metadata", "SafeReader", "SafeLoadPlanner", "MetadataUnpickler", "PUBLIC_GLOBALS", "dcp_load"]

_MD = "torch.distributed.checkpoint.metadata"
#: the public classes a DCP ``.metadata`` pickle names (besides torch's dtypes, layouts and memory formats)
PUBLIC_GLOBALS = frozenset({
    *((_MD, n) for n in ("Metadata", "MetadataIndex", "ChunkStorageMetadata", "TensorProperties",
                         "TensorStorageMetadata", "BytesStorageMetadata", "StorageMeta")),
    ("torch", "Size"), ("collections", "OrderedDict"),
    *(("pathlib", n) for n in ("Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath")),
})
_TORCH_VALUES = (torch.dtype, torch.layout, torch.memory_format)


class _Refused(pickle.UnpicklingError):
    """A global or persistent id checkpoint metadata never holds."""


class MetadataUnpickler(pickle.Unpickler):
    """An unpickler that resolves only DCP metadata's classes; any other global is refused before it is loaded."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in PUBLIC_GLOBALS or (module, name) in CHECKPOINT_PRIVATE_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), _TORCH_VALUES):
            return getattr(torch, name)
        shown = f"{module}.{name}"
        raise _Refused(f"it names {shown[:120]!r}, which checkpoint metadata never holds (loading it "
                                     f"could run code)")

    def persistent_load(self, pid: Any) -> Any:
        raise _Refused("it holds a persistent id, which checkpoint metadata never holds")


def read_metadata(folder: str | Path) -> Metadata:
    """The DCP metadata of the checkpoint ``folder``, unpickled by :class:`MetadataUnpickler` and checked.

    Raises:
        PlanError: ``folder/.metadata`` is missing or unreadable, names a global outside DCP's metadata classes,
            is not a pickle, or is not DCP ``Metadata`` (one line: the file and why).
    """
    path = Path(folder) / DCP_METADATA
    try:
        with open(path, "rb") as f:
            md = MetadataUnpickler(f).load()
    except OSError as e:
        raise PlanError(f"{path}: cannot read the checkpoint metadata: {e.strerror or e}") from None
    except _Refused as e:
        raise PlanError(f"{path}: refused: {' '.join(str(e).split())[:300]}") from None
    except Exception as e:  # noqa: BLE001 - any bytes: EOFError, ValueError, KeyError, RecursionError, …
        why = " ".join(f"{type(e).__name__}: {e}".split())[:200]
        raise PlanError(f"{path}: not DCP checkpoint metadata ({why})") from None
    entries = getattr(md, "state_dict_metadata", None) if isinstance(md, Metadata) else None
    if not isinstance(entries, dict) or not all(
            isinstance(k, str) and isinstance(v, (TensorStorageMetadata, BytesStorageMetadata))
            for k, v in entries.items()):
        raise PlanError(f"{path}: not DCP checkpoint metadata: expected a Metadata whose state_dict_metadata maps "
                        f"names to tensor or bytes entries, got {type(md).__name__}")
    for key, v in entries.items():
        if isinstance(v, TensorStorageMetadata) and not _tensor_ok(v):
            raise PlanError(f"{path}: entry {key[:120]!r}: not a tensor description (size {str(v.size)[:80]}, "
                            f"dtype {str(getattr(v.properties, 'dtype', None))[:40]})")
    _check_complete(md, path)
    return md


def _check_complete(md: Metadata, path: Path) -> None:
    """Every shard the metadata describes is in a data file: a checkpoint written by fewer ranks than it was
    planned for (a rank died, or a process group of ranks that never write) is refused naming the first missing
    shard, instead of a KeyError deep in DCP's reader."""
    stored = md.storage_data
    if not isinstance(stored, dict):
        raise PlanError(f"{path}: not DCP checkpoint metadata: storage_data is {type(stored).__name__}, "
                        f"expected a mapping of shards to data files")
    for key, v in md.state_dict_metadata.items():
        offsets = [c.offsets for c in v.chunks] if isinstance(v, TensorStorageMetadata) else [None]
        for off in offsets:
            if MetadataIndex(key, off) not in stored:
                at = f" at offset {tuple(off)}" if off is not None else ""
                raise PlanError(f"{path}: entry {key[:120]!r}: its shard{at} is in no data file (an incomplete "
                                f"checkpoint: a rank did not write its part); found {len(stored)} stored shards")


def _tensor_ok(v: TensorStorageMetadata) -> bool:
    size = v.size
    return (isinstance(size, torch.Size) and all(isinstance(n, int) and n >= 0 for n in size)
            and isinstance(getattr(v.properties, "dtype", None), torch.dtype) and isinstance(v.chunks, list))


class SafeReader(FileSystemReader):
    """DCP's file-system reader with :func:`read_metadata` (the restricted unpickler) for its metadata.

    Only the global ``.metadata`` meshplan writes is read (no per-rank metadata fallback: the method takes no
    ``rank``, so DCP does not try one).
    """

    def read_metadata(self) -> Metadata:  # type: ignore[override]
        md = read_metadata(self.path)
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, reading non-tensor entries with ``torch.load(weights_only=True)``.

    The entry is loaded restricted first, then handed to DCP's own placement as a pickle of what that load
    built (plain data only), so DCP's flattening is untouched and its unrestricted ``torch.load`` sees no
    crafted bytes.
    """

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        try:
            loaded = torch.load(value, weights_only=True)
        except Exception as e:  # noqa: BLE001 - weights_only's refusal (UnpicklingError) or garbage bytes
            named = re.search(r"Unsupported global: GLOBAL (\S+)", str(e))
            why = f"it names {named.group(1)[:120]!r}" if named else " ".join(str(e).split())[:200]
            raise PlanError(f"checkpoint entry {read_item.dest_index.fqn[:120]!r}: refused, not plain data ({why}; "
                            f"loading it could run code)") from None
        clean = io.BytesIO()
        torch.save(loaded, clean)
        clean.seek(0)
        super().load_bytes(read_item, clean)


def dcp_load(state: dict[str, Any], folder: str | Path, planner: DefaultLoadPlanner, **kwargs: Any) -> None:
    """``dcp.load`` of ``folder`` through :class:`SafeReader` and ``planner``; a :class:`PlanError` raised inside
    (a refused entry) comes out as itself, not wrapped in DCP's multi-line ``CheckpointException``."""
    try:
        dcp.load(state, storage_reader=SafeReader(folder), planner=planner, **kwargs)
    except dcp.CheckpointException as e:
        found = [exc for exc, _ in e.failures.values() if isinstance(exc, PlanError)]
        if found:
            raise PlanError(f"{folder}: {found[0]}") from None
        raise
