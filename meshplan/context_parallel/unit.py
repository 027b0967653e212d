"""Context parallelism as a unit: :data:`AXIS`, the one value the rest of meshplan reaches it through.

Torch-free (the solver imports it): each callable imports this folder's torch code when called.
"""

from __future__ import annotations

from typing import Any

from meshplan.axis import Axis
from meshplan.context_parallel.costs import TERMS

__all__ = ["AXIS"]


def _graphs(plan: Any, others: tuple) -> str:
    """The plan key with which another axis leaves graphs where attention modules were (traced stages), or ""."""
    return next((key for axis in others if (key := axis.graphs(plan))), "")


def _check(model: Any, plan: Any, layout: Any, report: Any, others: tuple = ()) -> None:
    from meshplan.context_parallel.check import check_context
    check_context(model, plan, layout, report, _graphs(plan, others))


def _prepare(model: Any, plan: Any, topology: Any, others: tuple = ()) -> str | None:
    from meshplan.context_parallel.check import prepare_context
    return prepare_context(model, plan, topology, _graphs(plan, others))


def _apply(model: Any, plan: Any, topology: Any, where: str, state: Any = None) -> Any:
    from meshplan.context_parallel.check import apply_context
    return apply_context(model, plan, topology, where)


def _shard_batch(state: Any, inputs: Any, targets: Any, shift: bool = False,
                 ignore_index: int = -100) -> tuple[Any, Any, bool]:
    from meshplan.context_parallel.batch import shard_for_state
    return shard_for_state(state, inputs, targets, shift, ignore_index)


def _report_lines(summary: dict) -> list[str]:
    from meshplan.context_parallel.check import context_lines
    return context_lines(summary)


def _rank_share(plan: Any, coords: dict, sizes: dict, shape: Any, modules: list) -> dict | None:
    """The chunks of each sequence the rank holds (:func:`~meshplan.context_parallel.chunks.rank_chunks`)."""
    from meshplan.context_parallel.chunks import n_chunks, rank_chunks
    cp, r = sizes.get("cp", 1), coords.get("cp", 0)
    if cp <= 1:
        return None
    balance = plan.context_parallel.load_balance if plan.context_parallel is not None else True
    mine, n = list(rank_chunks(cp, r, balance)), n_chunks(cp, balance)
    return {"text": f"sequence chunks {', '.join(map(str, mine))} of {n} (cp rank {r} of {cp})",
            "label": f"cp rank {r}/{cp}: chunks", "cells": [[f"c{k}", k in mine] for k in range(n)],
            "data": {"chunks": mine, "of": n, "rank": r, "degree": cp}}


def _profile(timed: Any, mean: Any, device: Any, dtype: Any, shape: dict) -> dict:
    from meshplan.context_parallel.profile import measure_sharded_attention
    return measure_sharded_attention(timed, mean, device, dtype, shape)


#: context parallelism: sequences split over ``cp`` (head-tail chunks), attention exact across the shards
AXIS = Axis(name="cp", section="context_parallel", title="context parallelism", mesh_dims=("cp",),
            state_field="context_parallel", report_key="context", check=_check, prepare=_prepare, apply=_apply,
            shard_batch=_shard_batch, report_lines=_report_lines,
            terms=TERMS, sees_others=True, rank_share=_rank_share, profile=_profile)
