"""The rank grid picture of ``meshplan ranks --format svg|png``: one panel per group kind, as the seeds' figures
draw Megatron's 16-GPU example and smp's 8 GPUs. Torch-free.

Every panel shows all ranks as cells (rank number, and ``g<i>``: the index of its group of that kind); the cells of
one group share one colour, in the kind's own hue (tp blue, cp purple, dp green, pp orange, the folded expert grid
red/brown/teal). With ``gpus_per_node`` each row of cells is one node when it fits (else the node boundaries are
thick lines between cells), and each panel title counts the groups that span nodes.
"""

from __future__ import annotations

from meshplan.plan_file.layout import ResolvedLayout
from meshplan.viz.drawing import Drawing, hsl, ink_on, text_width

__all__ = ["rank_grid", "panel_kinds", "KIND_HUES", "group_colour"]

#: the hue (degrees) of each group kind's colours
KIND_HUES = {"tp": 212, "cp": 275, "dp": 140, "dp_replicate": 95, "dp_shard": 165, "pp": 28,
             "ep": 355, "etp": 45, "edp": 185}
_TITLES = {"tp": "tensor parallel", "cp": "context parallel", "dp": "data parallel", "dp_replicate": "HSDP replicas",
           "dp_shard": "FSDP shards", "pp": "pipeline stages", "ep": "expert grid", "etp": "expert grid",
           "edp": "expert grid"}
_LIGHTNESS = (0.36, 0.62, 0.46, 0.74, 0.30, 0.55)
CELL, PAD, HEAD = 38, 18, 34


def group_colour(kind: str, index: int) -> str:
    """The colour of group ``index`` of ``kind``: the kind's hue, neighbouring groups at different lightness."""
    return hsl(KIND_HUES[kind] + 9 * ((index // len(_LIGHTNESS)) % 3 - 1), 0.62, _LIGHTNESS[index % len(_LIGHTNESS)])


def _groups(r: ResolvedLayout, kind: str) -> list[list[int]]:
    if kind in ("dp_replicate", "dp_shard"):
        return r.mesh_grid.groups(kind)
    return r.groups(kind)


def panel_kinds(r: ResolvedLayout) -> list[str]:
    """The kinds drawn: tp, cp, dp (split into shard and replicate for HSDP), pp, then the folded expert grid (ep,
    etp, edp) when ep > 1; each only when its groups have more than one rank (tp alone when none has)."""
    kinds = ["tp", "cp", "dp"] + (["dp_shard", "dp_replicate"] if r.dp_replicate > 1 and r.dp_shard > 1 else [])
    kinds += ["pp"] + (["ep", "etp", "edp"] if r.ep > 1 else [])
    return [k for k in kinds if len(_groups(r, k)[0]) > 1] or ["tp"]


def _node_edges(d: Drawing, x: float, y: float, rank: int, cols: int, n: int, per_node: int) -> None:
    """Thick lines on the cell's right/bottom edge where the neighbour is on another node."""
    right, below = rank + 1, rank + cols
    if (rank + 1) % cols and right < n and right // per_node != rank // per_node:
        d.line(x + CELL, y, x + CELL, y + CELL, stroke="#111111", width=3)
    if below < n and below // per_node != rank // per_node:
        d.line(x, y + CELL, x + CELL, y + CELL, stroke="#111111", width=3)


def _panel(d: Drawing, r: ResolvedLayout, kind: str, ox: float, oy: float, cols: int, per_node: int | None,
           node_rows: bool) -> None:
    groups, n = _groups(r, kind), r.world_size
    member = {rank: gi for gi, g in enumerate(groups) for rank in g}
    span = sum(len({m // per_node for m in g}) > 1 for g in groups) if per_node else 0
    title = f"{kind} groups ({_TITLES[kind]}): {len(groups)} × {len(groups[0])} ranks"
    title += f"; {span} span nodes" if per_node else ""
    d.text(ox, oy + 14, title, size=13, weight="bold", data={"kind": kind, "groups": str(len(groups))})
    gx = ox + (58 if node_rows else 0)
    for rank in range(n):
        x, y = gx + (rank % cols) * CELL, oy + HEAD + (rank // cols) * CELL
        fill = group_colour(kind, member[rank])
        node = f", node {rank // per_node}" if per_node else ""
        d.rect(x + 1, y + 1, CELL - 2, CELL - 2, fill=fill, title=f"rank {rank}: {kind} group {member[rank]} "
               f"{groups[member[rank]]}{node}", data={"rank": str(rank), "kind": kind, "group": str(member[rank])})
        d.text(x + CELL / 2, y + CELL / 2 + 1, str(rank), size=12, anchor="middle", fill=ink_on(fill))
        d.text(x + CELL / 2, y + CELL - 5, f"g{member[rank]}", size=8, anchor="middle", fill=ink_on(fill))
        if per_node and not node_rows:
            _node_edges(d, x, y, rank, cols, n, per_node)
    if node_rows:
        for node in range(-(-n // per_node)):
            y = oy + HEAD + node * CELL
            d.text(ox, y + CELL / 2 + 4, f"node {node}", size=11, fill="#333333")
            d.rect(gx, y, cols * CELL, CELL, stroke="#111111", stroke_width=2.5)


def _layout(r: ResolvedLayout, per_node: int | None) -> tuple[int, bool]:
    n = r.world_size
    if per_node and per_node <= 16:
        return per_node, True
    return min(n, 8 if n <= 64 else 16), False


def rank_grid(r: ResolvedLayout, gpus_per_node: int | None = None) -> Drawing:
    """The picture of ``r``'s groups: one panel per kind of :func:`panel_kinds`.

    Args:
        r: the resolved layout.
        gpus_per_node: ranks per node (consecutive ranks share a node, as torchrun places them); None: no nodes.

    Returns:
        The :class:`~meshplan.viz.drawing.Drawing` (``data-kind``/``data-rank``/``data-group`` on each cell).
    """
    kinds = panel_kinds(r)
    cols, node_rows = _layout(r, gpus_per_node)
    rows = -(-r.world_size // cols)
    pw = cols * CELL + (58 if node_rows else 0)
    pw = max(pw, max(text_width(f"{k} groups ({_TITLES[k]}): 0000 × 0000 ranks; 000 span nodes", 13) for k in kinds) * 0.8)
    ph = HEAD + rows * CELL
    per_row = max(1, min(len(kinds), int(1400 // (pw + PAD))))
    d = Drawing(per_row * (pw + PAD) + PAD, 48 + -(-len(kinds) // per_row) * (ph + PAD) + 30)
    shown = [k for k in ("tp", "cp", "pp", "vpp", "dp", "dp_replicate", "dp_shard") if getattr(r, k) > 1]
    shown = (shown + (["ep", "etp", "edp"] if r.ep > 1 else [])) or ["tp"]
    sizes = ", ".join(f"{k} {getattr(r, k)}" for k in shown)
    head = f"world {r.world_size}: {sizes}; order {r.order_str} (innermost first)"
    if gpus_per_node:
        head += f"; {gpus_per_node} GPUs per node ({-(-r.world_size // gpus_per_node)} nodes)"
    d.text(PAD, 24, head, size=14, weight="bold")
    for k, kind in enumerate(kinds):
        _panel(d, r, kind, PAD + (k % per_row) * (pw + PAD), 44 + (k // per_row) * (ph + PAD), cols,
               gpus_per_node, node_rows)
    note = "cells of one colour form one group; g<i>: the group's index"
    if gpus_per_node:
        note += "; thick lines: node boundaries"
    d.text(PAD, d.height - 10, note, size=11, fill="#555555")
    return d
