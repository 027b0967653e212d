"""transformers checkpoints whose keys are not the model's parameter names: read through transformers' own
conversion mapping, slice by slice.

transformers 5 keeps a mixture-of-experts layer's experts stacked in memory (Mixtral's
``mlp.experts.gate_up_proj`` ``[E, 2F, H]``) while checkpoints on the Hub, and its own ``save_pretrained``, hold one
tensor per expert (``block_sparse_moe.experts.3.w1.weight``); ``from_pretrained`` renames, stacks and concatenates
them on load (``transformers.conversion_mapping``). :func:`converted_sources` applies the same mapping (renamings,
``MergeModulelist`` stacking, ``Concatenate``) lazily: each parameter becomes a :class:`Merged` view that reads only
the rows a rank's shard asks for (an ep rank reads its experts' tensors only). Mappings with other operations are
refused by name.
"""

from __future__ import annotations

import re
from typing import Any, Callable

import torch

from meshplan.errors import PlanError

__all__ = ["Merged", "converted_sources"]

Reader = Callable[[], Any]  # returns an object with get_shape() and [slices] (a safetensors slice)


def _natural(key: str) -> list[Any]:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", key)]


class Merged:
    """One parameter assembled from checkpoint tensors: ``parts[p]`` is the list of per-expert tensors of source
    pattern ``p`` (stacked on a new dim 0), the stacks concatenated along ``cat_dim`` (None: one part).

    Offers the two methods :func:`meshplan.weights.load.load_state_dict` uses of a safetensors slice.
    """

    def __init__(self, parts: list[list[Any]], cat_dim: int | None):
        self.parts, self.cat_dim = parts, cat_dim
        shapes = [tuple(p[0].get_shape()) for p in parts]
        shape = [len(parts[0]), *shapes[0]]
        if cat_dim is not None:
            shape[cat_dim] = sum(s[cat_dim - 1] for s in shapes)
        self.shape = tuple(shape)

    def get_shape(self) -> tuple[int, ...]:
        return self.shape

    def get_dtype(self) -> str:
        """The safetensors dtype name of the parts (``"F32"``)."""
        return self.parts[0][0].get_dtype()

    def _row(self, e: int, rest: tuple[slice, ...]) -> torch.Tensor:
        if self.cat_dim is None:
            return self.parts[0][e][rest]
        c = self.cat_dim - 1
        a, b = rest[c].start, rest[c].stop
        pieces, offset = [], 0
        for part in self.parts:
            n = part[e].get_shape()[c]
            lo, hi = max(a, offset), min(b, offset + n)
            if lo < hi:
                pieces.append(part[e][rest[:c] + (slice(lo - offset, hi - offset),) + rest[c + 1:]])
            offset += n
        return torch.cat(pieces, dim=c)

    def __getitem__(self, index: tuple[slice, ...]) -> torch.Tensor:
        first, rest = index[0], tuple(index[1:])
        return torch.stack([self._row(e, rest) for e in range(first.start, first.stop)])


def _ops(converter: Any, target: str) -> int | None:
    """The concatenation dim of a converter made of ``MergeModulelist(dim=0)`` (+ ``Concatenate``); else refused."""
    names = [type(op).__name__ for op in converter.operations]
    dims = [getattr(op, "dim", None) for op in converter.operations]
    if names == ["MergeModulelist"] and dims == [0]:
        return None
    if names == ["MergeModulelist", "Concatenate"] and dims[0] == 0:
        return dims[1]
    raise PlanError(f"load_safetensors: {target}: transformers converts its checkpoint tensors with {names}; meshplan "
                    f"reads stacked experts (MergeModulelist(dim=0), then Concatenate) lazily and nothing else yet; "
                    f"load this model with transformers' from_pretrained before meshplan.parallelize")


def converted_sources(model: Any, keys: list[str], missing: set[str], open_slice: Callable[[str], Reader]
                      ) -> tuple[dict[str, Reader], set[str]]:
    """Readers for the ``missing`` parameters of a transformers ``model`` built from the checkpoint ``keys``.

    Args:
        model: a transformers ``PreTrainedModel`` (anything else: no conversion, ``{}``).
        keys: the checkpoint's keys.
        missing: the model's parameter names the checkpoint has no key for.
        open_slice: ``open_slice(key)`` → a safetensors slice of checkpoint key ``key``.

    Returns:
        ``({parameter name: reader}, the checkpoint keys they read)`` for the missing names the mapping produces.

    Raises:
        PlanError: the mapping needs an operation :class:`Merged` does not implement.
    """
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, rename_source_key
    except ImportError:
        return {}, set()
    if not hasattr(model, "config") or not hasattr(model, "base_model_prefix"):
        return {}, set()
    transforms = get_model_conversion_mapping(model)
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    renamings = [t for t in transforms if not isinstance(t, WeightConverter)]
    groups: dict[str, dict[str, list[str]]] = {}
    for key in keys:
        target, pattern = rename_source_key(key, renamings, converters)
        if target in missing:
            groups.setdefault(target, {}).setdefault(pattern or "", []).append(key)
    out: dict[str, Reader] = {}
    for target, by_pattern in groups.items():
        if list(by_pattern) == [""]:  # renamed only
            out[target] = (lambda k=by_pattern[""][0]: open_slice(k))
            continue
        conv = next(c for c in converters if any(p in c.source_patterns for p in by_pattern))
        cat_dim = _ops(conv, target)
        ordered = [sorted(by_pattern[p], key=_natural) for p in conv.source_patterns if p in by_pattern]
        out[target] = (lambda o=ordered, c=cat_dim: Merged([[open_slice(k) for k in part] for part in o], c))
    return out, {k for by_pattern in groups.values() for ks in by_pattern.values() for k in ks}
