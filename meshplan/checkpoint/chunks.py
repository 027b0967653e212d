"""Every tensor of a checkpoint as the boxes of its global tensor this rank holds, so DCP writes and reads each
element where it belongs, whatever the layout.

``torch.distributed.checkpoint`` describes a DTensor shard as ONE box of the global tensor: its local shape at the
global offset of its first element. meshplan holds some shards that are not one box: a packed fused projection
(``_StridedShard(dim, split_factor=k)``, :mod:`meshplan.tensor_parallel.packed`) holds its slice of each of the
``k`` parts, an expert's ``gate|up`` weight split over etp likewise. DCP would write such a shard as if its rows were
contiguous: a checkpoint that loads without error into the wrong rows. :class:`Boxes` presents these shards to DCP
as several boxes (views of the local tensor, one per contiguous run) and :class:`BoxSavePlanner` /
:class:`BoxLoadPlanner` hand DCP the right view for each; a shard that is one box (``Shard``, FSDP2's
``_StridedShard`` over a tp/ep ``Shard`` of the same dim) stays a DTensor, which DCP handles itself. The rows each
rank holds come from :func:`meshplan.weights.shards.local_slices`, the same function that loads full checkpoints.
"""

from __future__ import annotations

import itertools
from typing import Any, Mapping

import torch
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.tensor import DTensor

from meshplan._torch import compute_local_shape_and_global_offset, local_tensor
from meshplan.checkpoint.safe_read import SafeLoadPlanner
from meshplan.weights.shards import local_slices

__all__ = ["Boxes", "boxes_of", "as_boxes", "BoxSavePlanner", "BoxLoadPlanner"]

Box = tuple[tuple[int, ...], tuple[int, ...], torch.Tensor]  # (global offsets, sizes, view of the local tensor)


class Boxes:
    """This rank's part of one global tensor as boxes (global offsets, sizes, a view of the local shard).

    Implements the three methods DCP asks a checkpointable object for (``__create_write_items__`` when saving,
    ``__create_chunk_list__`` when loading, ``__get_tensor_shard__`` for the tensor of one box).

    Attributes:
        shape: the global shape; ``boxes``: ``[(offsets, sizes, view), …]``; ``dtype``: the shard's dtype.
    """

    def __init__(self, shape: tuple[int, ...], boxes: list[Box], dtype: torch.dtype):
        self.shape = torch.Size(shape)
        self.boxes = boxes
        self.dtype = dtype

    def size(self) -> torch.Size:
        return self.shape

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        props = TensorProperties(dtype=self.dtype)
        return [WriteItem(index=MetadataIndex(fqn, off), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(torch.Size(off), torch.Size(size)),
                                                      properties=props, size=self.shape))
                for off, size, _ in self.boxes]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(torch.Size(off), torch.Size(size)) for off, size, _ in self.boxes]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        for off, _, view in self.boxes:
            if tuple(off) == tuple(index.offset):
                return view
        raise ValueError(f"{index.fqn}: this rank holds no box at offset {tuple(index.offset)}")

    def __repr__(self) -> str:
        return f"Boxes(shape={tuple(self.shape)}, boxes={[(o, s) for o, s, _ in self.boxes]})"


def boxes_of(t: DTensor) -> list[Box]:
    """The boxes of the global tensor ``t``'s local shard holds: one per combination of contiguous runs.

    Boxes of no element are left out (uneven shards).
    """
    ranges = local_slices(tuple(t.shape), t.placements, t.device_mesh)
    local = local_tensor(t)
    per_dim = []
    for runs in ranges:
        starts = itertools.accumulate([0] + [b - a for a, b in runs])
        per_dim.append([(a, b - a, lo) for (a, b), lo in zip(runs, starts)])
    out = []
    for combo in itertools.product(*per_dim):
        if any(n == 0 for _, n, _ in combo):
            continue
        view = local
        for d, (_, n, lo) in enumerate(combo):
            view = view.narrow(d, lo, n)
        out.append((tuple(a for a, _, _ in combo), tuple(n for _, n, _ in combo), view))
    return out


