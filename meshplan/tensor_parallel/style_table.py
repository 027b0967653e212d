"""The tensor-parallel styles: one :class:`StyleSpec` per style name, everything the name means.

A plan rule names a style; its data (the fields a rule may set) is a rule class of
:mod:`meshplan.plan_file.tensor_parallel`, whose ``STYLE_NAMES`` is the one list of names. What the name *means*
is here: the modules it fits, the sizes tp must divide, its layouts given the residual stream, the torch
``ParallelStyle`` it builds, the collectives it costs, whether its parameters are sharded, its part in a block
(the colwise fan-out, local heads, the rowwise reduction) and its transformers spelling. Plan generation
(:mod:`meshplan.tensor_parallel.generate`), validation (:mod:`meshplan.checks.validate`), the explain table of
``meshplan check`` (:mod:`meshplan.checks.explain`), the region checks and transformers conversion read
:data:`STYLES`; no other module compares style names. A new style is a rule class there and an entry here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from operator import attrgetter
from types import MappingProxyType
from typing import Any, Callable, Mapping

import torch.nn as nn
from torch.distributed.tensor.parallel import ParallelStyle, PrepareModuleInput, PrepareModuleOutput

from meshplan.tensor_parallel.layouts import Stream, StyleArgs
from meshplan.tensor_parallel.style_costs import Costs, colwise_costs, lm_head_costs, prepare_costs, reduced_costs
from meshplan.tensor_parallel.style_costs import rowwise_costs
from meshplan.tensor_parallel.latent import LatentColwiseParallel, LatentParallel
from meshplan.tensor_parallel.layouts import placement, redistribute_collectives as redist
from meshplan.tensor_parallel.head_params import head_params_style
from meshplan.tensor_parallel.projection_norm import normalized_features as _features, projection_norm_style
from meshplan.tensor_parallel.packed import PackedColwiseParallel, PackedRowwiseParallel, features, packed_placement
from meshplan.tensor_parallel.styles import ColwiseParallel, ReplicateParallel, RowwiseParallel, SequenceParallel
from meshplan.tensor_parallel.styles import TableWiseEmbedding
from meshplan.tensor_parallel.vocab_embedding import VocabParallelEmbedding

__all__ = ["StyleSpec", "StyleArgs", "STYLES", "gives_local_shards"]



def gives_local_shards(overrides: Mapping[str, Any]) -> bool:
    """Does a colwise rule hand its module's caller this rank's shard (local heads) as a plain tensor?
    Not when its output is gathered (``output_layouts: replicate``) or kept a DTensor (global shape)."""
    return overrides.get("output_layouts") in (None, "shard(-1)") and overrides.get("use_local_output", True)


def _frozen(**defaults: Any) -> Mapping[str, Any]:
    return MappingProxyType(defaults)


@dataclass(frozen=True)
class StyleSpec:
    """Everything one tensor-parallel style means.

    Attributes:
        name: the style name a plan rule writes.
        build: a fresh torch ``ParallelStyle`` for one module (``None``: the module is left as is).
        defaults: the style's layouts (torch's keyword arguments) when the rule sets none: text, or a function
            of the :class:`~meshplan.tensor_parallel.layouts.Stream`.
        costs: ``(forward, backward)`` collectives of one module, from its layouts and overrides (not its parent's).
        needs: module types plan generation accepts for the plain torch style (empty: any; packed: ``Conv1D`` too).
        fits: ``fits(module, packed)``: does validation accept the module? (``None``: any.) Finer than
            ``needs``: ``Conv1D``, a packed ``nn.Embedding``, embedding tables.
        expects: what validation expected, for its message; ``misfit``: what it found lacking.
        sharded_dim: ``(name, size)`` of the dim tp shards (packed-aware: ``Conv1D``'s features too).
        size_note: appended to that name in plan generation's error (``" (vocab)"``).
        shards_params: its parameters are sharded over tp, but for ``replicated_params`` (names).
        column_parallel: a colwise projection: unless its ``input_layouts`` is set its parent converts the
            input once for all its colwise children (the fan-out); a plain ``shard(-1)`` output gives the parent
            local heads; its output feeds a rowwise sibling; it may pack fused parts.
        row_parallel: a rowwise projection: it needs a colwise sibling's ``shard(-1)``, and may leave its
            output ``partial`` for a parent's gather.
        packable: takes ``packed: k`` and ``Conv1D`` (the packed styles).
        stream_module: runs as is on the residual stream (``SequenceParallel`` under SP, untouched without;
            its dropouts draw per-shard masks under SP, shared ones without), so never on a projection.
        takes_stream: its input_layouts must be the residual stream; ``writes_stream``: its output is the
            stream (another output_layouts costs an extra redistribute).
        covers_submodules: modules inside it need no rule of their own.
        replicated: parameters replicated over tp, module run whole (partial gradients reduced once per
            backward); its input must be replicated, not local heads.
        on_local_heads: runs unchanged on this rank's heads (a colwise sibling's local output); its gradients
            are summed over tp.
        latent: MLA's latent (:mod:`~meshplan.tensor_parallel.latent`): takes its parent's converted input like a
            colwise child, runs whole, gradient partial; ``latent_input``: a colwise whose input is a latent.
        head_params: on a module seeing local heads: its rule's ``sharded`` own parameters split with the heads.
        whole_projection: a norm over a colwise sibling's whole output run on its shards (mean summed over tp).
        reduces_output: with ``output_layouts: partial`` it reduces its module's partial output (transformers'
            ``gather``), which rowwise rules below it must leave partial.
        hf_name: transformers' tp_plan string; ``hf_packed`` with ``packed: 2``; ``hf_variant``
            ``(field, value, string)`` when the rule sets ``field`` to ``value``.

    Example::

        >>> spec = STYLES["rowwise"]
        >>> spec.layouts({}, Stream(sequence_parallel=True))
        {'input_layouts': 'shard(-1)', 'output_layouts': 'shard(1)', 'use_local_output': False}
        >>> spec.collectives({}, Stream(sequence_parallel=True))
        (['reduce_scatter'], ['all_gather'])
    """

    name: str
    build: Callable[[StyleArgs], ParallelStyle | None]
    defaults: Mapping[str, Any] = field(default_factory=_frozen)
    costs: Callable[[Mapping[str, Any], Mapping[str, Any]], Costs] = lambda layouts, overrides: ([], [])
    needs: tuple[type, ...] = ()
    fits: Callable[[nn.Module, int], bool] | None = None
    expects: str = ""
    misfit: str = ""
    sharded_dim: Callable[[nn.Module], tuple[str, int]] | None = None
    size_note: str = ""
    shards_params: bool = False
    replicated_params: tuple[str, ...] = ()
    column_parallel: bool = False
    row_parallel: bool = False
    packable: bool = False
    stream_module: bool = False
    takes_stream: bool = False
    writes_stream: bool = False
    covers_submodules: bool = False
    replicated: bool = False
    on_local_heads: bool = False
    head_params: bool = False
    whole_projection: bool = False
    reduces_output: bool = False
    latent: bool = False
    latent_input: bool = False
    hf_name: str | None = None
    hf_packed: str | None = None
    hf_variant: tuple[str, str, str] | None = None

    def layouts(self, overrides: Mapping[str, Any], stream: Stream) -> dict[str, Any]:
        """The style's layouts (text) for a rule: the rule's own, else the defaults for ``stream``."""
        return {k: overrides[k] if k in overrides else v(stream) if callable(v) else v
                for k, v in self.defaults.items()}

    def collectives(self, overrides: Mapping[str, Any], stream: Stream) -> Costs:
        """``(forward, backward)`` collectives of one module of a rule (see :mod:`meshplan.checks.explain`)."""
        return self.costs(self.layouts(overrides, stream), overrides)

    def needs_text(self) -> str:
        """Plan generation's expected module types: ``"nn.Linear or nn.Embedding"``."""
        return " or ".join(f"nn.{t.__name__}" for t in self.needs)

    def gives_local_heads(self, overrides: Mapping[str, Any]) -> bool:
        """Does the parent of this rule's module see local heads (a colwise with a plain ``shard(-1)`` output)?"""
        return self.column_parallel and gives_local_shards(overrides)

    def gives_dtensor_output(self, overrides: Mapping[str, Any]) -> bool:
        """Does a colwise keep its output a DTensor (``use_local_output: false``: q/k/v reach SDPA as DTensors)?"""
        return self.column_parallel and overrides.get("use_local_output") is False

    def parent_converts_input(self, overrides: Mapping[str, Any]) -> bool:
        """Does the parent convert this module's input (once per block: the colwise fan-out)?"""
        return (self.column_parallel and "input_layouts" not in overrides) or self.latent

    def needs_colwise_input(self, overrides: Mapping[str, Any]) -> bool:
        """Does this module take a colwise sibling's ``shard(-1)`` output (a rowwise with that input)?"""
        return self.row_parallel and overrides.get("input_layouts") in (None, "shard(-1)")

    def shards_param(self, name: str) -> bool:
        """Is parameter ``name`` of a module of this style sharded over tp?"""
        return self.shards_params and name not in self.replicated_params

    def hf_style(self, data: Mapping[str, Any]) -> str | None:
        """transformers' tp_plan string for a rule of this style (``data``: its fields), or None."""
        if (data.get("packed") or 1) > 1:
            return self.hf_packed
        if self.hf_variant is not None and data.get(self.hf_variant[0]) == self.hf_variant[1]:
            return self.hf_variant[2]
        return self.hf_name


