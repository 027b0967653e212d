"""Load a full (unsharded) checkpoint into a parallelized model without materializing it on one rank.

:func:`load_state_dict` fills the shards from a full state dict without ever
holding more than one full tensor: from a safetensors file (every rank reads
only its slices with ``safe_open(...).get_slice``) or from a dict on one rank
(broadcast tensor by tensor; the other ranks pass ``None``). A model still on
the meta device is allocated first and its non-persistent buffers (RoPE
tables, …) computed by its own initializer.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any, Mapping

import torch
import torch.nn as nn

from meshplan.checkpoint.fit import misfit
from meshplan.errors import PlanError
from meshplan.weights.materialize import _device, _init_buffers, _local, _store, _to_empty, whole_of
from meshplan.weights.shards import local_slices, take_slices

__all__ = ["load_state_dict", "load_full_state_dict", "load_safetensors"]

def _sources(src: str | Path) -> dict[str, Path]:
    p = Path(src)
    if p.is_dir():
        idx = p / "model.safetensors.index.json"
        p = idx if idx.is_file() else p / "model.safetensors"
    if p.name.endswith(".index.json"):
        weight_map = json.loads(p.read_text())["weight_map"]
        return {k: p.parent / v for k, v in weight_map.items()}
    if not p.is_file():
        raise PlanError(f"{src}: no safetensors checkpoint (a .safetensors file, an index.json or a directory)")
    from safetensors import safe_open
    with safe_open(str(p), "pt") as f:
        return {k: p for k in f.keys()}


def _header(state: Mapping[str, torch.Tensor], targets: dict[str, torch.Tensor], others: set[str],
            strict: bool, complete: bool) -> dict | str:
    """``{key: (shape, dtype)}`` of a full dict, or what makes it unfit for ``targets`` (the text of the error)."""
    head = {k: (tuple(v.shape), v.dtype) for k, v in state.items()}
    bad = _verdict(head, targets, others, strict, complete)
    return "; ".join(bad) if bad else head


def _verdict(head: Mapping[str, tuple[tuple[int, ...], Any]], targets: Mapping[str, torch.Tensor], others: set[str],
             strict: bool, complete: bool) -> list[str]:
    """What makes a checkpoint of ``head`` (``{key: (shape, dtype)}``: a file's header, a dict's tensors) unfit
    for ``targets`` (the model's tensors, every stage's for a meta model; ``others``: other stages' keys): shapes,
    dtypes that cannot be cast, (``complete``) tensors none of whose names it holds, (``strict``) keys no rank's
    model has.
    Tied parameters count once. Reads no tensor data.
    """
    bad = [m for k, t in targets.items() if k in head
           for m in [misfit(k, head[k][0], head[k][1], t.shape, t.dtype)] if m is not None]
    names: dict[int, list[str]] = {}
    for k, t in targets.items():
        names.setdefault(id(t), []).append(k)
    missing = [ks[0] for ks in names.values() if not any(k in head for k in ks)]
    if complete and missing:
        why = "" if strict else " (the model is on the meta device: they would stay uninitialized memory)"
        bad.append(f"missing keys {missing[:8]}{' …' if len(missing) > 8 else ''}{why}")
    if strict:
        unexpected = sorted(set(head) - set(targets) - others)
        if unexpected:
            bad.append(f"unexpected keys {unexpected[:8]}{' …' if len(unexpected) > 8 else ''}")
    return bad


def load_state_dict(model: nn.Module, source: str | Path | Mapping[str, torch.Tensor] | None, *, device=None,
                    src_rank: int = 0, strict: bool = True) -> nn.Module:
    """Load a full (unsharded) state dict into a parallelized model, shard by shard.

    Args:
        model: parallelized; on the meta device (its shards are allocated here and its
            non-persistent buffers computed by its initializer on meta parameters) or materialized.
        source: a ``.safetensors`` file, a ``*.safetensors.index.json`` or a directory holding
            either: every rank reads only its own slices. Or a ``{name: full tensor}`` dict on
            rank ``src_rank`` (``None`` on the others), broadcast one tensor at a time.
        device: where the shards live. Default: the tp mesh's device type.
        src_rank: the global rank holding the dict.
        strict: missing or unexpected keys are an error (tied parameters count once). A model on the meta
            device refuses missing keys whatever ``strict`` says (their memory would stay uninitialized).

    Returns:
        ``model``.

    Raises:
        PlanError: missing/unexpected keys (``strict``), a shape mismatch or a dtype that cannot be cast, on every
            rank, from the files' headers (or rank ``src_rank``'s dict) before anything is allocated or written.
    """
    dev = _device(model, device)
    targets = model.state_dict(keep_vars=True)
    others = _other_stages(model, targets)
    meta = any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    shapes = targets
    if meta:  # every stage's shapes: each rank refuses what any rank would, before allocating
        with whole_of(model, "load_state_dict", "materialized models"):
            shapes = model.state_dict(keep_vars=True)
    if isinstance(source, (str, Path)):  # headers only: refused before anything is allocated or written
        _check_files(model, source, shapes, others, strict, strict or meta)
    else:
        head = _exchange_header(source, shapes, others, strict, strict or meta, src_rank)
    if meta:
        _to_empty(model, dev)
        with whole_of(model, "load_state_dict", "materialized models"):
            _init_buffers(model, dev)
        targets = model.state_dict(keep_vars=True)
    loaded: set[int] = set()
    if isinstance(source, (str, Path)):
        keys = _load_files(model, source, targets, loaded)
    else:
        keys = _load_broadcast(source, head, targets, others, src_rank, dev, loaded)
    missing = [k for k, t in targets.items() if id(t) not in loaded]
    unexpected = sorted(keys - set(targets) - others)
    if strict and (missing or unexpected):
        raise PlanError(f"load_state_dict: missing keys {missing[:8]}{' …' if len(missing) > 8 else ''}; unexpected "
                        f"keys {unexpected[:8]}{' …' if len(unexpected) > 8 else ''}")
    return model


def _load_files(model: nn.Module, source: str | Path, targets: dict[str, torch.Tensor], loaded: set[int]) -> set[str]:
    """Every rank reads its slices of each target from safetensors files (transformers' stacked experts from
    their per-expert tensors: :mod:`meshplan.hf.checkpoint_keys`).

    Returns:
        The checkpoint's keys, those read through a conversion counted under the parameter's name.
    """
    from safetensors import safe_open
    from meshplan.hf.checkpoint_keys import converted_sources
    files = _sources(source)
    handles: dict[Path, Any] = {}

    def open_slice(k: str) -> Any:
        if files[k] not in handles:
            handles[files[k]] = safe_open(str(files[k]), "pt", device="cpu").__enter__()
        return handles[files[k]].get_slice(k)

    def close() -> None:
        for h in handles.values():
            h.__exit__(None, None, None)
        handles.clear()

    readers = {k: (lambda k=k: open_slice(k)) for k in files}
    missing = {k for k in targets if k not in files}
    converted, consumed = converted_sources(model, list(files), missing, open_slice) if missing else ({}, set())
    readers.update(converted)
    for k, t in targets.items():
        if id(t) in loaded or k not in readers:
            continue
        # the files are closed after each tensor: a mapped file's pages this rank touched count in its RSS
        # until it is unmapped (a dim-1 slice touches every page of the tensor: the whole checkpoint by the end)
        with contextlib.ExitStack() as stack:
            stack.callback(close)
            sl = readers[k]()
            if tuple(sl.get_shape()) != tuple(t.shape):
                raise PlanError(f"{files.get(k, source)}: {k}: checkpoint shape {tuple(sl.get_shape())}, model "
                                f"{tuple(t.shape)}")
            full_ranges = [[(0, n)] for n in t.shape]
            ranges = local_slices(tuple(t.shape), t.placements, t.device_mesh) if hasattr(t, "placements") \
                else full_ranges
            with torch.no_grad():
                _local(t).copy_(take_slices(lambda s: sl[s], ranges).to(t.dtype))
            loaded.add(id(t))
    return (set(files) - consumed) | set(converted)


def load_full_state_dict(model: nn.Module, state_dict: Mapping[str, torch.Tensor] | None, *, src_rank: int = 0,
                         device=None, strict: bool = True) -> nn.Module:
    """:func:`load_state_dict` from a full dict held by rank ``src_rank`` (``None`` elsewhere)."""
    return load_state_dict(model, state_dict, src_rank=src_rank, device=device, strict=strict)


def load_safetensors(model: nn.Module, path: str | Path, *, device=None, strict: bool = True) -> nn.Module:
    """:func:`load_state_dict` from safetensors: every rank reads only its slices."""
    return load_state_dict(model, path, device=device, strict=strict)


def _other_stages(model: nn.Module, targets: Mapping[str, torch.Tensor]) -> set[str]:
    """Keys of the full model that other pipeline stages hold (expected in a full checkpoint, not loaded here).

    """
    from meshplan.axes import held_part
    from meshplan.state import parallel_state
    part = held_part(parallel_state(model))  # the axes' records: which part of the model this rank holds
    return set() if part is None else set(part[1]) - set(targets)


def _headers(model: nn.Module, source: str | Path, shapes: Mapping[str, torch.Tensor]
             ) -> tuple[dict[str, tuple[tuple[int, ...], str]], dict[str, Path]]:
    """Every checkpoint tensor's ``(shape, safetensors dtype)`` from the files' headers, transformers' per-expert
    tensors under the stacked parameter's name (their keys dropped), and which file each key came from."""
    from safetensors import safe_open
    from meshplan.hf.checkpoint_keys import converted_sources
    files = _sources(source)
    with contextlib.ExitStack() as stack:
        handles = {p: stack.enter_context(safe_open(str(p), "pt", device="cpu")) for p in sorted(set(files.values()))}

        def open_slice(k: str) -> Any:
            return handles[files[k]].get_slice(k)

        head = {k: (tuple(open_slice(k).get_shape()), open_slice(k).get_dtype()) for k in files}
        missing = {k for k in shapes if k not in files}
        converted, consumed = converted_sources(model, list(files), missing, open_slice) if missing else ({}, set())
        for k, read in converted.items():
            sl = read()
            head[k] = (tuple(sl.get_shape()), sl.get_dtype())
    return {k: v for k, v in head.items() if k not in consumed}, files