def _dcp_describes(t: DTensor, boxes: list[Box]) -> bool:
    """Does DCP's own one-box description of ``t``'s shard say what ``boxes`` say?"""
    sizes, offsets = compute_local_shape_and_global_offset(tuple(t.shape), t.device_mesh, t.placements)
    if not boxes:
        return 0 in tuple(sizes)
    return len(boxes) == 1 and tuple(boxes[0][0]) == tuple(offsets) and tuple(boxes[0][1]) == tuple(sizes)


def as_boxes(state: Mapping[str, Any], max_box_bytes: int | None = None) -> dict[str, Any]:
    """The flat ``state`` with each DTensor whose shard DCP would misplace replaced by its :class:`Boxes` (views:
    loading into them fills the DTensor); other values kept.

    Args:
        max_box_bytes: when saving, boxes (and plain tensors) larger than this are cut into boxes of whole rows of
            at most this size (:func:`_rows`): DCP reads a saved box whole (``torch.load`` of its blob) before it
            narrows it to what a rank asks for, so a rank loading a 1/n slice of a tensor saved whole would read
            (and hold for a moment) all of it; cut, it reads at most one box beyond its slice.
    """
    out: dict[str, Any] = {}
    for k, v in state.items():
        if isinstance(v, DTensor) and v.device_mesh.get_coordinate() is not None:
            boxes = boxes_of(v)
            cut = _rows(boxes, max_box_bytes, v.element_size())
            out[k] = v if cut is boxes and _dcp_describes(v, boxes) else Boxes(tuple(v.shape), cut, v.dtype)
        elif isinstance(v, torch.Tensor) and not isinstance(v, DTensor) and v.dim() > 0:
            whole = [((0,) * v.dim(), tuple(v.shape), v)]
            cut = _rows(whole, max_box_bytes, v.element_size())
            out[k] = v if cut is whole else Boxes(tuple(v.shape), cut, v.dtype)
        else:
            out[k] = v
    return out


def _rows(boxes: list[Box], max_bytes: int | None, item: int) -> list[Box]:
    """``boxes`` with each box over ``max_bytes`` cut along dim 0 into boxes of whole rows (``boxes`` itself when
    none is)."""
    if max_bytes is None or all(view.numel() * item <= max_bytes for _, _, view in boxes):
        return boxes
    out = []
    for off, size, view in boxes:
        row = max(1, view[0].numel() * item)
        step = max(1, max_bytes // row)
        for lo in range(0, size[0], step):
            n = min(step, size[0] - lo)
            out.append(((off[0] + lo, *off[1:]), (n, *size[1:]), view.narrow(0, lo, n)))
    return out


def _lookup(state: Mapping[str, Any], index: MetadataIndex) -> torch.Tensor | None:
    obj = state.get(index.fqn)
    return obj.__get_tensor_shard__(index) if isinstance(obj, Boxes) else None


class BoxSavePlanner(DefaultSavePlanner):
    """DCP's default save planner, handing out the view of each :class:`Boxes` box it writes."""

    def lookup_object(self, index: MetadataIndex) -> Any:
        found = _lookup(self.state_dict, index)
        return found if found is not None else super().lookup_object(index)


class BoxLoadPlanner(SafeLoadPlanner):
    """DCP's default load planner (non-tensor entries read restricted: :class:`SafeLoadPlanner`), handing out the
    view of each :class:`Boxes` box it fills.

    Takes a flat state dict (DCP's set-up replaces values it does not know by None: the boxes are set aside
    while it runs).
    """

    def set_up_planner(self, state_dict: dict[str, Any], metadata: Any = None, is_coordinator: bool = False) -> None:
        held = {k: v for k, v in state_dict.items() if isinstance(v, Boxes)}
        state_dict.update(dict.fromkeys(held, 0))
        super().set_up_planner(state_dict, metadata, is_coordinator)
        for d in (state_dict, self.state_dict, self.original_state_dict):
            d.update(held)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        found = _lookup(self.state_dict, index)
        return found if found is not None else super().lookup_tensor(index)
