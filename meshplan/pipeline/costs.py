"""Pipeline parallelism's terms in the solver's cost model (torch-free; :mod:`meshplan.solver` reaches them through
:data:`TERMS`, listed in :data:`meshplan.solver.units.UNITS`; the rest of meshplan through
:data:`meshplan.pipeline.unit.AXIS`).

* collectives: a send or receive per stage boundary a rank's stages touch, per microbatch and direction; with tied
  embeddings, one all-reduce of the embedding gradient over the first and last stage's ranks;
* the bubble: the fraction of a step a pipeline rank idles (``docs/pipeline.md``, measured there by replaying
  each torch schedule): ``(p−1)/(m+p−1)`` for GPipe and 1F1B, ``(p−1)/(v·m+p−1)`` interleaved,
  ``(p−1)/(3v·m+p−1)`` for the zero-bubble and V schedules (a split backward fills the bubble); on a host running
  more ranks than cores, what the busy ranks cannot take over of it (:func:`stretch`);
* the exposed sends: all of them without overlap; with it, the fill and drain hops;
* stage memory: the microbatches' worth of a rank's blocks kept at once (``docs/pipeline.md``'s table).

The pp degree itself is layout data: the solver enumerates it (:mod:`meshplan.solver.search`).
"""

from __future__ import annotations

from typing import Any

from meshplan.axis import AxisCosts, AxisTerms

__all__ = ["TERMS", "pp_collectives", "busy_slots", "idle_fraction", "stretch", "exposed_sends", "in_flight", "written_section"]


def pp_collectives(s: Any, c: Any, tr: Any, place: Any, pp_rank: int, memo: dict) -> list:
    """The pp collectives of pipeline rank ``pp_rank`` in one step (:class:`~meshplan.solver.terms.Collective`)."""
    from meshplan.solver.terms import Collective
    g = place.groups["pp"]
    sh = c.tp if tr.sequence_parallel and c.tp > 1 else 1
    act = c.rank_tokens(tr.seq) * s.hidden / sh * tr.act_bytes
    last = c.pp * c.vpp - 1
    sends = recvs = 0
    for st in place.stages_of(pp_rank):
        sends += (st < last) + (st > 0)  # forward to the next, gradient to the previous
        recvs += (st > 0) + (st < last)
    out = [Collective("pp", "send", g, act, sends * c.microbatches, "activations and their gradients", True),
           Collective("pp", "recv", g, act, recvs * c.microbatches, "activations and their gradients", True)]
    if s.tied_embeddings and c.pp > 1 and any(place.ends_of(pp_rank)):
        out.append(Collective("pp", "all_reduce", place.groups["embd"], s.vocab * s.hidden / c.tp * 4, 1,
                              "tied embedding gradient (first and last stage)"))
    return out


def busy_slots(c: Any) -> int:
    """Busy slots per pipeline rank in one step, in units of the schedule's work item (0 without pipelining): ``m``
    for GPipe and 1F1B, ``v·m`` interleaved, ``3v·m`` for the zero-bubble and V schedules (a split backward)."""
    schedule, p, v, m = c.schedule, c.pp, c.vpp, c.microbatches
    if p == 1 or schedule is None:
        return 0
    if schedule in ("gpipe", "1f1b"):
        return m
    if schedule in ("interleaved_1f1b", "looped_bfs"):
        return v * m
    if schedule == "zbv_zero_bubble" and m < 2 * p - 1:
        return v * m  # laid out for 2p-1 microbatches: fewer run with an interleaved bubble
    return 3 * v * m


def idle_fraction(c: Any) -> float:
    """The fraction of a step a pipeline rank of candidate ``c`` idles (0 without pipelining): the fill and drain's
    ``p − 1`` slots over all of them."""
    n = busy_slots(c)
    return (c.pp - 1) / (n + c.pp - 1) if n else 0.0


