"""What each tensor-parallel style name means, torch-free: one :class:`StyleSemantics` per style name.

A plan rule names a style; its data (the fields a rule may set) is a rule class of
:mod:`meshplan.plan_file.tensor_parallel`, whose ``STYLE_NAMES`` is the one list of names. What the name *means*
without torch is here: its layouts given the residual stream, the collectives it costs, whether its parameters are
sharded, its part in a block (the colwise fan-out, local heads, the rowwise reduction), what validation expects of
its module (in words) and its transformers spelling. The converters, transformers interop, the pictures and the
solver read :data:`SEMANTICS`; the torch side (the ``ParallelStyle`` each builds, the module types it fits, the dim
it shards) is :data:`meshplan.tensor_parallel.style_table.STYLES`, whose entries extend these. The style table is
these two files: no other module compares style names (``tests/test_house.py``). Part of the spec layer: imports
no torch, at any depth.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from operator import attrgetter
from types import MappingProxyType
from typing import Any, Callable, Mapping

from meshplan.plan_file.layout_text import Stream, redistribute_collectives as redist
from meshplan.plan_file.style_costs import Costs, colwise_costs, lm_head_costs, prepare_costs, reduced_costs
from meshplan.plan_file.style_costs import rowwise_costs

__all__ = ["StyleSemantics", "SEMANTICS", "gives_local_shards", "frozen"]


def gives_local_shards(overrides: Mapping[str, Any]) -> bool:
    """Does a colwise rule hand its module's caller this rank's shard (local heads) as a plain tensor?
    Not when its output is gathered (``output_layouts: replicate``) or kept a DTensor (global shape)."""
    return overrides.get("output_layouts") in (None, "shard(-1)") and overrides.get("use_local_output", True)


def frozen(**defaults: Any) -> Mapping[str, Any]:
    """A read-only mapping (a style's default layouts, a shared group of fields)."""
    return MappingProxyType(defaults)


@dataclass(frozen=True)
class StyleSemantics:
    """What one tensor-parallel style means, torch-free.

    Attributes:
        name: the style name a plan rule writes.
        defaults: the style's layouts (torch's keyword arguments) when the rule sets none: text, or a function
            of the :class:`~meshplan.plan_file.layout_text.Stream`.
        costs: ``(forward, backward)`` collectives of one module, from its layouts and overrides (not its parent's).
        expects: what validation expected of the module, for its message; ``misfit``: what it found lacking.
        size_note: appended to the sharded dim's name in plan generation's error (``" (vocab)"``).
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

        >>> spec = SEMANTICS["rowwise"]
        >>> spec.layouts({}, Stream(sequence_parallel=True))
        {'input_layouts': 'shard(-1)', 'output_layouts': 'shard(1)', 'use_local_output': False}
        >>> spec.collectives({}, Stream(sequence_parallel=True))
        (['reduce_scatter'], ['all_gather'])
    """

    name: str
    defaults: Mapping[str, Any] = field(default_factory=frozen)
    costs: Callable[[Mapping[str, Any], Mapping[str, Any]], Costs] = lambda layouts, overrides: ([], [])
    expects: str = ""
    misfit: str = ""
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


#: defaults that depend on the section (see :class:`~meshplan.plan_file.layout_text.Stream`)
_stream, _batch, _local, _logits, _local_logits = (attrgetter(a) for a in ("layout", "batch", "local", "logits",
                                                                           "local_logits"))
#: what the two projection styles share: sharded parameters, packed weights
_PROJECTION = frozen(expects="nn.Linear, Conv1D or nn.Embedding", shards_params=True, packable=True)
#: what the two embedding styles share: ids in, the residual stream out
_EMBEDDING = frozen(defaults=frozen(input_layouts=_batch, output_layouts=_stream, use_local_output=_local),
                    expects="nn.Embedding", shards_params=True, writes_stream=True)

SEMANTICS: Mapping[str, StyleSemantics] = MappingProxyType({s.name: s for s in (
    StyleSemantics("colwise", costs=colwise_costs,
                   defaults=frozen(input_layouts="replicate", output_layouts="shard(-1)", use_local_output=True),
                   column_parallel=True, **_PROJECTION, hf_name="colwise", hf_packed="packed_colwise",
                   hf_variant=("output_layouts", "replicate", "colwise_rep")),
    StyleSemantics("rowwise", costs=rowwise_costs,
                   defaults=frozen(input_layouts="shard(-1)", output_layouts=_stream, use_local_output=_local),
                   replicated_params=("bias",), row_parallel=True, writes_stream=True, **_PROJECTION,
                   hf_name="rowwise", hf_packed="packed_rowwise", hf_variant=("input_layouts", "replicate",
                                                                              "rowwise_rep")),
    StyleSemantics("norm", stream_module=True, covers_submodules=True, hf_name="sequence_parallel"),
    StyleSemantics("embedding", costs=reduced_costs("partial"), **_EMBEDDING, hf_name="embedding_rowwise"),
    StyleSemantics("embedding_colwise", costs=reduced_costs("shard(-1)"), **_EMBEDDING, hf_name="embedding_colwise"),
    StyleSemantics("embedding_tables", costs=lambda lay, o: (["broadcast (per table)"], ["reduce (per table)"]),
                   expects="a module holding embedding tables", misfit=" with no nn.Embedding children",
                   shards_params=True),
    StyleSemantics("lm_head", costs=lm_head_costs,
                   defaults=frozen(input_layouts=_stream, output_layouts=_logits, use_local_output=_local_logits),
                   expects="nn.Linear", size_note=" (vocab)", shards_params=True, takes_stream=True,
                   hf_name="colwise_gather_output"),
    StyleSemantics("replicate", defaults=frozen(input_layouts="replicate", use_local_output=True),
                   covers_submodules=True, replicated=True, hf_name="replicate"),
    StyleSemantics("head_norm", on_local_heads=True, hf_name="replicated_with_grad_allreduce"),
    StyleSemantics("latent", on_local_heads=True, latent=True, hf_name="mla_kv_a_proj"),
    StyleSemantics("latent_colwise", expects="nn.Linear",
                   defaults=frozen(output_layouts="shard(-1)", use_local_output=True),
                   costs=lambda lay, o: (redist("shard(-1)", lay["output_layouts"]), []), shards_params=True,
                   column_parallel=True, latent_input=True, hf_name="colwise"),
    StyleSemantics("head_params", head_params=True, hf_name="local_params"),
    StyleSemantics("projection_norm", shards_params=True, whole_projection=True, expects="a norm with a 1-D weight",
                   costs=lambda *_: (["all_reduce"], ["all_reduce"])),
    StyleSemantics("prepare_input", costs=prepare_costs("input_layouts", "desired_input_layouts"),
                   defaults=frozen(input_layouts=None, desired_input_layouts=None, input_kwarg_layouts=None,
                                   desired_input_kwarg_layouts=None, use_local_output=False)),
    StyleSemantics("prepare_output", costs=prepare_costs("output_layouts", "desired_output_layouts"),
                   defaults=frozen(output_layouts=None, desired_output_layouts=None, use_local_output=True),
                   reduces_output=True, hf_variant=("output_layouts", "partial", "gather")),
)})
