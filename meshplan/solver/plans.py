"""Between plans and candidates: a plan file read as a :class:`Candidate` and its :class:`Training` settings (for
``meshplan estimate``), and a chosen candidate written back as a plan (``meshplan solve --write``). Torch-free.
"""

from __future__ import annotations

from typing import Any

import yaml

from meshplan.solver.units import COST_UNITS as UNITS  # the units the per-microbatch terms take (in_solver)
from meshplan.errors import PlanError
from meshplan.plan_file.document import Plan
from meshplan.plan_file.layout import Layout
from meshplan.solver.candidate import Candidate, Training

__all__ = ["candidate_from_plan", "plan_from_candidate", "plan_text"]


def _sections(plan: Plan, lay, where: str) -> None:
    """A degree above 1 needs its section, as ``meshplan.parallelize`` says."""
    units = tuple((axis.degree(lay), axis.name, axis.section) for axis in UNITS)  # in parallelize's order
    for degree, name, key in units:
        if degree > 1 and getattr(plan, key) is None:
            raise PlanError(f"{where}: layout.{name}({degree}) > 1 but the plan has no {key} section")


def candidate_from_plan(plan: Plan, world: int, seq: int, global_batch: int, *, microbatches: int = 1,
                        dtype: str = "float32") -> tuple[Candidate, Training]:
    """The candidate and training settings a plan runs with on ``world`` ranks.

    Args:
        plan: the plan. world: ranks. seq / global_batch: the run. microbatches: gradient accumulation steps
            (a ``pipeline`` section's own count wins). dtype: the model's dtype (parameters and, without
            ``data_parallel.param_dtype``, compute).

    Raises:
        PlanError: the layout does not resolve, a degree lacks its section, or the batch does not split.
    """
    where = plan.source or "<plan>"
    lay = (plan.layout or Layout()).resolve(world)
    _sections(plan, lay, where)
    dp_sec, ac = plan.data_parallel, (plan.blocks.activation_checkpointing if plan.blocks else None)
    decided = {k: v for axis in UNITS for k, v in axis.decides(plan, lay).items()}  # the pipeline's schedule
    m = decided.get("microbatches", microbatches)
    data = lay.dp_replicate * lay.dp_shard
    if global_batch % (data * m):
        raise PlanError(f"{where}: the global batch ({global_batch}) must split over dp({data}) × microbatches({m}); "
                        f"expected a multiple of {data * m}")
    cand = Candidate(**{axis.name: axis.degree(lay) for axis in UNITS}, etp=lay.etp, vpp=lay.vpp,
                     dp_replicate=lay.dp_replicate, dp_shard=lay.dp_shard, order=lay.order_str,
                     schedule=decided.get("schedule"),
                     micro_batch=global_batch // (data * m), microbatches=m,
                     ac=ac.mode if ac else "none", ac_every=ac.every if ac else 1, ac_ops=bool(ac and ac.ops),
                     ac_policy=ac.policy if ac else None,
                     dp_mode=dp_sec.mode if dp_sec else None,
                     accumulate_unsharded=dp_sec.accumulate_unsharded if dp_sec else True,
                     vocab_ends=bool(dp_sec and dp_sec.ends == "vocab_parallel"))
    if cand.vocab_ends and (cand.mode != "fsdp" or cand.tp > 1):  # as parallelize refuses it (data_parallel/mode.py)
        raise PlanError(f"{where}: data_parallel.ends: vocab_parallel needs mode fsdp and tp 1; got mode {cand.mode}, "
                        f"tp({cand.tp}); use ends: fsdp")
    compute = (dp_sec.param_dtype if dp_sec else None) or dtype
    reshard = dp_sec.reshard_after_forward if dp_sec else None
    train = Training(
        seq=seq, global_batch=global_batch, dtype=compute, master_dtype=dtype,
        reduce_dtype=(dp_sec.reduce_dtype if dp_sec else None) or compute,
        reshard_after_forward=reshard is not False,
        cpu_offload=bool(dp_sec and dp_sec.cpu_offload),
        **{k: v for axis in UNITS for k, v in axis.training(plan).items()})
    return cand, train


def plan_from_candidate(cand: Candidate, train: Training, base: dict[str, Any] | None = None,
                        blocks_pattern: str = "layers.*") -> dict[str, Any]:
    """The plan (plain data) that runs ``cand``: its layout, blocks, pipeline and data-parallel settings, and the
    rule sections of ``base`` (a plan's data: ``tensor_parallel``, each axis unit's section).

    Raises:
        PlanError: the candidate needs a rule section ``base`` lacks, or the result does not validate.
    """
    base = dict(base or {})
    out: dict[str, Any] = {"version": 1, "layout": cand.layout_dict()}
    rules = tuple(axis for axis in UNITS if axis.written is None)  # the rule sections: copied from base
    for degree, key in ((axis.degree(cand), axis.section) for axis in rules):
        if key in base:
            out[key] = base[key]
        elif degree > 1:
            examples = ", ".join(f"{axis.example_plan} for {axis.section}" for axis in rules)
            raise PlanError(f"the chosen layout needs a {key} section; pass --plan with one (e.g. {examples})")
    if "tensor_parallel" in out:
        out["tensor_parallel"] = {**out["tensor_parallel"], "sequence_parallel": train.sequence_parallel,
                                  "loss_parallel": train.loss_parallel}
    ac: dict[str, Any] = {"mode": cand.ac}
    if cand.ac == "selective":
        kept = ({"policy": cand.ac_policy} if cand.ac_policy else {"ops": ["aten.mm.default"]} if cand.ac_ops
                else {"every": cand.ac_every})
        ac = {"mode": "selective", **kept}
    blocks = dict(base.get("blocks") or {"pattern": blocks_pattern})
    out["blocks"] = {**blocks, "activation_checkpointing": ac}
    for axis in UNITS:  # the sections a candidate decides (the pipeline's schedule)
        written = axis.written(cand, base.get(axis.section)) if axis.written is not None else None
        if written is not None:
            out[axis.section] = written
    dp = dict(base.get("data_parallel") or {})
    if train.dtype != train.master_dtype:
        dp.update(param_dtype=train.dtype, reduce_dtype=train.reduce_dtype)
    if cand.dp_mode is not None:
        dp["mode"] = cand.dp_mode
    if not cand.accumulate_unsharded:
        dp["accumulate_unsharded"] = False
    if cand.vocab_ends:
        dp["ends"] = "vocab_parallel"
    if dp:
        out["data_parallel"] = dp
    Plan.from_data(out, source="the written plan")  # raises PlanError with the key path if it does not validate
    return out


def plan_text(plan: dict[str, Any], header: str) -> str:
    """YAML text of a plan, with a comment header."""
    lines = [f"# {line}" for line in header.splitlines()]
    return "\n".join(lines) + "\n" + yaml.safe_dump(plan, sort_keys=False, width=110)
