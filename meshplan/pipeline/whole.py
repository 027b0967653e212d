"""The full model's structure behind a pruned meta-device model (the unit's ``whole`` hook).

A model parallelized on the meta device keeps, in its pipeline record, the modules :func:`~.split.prune`
removed (other stages' blocks and end modules): meta modules, so they hold no storage. :func:`whole_model` puts
them back for the duration of a ``with`` block, in the full model's module order, so the model's own initializer
walks the one-device module sequence (``meshplan.materialize`` replays the one-device random stream: each
removed module's parameters are drawn into a transient full tensor and dropped) and computes the buffers
(``meshplan.load_state_dict`` on meta). A model pruned after it was built on the CPU keeps nothing: its removed
modules held real tensors, and keeping them would hold the whole model on every rank.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator

import torch.nn as nn

from meshplan._torch import module_parameters

__all__ = ["Removed", "removed_parts", "whole_model"]


@dataclass(frozen=True)
class Removed:
    """What pruning a meta-device model removed on this rank.

    Attributes:
        container: path of the block container (``""``: the model is the container).
        keys: every block key of the full model, in order.
        blocks: the other stages' blocks, by key (meta modules).
        ends: the other stages' end modules, by path (meta modules), each replaced by ``nn.Identity``.
        tied: ``(first stage's name, last stage's name)`` of parameters both ends share.
    """

    container: str
    keys: tuple[str, ...]
    blocks: dict[str, nn.Module]
    ends: dict[str, nn.Module]
    tied: tuple[tuple[str, str], ...]


def removed_parts(model: nn.Module, split, stages: list[int], tied: list[tuple[str, str]]) -> Removed | None:
    """Before :func:`~.split.prune`: the modules it removes, when ``model`` is on the meta device (else None)."""
    if not any(p.is_meta for p in model.parameters()):
        return None
    mine = {k for s in stages for k in split.keys[s]}
    holder = model.get_submodule(split.container) if split.container else model
    keys = tuple(k for ks in split.keys for k in ks)
    ends = {**({p: model.get_submodule(p) for p in split.first} if 0 not in stages else {}),
            **({p: model.get_submodule(p) for p in split.last} if split.num_stages - 1 not in stages else {})}
    return Removed(split.container, keys, {k: holder.get_submodule(k) for k in keys if k not in mine}, ends,
                   tuple(tied))


def _slot(model: nn.Module, path: str) -> tuple[dict, str]:
    parent, _, name = path.rpartition(".")
    return (model.get_submodule(parent) if parent else model)._modules, name


@contextlib.contextmanager
def whole_model(model: nn.Module, removed: Removed) -> Iterator[nn.Module]:
    """``model`` with the removed modules back in their places (and tied parameters tied again) until the block
    ends; this rank's modules, their parameters and hooks are untouched."""
    holder = model.get_submodule(removed.container) if removed.container else model
    saved_blocks = holder._modules
    undo: list[tuple[dict, str, object]] = []
    holder._modules = type(saved_blocks)(
        (k, saved_blocks[k] if k in saved_blocks else removed.blocks[k]) for k in removed.keys)
    for k, v in saved_blocks.items():  # anything else the container held (none for a block container)
        holder._modules.setdefault(k, v)
    try:
        for path, mod in removed.ends.items():
            table, name = _slot(model, path)
            undo.append((table, name, table[name]))
            table[name] = mod
        for first, last in removed.tied:  # the held end's parameter, shared again with the removed end
            if _in(removed.ends, first) == _in(removed.ends, last):
                continue  # both ends held here: still one parameter
            held, other = (first, last) if _in(removed.ends, last) else (last, first)
            mod_path, _, name = other.rpartition(".")
            params = module_parameters(model.get_submodule(mod_path))
            undo.append((params, name, params[name]))
            params[name] = model.get_parameter(held)
        yield model
    finally:
        for table, name, value in reversed(undo):
            table[name] = value
        holder._modules = saved_blocks


def _in(ends: dict[str, nn.Module], name: str) -> bool:
    """Whether parameter ``name`` lives under one of the removed end modules."""
    return any(name == p or name.startswith(p + ".") for p in ends)
