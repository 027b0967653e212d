"""Drawing the items of :mod:`meshplan.viz.model`: boxes top to bottom, arrows with layouts and collectives,
frames for the blocks and the input conversions. Torch-free apart from the style table it reads."""

from __future__ import annotations

from typing import Any

from meshplan.viz.drawing import Drawing, ink_on, text_width
from meshplan.viz.model import BOX_H, CONVERSION, EDGE_H, STYLE_COLOURS, WIDTH, Item, describe, model_items
from meshplan.viz.model_axes import FSDP, box_note, rank_panel, rank_title, wrap_note

__all__ = ["model_picture"]

_FWD, _BWD, INDENT, X0 = "#1f5fa8", "#c0392b", 26, 24


def _weights(row: dict) -> str:
    parts = []
    for name, p in row["params"].items():
        local, glob = p.get("local"), p["global"]
        shape = "×".join(map(str, local or glob))
        of = f" of {'×'.join(map(str, glob))}" if local and local != glob else ""
        parts.append(f"{name} {p.get('placement') or ''} [{shape}{of}]".replace("  ", " "))
    return "; ".join(parts) or "no parameters"


def _fit(text: str, width: float, size: float) -> str:
    keep = int(width / (0.6 * size))
    return text if len(text) <= keep else text[:max(1, keep - 1)] + "…"


def _box(d: Drawing, row: dict, x: float, y: float, w: float, n: int, region: str | None) -> None:
    fill = STYLE_COLOURS.get(row["style"], "#cccccc")
    d.rect(x, y, w, BOX_H, fill=fill, stroke="#333333", rx=5, title=f"{row['pattern']}: {row['style']}; "
           f"torch: {row.get('torch_style') or '-'}; {_weights(row)}",
           data={"module": row["pattern"], "style": row["style"], "n": str(n)})
    ink = ink_on(fill)
    name = row["pattern"]
    if region and w < WIDTH / 2 and name.startswith(region + "."):
        name = name[len(region) + 1:]  # a colwise sibling: its name inside the frame
    name += f"  × {n}" if n > 1 else ""
    d.text(x + 8, y + 17, _fit(name, w - 16 - text_width(row["style"], 11), 12), size=12, weight="bold", fill=ink)
    d.text(x + w - 8, y + 17, row["style"], size=11, anchor="end", fill=ink, data={"badge": row["style"]})
    d.text(x + 8, y + 35, _fit(_weights(row), w - 16, 10), size=10, fill=ink)


def _edge(d: Drawing, x: float, y: float, label: str, fwd: list, bwd: list, data: dict) -> None:
    d.line(x, y + 2, x, y + EDGE_H - 3, stroke="#444444", width=1.5, arrow=True)
    d.text(x + 10, y + 15, label, size=11, fill="#111111", data={"activation": label, **data})
    if fwd or bwd:
        tx = x + 14 + text_width(label, 11)
        d.text(tx, y + 15, "fwd → " + (", ".join(fwd) or "nothing"), size=10.5, fill=_FWD,
               data={"forward": ",".join(fwd)})
        d.text(tx, y + 30, "bwd ← " + (", ".join(bwd) or "nothing"), size=10.5, fill=_BWD,
               data={"backward": ",".join(bwd)})


def _arriving(prev: Item | None, item: Item) -> str:
    if prev is None:
        return f"input: {describe(item.inp)}"
    a, b = describe(prev.out, " local shards"), describe(item.inp, " local shards")
    return a if a == b else f"{a} → {b}"


def _frames(items: list[Item], spans: list[tuple[float, float]], wrap: str = "") -> list[tuple[int, float, float, str]]:
    """(depth, top, bottom, label) of the block frame and each input conversion's frame (``wrap``: the block
    frame's data-parallel words, :func:`meshplan.viz.model_axes.wrap_note`)."""
    out = []
    blocks = [i for i, it in enumerate(items) if it.block]
    if blocks:
        first = items[blocks[0]]
        out.append((1, spans[blocks[0]][0], spans[blocks[-1]][1],
                    f"{first.rows[0]['pattern'].split('.*.', 1)[0]}.* : {first.n} blocks (one drawn){wrap}"))
    for i, it in enumerate(items):
        if it.rows[0]["style"] == CONVERSION:
            inside = [j for j in range(i + 1, len(items)) if items[j].region and
                      (items[j].region + ".").startswith(it.region + ".")]
            end = spans[inside[-1]][1] if inside else spans[i][1]
            out.append((it.depth + 1, spans[i][1] - 24, end,
                        f"{it.region}: its input gathered once (→ Replicate) for its colwise layers"))
    return out