def _check_files(model: nn.Module, source: str | Path, shapes: Mapping[str, torch.Tensor], others: set[str],
                 strict: bool, complete: bool) -> None:
    """Refuse a safetensors checkpoint that does not fit the model, from the files' headers alone (nothing is
    allocated yet; a pipelined meta model's ``shapes`` cover every stage, so every rank refuses alike).

    Raises:
        PlanError: naming the first tensors that differ (file, key, checkpoint vs model shape or dtype), the
            missing and (``strict``) unexpected keys.
    """
    head, files = _headers(model, source, shapes)
    bad = [f"{files[b.split(': ')[0]]}: {b}" if b.split(": ")[0] in files else b
           for b in _verdict(head, shapes, others, strict, complete)]
    if bad:
        raise PlanError(f"load_safetensors({source}): {'; '.join(bad[:4])}"
                        f"{f' … ({len(bad)} problems)' if len(bad) > 4 else ''}; refused before "
                        f"allocating the model: save the checkpoint from a model of this config, or build the model "
                        f"with the checkpoint's config")


def _exchange_header(source: Mapping[str, torch.Tensor] | None, shapes: Mapping[str, torch.Tensor],
                     others: set[str], strict: bool, complete: bool, src_rank: int) -> dict:
    """Rank ``src_rank``'s ``{key: (shape, dtype)}``, checked there against ``shapes`` (a meta model's: every
    stage's) and sent to every rank, before anything is allocated.

    Raises:
        PlanError: a shape mismatch, a dtype that cannot be cast, (``strict``) missing or unexpected keys, on every
            rank.
    """
    import torch.distributed as dist
    head = [_header(source, shapes, others, strict, complete) if dist.get_rank() == src_rank else None]
    dist.broadcast_object_list(head, src=src_rank)
    if isinstance(head[0], str):
        raise PlanError(f"load_state_dict from rank {src_rank}: {head[0]}")
    return head[0]


def _load_broadcast(source: Mapping[str, torch.Tensor] | None, head: dict, targets: dict[str, torch.Tensor],
                    others: set[str], src_rank: int, dev: torch.device, loaded: set[int]) -> set[str]:
    """Broadcast rank ``src_rank``'s full tensors (``head``: their shapes and dtypes) one at a time, each rank
    storing its slices; every rank takes part in every broadcast of a key some rank holds (pipeline stages hold
    different keys).

    Returns:
        The checkpoint's keys.
    """
    import torch.distributed as dist
    mine = dist.get_rank() == src_rank
    for k, (shape, dtype) in head.items():
        t = targets.get(k)
        if t is None and k not in others:
            continue  # no rank holds it (unexpected: reported by the caller)
        full = source[k].to(device=dev, dtype=dtype) if mine else torch.empty(shape, dtype=dtype, device=dev)
        dist.broadcast(full, src=src_rank)
        if t is not None and id(t) not in loaded:
            _store(t, full.to(t.dtype))
            loaded.add(id(t))
    return set(head)
