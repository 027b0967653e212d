"""The model picture's rank panel (``meshplan check --format svg|png``, ``--rank R``; default rank 0): what every
axis gives that rank, from the report's rank view (:mod:`meshplan.checks.rank_view`, nothing re-derived).

* its coordinates and its parameter, gradient and AdamW bytes (``data-parameters``, ``data-bytes``: the figures
  ``meshplan estimate --rank R`` gives, every axis counted);
* the stages as a strip, one cell per stage (``data-stage``, ``data-stage-rank``), the rank's own filled;
* the data-parallel wrapping: the units FSDP2 wraps (``fully_shard``: the experts over edp, each block, each root's
  embedding and head, the root) or DDP replicates, in the wrap's order, with the rank's bytes of each, and over
  which ranks (``data-fsdp``, ``data-fsdp-units``);
* what every other axis gives the rank (:attr:`meshplan.axis.Axis.rank_share`: its experts, its chunks of each
  sequence), a line each (``data-share``: the axis) and a strip where the axis has one (``data-cell``).

Torch-free (the unit texts are :mod:`meshplan.checks.rank_layout`'s, torch-free at import).
"""

from __future__ import annotations

from typing import Any

from meshplan.checks.rank_layout import unit_texts
from meshplan.mesh.ranks import ranks_text
from meshplan.solver.report import fmt_bytes
from meshplan.viz.drawing import Drawing
from meshplan.viz.model import WIDTH

__all__ = ["rank_title", "rank_panel", "wrap_note", "box_note", "MINE", "OTHER", "FSDP"]

MINE, OTHER, FSDP = "#f28e2b", "#e8e8e8", "#2e8b57"


def rank_title(view: dict | None) -> tuple[str, dict]:
    """The title's rank line and its ``data-*`` pairs (the rank's figures), or a line saying why there are none."""
    if view is None:
        return "per-rank figures: none (no dry run: the plan has errors)", {}
    c, s = view["coordinates"], view["sizes"]
    where = ", ".join(f"{k} {v}/{s.get(k, 1)}" for k, v in c.items() if s.get(k, 1) > 1) or "the only rank"
    if view["parameters"] is None:
        return f"rank {view['rank']} ({where}): parameters not counted ({view['reason']})", {"rank": view["rank"]}
    text = (f"rank {view['rank']} ({where}): {view['parameters']:,} parameters, {fmt_bytes(view['parameter_bytes'])}"
            f"; gradients {fmt_bytes(view['gradient_bytes'])}, AdamW {fmt_bytes(view['optimizer_bytes'])}")
    return text, {"rank": view["rank"], "parameters": view["parameters"], "bytes": view["parameter_bytes"]}


def box_note(view: dict | None, rows: list[dict]) -> tuple[str, dict] | None:
    """The rank's share of a box's modules (``rows``: each ``{n, rank_bytes, rank_held}``): text and data."""
    if view is None or view["parameters"] is None:
        return None
    n, held, nbytes = (sum(r[k] for r in rows) for k in ("n", "rank_held", "rank_bytes"))
    if not any(r["params"] for r in rows):
        return None
    part = f"{held} of {n} held" if n > 1 else ("held" if held else "not held")
    return f"rank {view['rank']}: {part}, {fmt_bytes(nbytes)}", {"rank-bytes": nbytes, "rank-held": held}


def wrap_note(view: dict | None) -> str:
    """The block frame's words for the data-parallel wrapping ('' without FSDP2 on the blocks)."""
    w = ((view or {}).get("layout") or {}).get("wrapping")
    return f"; FSDP2 wraps each ({' x '.join(w['over_axes'])})" if w and w["blocks"] else ""


def _strip(d: Drawing, y: float, label: str, cells: list[tuple[str, bool, dict]]) -> float:
    d.text(24, y + 14, label, size=11, weight="bold")
    x0, w = 24 + 130, (WIDTH - 130) / max(1, len(cells))
    for k, (text, mine, data) in enumerate(cells):
        d.rect(x0 + k * w, y, w - 2, 20, fill=MINE if mine else OTHER, stroke="#777777", title=data.pop("title", text),
               data={**data, "mine": str(mine).lower()})
        if w > 16:
            d.text(x0 + k * w + (w - 2) / 2, y + 14, text, size=9 if w < 40 else 10, anchor="middle")
    return y + 26


def _wrapping_lines(w: dict | None) -> list[tuple[str, dict]]:
    """The data-parallel wrapping: a line naming the mode and its group (``data-fsdp-units``: each unit's modules,
    ``;``-separated, a root as ``root:<name>``), then a line per kind of unit with this rank's bytes
    (:func:`meshplan.checks.rank_layout.unit_texts`, the words of ``check --rank R``)."""
    if w is None:
        return [("FSDP2/DDP: none (no data-parallel degree above 1)", {"fsdp": "none"})]
    over = " x ".join(w["over_axes"])
    kind = {"ddp": "DDP (replicate)", "hsdp": "HSDP (fully_shard)"}.get(w["mode"], "FSDP2 (fully_shard)")
    units = ";".join(",".join(u["modules"]) or f"root:{u['root']}" for u in w["units"])
    n = len(w["units"])
    out = [(f"{kind} wraps {n} unit{'s' if n != 1 else ''} over {over} (ranks {ranks_text(w['ranks'])}), in this order:",
            {"fsdp": w["mode"], "fsdp-units": units})]
    return out + [(t, {"fsdp": "unit"}) for t in unit_texts(w)]


def rank_panel(d: Drawing, view: dict | None, y: float) -> float:
    """Draw the rank panel from ``y``; returns the y under it."""
    lay = (view or {}).get("layout")
    if not lay:
        return y
    d.text(24, y + 14, f"what each axis gives rank {view['rank']}", size=12, weight="bold")
    y += 22
    if lay["stages"]:
        cells = [(f"s{s['stage']}", s["mine"], {"stage": s["stage"], "stage-rank": s["pp_rank"],
                                                "title": f"stage {s['stage']} (stage rank {s['pp_rank']}): {s['text']}"})
                 for s in lay["stages"]]
        y = _strip(d, y, "stages", cells)
        mine = "; ".join(f"stage {s['stage']}: {s['text']}" for s in lay["stages"] if s["mine"])
        d.text(24 + 130, y + 10, f"rank {view['rank']} holds {mine}", size=10.5, data={"stages-held": mine})
        y += 18
    for text, data in _wrapping_lines(lay["wrapping"]):
        if data["fsdp"] != "unit":
            d.rect(24, y + 3, 12, 12, fill=FSDP if data["fsdp"] != "none" else OTHER)
        d.text(42 if data["fsdp"] != "unit" else 60, y + 13, text, size=10.5, data=data)
        y += 18
    for share in lay["shares"]:
        d.text(24, y + 13, share["text"], size=10.5, data={"share": share["axis"]})
        y += 18
        if share["cells"]:
            y = _strip(d, y + 2, share["label"], [(c, mine, {"cell": c, "axis": share["axis"]})
                                                   for c, mine in share["cells"]])
    return y + 6
