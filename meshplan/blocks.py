"""The ``blocks`` step: activation checkpointing and ``torch.compile`` per block (torchtitan's apply_ac/apply_compile).

:func:`apply_blocks` runs after tensor parallelism and before FSDP2 (which then ``fully_shard``-s the blocks it
found, then each root's embedding and [final norm, head] units, :func:`meshplan.model_copies.end_groups`, then
the root). The blocks are the modules the section's ``pattern`` matches, found by meshplan's one module-path
matcher (:func:`meshplan.plan_file.patterns.match_pattern`). The section's model lives in
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

__all__ = ["AppliedBlocks", "apply_blocks", "as_blocks", "block_paths", "blocks_problem", "blocks_reason", "repeated_blocks"]


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


def blocks_reason(plan: Any, layout: Any) -> str:
    """Why :func:`meshplan.parallelize` runs the blocks step for ``plan`` on the resolved ``layout`` (the text
    its error names), or "" when it does not: a ``blocks`` section, else an axis that wraps the blocks
    (:func:`meshplan.axes.blocks_reason`: FSDP2 wraps each block).
    ``meshplan check`` asks the same question, so a plan it passes finds its blocks."""
    if plan.blocks is not None:
        return "the blocks section"
    from meshplan.axes import blocks_reason as axes_reason
    return axes_reason(plan, layout)


def blocks_problem(model: "nn.Module", plan: Any, layout: Any, source: str | None = None) -> PlanError | None:
    """The error :func:`meshplan.parallelize` raises before changing the model when its blocks step would find no
    block (:func:`blocks_reason`, :func:`block_paths`), else None; ``meshplan check`` reports the same one."""
    why = blocks_reason(plan, layout)
    if not why:
        return None
    try:
        block_paths(model, plan.blocks, why)
    except PlanError as e:
        return PlanError(f"{source}: {e}" if source else str(e))
    return None


def repeated_blocks(model: "nn.Module") -> str | None:
    """The pattern of ``model``'s repeated blocks: the children of its largest ``ModuleList`` (by parameter count,
    then the shallowest) holding two or more modules, e.g. ``model.layers.*``; None without one."""
    import torch.nn as nn
    best: tuple | None = None
    for path, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList) and len(mod) >= 2 and path:
            size = sum(p.numel() for p in mod.parameters())
            key = (size, -path.count("."))
            if best is None or key > best[0]:
                best = (key, path)
    return f"{best[1]}.*" if best is not None else None


def block_paths(model: "nn.Module", section: Blocks | Mapping[str, Any] | None, why: str = "") -> list[str]:
    """The module paths of the blocks ``section`` names (default ``layers.*``), in model order.

    Args:
        why: what needs the blocks, for the message (an axis' :attr:`~meshplan.axis.Axis.blocks_reason`).

    Raises:
        PlanError: the pattern matches no module; names the pattern, the model, its top-level children and the
            pattern of its repeated blocks (:func:`repeated_blocks`), which would match.
    """
    from meshplan.plan_file.patterns import match_pattern
    section = as_blocks(section)
    try:
        return match_pattern(model, section.pattern, "blocks")
    except PlanError as e:
        found = repeated_blocks(model)
        fix = (f"; expected the model's repeated blocks: write `blocks: {{pattern: {found}}}`" if found else
               "; the model has no ModuleList of blocks: name them in `blocks: {pattern: …}`")
        raise PlanError(f"{e}{' (' + why + ')' if why else ''}{fix}") from None


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
    from meshplan._torch import checkpoint_wrapper
    from meshplan.recompute import context_fn
    from meshplan.state import parallel_state
    fn = context_fn(ops, ac.policy)
    state = parallel_state(model)
    if state is not None:  # the recompute sees its forward's per-forward state (an axis' runtime's)
        fn = state.recompute_contexts(fn)
    kwargs = {"context_fn": fn} if fn is not None else {}
    for k, path in enumerate(blocks, start=1):
        if ac.mode == "full" or k % ac.every == 0:  # op level (ops, policy): every 1
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
        PlanError: an invalid section, a pattern that matches no module (naming the model's top-level children
            and the pattern of its repeated blocks),
            an unknown checkpoint op, or blocks applied already. Every check runs before the model changes.

    Example::

        >>> apply_blocks(model, {"pattern": "layers.*", "activation_checkpointing": {"mode": "full"}})
    """
    from meshplan.state import attach_state, parallel_state
    section = as_blocks(section)
    state = parallel_state(model)
    if state is not None and state.blocks is not None:
        raise PlanError(f"blocks were already applied to this {type(model).__name__}")
    paths = block_paths(model, section)
    ops = _resolve_ops(section.activation_checkpointing)  # every check before the model changes
    _checkpoint(model, paths, section.activation_checkpointing, ops)
    if section.compile:
        for path in paths:
            model.get_submodule(path).compile()
    attach_state(model, blocks=AppliedBlocks(section=section, paths=paths))
    return model
