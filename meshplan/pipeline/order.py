"""The compute steps each pp rank runs in one training step, in the order torch's schedule runs them.

:func:`executed_steps` builds the plan's ``torch.distributed.pipelining`` schedule class over stand-in stages
(no process group, no model) and reads what it would execute:

* the multi-stage schedules (``interleaved_1f1b``, ``looped_bfs``, ``interleaved_zero_bubble``, ``zbv_zero_bubble``,
  ``dualpipev``) run the action list of their runtime, ``pipeline_order_with_comms[rank]``; its compute actions
  are the steps (a ``dualpipev`` overlapped forward+backward becomes its two steps, marked ``overlap``);
* ``gpipe`` and ``1f1b`` run a loop of their own (their ``pipeline_order`` IR is only a sketch, wrong for
  1F1B's last rank in torch 2.13), so each rank's loop runs on stand-in stages that record
  ``forward_one_chunk`` / ``backward_one_chunk``.

Kinds: ``F`` forward, ``B`` full backward (input and weight gradients), ``I`` backward for the input gradient
only and ``W`` the weight gradient (zero-bubble schedules split ``B`` into ``I`` then ``W``).
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["Step", "executed_steps"]


class Step(NamedTuple):
    """One compute step: ``kind`` (F, B, I or W) of ``microbatch`` on ``stage``; ``overlap``: the index of the
    overlapped forward+backward pair it belongs to on its rank (dualpipev), else None."""

    stage: int
    kind: str
    microbatch: int
    overlap: int | None = None

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"


def _stand_in(stage: int, num_stages: int, pp: int, record: list | None = None):
    """A ``PipelineStage`` stand-in: the attributes schedules read, no communication, optional call recording."""
    from unittest import mock

    from torch.distributed.pipelining import PipelineStage
    s = mock.create_autospec(PipelineStage, instance=True)
    s.stage_index, s.num_stages, s.is_first, s.is_last = stage, num_stages, stage == 0, stage == num_stages - 1
    s.group_rank, s.group_size, s.submod, s.device = stage % pp, pp, None, "cpu"
    for name in ("get_fwd_recv_ops", "get_fwd_send_ops", "get_bwd_recv_ops", "get_bwd_send_ops"):
        getattr(s, name).return_value = []
    if record is not None:
        s.forward_one_chunk.side_effect = lambda mb, *a, **k: record.append(Step(stage, "F", mb))
        s.backward_one_chunk.side_effect = lambda mb, *a, **k: record.append(Step(stage, "B", mb))
    return s


def _loss(output, target):
    return output


def _runtime_steps(actions: list) -> list[Step]:
    steps, pairs = [], 0
    for a in actions:
        kind = getattr(a, "computation_type", None)
        if a is None or kind is None:
            continue
        if kind.value == "OVERLAP_F_B":
            steps += [Step(s.stage_index, s.computation_type.value, s.microbatch_index, pairs) for s in a.sub_actions]
            pairs += 1
        elif kind.value in ("F", "B", "I", "W"):
            steps.append(Step(a.stage_index, kind.value, a.microbatch_index))
    return steps


def executed_steps(schedule: str, pp: int, vpp: int, microbatches: int,
                   where: str = "pipeline") -> list[list[Step]]:
    """Each pp rank's compute steps, in execution order.

    Args:
        schedule: a plan's schedule name (``1f1b``, ``zbv_zero_bubble``, …).
        pp: pipeline ranks; vpp: stages per rank; microbatches: the pipeline section's microbatches.
        where: prefix of the error messages (the plan file and key).

    Returns:
        ``steps[rank]``: the :class:`Step` list rank ``rank`` runs.

    Raises:
        PlanError: the combination is one :func:`meshplan.pipeline.stages.check_schedule` refuses.
    """
    from meshplan import _torch
    from meshplan.pipeline.split import local_stage_ids
    from meshplan.pipeline.stages import check_schedule, schedule_class
    from meshplan.plan_file.pipeline import MULTI_STAGE_SCHEDULES, Pipeline
    check_schedule(Pipeline(schedule=schedule, microbatches=microbatches), pp, vpp, where)
    cls, n = schedule_class(schedule), pp * vpp
    if schedule in MULTI_STAGE_SCHEDULES:
        stages = [_stand_in(s, n, pp) for s in local_stage_ids(0, pp, vpp, schedule)]
        built = cls(stages, microbatches, loss_fn=_loss)
        return [_runtime_steps(built.pipeline_order_with_comms[r]) for r in range(pp)]
    out = []
    for rank in range(pp):
        record: list[Step] = []
        _torch.step_microbatches(cls(_stand_in(rank, n, pp, record), microbatches, loss_fn=_loss), microbatches)
        out.append(record)
    return out
