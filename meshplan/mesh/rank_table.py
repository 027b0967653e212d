"""Render a resolved layout's groups and ranks as a table, JSON data or SVG."""

from __future__ import annotations

import json

from meshplan.plan_file.layout import GROUP_KINDS, ResolvedLayout

__all__ = ["ranks_data", "ranks_table", "ranks_svg", "render"]

_RANK_KEYS = ("tp", "cp", "dp", "pp", "etp", "ep", "edp", "tp_rank", "pp_rank", "rdp_rank", "dp_rank", "mp_rank")


def ranks_data(r: ResolvedLayout) -> dict:
    """The JSON document of ``meshplan ranks --format json``."""
    sizes = {k: v for k, v in r.sizes().items()}
    return {
        "world_size": r.world_size,
        "order": r.order_str,
        "sizes": sizes,
        "groups": {k: r.groups(k) for k in GROUP_KINDS},
        "ranks": [r.rank_info(i) for i in range(r.world_size)],
    }


def _fmt_groups(groups: list[list[int]], limit: int = 16) -> str:
    text = " ".join("[" + ",".join(map(str, g)) + "]" for g in groups[:limit])
    return text + (f" … ({len(groups)} groups)" if len(groups) > limit else "")


def ranks_table(r: ResolvedLayout, max_ranks: int = 256) -> str:
    """A readable text report: sizes, the groups of each kind, then one row per rank."""
    s = r.sizes()
    lines = [f"world_size {r.world_size}  order {r.order_str} (innermost first)",
             "sizes  " + "  ".join(f"{k}={v}" for k, v in s.items()), "", "groups"]
    width = max(map(len, GROUP_KINDS))
    for kind in GROUP_KINDS:
        lines.append(f"  {kind:<{width}}  {_fmt_groups(r.groups(kind))}")
    lines += ["", "ranks"]
    head = ["rank", *_RANK_KEYS]
    widths = [max(4, len(h)) for h in head]
    lines.append("  " + "  ".join(h.rjust(w) for h, w in zip(head, widths)))
    for i in range(min(r.world_size, max_ranks)):
        info = r.rank_info(i)
        lines.append("  " + "  ".join(str(info[h]).rjust(w) for h, w in zip(head, widths)))
    if r.world_size > max_ranks:
        lines.append(f"  … {r.world_size - max_ranks} more ranks (use --format json for all)")
    return "\n".join(lines)


def ranks_svg(r: ResolvedLayout, gpus_per_node: int | None = None) -> str:
    """The rank grid picture as SVG: one panel per group kind (see :mod:`meshplan.viz.rank_grid`)."""
    from meshplan.viz.rank_grid import rank_grid
    return rank_grid(r, gpus_per_node).to_svg()


def render(r: ResolvedLayout, fmt: str, gpus_per_node: int | None = None) -> str | bytes:
    """``meshplan ranks`` output: ``table`` and ``json`` text, ``svg`` text, ``png`` bytes (matplotlib)."""
    if fmt == "json":
        return json.dumps(ranks_data(r), separators=(",", ":"))
    if fmt in ("svg", "png"):
        from meshplan.viz.rank_grid import rank_grid
        drawing = rank_grid(r, gpus_per_node)
        if fmt == "png":
            from meshplan.viz.png import to_png
            return to_png(drawing)
        return drawing.to_svg()
    return ranks_table(r)
