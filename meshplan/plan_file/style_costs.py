"""The collectives each tensor-parallel style costs, forward and backward, given its layouts.

Each function takes the style's resolved layouts (``lay``) and the rule's own overrides (``o``) and returns
``(forward collectives, backward collectives)``; :data:`meshplan.plan_file.style_semantics.SEMANTICS` names one
per style (the explain table of ``meshplan check`` and the converters read them). Torch-free (the spec layer).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

from meshplan.plan_file.layout_text import backward_collectives as back, conversions_collectives
from meshplan.plan_file.layout_text import redistribute_collectives as redist

Costs = tuple[list[str], list[str]]


def colwise_costs(lay: Mapping[str, Any], o: Mapping[str, Any]) -> Costs:
    fwd: list[str] = []
    bwd: list[str] = []
    if "input_layouts" in o:  # else its parent converts the input once (a row of its own)
        fwd += redist(lay["input_layouts"], "replicate")
        bwd += redist("partial", lay["input_layouts"])
    return fwd + redist("shard(-1)", lay["output_layouts"]), bwd


def rowwise_costs(lay: Mapping[str, Any], o: Mapping[str, Any]) -> Costs:
    inp, out = lay["input_layouts"], lay["output_layouts"]
    return (redist(inp, "shard(-1)") + redist("partial", out),
            back(inp, "shard(-1)") + back("partial", out))


def reduced_costs(computed: str) -> Callable[[Mapping[str, Any], Mapping[str, Any]], Costs]:
    """An embedding computes ``computed`` (partial lookups, or embedding-dim shards), converted to its output."""
    return lambda lay, o: (redist(computed, lay["output_layouts"]), back(computed, lay["output_layouts"]))


def lm_head_costs(lay: Mapping[str, Any], o: Mapping[str, Any]) -> Costs:
    inp = lay["input_layouts"]
    return redist(inp, "replicate") + redist("shard(-1)", lay["output_layouts"]), redist("partial", inp)


def prepare_costs(source: str, desired: str) -> Callable[[Mapping[str, Any], Mapping[str, Any]], Costs]:
    """Each layout of ``source`` converted to the one of ``desired``."""
    return lambda lay, o: conversions_collectives(lay[source], lay[desired])
