"""PNG output of a :class:`~meshplan.viz.drawing.Drawing` through matplotlib (the optional ``meshplan[viz]`` extra).

The same shapes as the SVG: one matplotlib patch or text per item, on a figure of the drawing's size in pixels
(``scale`` × for sharper text), rendered headless with the Agg backend.
"""

from __future__ import annotations

import io

from meshplan.errors import PlanError
from meshplan.viz.drawing import Drawing, Line, Rect, Text

__all__ = ["to_png"]

_ANCHOR = {"start": "left", "middle": "center", "end": "right"}


def _dash(dash: str | None):
    return "solid" if not dash else (0, tuple(float(v) for v in dash.replace(",", " ").split()))


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise PlanError("--format png needs matplotlib: pip install 'meshplan[viz]' (or use --format svg, which "
                        "needs nothing)") from None
    matplotlib.use("Agg", force=False)
    from matplotlib.figure import Figure
    from matplotlib.patches import FancyArrowPatch, Rectangle
    return Figure, Rectangle, FancyArrowPatch


def to_png(drawing: Drawing, scale: float = 2.0) -> bytes:
    """The drawing as PNG bytes (``scale`` pixels per drawing unit).

    Raises:
        PlanError: matplotlib is not installed (the message says how to install it).
    """
    Figure, Rectangle, FancyArrowPatch = _pyplot()
    dpi = 100
    fig = Figure(figsize=(drawing.width * scale / dpi, drawing.height * scale / dpi), dpi=dpi)
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(0, drawing.width)
    ax.set_ylim(drawing.height, 0)
    ax.axis("off")
    fig.patch.set_facecolor(drawing.background)
    pt = 72 / dpi * scale  # points per drawing pixel
    for it in drawing.items:
        if isinstance(it, Rect):
            ax.add_patch(Rectangle((it.x, it.y), it.w, it.h, facecolor=it.fill if it.fill != "none" else "none",
                                   edgecolor=it.stroke or "none", linewidth=it.stroke_width * pt if it.stroke else 0,
                                   linestyle=_dash(it.dash)))
        elif isinstance(it, Line):
            if it.arrow:
                ax.add_patch(FancyArrowPatch((it.x1, it.y1), (it.x2, it.y2), arrowstyle="-|>",
                                             mutation_scale=8 * scale, color=it.stroke, linewidth=it.width * pt,
                                             linestyle=_dash(it.dash), shrinkA=0, shrinkB=0))
            else:
                ax.plot([it.x1, it.x2], [it.y1, it.y2], color=it.stroke, linewidth=it.width * pt,
                        linestyle=_dash(it.dash), solid_capstyle="butt")
        elif isinstance(it, Text):
            ax.text(it.x, it.y, it.text, fontsize=it.size * pt, ha=_ANCHOR[it.anchor], va="baseline",
                    color=it.fill, fontweight=it.weight, family="DejaVu Sans")
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, facecolor=drawing.background)
    return buf.getvalue()
