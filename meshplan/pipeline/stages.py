"""Stages and schedules: this rank's ``PipelineStage`` objects and the ``torch.distributed.pipelining`` schedule.

What crosses a stage boundary is a plain tensor. With sequence parallelism the residual stream is a DTensor
(``Shard(1)``, or ``Shard(0)`` in smp's batch mode): a stage sends its local shard and the next stage wraps what
it receives back into the DTensor the blocks expect, with the placement the plan gives the stream (both ways:
the gradient sent back is the local shard's too).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from meshplan.plan_file.pipeline import MULTI_STAGE_SCHEDULES, Pipeline
from meshplan.plan_file.stages import check_schedule  # noqa: F401  (re-exported: torch-free rules)

__all__ = ["PipelineApplied", "StepLoss", "schedule_class", "check_schedule", "boundary_hooks", "output_field"]


def schedule_class(name: str) -> type:
    """The torch schedule class of a plan's schedule name."""
    from torch.distributed import pipelining as pl
    return {"gpipe": pl.ScheduleGPipe, "1f1b": pl.Schedule1F1B, "interleaved_1f1b": pl.ScheduleInterleaved1F1B,
            "looped_bfs": pl.ScheduleLoopedBFS, "interleaved_zero_bubble": pl.ScheduleInterleavedZeroBubble,
            "zbv_zero_bubble": pl.ScheduleZBVZeroBubble, "dualpipev": pl.ScheduleDualPipeV}[name]


def _stream_placement(sequence_parallel: bool | str) -> Any:
    return Shard(1) if sequence_parallel is True else Shard(0) if sequence_parallel == "batch" else None


def boundary_hooks(view: nn.Module, tp_mesh: DeviceMesh | None, sequence_parallel: bool | str,
                   first: bool, last: bool, loss: "StepLoss | None" = None) -> None:
    """Make a stage take and give plain tensors: a received local shard becomes the stream's DTensor, a DTensor
    output (not the last stage's: the loss takes it) is sent as its local shard. A transformers ``ModelOutput``
    becomes its ``logits`` on every stage (on earlier stages the hidden state, the head being a pass-through):
    torch's stages take and give tensors only; a base model's (no head) becomes its ``last_hidden_state``. The
    last stage's output class is noted on ``loss``, which hands the user's loss function the same class holding
    that tensor, as the model without a pipeline would."""
    place = _stream_placement(sequence_parallel) if tp_mesh is not None else None

    def to_stream(_mod: nn.Module, args: tuple) -> tuple:
        x = args[0]
        if isinstance(x, torch.Tensor) and not isinstance(x, DTensor) and x.is_floating_point():
            x = DTensor.from_local(x, tp_mesh, [place], run_check=False)
        return (x, *args[1:])

    def to_local(_mod: nn.Module, _args: tuple, out: Any) -> Any:
        key = output_field(out)
        if key is not None:  # transformers' ModelOutput: a causal LM's logits, a base model's last hidden state
            if last and loss is not None:
                loss.output_type, loss.output_key = type(out), key
            out = getattr(out, key)
        return out.to_local() if isinstance(out, DTensor) and not last else out

    if place is not None and not first:
        view.register_forward_pre_hook(to_stream, prepend=True)  # before the model's root hooks (axis units' positions)
    view.register_forward_hook(to_local)


def output_field(out: Any) -> str | None:
    """The tensor field a stage gives of a transformers ``ModelOutput``: ``logits`` (a model with a head), else
    ``last_hidden_state`` (a base model); None for anything else (a tensor, a tuple)."""
    if isinstance(out, torch.Tensor):
        return None
    for key in ("logits", "last_hidden_state"):
        if isinstance(getattr(out, key, None), torch.Tensor):
            return key
    return None


class StepLoss:
    """The schedule's loss function: the user's summed loss of one microbatch divided by the step's global
    token count (both set before each step). The schedule also calls it on placeholder outputs to infer
    gradient shapes, so the step's loss is read from the schedule's ``losses``, not counted here."""

    def __init__(self) -> None:
        self.fn: Callable | None = None
        self.num_tokens = 1
        self.output_type: type | None = None  # the last stage's ModelOutput class, whose tensor it gives
        self.output_key = "logits"  # that tensor's field: logits, or a base model's last_hidden_state

    def __call__(self, output: Any, target: Any) -> torch.Tensor:
        if self.output_type is not None:
            output = self.output_type(**{self.output_key: output})
        return self.fn(output, target) / max(self.num_tokens, 1)


@dataclass
class PipelineApplied:
    """What the pipeline step did on this rank.

    Attributes:
        section: the plan's ``pipeline`` section.
        stage_ids: the stages this rank runs; ``num_stages``: pp·vpp.
        views: the stage modules (views of the model sharing its parameters), in ``stage_ids`` order.
        stages: the ``PipelineStage`` objects (built by :func:`meshplan.pipeline.build_stages`).
        tied: names of parameters the first and last stage share (their gradients are summed over the
            embedding group); ``embedding_group``: that group (None: both ends on this rank, or no tie).
        loss: the schedule's :class:`StepLoss`; ``built``: the schedule, made on first use.
        full_keys: the full model's state-dict keys (a full checkpoint holds them; this rank loads its own).
        removed: the other stages' meta modules (:class:`~meshplan.pipeline.whole.Removed`) when the model was
            split on the meta device, else None.
    """

    section: Pipeline
    stage_ids: list[int]
    num_stages: int
    views: list[nn.Module] = field(default_factory=list)
    stages: list[Any] = field(default_factory=list)
    tied: list[str] = field(default_factory=list)
    embedding_group: Any = None
    loss: StepLoss = field(default_factory=StepLoss)
    full_keys: tuple[str, ...] = ()
    removed: Any = None
    built: Any = None

    @property
    def has_first(self) -> bool:
        return 0 in self.stage_ids

    @property
    def has_last(self) -> bool:
        return self.num_stages - 1 in self.stage_ids

    def schedule(self) -> Any:
        """The schedule running this rank's stages with :attr:`loss` (no grad scaling: the loss is normalised)."""
        if self.built is None:
            cls = schedule_class(self.section.schedule)
            stages = self.stages if self.section.schedule in MULTI_STAGE_SCHEDULES else self.stages[0]
            self.built = cls(stages, self.section.microbatches, loss_fn=self.loss, scale_grads=False)
        return self.built
