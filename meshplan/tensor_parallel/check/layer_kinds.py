"""Rules whose wildcard pattern spans layers of different kinds (GLM-5-Next's linear-attention and MLA layers both
hold ``self_attn.o_proj``): a rowwise that has colwise siblings in some layers only.

transformers' plans name ``layers.*.self_attn.o_proj: rowwise`` for every layer; in a layer whose attention has no
colwise projections its input is whole, and rowwise would treat it as a shard. The fix is a rule per module that
does have the colwise siblings (and none for the others, which then run whole).
"""

from __future__ import annotations

from typing import Any

from meshplan.tensor_parallel.style_table import STYLES

__all__ = ["layer_kinds_hint"]


def layer_kinds_hint(pattern: str, by_parent: dict[str, list[tuple[str, str, Any]]] | None,
                     modules: dict[str, Any]) -> str:
    """The end of the error of a rowwise without colwise siblings: the modules of the same ``pattern`` that have
    them (``by_parent``: parent path → ``(path, pattern, rule)`` of its ruled children), or ``""``."""
    if not by_parent:
        return ""
    other = [(p, par) for par, kids in by_parent.items() for p, pat, _ in kids
             if pat == pattern and any(STYLES[k[2].style].column_parallel for k in kids)]
    if not other:
        return ""
    kind = type(modules[other[0][1]]).__name__ if other[0][1] in modules else "a module"
    more = f" (and {len(other) - 4} more)" if len(other) > 4 else ""
    return (f"; the pattern also matches {len(other)} module(s) whose parent ({kind}) has colwise children: the "
            f"layers differ in kind, so replace {pattern!r} by one rule per such module "
            f"({', '.join(repr(p) for p, _ in other[:4])}{more}) and leave the others without a rule")
