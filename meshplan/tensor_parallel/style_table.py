"""The tensor-parallel styles' torch side: one :class:`StyleSpec` per style name, its meaning and its torch builds.

What a style name means without torch (layouts, collectives, its part in a block, its transformers spelling) is
:data:`meshplan.plan_file.style_semantics.SEMANTICS`, in the torch-free spec layer. Here each entry extends its
semantics with the torch ``ParallelStyle`` it builds, the module types it fits and the dim tp shards. Plan
generation (:mod:`meshplan.tensor_parallel.generate`), validation (:mod:`meshplan.tensor_parallel.check.validate`),
the explain table of ``meshplan check`` (:mod:`meshplan.checks.explain`) and the region checks read
:data:`STYLES`; the style table is these two files, and no other module compares style names. A new style is a rule class in
:mod:`meshplan.plan_file.tensor_parallel`, an entry in ``SEMANTICS`` and one here.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Callable, Mapping

import torch.nn as nn
from torch.distributed.tensor.parallel import ParallelStyle, PrepareModuleInput, PrepareModuleOutput

from meshplan.plan_file.style_semantics import SEMANTICS, StyleSemantics, frozen
from meshplan.tensor_parallel.layouts import StyleArgs, placement
from meshplan.tensor_parallel.latent import LatentColwiseParallel, LatentParallel
from meshplan.tensor_parallel.head_params import head_params_style
from meshplan.tensor_parallel.projection_norm import normalized_features as _features, projection_norm_style
from meshplan.tensor_parallel.packed import PackedColwiseParallel, PackedRowwiseParallel, features, packed_placement
from meshplan.tensor_parallel.styles import ColwiseParallel, ReplicateParallel, RowwiseParallel, SequenceParallel
from meshplan.tensor_parallel.styles import TableWiseEmbedding
from meshplan.tensor_parallel.vocab_embedding import VocabParallelEmbedding

__all__ = ["StyleSpec", "StyleArgs", "STYLES"]


def _untouched(a: StyleArgs) -> None:
    """No torch style: the module is left as is (head_norm; the default)."""
    return None


@dataclass(frozen=True)
class StyleSpec(StyleSemantics):
    """Everything one tensor-parallel style means: its :class:`~meshplan.plan_file.style_semantics.StyleSemantics`
    (every attribute of those) and its torch side.

    Attributes:
        build: a fresh torch ``ParallelStyle`` for one module (``None``: the module is left as is).
        needs: module types plan generation accepts for the plain torch style (empty: any; packed: ``Conv1D`` too).
        fits: ``fits(module, packed)``: does validation accept the module? (``None``: any.) Finer than
            ``needs``: ``Conv1D``, a packed ``nn.Embedding``, embedding tables.
        sharded_dim: ``(name, size)`` of the dim tp shards (packed-aware: ``Conv1D``'s features too).

    Example::

        >>> STYLES["rowwise"].needs_text(), STYLES["rowwise"].row_parallel
        ('nn.Linear or nn.Embedding', True)
    """

    build: Callable[[StyleArgs], ParallelStyle | None] = _untouched
    needs: tuple[type, ...] = ()
    fits: Callable[[nn.Module, int], bool] | None = None
    sharded_dim: Callable[[nn.Module], tuple[str, int]] | None = None

    def needs_text(self) -> str:
        """Plan generation's expected module types: ``"nn.Linear or nn.Embedding"``."""
        return " or ".join(f"nn.{t.__name__}" for t in self.needs)


# -- builds -----------------------------------------------------------------------------------------------
def _colwise(a: StyleArgs) -> ParallelStyle:
    kw = a.torch_kwargs()
    if a.packed is None:
        return ColwiseParallel(**kw)
    if "output_layouts" not in a.overrides:
        kw["output_layouts"] = packed_placement(-1, a.packed)
    return PackedColwiseParallel(packed=a.packed, **kw)


def _rowwise(a: StyleArgs) -> ParallelStyle:
    kw = a.torch_kwargs()
    if a.packed is None:
        return RowwiseParallel(**kw)
    if "input_layouts" not in a.overrides:
        kw["input_layouts"] = packed_placement(-1, a.packed)
    return PackedRowwiseParallel(packed=a.packed, **kw)


def _norm(a: StyleArgs) -> ParallelStyle | None:
    if a.stream.local:
        return None  # untouched without sequence parallelism
    return SequenceParallel(sequence_dim=placement(a.stream.layout).dim, use_local_output=False)


def _torch_style(cls: type) -> Callable[[StyleArgs], ParallelStyle]:
    return lambda a: cls(**a.torch_kwargs())


# -- the modules a style fits, the dim it shards ------------------------------------------------------------

def _projection(mod: nn.Module, packed: int) -> bool:
    return features(mod) is not None or (isinstance(mod, nn.Embedding) and packed == 1)


def _out_dim(mod: nn.Module) -> tuple[str, int]:
    if isinstance(mod, nn.Embedding):
        return "embedding_dim", mod.embedding_dim
    return "out_features", features(mod)[1]


def _in_dim(mod: nn.Module) -> tuple[str, int]:
    if isinstance(mod, nn.Embedding):
        return "num_embeddings", mod.num_embeddings
    return "in_features", features(mod)[0]


#: what the two projection styles share: the modules they fit
_PROJECTION = frozen(needs=(nn.Linear, nn.Embedding), fits=_projection)
#: what the two embedding styles share: the module they fit
_EMBEDDING = frozen(needs=(nn.Embedding,), fits=lambda m, packed: isinstance(m, nn.Embedding))

#: each style's torch side, by name (its semantics: SEMANTICS[name])
_TORCH: Mapping[str, Mapping[str, Any]] = frozen(
    colwise=frozen(build=_colwise, sharded_dim=_out_dim, **_PROJECTION),
    rowwise=frozen(build=_rowwise, sharded_dim=_in_dim, **_PROJECTION),
    norm=frozen(build=_norm),
    embedding=frozen(build=_torch_style(VocabParallelEmbedding), **_EMBEDDING,
                     sharded_dim=lambda m: ("num_embeddings", m.num_embeddings)),
    embedding_colwise=frozen(build=_torch_style(ColwiseParallel), **_EMBEDDING,
                             sharded_dim=lambda m: ("embedding_dim", m.embedding_dim)),
    embedding_tables=frozen(build=lambda a: TableWiseEmbedding(),
                            fits=lambda m, packed: any(isinstance(c, nn.Embedding) for c in m.children())),
    lm_head=frozen(build=_torch_style(ColwiseParallel), needs=(nn.Linear, nn.Embedding),
                   fits=lambda m, packed: isinstance(m, nn.Linear),
                   sharded_dim=lambda m: ("out_features", m.out_features)),
    replicate=frozen(build=_torch_style(ReplicateParallel)),
    head_norm=frozen(build=_untouched),
    latent=frozen(build=lambda a: LatentParallel()),
    latent_colwise=frozen(build=_torch_style(LatentColwiseParallel), needs=(nn.Linear,), sharded_dim=_out_dim,
                          fits=lambda m, k: isinstance(m, nn.Linear)),
    head_params=frozen(build=lambda a: head_params_style(a.overrides)),
    projection_norm=frozen(build=projection_norm_style, fits=lambda m, _: _features(m) is not None,
                           sharded_dim=lambda m: ("features", _features(m) or 0)),
    prepare_input=frozen(build=_torch_style(PrepareModuleInput)),
    prepare_output=frozen(build=_torch_style(PrepareModuleOutput)),
)

STYLES: Mapping[str, StyleSpec] = frozen(**{
    name: StyleSpec(**{f.name: getattr(sem, f.name) for f in fields(StyleSemantics)}, **_TORCH[name])
    for name, sem in SEMANTICS.items()})