def stretch(c: Any, o: float) -> float:
    """How much a pipeline rank's busy time stretches to the step on a host running ``o`` ranks per core.

    With a core per rank (``o <= 1``) the bubble idles: ``1 / (1 − f)``. With more ranks than cores an idle rank's
    core goes to the busy ones, but only while more ranks are busy than there are cores: the schedule is walked slot
    by slot (``n`` busy slots per rank: ``m``, ``v·m`` or ``3v·m``; ``k`` of the ``p`` stages busy in a slot of the
    fill or drain), each slot taking ``max(1, o·k/p)`` of a rank's time alone on a core. GPipe over 4 stages and 4
    microbatches at 2 ranks per core: slots of 1, 1, 1.5, 2, 1.5, 1, 1 over the 8 a fluid share of the cores gives,
    ×1.125 (the earlier ``1 / min(1, (1 − f)·o)`` gave 1: a step measured 16% above it).

    Example::

        >>> from types import SimpleNamespace as C
        >>> round(stretch(C(schedule="gpipe", pp=4, vpp=1, microbatches=4), 2.0), 3)
        1.125
    """
    n, p = busy_slots(c), c.pp
    if not n:
        return 1.0
    if o <= 1:
        return (n + p - 1) / n
    slots = sum(max(1.0, o * min(s + 1, p, n, n + p - 1 - s) / p) for s in range(n + p - 1))
    return slots / (o * n)


def exposed_sends(colls: list, cl: Any, c: Any) -> float:
    """Pipeline sends not hidden behind compute: all of them without overlap; with it, the fill and drain hops."""
    hops = [x for x in colls if x.axis == "pp" and x.kind in ("send", "recv")]
    if not hops:
        return 0.0
    hop = cl.comm_time("send", 2, hops[0].group.nodes, hops[0].nbytes)
    return (1 - cl.overlap) * hop * sum(x.count for x in hops) + cl.overlap * 2 * (c.pp - 1) * hop


def in_flight(c: Any, pp_rank: int) -> float:
    """Microbatches' worth of a pipeline rank's blocks kept at once (``docs/pipeline.md``'s table)."""
    p, v, m, s = c.pp, c.vpp, c.microbatches, c.schedule
    if p == 1:
        return 1.0
    if s in ("gpipe", "looped_bfs"):
        return float(m)
    if s == "1f1b":
        return float(min(m, p - pp_rank))
    if s == "interleaved_1f1b":
        return min(float(m), p + (p - 1) / v)
    if s == "dualpipev":
        return min(float(m), p + 0.5)
    return float(min(m, p))  # the zero-bubble schedules


def written_section(c: Any, base: Any) -> dict | None:
    """The ``pipeline`` section ``meshplan solve --write`` gives candidate ``c`` (over the base plan's), or None
    at pp 1."""
    if c.pp == 1:
        return None
    return {**(base or {}), "schedule": c.schedule, "microbatches": c.microbatches}


def decides(plan: Any, lay: Any) -> dict:
    """The candidate fields a plan's pipeline section sets: its microbatches (they win over the run's), and its
    schedule when ``pp`` > 1."""
    sec = plan.pipeline
    return {} if sec is None else {"microbatches": sec.microbatches, "schedule": sec.schedule if lay.pp > 1 else None}


def _none(*_args: Any) -> float:
    return 0.0


#: the unit as the solver sees it (the same terms as :data:`meshplan.pipeline.unit.AXIS`)
TERMS = AxisTerms(name="pp", section="pipeline", training=lambda plan: {}, example_plan="plans/llama_pp.yaml",
                  costs=AxisCosts(collectives=pp_collectives, block_activations=_none, first_stage_activations=_none,
                                  sequence_problem=lambda seq, d, t: None, run_problem=lambda c, tr, device: None,
                                  per_microbatch=False, exposed=exposed_sends, stretch=stretch,
                                  in_flight=in_flight),
                  written=written_section, decides=decides)
