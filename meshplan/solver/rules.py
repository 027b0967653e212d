"""Why a candidate cannot run: the rules ``meshplan.parallelize`` enforces, in its words. Torch-free.

Each rule returns ``(reason, message)`` or None. The messages come from the functions meshplan itself raises
with, so a layout ``meshplan solve`` rejects fails ``parallelize`` the same way:

* ``layout``: :meth:`meshplan.plan_file.layout.Layout.resolve` (degrees dividing the world, dp_replicate, the
  order string);
* ``heads``, ``kv_heads``, ``vocab``, ``ffn``, ``experts``: :func:`meshplan.mesh.ranks.not_dividing`, the wording of
  tensor and expert parallelism's checks; ``etp``: expert parallelism's 1-or-tp rule;
* ``sequence``: each axis unit's ``costs.sequence_problem`` (its chunks, then sequence parallelism);
* ``blocks``: the pipeline split's "cannot fill" rule; ``schedule``: :func:`meshplan.plan_file.stages.schedule_problem`;
* ``batch``: the global batch over the data ranks and microbatches (``train_step``'s rules);
* ``device``: what the cluster's device cannot run (each axis unit's ``costs.run_problem``; CPU offload needs an
  accelerator);
* ``memory``: the estimate above the usable device memory (checked by :mod:`meshplan.solver.search`).
"""

from __future__ import annotations

from meshplan.solver.units import COST_UNITS as UNITS  # the units the per-microbatch terms take (in_solver)
from meshplan.errors import PlanError
from meshplan.mesh.ranks import divisors_text, not_dividing
from meshplan.plan_file.expert_parallel import etp_problem
from meshplan.plan_file.stages import schedule_problem
from meshplan.solver.candidate import Candidate, Training
from meshplan.solver.placement import resolve
from meshplan.solver.shape import ModelShape

__all__ = ["REASONS", "layout_problem", "model_problem", "sequence_problem", "run_problem", "problem"]

#: every rejection reason, in the order they are checked
REASONS = ("layout", "heads", "kv_heads", "vocab", "ffn", "experts", "etp", "sequence", "blocks", "schedule",
           "batch", "device", "memory")

Problem = tuple[str, str] | None


def layout_problem(c: Candidate) -> Problem:
    """The layout's own rules (degrees, order): :meth:`Layout.resolve`'s message."""
    try:
        resolve(c)
    except PlanError as e:
        return "layout", f"layout: {e}"
    return None


def model_problem(s: ModelShape, c: Candidate) -> Problem:
    """What tp, ep and etp must divide in the model."""
    where = f"model {s.name}"
    for reason, axis, degree, what, n in (
            ("heads", "tp", c.tp, "num_attention_heads", s.heads),
            ("kv_heads", "tp", c.tp, "num_key_value_heads", s.kv_heads),
            ("vocab", "tp", c.tp, "vocab_size", s.vocab),
            ("ffn", "tp", c.tp, "intermediate_size", s.ffn)):
        why = not_dividing(axis, degree, what, n)
        if why:
            return reason, f"{where}: {why}"
    if c.ep > 1 and not s.experts:
        return "experts", f"{where}: ep({c.ep}) > 1 but the model has no experts; valid ep: 1"
    if s.experts:
        why = not_dividing("ep", c.ep, "the {n} experts", s.experts)
        if why:
            return "experts", f"{where}: {why}"
        why = etp_problem(c.etp, c.tp)
        if why:
            return "etp", f"{where}: {why}"
        why = not_dividing("etp", c.etp, "moe_intermediate_size", s.expert_width)
        if why:
            return "etp", f"{where}: {why}"
    return None


def sequence_problem(c: Candidate, tr: Training) -> Problem:
    """Why the sequence cannot be split as ``c``'s axes that are units split it, then over tp for sequence
    parallelism."""
    tp_seq = c.tp if tr.sequence_parallel and c.tp > 1 else 1
    for axis in UNITS:
        why = axis.costs.sequence_problem(tr.seq, axis.degree(c), tp_seq)
        if why:
            return "sequence", why
    return None


def run_problem(s: ModelShape, c: Candidate, tr: Training, device: str = "cuda") -> Problem:
    """What the sequence, the blocks, the schedule, the batch and the device allow."""
    problem = sequence_problem(c, tr)
    if problem:
        return problem
    stages = c.pp * c.vpp
    if s.layers < stages:
        return "blocks", (f"pipeline: {s.layers} blocks cannot fill {stages} stages (pp·vpp); expected at least "
                          f"{stages} blocks")
    if c.pp > 1:
        data = max(c.dp * c.cp, c.world // (c.etp * c.ep * c.pp) if c.ep > 1 else 1)  # as other_degrees says
        others = {"tp": c.tp, "cp": c.cp, "ep": c.ep, "data": data}
        why = schedule_problem(c.schedule or "1f1b", c.microbatches, c.pp, c.vpp, others=others)
        if why:
            return "schedule", why
    if tr.global_batch % c.dp:
        return "batch", (f"the global batch ({tr.global_batch}) must be a positive multiple of the data-parallel "
                         f"size ({c.dp}); valid data-parallel sizes: {divisors_text(tr.global_batch)}")
    local = tr.global_batch // c.dp
    if c.micro_batch * c.microbatches != local:
        return "batch", (f"microbatches({c.microbatches}) × micro batch({c.micro_batch}) != this rank's batch "
                         f"size ({local}); valid microbatches: {divisors_text(local)}")
    for axis in UNITS:
        problem = axis.costs.run_problem(c, tr, device)
        if problem:
            return problem
    if device == "cpu" and tr.cpu_offload:
        return "device", "data_parallel.cpu_offload: true needs an accelerator"
    return None


def problem(s: ModelShape, c: Candidate, tr: Training, device: str = "cuda") -> Problem:
    """The first rule ``c`` breaks (memory aside), or None."""
    return layout_problem(c) or model_problem(s, c) or run_problem(s, c, tr, device)
