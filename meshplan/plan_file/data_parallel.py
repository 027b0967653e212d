"""The ``data_parallel`` plan section, as data: FSDP2 / HSDP / replication, activation checkpointing, mixed
precision, compile. Torch-free (the plan's JSON Schema and ``meshplan check`` load it without torch); applied by
:mod:`meshplan.data_parallel.fsdp`.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator, model_validator

from meshplan.plan_file.strict import Strict

__all__ = ["DataParallel", "ActivationCheckpointing", "Dtype"]

Dtype = Literal["float32", "bfloat16", "float16"]
_OP_RE = re.compile(r"^[A-Za-z_]\w*\.[A-Za-z_]\w*(\.[A-Za-z_]\w*)?$")


class ActivationCheckpointing(Strict):
    """Which blocks recompute their activations in backward.

    Example (YAML)::

        activation_checkpointing: {mode: selective, ops: [aten.mm.default]}
    """

    mode: Literal["none", "full", "selective"] = Field(
        "none", description="none; full: every block; selective: every k-th block (every) and/or op-level (ops).")
    every: int = Field(1, ge=1, description="selective: checkpoint blocks k, 2k, 3k, … (counting from 1).")
    ops: tuple[str, ...] = Field(
        (), description="selective, op level: ops whose outputs are SAVED (e.g. aten.mm.default); everything "
                        "else in a checkpointed block is recomputed.")

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
        if self.mode != "selective" and (self.every != 1 or self.ops):
            raise ValueError(f"every ({self.every}) and ops ({list(self.ops)}) need mode: selective, got "
                             f"mode: {self.mode}")
        if self.mode == "selective" and self.every == 1 and not self.ops:
            raise ValueError("mode: selective needs every > 1 or a list of ops (every: 1 without ops is mode: full)")
        return self


class DataParallel(Strict):
    """The ``data_parallel`` plan section.

    Example (YAML)::

        data_parallel:
          param_dtype: bfloat16
          reduce_dtype: float32
          activation_checkpointing: {mode: selective, every: 2}
    """

    mode: Literal["fsdp", "hsdp", "ddp", "none"] | None = Field(
        None, description="Default from the layout: hsdp when dp_replicate and dp_shard > 1, fsdp when dp_shard·cp "
                          "> 1, ddp when only dp_replicate > 1, else none. fsdp/ddp given explicitly shard/replicate "
                          "over ALL data ranks (dp_replicate·dp_shard·cp).")
    blocks: str = Field("layers.*", description="Module-path pattern of the blocks ('*' = one path segment); each "
                                                "is fully_shard-ed, checkpointed and compiled on its own.")
    param_dtype: Dtype | None = Field(None, description="Dtype of all-gathered parameters in forward/backward.")
    reduce_dtype: Dtype | None = Field(None, description="Dtype of gradient reduction; default param_dtype.")
    reshard_after_forward: bool | int | None = Field(
        None, description="Blocks free gathered parameters after forward (true, default) or keep them (false); "
                          "an int k reshards to groups of k ranks (a divisor of the shard size; not with tp).")
    gradient_reduction: Literal["sum", "mean"] = Field(
        "sum", description="sum (meshplan's globally normalised loss) or mean (divide by the data-parallel size, "
                           "for a loss that is a per-rank mean).")
    accumulate_unsharded: bool = Field(
        True, description="Gradient accumulation: keep parameters and gradients unsharded between microbatches "
                          "(one all-gather per block per step, one reduce-scatter at the end). false: reduce-scatter "
                          "every microbatch (least memory).")
    cpu_offload: bool = Field(False, description="Offload sharded parameters, gradients and optimizer state to CPU "
                                                 "(FSDP2 CPUOffloadPolicy; needs an accelerator).")
    activation_checkpointing: ActivationCheckpointing = Field(
        default_factory=ActivationCheckpointing, description="Activation checkpointing of the blocks.")
    compile: bool = Field(False, description="torch.compile each block (after checkpointing, before FSDP).")

    @field_validator("reshard_after_forward")
    @classmethod
    def _check_reshard(cls, v: bool | int | None) -> bool | int | None:
        if v is not None and not isinstance(v, bool) and v < 2:
            raise ValueError(f"an int reshard_after_forward is a group size >= 2, got {v}; use true or false")
        return v

    @field_validator("blocks")
    @classmethod
    def _check_blocks(cls, v: str) -> str:
        if not v or any(not s for s in v.split(".")):
            raise ValueError(f"blocks pattern {v!r} has an empty path segment")
        return v
