"""The ``pipeline`` plan section, as data: how the model is cut into stages and which schedule runs them.

The degrees come from the layout (``pp`` ranks, ``vpp`` virtual stages each: ``pp × vpp`` stages). With
``split: blocks`` (the default) the stage unit is the ``blocks`` section's pattern (``layers.*``); with
``split: trace`` a model that is not a block stack is traced and cut before each of ``split_points`` (module
paths). Torch-free; applied by :mod:`meshplan.pipeline` (``split: trace``: :mod:`meshplan.pipeline.traced`).

Example (YAML)::

    layout: {pp: 2, tp: 2}
    blocks: {pattern: layers.*}
    pipeline:
      schedule: 1f1b
      microbatches: 4

    # a ResNet cut before layer3 by tracing
    layout: {pp: 2}
    pipeline: {split: trace, split_points: [layer3], schedule: gpipe, microbatches: 4}
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

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
    """The ``pipeline`` plan section: stages over the ``pp`` axis (of blocks, or traced), run by a schedule."""

    split: Literal["blocks", "trace"] = Field(
        "blocks", description="How the model is cut into stages. blocks: the blocks section's pattern dealt out "
                              "over the stages, each stage a view of the model (eager). trace: for a model that is "
                              "not a block stack (a ResNet): torch.export traces it on the first train_step's "
                              "microbatch and cuts the graph before each of split_points (required); layout pp "
                              "(and vpp) only, no tensor_parallel, data_parallel or blocks section yet.")

    schedule: ScheduleName = Field(
        "1f1b", description="torch.distributed.pipelining schedule: gpipe (all forwards, then all backwards), "
                            "1f1b (PipeDream-flush), interleaved_1f1b and looped_bfs (vpp stages per rank), "
                            "interleaved_zero_bubble, zbv_zero_bubble and dualpipev (V-shape: vpp = 2).")
    microbatches: int = Field(
        ..., ge=1, le=1 << 16, description="Microbatches per optimizer step: the batch is split in this many "
                                           "along dim 0 (1f1b-type schedules need at least pp).")
    split_points: tuple[str, ...] | None = Field(
        None, description="Module paths where a stage begins (pp·vpp − 1 of them), e.g. [layers.4, layers.8]; "
                          "default: blocks balanced over the stages. split: trace: any modules forward calls "
                          "once each, in forward order, e.g. [layer3].")
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

    @model_validator(mode="after")
    def _check_split(self) -> "Pipeline":
        if self.split != "trace":
            return self
        if self.split_points is None:
            raise ValueError("split: trace needs split_points (the modules where stages 2, 3, … begin, e.g. "
                             "[layer3]); got none")
        block_only = {k: v for k, v in (("first_stage_fewer_blocks", self.first_stage_fewer_blocks),
                                         ("last_stage_fewer_blocks", self.last_stage_fewer_blocks),
                                         ("first_stage_modules", self.first_stage_modules),
                                         ("last_stage_modules", self.last_stage_modules)) if v}
        if block_only:
            raise ValueError(f"{', '.join(block_only)} apply to split: blocks only; got {block_only} with split: "
                             f"trace (a traced stage runs exactly what forward runs between its split points)")
        return self
