"""The ``blocks`` plan section, as data: the model's repeated blocks and what is done to each one.

A block (a transformer layer) is the unit of activation checkpointing, of ``torch.compile`` and of FSDP2's
``fully_shard`` (and, with pipelining, of stages). Torch-free; applied by :mod:`meshplan.blocks`.

Plan files written before this section had ``data_parallel: {blocks: <pattern>, activation_checkpointing: …,
compile: …}``; :func:`split_legacy` maps that spelling here, with a ``FutureWarning``.
"""

from __future__ import annotations

import re
import warnings
from typing import Any, Literal, Mapping

import yaml
from pydantic import Field, field_validator, model_validator

from meshplan.errors import PlanError
from meshplan.plan_file.strict import Strict

__all__ = ["Blocks", "ActivationCheckpointing", "LEGACY_KEYS", "split_legacy"]

_OP_RE = re.compile(r"^[A-Za-z_]\w*\.[A-Za-z_]\w*(\.[A-Za-z_]\w*)?$")
#: ``data_parallel`` key (old spelling) -> ``blocks`` key
LEGACY_KEYS = {"blocks": "pattern", "activation_checkpointing": "activation_checkpointing", "compile": "compile"}


class ActivationCheckpointing(Strict):
    """Which blocks recompute their activations in backward (torchtitan's ``activation_checkpoint``).

    Example (YAML)::

        activation_checkpointing: {mode: selective, ops: [aten.mm.default]}
        activation_checkpointing: {mode: selective, policy: megatron}
    """

    mode: Literal["none", "full", "selective"] = Field(
        "none", description="none; full: every block; selective: every k-th block (every) and/or op-level (ops or "
                            "policy).")
    every: int = Field(1, ge=1, description="selective: checkpoint blocks k, 2k, 3k, … (counting from 1).")
    ops: tuple[str, ...] = Field(
        (), description="selective, op level: ops whose outputs are SAVED (e.g. aten.mm.default); everything "
                        "else in a checkpointed block is recomputed.")
    policy: Literal["megatron"] | None = Field(
        None, description="selective, op level: a built-in policy instead of ops. megatron: keep the colwise "
                          "matmul outputs and the REDUCED row-parallel outputs (reduce-scatter / all-reduce / "
                          "all-to-all results, sharded over the sequence under sequence parallelism), recompute "
                          "the rest: the attention core, the row-parallel matmuls, norms, activations, dropout "
                          "and all-gathers; the kept bytes fall as 1/tp (docs/data-parallel.md).")

    @field_validator("ops", mode="before")
    @classmethod
    def _list_to_tuple(cls, ops: object) -> object:
        return tuple(ops) if isinstance(ops, list) else ops  # plan files have lists, not tuples (strict base)

    @field_validator("ops")
    @classmethod
    def _check_ops(cls, ops: tuple[str, ...]) -> tuple[str, ...]:
        for i, op in enumerate(ops):
            if not _OP_RE.match(op):
                raise ValueError(f"ops[{i}] = {op!r} is not 'namespace.op' or 'namespace.op.overload' "
                                 f"(e.g. 'aten.mm.default')")
        return ops

    @model_validator(mode="after")
    def _check_mode(self) -> "ActivationCheckpointing":
        if self.mode != "selective" and (self.every != 1 or self.ops or self.policy):
            raise ValueError(f"every ({self.every}), ops ({list(self.ops)}) and policy ({self.policy}) need mode: "
                             f"selective, got mode: {self.mode}")
        if self.ops and self.policy:
            raise ValueError(f"ops ({list(self.ops)}) and policy ({self.policy}) are both given; expected one: "
                             f"policy: {self.policy} chooses the kept ops itself")
        if self.mode == "selective" and self.every == 1 and not self.ops and not self.policy:
            raise ValueError("mode: selective needs every > 1, a list of ops or policy: megatron (every: 1 without "
                             "ops is mode: full)")
        return self


class Blocks(Strict):
    """The ``blocks`` plan section.

    Example (YAML)::

        blocks:
          pattern: layers.*
          activation_checkpointing: {mode: selective, every: 2}
          compile: true
    """

    pattern: str = Field("layers.*", description="Module-path pattern of the blocks ('*' = one path segment, as in "
                                                 "tensor_parallel.rules); each block is checkpointed, compiled and "
                                                 "fully_shard-ed on its own.")
    activation_checkpointing: ActivationCheckpointing = Field(
        default_factory=ActivationCheckpointing, description="Activation checkpointing of the blocks.")
    compile: bool = Field(False, description="torch.compile each block (after checkpointing, before FSDP).")

    @field_validator("pattern")
    @classmethod
    def _check_pattern(cls, v: str) -> str:
        if not v or any(not s for s in v.split(".")):
            raise ValueError(f"blocks pattern {v!r} has an empty path segment")
        return v


def _flow(value: Any) -> str:
    """``value`` as one line of YAML (flow style)."""
    try:
        return yaml.safe_dump(value, default_flow_style=True, sort_keys=False, width=float("inf")).strip()
    except yaml.YAMLError:
        return repr(value)


def split_legacy(data_parallel: Any, blocks: Any, where: str | None = None,
                 function: str | None = None) -> tuple[Any, Any]:
    """Map the old spelling (``blocks``/``activation_checkpointing``/``compile`` under ``data_parallel``) to the
    ``blocks`` section, warning with what to write instead.

    Args:
        data_parallel: the ``data_parallel`` section's data (anything: only a mapping is looked at).
        blocks: the ``blocks`` section's data, or None when there is none.
        where: the plan file (or what the plan came from), named in messages.
        function: the function that was given the section (e.g. ``apply_data_parallel``): the warning then says
            to pass ``blocks=`` to it instead of editing a plan file.

    Returns:
        ``(data_parallel, blocks)``: the old keys moved from the first into the second (new dicts; the inputs
        are returned unchanged when there is nothing to move).

    Raises:
        PlanError: both spellings given.

    Example::

        >>> split_legacy({"compile": True, "param_dtype": "bfloat16"}, None, "plans/x.yaml")   # FutureWarning
        ({'param_dtype': 'bfloat16'}, {'compile': True})
    """
    if not isinstance(data_parallel, Mapping) or not any(k in data_parallel for k in LEGACY_KEYS):
        return data_parallel, blocks
    old = [k for k in LEGACY_KEYS if k in data_parallel]
    keys, prefix = ", ".join(f"data_parallel.{k}" for k in old), f"{where}: " if where else ""
    if blocks is not None:
        raise PlanError(f"{prefix}{keys} and the blocks section are both given; expected one: move "
                        f"{', '.join(old)} into blocks (the data_parallel spelling is deprecated)")
    moved = {LEGACY_KEYS[k]: data_parallel[k] for k in old}
    rest = {k: v for k, v in data_parallel.items() if k not in LEGACY_KEYS}
    fix = (f"pass blocks={moved!r} to {function}" if function else
           f"write `blocks: {_flow(moved)}` at the top level of the plan")
    warnings.warn(f"{prefix}{keys}: deprecated, these configure the model's blocks and moved to the top-level blocks "
                  f"section; {fix} and remove {', '.join(old)} from data_parallel", FutureWarning, stacklevel=3)
    return rest, moved
