"""Render a resolved layout's groups and ranks as a table, JSON data or SVG."""

from __future__ import annotations

import html
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


_PALETTE = ["#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1", "#ff9da7",
            "#9c755f", "#bab0ac", "#1f77b4", "#aec7e8", "#ffbb78", "#98df8a", "#c5b0d5", "#c49c94"]


def ranks_svg(r: ResolvedLayout, kinds: tuple[str, ...] = ("tp", "cp", "dp", "pp", "ep", "edp", "tp-dp", "tp-pp"),
              cols: int | None = None) -> str:
    """One panel per group kind: every rank a cell, cells of one group one colour (as in the seeds' figures)."""
    n = r.world_size
    cols = cols or min(n, 8 if n <= 64 else 16)
    rows = -(-n // cols)
    cell, pad, title = 34, 16, 22
    kinds = tuple(k for k in kinds if len(r.groups(k)[0]) > 1) or ("tp",)
    pw, ph = cols * cell, rows * cell + title
    per_row = 2
    width = per_row * (pw + pad) + pad
    height = -(-len(kinds) // per_row) * (ph + pad) + pad + 24
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif">',
           f'<text x="{pad}" y="18" font-size="14">{html.escape(f"world {n}, order {r.order_str} (innermost first)")}</text>']
    for k, kind in enumerate(kinds):
        ox, oy = pad + (k % per_row) * (pw + pad), 24 + pad + (k // per_row) * (ph + pad)
        out.append(f'<text x="{ox}" y="{oy + 14}" font-size="13" font-weight="bold">{html.escape(kind)} groups</text>')
        member = {rank: gi for gi, g in enumerate(r.groups(kind)) for rank in g}
        for rank in range(n):
            x, y = ox + (rank % cols) * cell, oy + title + (rank // cols) * cell
            colour = _PALETTE[member[rank] % len(_PALETTE)]
            out.append(f'<rect x="{x}" y="{y}" width="{cell - 2}" height="{cell - 2}" fill="{colour}">'
                       f'<title>rank {rank}: {kind} group {member[rank]}</title></rect>')
            out.append(f'<text x="{x + cell / 2 - 1}" y="{y + cell / 2 + 4}" font-size="11" text-anchor="middle" '
                       f'fill="white">{rank}</text>')
    out.append("</svg>")
    return "\n".join(out)


def render(r: ResolvedLayout, fmt: str) -> str:
    if fmt == "json":
        return json.dumps(ranks_data(r), separators=(",", ":"))
    if fmt == "svg":
        return ranks_svg(r)
    return ranks_table(r)
