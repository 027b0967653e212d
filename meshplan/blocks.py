"""The ``blocks`` step: activation checkpointing and ``torch.compile`` per block (torchtitan's apply_ac/apply_compile).

:func:`apply_blocks` runs after tensor parallelism and before FSDP2 (which then ``fully_shard``-s the blocks it
found, then the root). The blocks are the modules the section's ``pattern`` matches, found by meshplan's one
module-path matcher (:func:`meshplan.plan_file.patterns.match_pattern`). The section's model lives in
:mod:`meshplan.plan_file.blocks` (torch-free).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping

from pydantic import ValidationError

from meshplan.errors import PlanError
from meshplan.plan_file.blocks import ActivationCheckpointing, Blocks

if TYPE_CHECKING:
    import torch.nn as nn

__all__ = ["AppliedBlocks", "apply_blocks", "as_blocks"]


@dataclass(frozen=True)
class AppliedBlocks:
    """What :func:`apply_blocks` did; recorded as :attr:`meshplan.state.ParallelState.blocks`.

    Attributes:
        section: the validated :class:`~meshplan.plan_file.blocks.Blocks` section.
        paths: module paths of the blocks, in model order (FSDP2 shards each; ``train_step`` sets their knobs).
    """

    section: Blocks
    paths: list[str]


def as_blocks(section: Blocks | Mapping[str, Any] | None) -> Blocks:
    """A validated :class:`Blocks` section from a section, its dict, or None (the defaults).

    Raises:
        PlanError: the dict does not validate; ``blocks: <key path>: <problem>``.
    """
    if section is None:
        return Blocks()
    if isinstance(section, Blocks):
        return section
    try:
        return Blocks.model_validate(dict(section))
    except ValidationError as e:
        from meshplan.plan_file.reading import pydantic_message
        raise PlanError(f"blocks: {pydantic_message(e)}") from None


def _resolve_ops(ac: ActivationCheckpointing) -> list:
    import torch
    ops = []
    for i, name in enumerate(ac.ops):
        parts = name.split(".")
        try:
            op = getattr(getattr(torch.ops, parts[0]), parts[1])
            ops.append(getattr(op, parts[2] if len(parts) == 3 else "default"))
        except (AttributeError, RuntimeError):
            raise PlanError(f"blocks.activation_checkpointing.ops[{i}]: unknown op {name!r} "
                            f"(torch.ops.{name} does not exist)") from None
    return ops


def _checkpoint(model: "nn.Module", blocks: list[str], ac: ActivationCheckpointing, ops: list) -> None:
    if ac.mode == "none":
        return
    from functools import partial

    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    from meshplan._torch import checkpoint_wrapper
    kwargs = {"context_fn": partial(create_selective_checkpoint_contexts, ops)} if ops else {}
    for k, path in enumerate(blocks, start=1):
        if ac.mode == "full" or k % ac.every == 0:
            parent, _, name = path.rpartition(".")
            wrapped = checkpoint_wrapper(model.get_submodule(path), preserve_rng_state=True, **kwargs)
            model.get_submodule(parent).register_module(name, wrapped)


def apply_blocks(model: "nn.Module", section: Blocks | Mapping[str, Any] | None = None) -> "nn.Module":
    """Apply the ``blocks`` section to ``model`` in place: checkpoint, then compile, each block.

    Args:
        model: the (tensor-parallel) model, before FSDP.
        section: a :class:`~meshplan.plan_file.blocks.Blocks`, its dict, or None (``layers.*``, nothing applied).

    Returns:
        ``model``, with the blocks recorded in its :class:`~meshplan.state.ParallelState` (``blocks``).

    Raises:
        PlanError: an invalid section, a pattern that matches no module (naming the model's top-level children),
            an unknown checkpoint op, or blocks applied already. Every check runs before the model changes.

    Example::

        >>> apply_blocks(model, {"pattern": "layers.*", "activation_checkpointing": {"mode": "full"}})
    """
    from meshplan.plan_file.patterns import match_pattern
    from meshplan.state import attach_state, parallel_state
    section = as_blocks(section)
    state = parallel_state(model)
    if state is not None and state.blocks is not None:
        raise PlanError(f"blocks were already applied to this {type(model).__name__}")
    paths = match_pattern(model, section.pattern, "blocks")
    ops = _resolve_ops(section.activation_checkpointing)  # every check before the model changes
    _checkpoint(model, paths, section.activation_checkpointing, ops)
    if section.compile:
        for path in paths:
            model.get_submodule(path).compile()
    attach_state(model, blocks=AppliedBlocks(section=section, paths=paths))
    return model
