"""The ``data_parallel`` plan section, as data: FSDP2 / HSDP / replication, mixed precision, offload. Torch-free
(the plan's JSON Schema and ``meshplan check`` load it without torch); applied by :mod:`meshplan.data_parallel.fsdp`.
The blocks it shards, their checkpointing and compile are the ``blocks`` section (:mod:`meshplan.plan_file.blocks`).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from meshplan.plan_file.strict import Strict

__all__ = ["DataParallel", "Dtype"]

Dtype = Literal["float32", "bfloat16", "float16"]


class DataParallel(Strict):
    """The ``data_parallel`` plan section.

    Example (YAML)::

        data_parallel:
          param_dtype: bfloat16
          reduce_dtype: float32
          reshard_after_forward: true
    """

    mode: Literal["fsdp", "hsdp", "ddp", "none"] | None = Field(
        None, description="Default from the layout: hsdp when dp_replicate and dp_shard > 1, fsdp when dp_shard·cp "
                          "> 1, ddp when only dp_replicate > 1, else none. fsdp/ddp given explicitly shard/replicate "
                          "over ALL data ranks (dp_replicate·dp_shard·cp).")
    param_dtype: Dtype | None = Field(None, description="Dtype of all-gathered parameters in forward/backward.")
    reduce_dtype: Dtype | None = Field(None, description="Dtype of gradient reduction; default param_dtype.")
    reshard_after_forward: bool | int | None = Field(
        None, description="Blocks free gathered parameters after forward (true, default) or keep them (false); "
                          "an int k reshards to groups of k ranks (a divisor of the shard size; not with tp).")
    gradient_reduction: Literal["sum", "mean"] = Field(
        "sum", description="sum (meshplan's globally normalised loss) or mean (divide by the data-parallel size, "
                           "for a loss that is a per-rank mean).")
    accumulate_unsharded: bool = Field(
        True, description="Microbatches (train_step's accumulation and a pipeline stage's): keep parameters and "
                          "gradients unsharded between them (one reduce-scatter per unit and step; torchtitan's and "
                          "torch's pipeline default; a pipeline stage then holds its whole unsharded parameters and "
                          "gradients). false: reduce-scatter and reshard every microbatch (least memory: one unit "
                          "unsharded at a time; pipelines: full backwards of an eager split).")
    ends: Literal["fsdp", "vocab_parallel"] = Field(
        "fsdp", description="The input embedding and the head (nn.Embedding / nn.Linear outside the blocks): fsdp "
                            "(FSDP2 units: gathered for compute, their whole gradient reduce-scattered) or "
                            "vocab_parallel (each data rank keeps its 1/shard-size rows for good, as tensor "
                            "parallelism would over the data ranks: the tokens' activations are gathered instead, "
                            "no weight is ever whole; fsdp mode at tp 1, for large vocabularies and pipelines).")
    prefetch: bool = Field(
        True, description="Overlap FSDP2's gathers (torch's default): the next unit gathered while this one runs its "
                          "backward, and in forward an all-gather result kept until the next unit's. false: one "
                          "unit's parameters gathered at a time (least memory; each all-gather waits in the open).")
    reduce_scatter: Literal["collective", "chunked"] = Field(
        "collective", description="How FSDP2 reduce-scatters gradients: collective (one reduce_scatter per unit) or "
                                  "chunked (CPU/gloo only: each rank's chunk reduced to it in pieces of at most "
                                  "16 MiB, its input freed at once: no input-sized buffer inside gloo's "
                                  "reduce-scatter nor one kept until the next unit's reduction; same sums).")
    cpu_offload: bool = Field(False, description="Offload sharded parameters, gradients and optimizer state to CPU "
                                                 "(FSDP2 CPUOffloadPolicy; needs an accelerator).")

    @field_validator("reshard_after_forward")
    @classmethod
    def _check_reshard(cls, v: bool | int | None) -> bool | int | None:
        if v is not None and not isinstance(v, bool) and v < 2:
            raise ValueError(f"an int reshard_after_forward is a group size >= 2, got {v}; use true or false")
        return v
