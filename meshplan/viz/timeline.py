"""The pipeline timeline of ``meshplan check --schedule --format svg|png``: one row per pp rank, time to the
right, one cell per compute step (forward, backward, input-grad, weight-grad) and the idle time between them,
as the seeds' GPipe and 1F1B figures draw it. Torch-free (the steps come from
:func:`meshplan.pipeline.order.executed_steps`).

:func:`simulate` places each rank's steps in the order the schedule runs them, each as early as its rank is free
and its inputs exist: a forward needs the previous stage's forward of the microbatch, a backward (``B`` or
``I``) the next stage's backward of it (the last stage: its own forward), a weight-grad ``W`` its own ``I``.
Durations are in units of one forward: ``F`` = ``I`` = ``W`` = 1, ``B`` = ``I`` + ``W`` = 2 (the usual
assumption of the zero-bubble papers; point-to-point transfers take no time).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

from meshplan.viz.drawing import Drawing, Text, hsl, ink_on, text_width

__all__ = ["Placed", "simulate", "timeline", "schedule_table", "schedule_document", "DURATION", "KIND_COLOURS"]

#: time units per step kind
DURATION = {"F": 1, "I": 1, "W": 1, "B": 2}
#: fill colour per step kind (idle: light grey)
KIND_COLOURS = {"F": "#4e79a7", "B": "#f28e2b", "I": "#e8a33d", "W": "#59a14f", "idle": "#e9e9e9"}
_NAMES = {"F": "forward", "B": "backward (input + weight grad)", "I": "backward, input grad",
          "W": "weight grad", "idle": "idle"}


class Placed(NamedTuple):
    """A step placed in time on its rank."""

    rank: int
    step: Any
    start: int
    end: int


def _needs(step: Any, last_stage: int) -> list[tuple[int, str, int]]:
    """The (stage, kind, microbatch) keys of which ONE must be done before ``step`` starts."""
    s, k, mb = step.stage, step.kind, step.microbatch
    if k == "F":
        return [(s - 1, "F", mb)] if s > 0 else []
    if k in ("B", "I"):
        return [(s, "F", mb)] if s == last_stage else [(s + 1, "B", mb), (s + 1, "I", mb)]
    return [(s, "I", mb)]


def simulate(steps: Sequence[Sequence[Any]]) -> list[list[Placed]]:
    """Place every rank's steps in time (see the module docstring).

    Args:
        steps: ``steps[rank]``, each with ``stage``, ``kind`` (F/B/I/W) and ``microbatch``, in execution order.

    Returns:
        ``placed[rank]``: the steps with their start and end times, in order.
    """
    last = max(s.stage for rank in steps for s in rank)
    done: dict[tuple[int, str, int], int] = {}
    placed: list[list[Placed]] = [[] for _ in steps]
    free, pos = [0] * len(steps), [0] * len(steps)
    while any(p < len(r) for p, r in zip(pos, steps)):
        progressed = False
        for rank, queue in enumerate(steps):
            while pos[rank] < len(queue):
                step = queue[pos[rank]]
                needs = _needs(step, last)
                ready = [done[k] for k in needs if k in done]
                if needs and not ready:
                    break
                start = max(free[rank], min(ready)) if ready else free[rank]
                end = start + DURATION[step.kind]
                done[(step.stage, step.kind, step.microbatch)] = end
                placed[rank].append(Placed(rank, step, start, end))
                free[rank], pos[rank], progressed = end, pos[rank] + 1, True
        assert progressed, f"schedule deadlocks at steps {[q[p] for q, p in zip(steps, pos) if p < len(q)]}"
    return placed


def _fill(kind: str, chunk: int) -> str:
    if chunk == 0 or kind == "idle":
        return KIND_COLOURS[kind]
    base = {"F": 212, "B": 28, "I": 40, "W": 110}[kind]
    return hsl(base, 0.65, 0.40 if chunk % 2 else 0.70)


def _row(d: Drawing, placed: list[Placed], y: float, x0: float, unit: float, span: int, chunks: dict) -> None:
    clock = 0
    for p in placed + [Placed(-1, None, span, span)]:
        if p.start > clock:
            d.rect(x0 + clock * unit, y, (p.start - clock) * unit, 30, fill=KIND_COLOURS["idle"],
                   title=f"idle {clock}-{p.start}", data={"kind": "idle", "start": str(clock)})
        clock = max(clock, p.end)
        if p.step is None:
            break
        st = p.step
        fill = _fill(st.kind, chunks[st.stage])
        d.rect(x0 + p.start * unit, y, (p.end - p.start) * unit, 30, fill=fill, stroke="#ffffff", stroke_width=1,
               title=f"rank {p.rank}: {_NAMES[st.kind]} of microbatch {st.microbatch} on stage {st.stage} "
                     f"(t {p.start}-{p.end})",
               data={"rank": str(p.rank), "stage": str(st.stage), "kind": st.kind, "mb": str(st.microbatch),
                     "start": str(p.start)})
        if unit * (p.end - p.start) >= 14:
            d.text(x0 + (p.start + p.end) / 2 * unit, y + 19, str(st.microbatch), size=min(12, unit * 0.55),
                   anchor="middle", fill=ink_on(fill), weight="bold")
        if st.overlap is not None:
            d.rect(x0 + p.start * unit, y - 2, (p.end - p.start) * unit, 34, stroke="#7b2d8e", stroke_width=2)


def timeline(steps: Sequence[Sequence[Any]], title: str, stage_names: dict[int, str] | None = None) -> Drawing:
    """The timeline picture of ``steps`` (see :func:`simulate`).

    Args:
        steps: ``steps[rank]`` in execution order (:func:`meshplan.pipeline.order.executed_steps`).
        title: the first line (schedule, degrees, microbatches).
        stage_names: optional text per stage (its blocks), listed under the rows.

    Returns:
        The drawing; each step's cell carries ``data-rank``, ``data-stage``, ``data-kind``, ``data-mb`` and
        ``data-start``, each idle gap ``data-kind="idle"``.
    """
    placed = simulate(steps)
    span, idle = _idle(placed)
    chunks = {s: i for row in steps for i, s in enumerate(sorted({x.stage for x in row}))}
    unit = max(8.0, min(30.0, 1500 / span))
    x0, top = 150, 70
    names = stage_names or {}
    d = Drawing(x0 + span * unit + 30, top + len(steps) * 40 + 80 + 16 * len(names))
    d.text(16, 24, title, size=14, weight="bold")
    d.text(16, 44, f"{span} time units (forward = 1, backward = 2 = input grad 1 + weight grad 1); idle "
                   f"(bubble) {idle:.0%} of {len(steps)} ranks × {span}", size=11, fill="#444444",
           data={"span": str(span), "idle": f"{idle:.4f}"})
    for rank, row in enumerate(placed):
        y = top + rank * 40
        stages = sorted({p.step.stage for p in row})
        d.text(16, y + 14, f"rank {rank}", size=12, weight="bold")
        d.text(16, y + 28, "stage " + ", ".join(map(str, stages)), size=10, fill="#555555")
        _row(d, row, y, x0, unit, span, chunks)
    y = top + len(steps) * 40 + 14
    x = 16
    used = sorted({p.step.kind for row in placed for p in row}, key="FBIW".index) + ["idle"]
    for kind in used:
        d.rect(x, y, 14, 14, fill=KIND_COLOURS[kind])
        d.text(x + 19, y + 11, _NAMES[kind], size=11)
        x += 34 + 6.6 * len(_NAMES[kind])
    if any(p.step.overlap is not None for row in placed for p in row):
        d.rect(x, y - 1, 28, 16, stroke="#7b2d8e", stroke_width=2)
        d.text(x + 34, y + 11, "forward and backward overlapped (dualpipev)", size=11)
    if max(chunks.values()) > 0:
        d.text(16, y + 32, "darker / lighter shades: a rank's later stages (vpp > 1); numbers: microbatches",
               size=11, fill="#555555")
    for i, (s, text) in enumerate(sorted(names.items())):
        d.text(16, y + 50 + 16 * i, f"stage {s}: {text}", size=11, fill="#333333")
    d.width = max(d.width, _text_right(d) + 16)  # a short schedule's canvas clipped its title ("2 microbatche")
    return d


def _text_right(d: Drawing) -> float:
    """The rightmost end of the left-anchored texts of ``d`` (bold measured 15 % wider)."""
    return max((t.x + text_width(t.text, t.size) * (1.15 if t.weight == "bold" else 1.0) for t in d.items
                if isinstance(t, Text) and t.anchor == "start"), default=0.0)


def _idle(placed: list[list[Placed]]) -> tuple[int, float]:
    span = max(p.end for row in placed for p in row)
    return span, 1 - sum(p.end - p.start for row in placed for p in row) / (len(placed) * span)


def schedule_table(steps: Sequence[Sequence[Any]], title: str) -> str:
    """The text form: one line per rank, each step as ``<stage><kind><microbatch>@<start>`` (``1F0@1``)."""
    placed = simulate(steps)
    span, idle = _idle(placed)
    out = [title, f"{span} time units (forward 1, backward 2 = input grad 1 + weight grad 1); idle {idle:.1%}"]
    for rank, row in enumerate(placed):
        out.append(f"rank {rank}: " + " ".join(f"{p.step}@{p.start}" + ("*" if p.step.overlap is not None else "")
                                              for p in row))
    if any(p.step.overlap is not None for row in placed for p in row):
        out.append("*: a forward and a backward that dualpipev overlaps")
    return "\n".join(out)


def schedule_document(steps: Sequence[Sequence[Any]], schedule: str) -> dict:
    """The json form: ``{schedule, span, idle, ranks: [[{stage, kind, microbatch, start, end, overlap}]]}``."""
    placed = simulate(steps)
    span, idle = _idle(placed)
    return {"schedule": schedule, "span": span, "idle": round(idle, 6), "ranks": [
        [{"stage": p.step.stage, "kind": p.step.kind, "microbatch": p.step.microbatch, "start": p.start,
          "end": p.end, "overlap": p.step.overlap} for p in row] for row in placed]}
