"""Match plan rules (module-path patterns) to a model's modules."""

from __future__ import annotations

import difflib
import re
from fnmatch import fnmatchcase
from typing import Any, Mapping

import torch.nn as nn

from .errors import PlanError

__all__ = ["match_rules", "is_pattern"]


def is_pattern(path: str) -> bool:
    return any(c in path for c in "*?[")


def _matches(pattern: str, path: str) -> bool:
    ps, qs = pattern.split("."), path.split(".")
    return len(ps) == len(qs) and all(fnmatchcase(q, p) for p, q in zip(ps, qs))


def _closest(pattern: str, paths: list[str]) -> list[str]:
    probe = re.sub(r"\*", "0", pattern)
    return difflib.get_close_matches(probe, paths, n=3, cutoff=0.3)


def match_rules(model: nn.Module, rules: Mapping[str, Any], where: str = "tensor_parallel.rules") -> dict[str, tuple[str, Any]]:
    """Assign each module path the rule that claims it.

    An exact path beats a wildcard; two wildcard rules that claim one module
    with different rules are an error, and so is a rule that matches nothing
    (the message names the closest module paths).

    Returns:
        ``{module_path: (pattern, rule)}`` in the model's module order.

    Raises:
        PlanError: unmatched rule or conflicting rules; names ``where`` and the pattern.
    """
    paths = [name for name, _ in model.named_modules() if name]
    claims: dict[str, list[tuple[str, Any]]] = {}
    for pattern, rule in rules.items():
        hits = [p for p in paths if p == pattern] if not is_pattern(pattern) else [p for p in paths if _matches(pattern, p)]
        if not hits:
            near = _closest(pattern, paths)
            hint = f"; closest module paths: {', '.join(near)}" if near else f"; the model has {len(paths)} modules"
            raise PlanError(f"{where}.{pattern!r}: matches no module of {type(model).__name__}{hint}")
        for h in hits:
            claims.setdefault(h, []).append((pattern, rule))
    out: dict[str, tuple[str, Any]] = {}
    for path in paths:
        cands = claims.get(path)
        if not cands:
            continue
        exact = [c for c in cands if not is_pattern(c[0])]
        if exact:
            out[path] = exact[0]
            continue
        first = cands[0]
        for other in cands[1:]:
            if other[1] != first[1]:
                raise PlanError(f"{where}: module {path!r} is claimed by {first[0]!r} ({first[1].style}) and "
                                f"{other[0]!r} ({other[1].style}); give it an exact rule or narrow a pattern")
        out[path] = first
    return out
