"""The model picture of ``meshplan check --format svg|png``: the model as its blocks, top to bottom in forward
order, from the explain rows of :func:`meshplan.check` (nothing re-derived).

Each ruled module (one box per rule, the block's modules once with "× n") shows its style, and its weight's
placement and local shape per rank. The arrows between them carry the activation's layout (the ``Shard(1)``
residual stream under sequence parallelism, ``Replicate`` inside a block after its input conversion,
``Shard(-1)`` local heads after a colwise, vocab-sharded logits) and the collectives of that boundary: forward
(blue, →) and backward (red, ←). A colwise parent's input conversion is drawn as a frame around its children
("inside: Replicate"), as Megatron's f/g operators.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from meshplan.plan_file.patterns import wildcard
from meshplan.plan_file.layout_text import Stream
from meshplan.plan_file.style_semantics import SEMANTICS

__all__ = ["Item", "model_items", "describe", "STYLE_COLOURS", "CONVERSION"]

CONVERSION = "input conversion"
#: box colour per style (the input conversion: its frame)
STYLE_COLOURS = {"colwise": "#4e79a7", "rowwise": "#e15759", "norm": "#d3cfc9", "embedding": "#59a14f",
                 "embedding_colwise": "#8cd17d", "embedding_tables": "#86bcb6", "lm_head": "#b07aa1",
                 "replicate": "#9c755f", "head_norm": "#76b7b2", "prepare_input": "#edc948",
                 "prepare_output": "#edc948", CONVERSION: "#f1ce63"}
BOX_H, EDGE_H, WIDTH = 44, 40, 760


def describe(layout: Any, after: str = "") -> str:
    """A layout as the picture writes it: ``Shard(1)`` plus what it means there."""
    if isinstance(layout, list):
        return "(" + ", ".join(describe(x) for x in layout) + ")"
    text = {"replicate": "Replicate", "partial": "Partial (sum pending)", None: "Replicate"}.get(layout)
    if text:
        return text
    dim = layout[len("shard("):-1]
    meaning = {"1": " sequence-sharded", "0": " batch-sharded", "-1": after}.get(dim, "")
    return f"Shard({dim}){meaning}"


@dataclass
class Item:
    """One box (or one row of colwise siblings) of the picture, with the layouts around it."""

    rows: list[dict]
    inp: Any
    out: Any
    depth: int = 0
    region: str | None = None  # the colwise parent whose conversion frames this item
    block: bool = False
    collectives_in: tuple[list, list] = ([], [])
    collectives_out: tuple[list, list] = ([], [])
    n: int = 1
    extra: dict = field(default_factory=dict)


def _layouts(row: dict, rule: Any, stream: Stream) -> tuple[Any, Any]:
    if row["style"] == CONVERSION:
        return stream.layout, "replicate"
    spec = SEMANTICS[row["style"]]
    lay = spec.layouts(rule.overrides() if rule is not None else {}, stream)
    fallback = stream.layout if spec.stream_module else "shard(-1)" if spec.on_local_heads else "replicate"
    inp = lay.get("input_layouts", lay.get("desired_input_layouts")) or fallback
    out = lay.get("output_layouts", lay.get("desired_output_layouts")) or (inp if spec.stream_module else fallback)
    return inp, out


def _input_side(row: dict) -> bool:
    if row["style"] == CONVERSION:
        return True
    spec = SEMANTICS[row["style"]]
    return spec.takes_stream or (spec.column_parallel and bool(row["forward"]))


def _grouped(report: Any, order: dict[str, int] | None = None) -> list[dict]:
    """The explain rows folded per rule (the blocks' modules once), in forward order (``order``: pattern → rank of
    its first call; else model order), each with its count."""
    groups: dict[tuple, dict] = {}
    for r in report.modules:
        key = (wildcard(r["module"]) if r["rule"] == "(colwise parent)" else r["rule"], r["style"])
        g = groups.setdefault(key, {**r, "pattern": key[0], "n": 0, "rank_bytes": 0, "rank_held": 0})
        g["n"] += 1
        g["rank_bytes"] += r["bytes_per_rank"] or 0  # the checked rank's bytes (meshplan.checks.rank_view)
        g["rank_held"] += 1 if r["bytes_per_rank"] else 0
    rows = list(groups.values())
    if order:
        place = {id(r): (order.get(r["pattern"], order.get(_parent(r["pattern"]), len(order))), i)
                 for i, r in enumerate(rows)}
        rows.sort(key=lambda r: place[id(r)])
    return _colwise_first(rows)


def _parent(pattern: str) -> str:
    return pattern.rpartition(".")[0]


def _colwise_first(rows: list[dict]) -> list[dict]:
    """Inside each input conversion, its colwise layers first (they all read the converted input; w1, w3 of
    a gated MLP are registered around w2), the rest after, each part in model order."""
    out, i = [], 0
    while i < len(rows):
        out.append(rows[i])
        if rows[i]["style"] != CONVERSION:
            i += 1
            continue
        prefix, j = rows[i]["pattern"] + ".", i + 1
        while j < len(rows) and rows[j]["pattern"].startswith(prefix):
            j += 1
        inside = rows[i + 1:j]
        first = [r for r in inside if r["style"] != CONVERSION and SEMANTICS[r["style"]].column_parallel]
        out += first + [r for r in inside if r not in first]
        i = j
    return out


def _block_prefix(plan: Any, rows: list[dict]) -> str | None:
    if plan.blocks is not None:
        return plan.blocks.pattern
    starred = [r["pattern"].split(".*.", 1)[0] + ".*" for r in rows if ".*." in r["pattern"]]
    return max(set(starred), key=starred.count) if starred else None


def _joins(prev: Item, row: dict, regions: list[str], depth: int) -> bool:
    """Is ``row`` a colwise sibling of the colwise row ``prev`` (same region): drawn side by side."""
    def colwise(r: dict) -> bool:
        return r["style"] != CONVERSION and SEMANTICS[r["style"]].column_parallel
    return colwise(row) and all(colwise(r) for r in prev.rows) and prev.depth == depth and \
        prev.region == (regions[-1] if regions else None)


def model_items(report: Any, plan: Any, order: dict[str, int] | None = None) -> list[Item]:
    """The picture's items in forward order (a row of colwise siblings is one item); ``order``: see
    :func:`meshplan.checks.call_order.forward_order`."""
    section = plan.tensor_parallel
    rules = section.rules if section is not None else {}
    stream = Stream.of(section)
    rows = _grouped(report, order)
    block = _block_prefix(plan, rows)
    items: list[Item] = []
    regions: list[str] = []
    for row in rows:
        pat = row["pattern"]
        while regions and not pat.startswith(regions[-1] + "."):
            regions.pop()
        inp, out = _layouts(row, rules.get(pat), stream)
        coll = (row["forward"], row["backward"])
        in_block = block is not None and pat.startswith(block + ".")
        depth = int(in_block) + len(regions)
        if row["style"] == CONVERSION:
            regions.append(pat)
            items.append(Item([row], inp, out, depth, pat, in_block, collectives_in=coll, n=row["n"]))
            continue
        prev = items[-1] if items else None
        if prev is not None and _joins(prev, row, regions, depth):
            prev.rows.append(row)
            continue
        side = "collectives_in" if _input_side(row) else "collectives_out"
        items.append(Item([row], inp, out, depth, regions[-1] if regions else None, in_block, n=row["n"],
                          **{side: coll}))
    return items
