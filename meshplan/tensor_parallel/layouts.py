"""Layouts as torch takes them: placements from the layout texts of a plan, and what one module's torch
``ParallelStyle`` is built from.

The text arithmetic (the residual stream, the collectives of a conversion) is torch-free, in
:mod:`meshplan.plan_file.layout_text`; its names are importable from here too. The style table
(:mod:`meshplan.tensor_parallel.style_table`) builds each style's torch objects from :class:`StyleArgs`.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Any, Mapping

from meshplan.plan_file.layout_text import Stream, backward_collectives, conversions_collectives, \
    redistribute_collectives, residual_stream
from meshplan.plan_file.tensor_parallel import layout_kind

__all__ = ["residual_stream", "Stream", "StyleArgs", "placement", "parse_layout", "redistribute_collectives",
           "backward_collectives", "conversions_collectives"]

_SHARD_RE = re.compile(r"^shard\((-?\d+)\)$")


def parse_layout(text: str | None) -> Any:
    """``"shard(1)"`` → ``Shard(1)`` (``None`` stays ``None``: a non-tensor argument)."""
    if text is None:
        return None
    from torch.distributed.tensor import Partial, Replicate, Shard
    kind = layout_kind(text)
    if kind != "S":
        return Replicate() if kind == "R" else Partial()
    m = _SHARD_RE.match(text)
    assert m, text  # validated by LayoutText
    return Shard(int(m.group(1)))


@dataclass(frozen=True)
class StyleArgs:
    """What one module's torch ``ParallelStyle`` is built from (see :mod:`meshplan.tensor_parallel.style_table`).

    Attributes:
        layouts: the style's layouts as text, defaults filled in.
        stream: the section's residual stream.
        overrides: the keyword arguments the rule set.
        packed: ``None`` for the plain style, else the packed style's count (packed weights, ``Conv1D``).
    """

    layouts: Mapping[str, Any]
    stream: Stream
    overrides: Mapping[str, Any]
    packed: int | None = None

    def torch_kwargs(self) -> dict[str, Any]:
        """:attr:`layouts` as torch's keyword arguments: placements for layouts, the rest as is."""
        out = {}
        for key, value in self.layouts.items():
            if key.endswith("_kwarg_layouts"):
                out[key] = {k: parse_layout(v) for k, v in (value or {}).items()} or None
            else:
                out[key] = placement(value) if key.endswith("layouts") else value
        return out


@functools.lru_cache(maxsize=None)
def _parse(text: str):
    return parse_layout(text)  # placements are immutable: one object per layout text


def placement(value: Any) -> Any:
    """The torch placement(s) of a layout text, a list of them (a tuple), or ``None`` (``None``)."""
    if value is None:
        return None
    if isinstance(value, list):
        return tuple(_parse(v) for v in value)
    return _parse(value)
