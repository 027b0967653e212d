"""The ``pipeline`` plan section, as data: how the blocks are cut into stages and which schedule runs them.

The degrees come from the layout (``pp`` ranks, ``vpp`` virtual stages each: ``pp × vpp`` stages); the stage
unit is the ``blocks`` section's pattern (``layers.*``). Torch-free; applied by :mod:`meshplan.pipeline`.

Example (YAML)::

    layout: {pp: 2, tp: 2}
    blocks: {pattern: layers.*}
    pipeline:
      schedule: 1f1b
      microbatches: 4
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from meshplan.plan_file.strict import Strict

__all__ = ["Pipeline", "SCHEDULES", "V_SCHEDULES", "MULTI_STAGE_SCHEDULES"]

ScheduleName = Literal["gpipe", "1f1b", "interleaved_1f1b", "looped_bfs", "interleaved_zero_bubble",
                       "zbv_zero_bubble", "dualpipev"]
#: every schedule name a plan may write
SCHEDULES: tuple[str, ...] = ScheduleName.__args__
#: schedules that run several stages per rank (``vpp`` > 1 allowed)
MULTI_STAGE_SCHEDULES = ("interleaved_1f1b", "looped_bfs", "interleaved_zero_bubble", "zbv_zero_bubble",
                         "dualpipev")
#: V-shaped schedules: exactly two stages per rank, rank r holds stages r and 2·pp−1−r
V_SCHEDULES = ("zbv_zero_bubble", "dualpipev")


class Pipeline(Strict):
    """The ``pipeline`` plan section: stages of blocks over the ``pp`` axis, run by a schedule."""

    schedule: ScheduleName = Field(
        "1f1b", description="torch.distributed.pipelining schedule: gpipe (all forwards, then all backwards), "
                            "1f1b (PipeDream-flush), interleaved_1f1b and looped_bfs (vpp stages per rank), "
                            "interleaved_zero_bubble, zbv_zero_bubble and dualpipev (V-shape: vpp = 2).")
    microbatches: int = Field(
        ..., ge=1, le=1 << 16, description="Microbatches per optimizer step: the batch is split in this many "
                                           "along dim 0 (1f1b-type schedules need at least pp).")
    split_points: tuple[str, ...] | None = Field(
        None, description="Module paths where a stage begins (pp·vpp − 1 of them), e.g. [layers.4, layers.8]; "
                          "default: blocks balanced over the stages.")
    first_stage_fewer_blocks: int = Field(
        0, ge=0, description="Without split_points: give the first stage this many blocks fewer than the others "
                             "(it also runs the embedding).")
    last_stage_fewer_blocks: int = Field(
        0, ge=0, description="Without split_points: give the last stage this many blocks fewer than the others "
                             "(it also runs the head and the loss).")
    first_stage_modules: tuple[str, ...] | None = Field(
        None, description="Modules outside the blocks that only the first stage runs (default: those with "
                          "parameters registered before the blocks, e.g. the embedding); the other stages "
                          "pass their input through in their place.")
    last_stage_modules: tuple[str, ...] | None = Field(
        None, description="Modules outside the blocks that only the last stage runs (default: those with "
                          "parameters registered after the blocks, e.g. the final norm and the head).")

    @field_validator("split_points", "first_stage_modules", "last_stage_modules", mode="before")
    @classmethod
    def _list_to_tuple(cls, v: object) -> object:
        return tuple(v) if isinstance(v, list) else v  # plan files have lists; the strict base wants tuples

    @field_validator("split_points", "first_stage_modules", "last_stage_modules")
    @classmethod
    def _check_paths(cls, v: tuple[str, ...] | None) -> tuple[str, ...] | None:
        for i, path in enumerate(v or ()):
            if not path or any(not s for s in path.split(".")) or "*" in path:
                raise ValueError(f"[{i}] = {path!r} is not a module path (dot-separated names, no '*')")
        if v is not None and len(set(v)) != len(v):
            raise ValueError(f"repeated module paths: {list(v)}")
        return v
