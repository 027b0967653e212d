"""A picture as data: rectangles, lines and text in pixel units, written as SVG (no dependency) or handed to
:mod:`meshplan.viz.png`. Torch-free.

Text is measured with a fixed advance per character (:func:`text_width`, DejaVu Sans / Arial proportions) so that
layouts can size boxes before anything is rendered; every string is XML-escaped when written.

Example::

    >>> d = Drawing(120, 40)
    >>> d.rect(0, 0, 120, 40, fill="#4e79a7", title="rank 0 <tp>")
    >>> d.text(60, 24, "a < b", anchor="middle")
    >>> "a &lt; b" in d.to_svg()
    True
"""

from __future__ import annotations

import colorsys
from dataclasses import dataclass, field
from xml.sax.saxutils import escape, quoteattr

__all__ = ["Drawing", "Rect", "Line", "Text", "text_width", "hsl", "ink_on", "FONT"]

#: the font stack of every text (matplotlib's PNG uses DejaVu Sans, the first)
FONT = "DejaVu Sans, Arial, Helvetica, sans-serif"


def text_width(text: str, size: float) -> float:
    """Approximate rendered width of ``text`` at ``size`` px (DejaVu Sans averages ~0.6 em per character)."""
    return 0.6 * size * len(text)


def hsl(hue: float, saturation: float, lightness: float) -> str:
    """``#rrggbb`` of a colour given as hue in degrees, saturation and lightness in [0, 1]."""
    r, g, b = colorsys.hls_to_rgb((hue % 360) / 360, lightness, saturation)
    return "#{:02x}{:02x}{:02x}".format(*(round(c * 255) for c in (r, g, b)))


def ink_on(fill: str) -> str:
    """Black or white text, whichever reads better on ``fill`` (``#rrggbb``)."""
    r, g, b = (int(fill[i:i + 2], 16) / 255 for i in (1, 3, 5))
    return "#111111" if 0.299 * r + 0.587 * g + 0.114 * b > 0.55 else "#ffffff"


@dataclass(frozen=True)
class Rect:
    x: float
    y: float
    w: float
    h: float
    fill: str = "none"
    stroke: str | None = None
    stroke_width: float = 1.0
    rx: float = 0.0
    dash: str | None = None
    title: str | None = None
    data: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class Line:
    x1: float
    y1: float
    x2: float
    y2: float
    stroke: str = "#333333"
    width: float = 1.0
    dash: str | None = None
    arrow: bool = False


@dataclass(frozen=True)
class Text:
    x: float
    y: float
    text: str
    size: float = 11.0
    anchor: str = "start"
    fill: str = "#111111"
    weight: str = "normal"
    data: tuple[tuple[str, str], ...] = ()


def _num(v: float) -> str:
    return f"{v:.1f}".rstrip("0").rstrip(".")


def _data(pairs: tuple[tuple[str, str], ...]) -> str:
    return "".join(f" data-{k}={quoteattr(str(v))}" for k, v in pairs)


@dataclass
class Drawing:
    """The shapes of one picture, in drawing order, on a ``width`` × ``height`` px canvas (y grows downwards).

    ``data`` pairs become ``data-*`` attributes in SVG: tests read what a cell stands for from them.
    """

    width: float
    height: float
    items: list[Rect | Line | Text] = field(default_factory=list)
    background: str = "#ffffff"

    def rect(self, x: float, y: float, w: float, h: float, **kw) -> None:
        kw["data"] = tuple((kw.get("data") or {}).items())
        self.items.append(Rect(x, y, w, h, **kw))

    def line(self, x1: float, y1: float, x2: float, y2: float, **kw) -> None:
        self.items.append(Line(x1, y1, x2, y2, **kw))

    def text(self, x: float, y: float, text: str, **kw) -> None:
        kw["data"] = tuple((kw.get("data") or {}).items())
        self.items.append(Text(x, y, str(text), **kw))

    def to_svg(self) -> str:
        """The picture as a standalone SVG document (valid XML, every text and attribute escaped)."""
        out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{_num(self.width)}" height="{_num(self.height)}" '
               f'viewBox="0 0 {_num(self.width)} {_num(self.height)}" font-family={quoteattr(FONT)}>',
               '<defs><marker id="arrow" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" markerHeight="7" '
               'orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" fill="#444444"/></marker></defs>',
               f'<rect width="100%" height="100%" fill="{self.background}"/>']
        for it in self.items:
            if isinstance(it, Rect):
                stroke = f' stroke="{it.stroke}" stroke-width="{_num(it.stroke_width)}"' if it.stroke else ""
                dash = f' stroke-dasharray="{it.dash}"' if it.dash else ""
                rx = f' rx="{_num(it.rx)}"' if it.rx else ""
                title = f"<title>{escape(it.title)}</title>" if it.title else ""
                out.append(f'<rect x="{_num(it.x)}" y="{_num(it.y)}" width="{_num(it.w)}" height="{_num(it.h)}" '
                           f'fill="{it.fill}"{stroke}{dash}{rx}{_data(it.data)}>{title}</rect>')
            elif isinstance(it, Line):
                dash = f' stroke-dasharray="{it.dash}"' if it.dash else ""
                arrow = ' marker-end="url(#arrow)"' if it.arrow else ""
                out.append(f'<line x1="{_num(it.x1)}" y1="{_num(it.y1)}" x2="{_num(it.x2)}" y2="{_num(it.y2)}" '
                           f'stroke="{it.stroke}" stroke-width="{_num(it.width)}"{dash}{arrow}/>')
            else:
                weight = ' font-weight="bold"' if it.weight == "bold" else ""
                out.append(f'<text x="{_num(it.x)}" y="{_num(it.y)}" font-size="{_num(it.size)}" '
                           f'text-anchor="{it.anchor}" fill="{it.fill}"{weight}{_data(it.data)}>'
                           f'{escape(it.text)}</text>')
        out.append("</svg>")
        return "\n".join(out) + "\n"