#: defaults that depend on the section (see :class:`~meshplan.tensor_parallel.layouts.Stream`)
_stream, _batch, _local, _logits, _local_logits = (attrgetter(a) for a in ("layout", "batch", "local", "logits",
                                                                           "local_logits"))


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


#: what the two projection styles share: the modules they fit, sharded parameters, packed weights
_PROJECTION = _frozen(needs=(nn.Linear, nn.Embedding), fits=_projection,
                      expects="nn.Linear, Conv1D or nn.Embedding", shards_params=True, packable=True)
#: what the two embedding styles share: ids in, the residual stream out
_EMBEDDING = _frozen(defaults=_frozen(input_layouts=_batch, output_layouts=_stream, use_local_output=_local),
                     needs=(nn.Embedding,), fits=lambda m, packed: isinstance(m, nn.Embedding),
                     expects="nn.Embedding", shards_params=True, writes_stream=True)

STYLES: Mapping[str, StyleSpec] = MappingProxyType({s.name: s for s in (
    StyleSpec("colwise", build=_colwise, costs=colwise_costs,
              defaults=_frozen(input_layouts="replicate", output_layouts="shard(-1)", use_local_output=True),
              sharded_dim=_out_dim, column_parallel=True, **_PROJECTION,
              hf_name="colwise", hf_packed="packed_colwise", hf_variant=("output_layouts", "replicate", "colwise_rep")),
    StyleSpec("rowwise", build=_rowwise, costs=rowwise_costs,
              defaults=_frozen(input_layouts="shard(-1)", output_layouts=_stream, use_local_output=_local),
              sharded_dim=_in_dim, replicated_params=("bias",), row_parallel=True, writes_stream=True, **_PROJECTION,
              hf_name="rowwise", hf_packed="packed_rowwise", hf_variant=("input_layouts", "replicate", "rowwise_rep")),
    StyleSpec("norm", build=_norm, stream_module=True, covers_submodules=True, hf_name="sequence_parallel"),
    StyleSpec("embedding", build=_torch_style(VocabParallelEmbedding), costs=reduced_costs("partial"),
              sharded_dim=lambda m: ("num_embeddings", m.num_embeddings), **_EMBEDDING,
              hf_name="embedding_rowwise"),
    StyleSpec("embedding_colwise", build=_torch_style(ColwiseParallel), costs=reduced_costs("shard(-1)"),
              sharded_dim=lambda m: ("embedding_dim", m.embedding_dim), **_EMBEDDING,
              hf_name="embedding_colwise"),
    StyleSpec("embedding_tables", build=lambda a: TableWiseEmbedding(),
              costs=lambda lay, o: (["broadcast (per table)"], ["reduce (per table)"]),
              fits=lambda m, packed: any(isinstance(c, nn.Embedding) for c in m.children()),
              expects="a module holding embedding tables", misfit=" with no nn.Embedding children",
              shards_params=True),
    StyleSpec("lm_head", build=_torch_style(ColwiseParallel), costs=lm_head_costs,
              defaults=_frozen(input_layouts=_stream, output_layouts=_logits, use_local_output=_local_logits),
              needs=(nn.Linear, nn.Embedding), fits=lambda m, packed: isinstance(m, nn.Linear), expects="nn.Linear",
              sharded_dim=lambda m: ("out_features", m.out_features), size_note=" (vocab)", shards_params=True,
              takes_stream=True, hf_name="colwise_gather_output"),
    StyleSpec("replicate", build=_torch_style(ReplicateParallel),
              defaults=_frozen(input_layouts="replicate", use_local_output=True),
              covers_submodules=True, replicated=True, hf_name="replicate"),
    StyleSpec("head_norm", build=lambda a: None, on_local_heads=True, hf_name="replicated_with_grad_allreduce"),
    StyleSpec("latent", build=lambda a: LatentParallel(), on_local_heads=True, latent=True, hf_name="mla_kv_a_proj"),
    StyleSpec("latent_colwise", build=_torch_style(LatentColwiseParallel), needs=(nn.Linear,), expects="nn.Linear",
              defaults=_frozen(output_layouts="shard(-1)", use_local_output=True), sharded_dim=_out_dim,
              costs=lambda lay, o: (redist("shard(-1)", lay["output_layouts"]), []), fits=lambda m, k: isinstance(
                  m, nn.Linear), shards_params=True, column_parallel=True, latent_input=True, hf_name="colwise"),
    StyleSpec("head_params", build=lambda a: head_params_style(a.overrides), head_params=True, hf_name="local_params"),
    StyleSpec("projection_norm", build=projection_norm_style, shards_params=True, whole_projection=True,
              fits=lambda m, _: _features(m) is not None, expects="a norm with a 1-D weight",
              sharded_dim=lambda m: ("features", _features(m) or 0), costs=lambda *_: (["all_reduce"], ["all_reduce"])),
    StyleSpec("prepare_input", build=_torch_style(PrepareModuleInput),
              costs=prepare_costs("input_layouts", "desired_input_layouts"),
              defaults=_frozen(input_layouts=None, desired_input_layouts=None, input_kwarg_layouts=None,
                               desired_input_kwarg_layouts=None, use_local_output=False)),
    StyleSpec("prepare_output", build=_torch_style(PrepareModuleOutput),
              costs=prepare_costs("output_layouts", "desired_output_layouts"),
              defaults=_frozen(output_layouts=None, desired_output_layouts=None, use_local_output=True),
              reduces_output=True, hf_variant=("output_layouts", "partial", "gather")),
)})