def _body(d: Drawing, items: list[Item], y: float, view: dict | None = None) -> tuple[float, list[tuple[float, float]]]:
    spans, prev = [], None
    for it in items:
        top = y
        if it.block and not (prev is not None and prev.block):
            y += 24  # the block frame's label
        x, w = X0 + INDENT * it.depth, WIDTH - 2 * INDENT * it.depth
        fwd = list((prev.collectives_out[0] if prev else [])) + list(it.collectives_in[0])
        bwd = list((prev.collectives_out[1] if prev else [])) + list(it.collectives_in[1])
        _edge(d, x + 30, y, _arriving(prev, it), fwd, bwd, {"before": it.rows[0]["pattern"]})
        y += EDGE_H
        if it.rows[0]["style"] == CONVERSION:
            y += 22  # the frame's label
        else:
            bw = (w - 8 * (len(it.rows) - 1)) / len(it.rows)
            for k, row in enumerate(it.rows):
                _box(d, row, x + k * (bw + 8), y, bw, row["n"], it.region)
            note = box_note(view, it.rows)
            if note is not None:  # the checked rank's share, right of the box
                d.text(X0 + WIDTH + 10, y + 26, note[0], size=10.5, fill="#8a4b08",
                       data={"module": ",".join(r["pattern"] for r in it.rows), **note[1]})
            y += BOX_H
        spans.append((top, y))
        prev = it
    return y, spans


def model_picture(report: Any, plan: Any, notes: list[str], order: dict[str, int] | None = None) -> Drawing:
    """The model picture of a checked plan (see :mod:`meshplan.viz.model`).

    Args:
        report: the :class:`~meshplan.checks.report.Report` of :func:`meshplan.check` (its explain rows).
        plan: the plan checked (section flags and rule overrides).
        notes: text lines shown under the model (totals, each axis' summary lines).
        order: the modules' forward order (:func:`meshplan.checks.call_order.forward_order`); None: model order.

    Returns:
        The drawing: ``data-module``/``data-style`` on each box, ``data-activation``, ``data-forward`` and
        ``data-backward`` on each arrow; the rank view's rank (``report.rank_view``: ``check --rank R``, default
        0) in the title (``data-parameters``, ``data-bytes``), beside each box (``data-rank-bytes``) and in the
        panel under the model (:mod:`meshplan.viz.model_axes`: stages, FSDP2 wrapping, each axis' share).
    """
    items = model_items(report, plan, order)
    tp = plan.tensor_parallel
    flags = "no tensor_parallel section" if tp is None else \
        f"sequence_parallel {str(tp.sequence_parallel).lower()}, loss_parallel {str(tp.loss_parallel).lower()}"
    view = report.rank_view
    d = Drawing(WIDTH + 2 * X0 + 260, 0)
    d.text(X0, 26, f"{report.source}: {report.model}, tp {report.tp}, world {report.world_size}; {flags}",
           size=14, weight="bold")
    title, data = rank_title(view)
    d.text(X0, 46, title, size=12, weight="bold", fill="#8a4b08", data=data)
    y, spans = _body(d, items, 60, view)
    last = items[-1] if items else None
    if last is not None:
        _edge(d, X0 + INDENT * last.depth + 30, y, describe(last.out, " vocab-sharded logits") + " → loss",
              *last.collectives_out, {"before": "(loss)"})
        y += EDGE_H
    for depth, top, bottom, label in _frames(items, spans, wrap_note(view)):
        x = X0 + INDENT * (depth - 1) - 8
        d.items.insert(0, _frame_rect(x, top - 4, WIDTH - 2 * INDENT * (depth - 1) + 16, bottom - top + 12, depth))
        d.text(x + 10, top + 14, label, size=11, weight="bold", fill="#5a4a00"
               if depth > 1 else FSDP if "FSDP2" in label else "#333333", data={"frame": label})
    y = rank_panel(d, view, y + 10)
    for line in notes:
        d.text(X0, y + 14, line, size=11, fill="#333333")
        y += 18
    d.height = y + 16
    d.width = max(d.width, X0 + max((text_width(n, 11) for n in notes), default=0) + 24)
    return d


def _frame_rect(x: float, y: float, w: float, h: float, depth: int):
    from meshplan.viz.drawing import Rect
    fill, stroke = ("#f4f4f4", "#999999") if depth == 1 else ("#fff6d6", "#d4b000")
    return Rect(x, y, w, h, fill=fill, stroke=stroke, stroke_width=1.2, rx=8, dash=None if depth == 1 else "5,3")
