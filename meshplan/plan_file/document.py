"""The plan: a Pydantic document with one optional section per kind of parallelism."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, Literal, Mapping

from pydantic import Field, ValidationError, field_validator

from meshplan.errors import PlanError
from meshplan.plan_file.layout import Layout
from meshplan.plan_file.reading import check_data, pydantic_message, read_plan_data
from meshplan.plan_file.strict import Strict
from meshplan.plan_file.tensor_parallel import TensorParallel
from meshplan.plan_file.blocks import Blocks, split_legacy
from meshplan.plan_file.data_parallel import DataParallel
from meshplan.plan_file.pipeline import Pipeline
from meshplan.plan_file.context_parallel import ContextParallel
from meshplan.plan_file.expert_parallel import ExpertParallel
from meshplan.plan_file.faults import Faults
from meshplan.plan_file.initialization import Init
from meshplan.plan_file.training import Training

__all__ = ["Plan", "load_plan", "as_plan"]


class Plan(Strict):
    """A parallelization plan, as checked into a model repo.

    Every section is optional. ``source`` (not part of the file) remembers
    where the plan came from, so errors can name the file.
    """

    version: Literal[1] = Field(1, description="Plan format version.")
    layout: Layout | None = Field(None, description="Parallel degrees and their order; a mesh passed at apply time wins.")
    tensor_parallel: TensorParallel | None = Field(
        None, description="Tensor and sequence parallelism: layer rules → sharding styles.")
    blocks: Blocks | None = Field(
        None, description="The model's repeated blocks (pattern) and what is done to each: activation "
                          "checkpointing, torch.compile; FSDP shards them one by one.")
    data_parallel: DataParallel | None = Field(
        None, description="Data parallelism over dp_replicate × dp_shard: FSDP2, HSDP or replication, mixed "
                          "precision, offload.")
    pipeline: Pipeline | None = Field(
        None, description="Pipeline parallelism over layout.pp (× vpp virtual stages): the blocks cut into stages, "
                          "the schedule and the microbatches.")
    context_parallel: ContextParallel | None = Field(
        None, description="Context parallelism over layout.cp: sequences split across cp ranks (load-balanced for "
                          "causal attention), attention made exact across the shards.")
    expert_parallel: ExpertParallel | None = Field(
        None, description="Expert parallelism for mixture-of-experts layers: experts sharded over layout.ep on the "
                          "folded expert mesh (pp, edp, ep, etp), tokens dispatched by all-to-all.")
    faults: Faults | None = Field(
        None, description="Collective timeouts of every process group (until and after the first train_step), "
                          "heartbeats and the flight recorder: a silent or dead rank makes the others end with a "
                          "RankFailure naming it and the mesh axis, not hang.")
    init: Init | None = Field(
        None, description="How meshplan.materialize initializes a meta-device model: 'exact' (the one-device "
                          "numbers, O(model) per rank) or 'sharded' (keyed per-shard draws, O(shard) per rank); "
                          "the call's mode= wins.")
    training: Training | None = Field(
        None, description="What `meshplan train` trains (model, data) and how (steps, batch, optimizer, schedule, "
                          "evaluation, checkpoints, export, logging); ignored by parallelize.")
    source: str | None = Field(None, exclude=True, description="Where the plan was read from (set by the loader).")

    @field_validator("version", mode="before")
    @classmethod
    def _exact_version(cls, v: Any) -> Any:
        if type(v) is not int:  # a Literal compares by ==: true and 1.0 would pass as 1
            raise ValueError("Input should be the integer 1")
        return v

    @classmethod
    def from_data(cls, data: Mapping[str, Any], source: str | None = None) -> "Plan":
        """Validate plain data (a file's content) into a Plan.

        The old spelling ``data_parallel: {blocks, activation_checkpointing, compile}`` loads as the ``blocks``
        section, with a ``FutureWarning`` naming ``source`` and what to write instead.

        Raises:
            PlanError: naming ``source`` and the key path of every problem; both spellings of ``blocks``.
        """
        if "source" in data:
            raise PlanError(f"{source or '<plan>'}: source: is set by the loader, not the file")
        try:
            check_data(data)  # sizes, depth, integers Python cannot print: before pydantic sees them
        except PlanError as e:
            raise PlanError(f"{source or '<plan>'}: {e}") from None
        with warnings.catch_warnings(record=True) as deprecated:  # shown only for a plan that validates: an
            warnings.simplefilter("always")                          # invalid one ends in one PlanError, nothing else
            dp, blocks = split_legacy(data.get("data_parallel"), data.get("blocks"), source or "<plan>")
        if dp is not data.get("data_parallel"):
            data = {**data, "data_parallel": dp, "blocks": blocks}
        try:
            plan = cls.model_validate({**data, "source": source})
        except ValidationError as e:
            raise PlanError(f"{source or '<plan>'}: {pydantic_message(e)}") from None
        for w in deprecated:
            warnings.warn(w.message, w.category, stacklevel=3)
        return plan


def load_plan(path: str | Path) -> Plan:
    """Read and validate a plan file (``.yaml``/``.yml``/``.json``/``.toml``).

    Raises:
        PlanError: the file cannot be read or parsed, or does not validate; the
            message names the file and the key path.

    Example::

        >>> plan = meshplan.load_plan("plans/llama.yaml")
    """
    return Plan.from_data(read_plan_data(path), source=str(path))


def as_plan(plan: Plan | Mapping[str, Any] | str | Path) -> Plan:
    """Accept a Plan, a dict of a file's content, or a path."""
    if isinstance(plan, Plan):
        return plan
    if isinstance(plan, (str, Path)):
        return load_plan(plan)
    if isinstance(plan, Mapping):
        return Plan.from_data(plan)
    raise PlanError(f"a plan is a path, a dict or a meshplan.Plan, got {type(plan).__name__}")
