"""The ``tensor_parallel`` plan section: layer rules → sharding styles, as data.

A rule maps a module-path pattern (``layers.*.attention.wq``; ``*`` is one path
segment) to a style name or to a mapping ``{style: …}`` with torch's keyword
arguments as data. Layouts are written ``replicate``, ``shard(N)`` or ``partial``.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, Union, get_args

from pydantic import Field, field_validator, model_validator

from meshplan.plan_file.hf_aliases import resolve_alias
from meshplan.plan_file.strict import Strict

__all__ = ["TensorParallel", "Rule", "STYLE_NAMES", "layout_kind", "LayoutText"]

_LAYOUT_RE = re.compile(r"^(replicate|partial|shard\((-?\d+)\))$")


def layout_kind(text: Any) -> str:
    """``"R"`` (replicate; also ``None``), ``"P"`` (partial) or ``"S"`` (a shard, or a list of layouts)."""
    if not isinstance(text, str):
        return "R" if text is None else "S"
    return {"replicate": "R", "partial": "P"}.get(text, "S")


def _check_layout(v: Any) -> Any:
    if v is None:
        return v
    if not isinstance(v, str) or not _LAYOUT_RE.match(v.strip().lower()):
        raise ValueError(f"a layout is 'replicate', 'shard(N)' or 'partial', got {v!r}")
    return v.strip().lower()


from pydantic import BeforeValidator  # noqa: E402

LayoutText = Annotated[str | None, BeforeValidator(_check_layout)]
Layouts = Union[LayoutText, list[LayoutText]]


class _Rule(Strict):
    def overrides(self) -> dict[str, Any]:
        """The keyword arguments the user set (they override the generated ones)."""
        return {k: v for k, v in self if k != "style" and v is not None}


class Colwise(_Rule):
    """Linear/Embedding sharded by output features (torch ``ColwiseParallel``)."""
    style: Literal["colwise"] = Field(description="Shard the weight's output features over tp.")
    input_layouts: Layouts = Field(None, description="Layout of the input as it arrives (default: generated).")
    output_layouts: Layouts = Field(None, description="Layout of the output (default shard(-1)).")
    use_local_output: bool | None = Field(None, description="Return a plain local tensor instead of a DTensor. Default: generated (true unless the residual stream needs otherwise).")
    packed: int | None = Field(None, ge=1, le=64, description="The output features pack k (1 to 64) equal fused projections (gate_up: 2, qkv: 3 with as many KV heads as heads); each is sharded separately.")


class Rowwise(_Rule):
    """Linear/Embedding sharded by input features (torch ``RowwiseParallel``)."""
    style: Literal["rowwise"] = Field(description="Shard the weight's input features over tp; output reduced.")
    input_layouts: Layouts = Field(None, description="Layout of the input (default shard(-1)).")
    output_layouts: Layouts = Field(None, description="Layout of the reduced output (default: the residual stream's).")
    use_local_output: bool | None = Field(None, description="Return a plain local tensor instead of a DTensor. Default: generated (false unless the residual stream needs otherwise).")
    packed: int | None = Field(None, ge=1, le=64, description="The input features pack k (1 to 64) equal fused inputs; each is sharded separately.")


class Norm(_Rule):
    """LayerNorm/RMSNorm/Dropout in the sequence-parallel region (torch ``SequenceParallel``)."""
    style: Literal["norm"] = Field(description="Run on the sharded residual stream; untouched when SP is off.")


class Embedding(_Rule):
    """Vocab-parallel embedding: each tp rank holds a slice of the vocabulary."""
    style: Literal["embedding"] = Field(description="Shard the vocabulary over tp (Megatron's VocabParallelEmbedding).")
    output_layouts: Layouts = Field(None, description="Layout of the output (default: the residual stream's).")


class EmbeddingColwise(_Rule):
    """Embedding sharded along the embedding dim."""
    style: Literal["embedding_colwise"] = Field(description="Shard the embedding dim over tp; output gathered.")
    output_layouts: Layouts = Field(None, description="Layout of the output (default: the residual stream's).")


class EmbeddingTables(_Rule):
    """Several embedding tables placed whole, table-wise, across the tp ranks."""
    style: Literal["embedding_tables"] = Field(
        description="Children nn.Embedding tables are placed round-robin on tp ranks; outputs broadcast.")


class LmHead(_Rule):
    """Output projection: vocab-sharded DTensor logits for loss_parallel, gathered otherwise."""
    style: Literal["lm_head"] = Field(description="Shard the vocabulary of the output projection over tp.")
    input_layouts: Layouts = Field(None, description="Layout of the input (default: the residual stream's).")
    output_layouts: Layouts = Field(None, description="Layout of the logits (default: shard(-1) with loss_parallel, else replicate).")
    use_local_output: bool | None = Field(None, description="Plain tensor output (default: not loss_parallel).")


class ReplicateRule(_Rule):
    """Parameters as Replicate DTensors with correct gradient reduction."""
    style: Literal["replicate"] = Field(description="Replicate the module's parameters over tp.")
    input_layouts: Layouts = Field(None, description="Layout of tensor inputs (default: replicate).")
    use_local_output: bool | None = Field(None, description="Return plain local tensors. Default: generated (true unless the residual stream needs otherwise).")


class HeadNorm(_Rule):
    """A module that runs on this rank's attention heads: per-head ``q_norm``/``k_norm`` on tp-sharded heads."""
    style: Literal["head_norm"] = Field(
        description="The module runs unchanged on this rank's local heads (a colwise sibling's local output); its "
                    "parameters stay replicated and their gradients, each rank's heads' part, are summed over tp "
                    "in the one coalesced post-backward reduction (transformers' replicated_with_grad_allreduce).")


class Latent(_Rule):
    """A module of MLA's latent path (``q_a_proj``, ``kv_a_proj_with_mqa``, ``q_a_layernorm``, ``kv_a_layernorm``)."""
    style: Literal["latent"] = Field(
        description="DeepSeek MLA's low-rank latent: the module runs whole on every tp rank on the block input "
                    "(or another latent module's output); its output feeds per-head projections (latent_colwise) "
                    "and this rank's heads, so its gradient, each rank's heads' part, stays partial: it reaches "
                    "the block input's one reduction, and the parameters' gradients are summed over tp in the "
                    "coalesced post-backward reduction (transformers' mla_kv_a_proj).")


class LatentColwise(_Rule):
    """A per-head up-projection of MLA's latent (``q_b_proj``, ``kv_b_proj``): colwise on a latent input."""
    style: Literal["latent_colwise"] = Field(
        description="Shard the weight's output features (heads) over tp; the input is a latent (a 'latent' "
                    "module's output): replicated, taken with no collective, its gradient left partial.")
class HeadParams(_Rule):
    """A module's own parameters that belong to attention heads it sees locally (sinks, differential lambdas)."""
    style: Literal["head_params"] = Field(
        description="The module's own parameters (not its children's) that act on its attention heads while its "
                    "colwise children shard those heads: 'sharded' ones are indexed by head and split with them, "
                    "'summed' ones are shared by every head and stay replicated, their gradients summed over tp.")
    sharded: list[str] = Field(
        default_factory=list, description="Names of the module's own parameters indexed by head along 'dim' (gpt-oss "
                                          "'sinks': one logit per head): Shard(dim) over tp, so each rank holds its "
                                          "heads' entries; the module's forward sees this rank's slice (a plain "
                                          "tensor) and each rank's gradient is its slice's (transformers: a "
                                          "'colwise' rule on the parameter plus 'local_params' on the module).")
    dim: int = Field(0, ge=0, le=7, description="The head dim of the 'sharded' parameters (default 0).")
    replicated: list[str] = Field(
        default_factory=list, description="Names of the module's own parameters that act only outside its heads "
                                          "(GPT-NeoX-Japanese's 'dense_bias', added after o_proj's reduction): plain, "
                                          "whole on every rank, their gradients already whole (nothing summed).")
    use_local_output: bool | None = Field(
        None, description="The forward sees the 'sharded' parameters as this rank's slices, plain tensors (default "
                          "true); false: as DTensors (for colwise children that keep DTensor outputs).")
    summed: list[str] = Field(
        default_factory=list, description="Names of the module's own parameters shared by all its heads (DiffLlama "
                                          "'lambda_q1', a vector of head_dim): replicated, each rank's gradient "
                                          "covers its heads only and the ranks' gradients are summed over tp in the "
                                          "one coalesced post-backward reduction.")

    @model_validator(mode="after")
    def _check_names(self) -> "HeadParams":
        lists = (self.sharded, self.summed, self.replicated)
        if not any(lists):
            raise ValueError("head_params names no parameter; expected 'sharded: [names]', 'summed: [names]' "
                             "and/or 'replicated: [names]'")
        both = sorted(n for n in set().union(*lists) if sum(n in x for x in lists) > 1)
        if both:
            raise ValueError(f"head_params: {both} are in more than one of sharded, summed, replicated; expected "
                             f"each name in one list")
        return self


class ProjectionNorm(_Rule):
    """A norm over a colwise sibling's whole output, run on its shards (Olmo2's ``q_norm``/``k_norm``)."""
    style: Literal["projection_norm"] = Field(
        description="The module normalises the whole output of a colwise sibling (num_heads x head_dim features, "
                    "not one head): its 1-D parameters are sharded Shard(0) like those features, it runs on this "
                    "rank's shard and its mean over the features is summed over tp (one small all-reduce).")
    use_local_output: bool | None = Field(
        None, description="Return this rank's shard as a plain tensor (default true); false: a DTensor.")


class PrepareInput(_Rule):
    """torch ``PrepareModuleInput``."""
    style: Literal["prepare_input"] = Field(description="Redistribute the module's inputs.")
    input_layouts: Layouts = Field(None, description="Layouts of the positional inputs as they arrive.")
    desired_input_layouts: Layouts = Field(None, description="Layouts the module needs.")
    input_kwarg_layouts: dict[str, LayoutText] | None = Field(None, description="Keyword inputs as they arrive.")
    desired_input_kwarg_layouts: dict[str, LayoutText] | None = Field(None, description="Keyword inputs as needed.")
    use_local_output: bool | None = Field(None, description="Hand plain local tensors to the module. Default: generated (false unless the residual stream needs otherwise).")


class PrepareOutput(_Rule):
    """torch ``PrepareModuleOutput``."""
    style: Literal["prepare_output"] = Field(description="Redistribute the module's outputs.")
    output_layouts: Layouts = Field(description="Layouts of the outputs as produced.")
    desired_output_layouts: Layouts = Field(description="Layouts the consumer needs.")
    use_local_output: bool | None = Field(None, description="Return plain local tensors. Default: generated (true unless the residual stream needs otherwise).")


Rule = Annotated[
    Union[Colwise, Rowwise, Norm, Embedding, EmbeddingColwise, EmbeddingTables, LmHead, ReplicateRule, HeadNorm,
          Latent, LatentColwise, HeadParams, ProjectionNorm, PrepareInput, PrepareOutput],
    Field(discriminator="style"),
]
#: the style names, in the order of :data:`Rule` (read from each rule class's ``style`` Literal): the one list
STYLE_NAMES: tuple[str, ...] = tuple(get_args(cls.model_fields["style"].annotation)[0]
                                     for cls in get_args(get_args(Rule)[0]))


def _normalise_rule(v: Any) -> Any:
    if isinstance(v, str):
        return resolve_alias(v)
    if isinstance(v, dict) and isinstance(v.get("style"), str):
        alias = resolve_alias(v["style"])
        return {**alias, **{k: x for k, x in v.items() if k != "style"}}
    return v


class TensorParallel(Strict):
    """Tensor and sequence parallelism over the ``tp`` mesh axis.

    Example (YAML)::

        tensor_parallel:
          sequence_parallel: true
          loss_parallel: true
          rules:
            tok_embeddings: embedding
            layers.*.attention_norm: norm
            layers.*.attention.wq: colwise
            layers.*.attention.wo: rowwise
            norm: norm
            output: lm_head
    """

    sequence_parallel: bool | Literal["batch"] = Field(
        True, description="true: shard the sequence dim between TP regions (Megatron-SP); false: replicate the "
                          "residual stream; 'batch': smp's mode, each tp rank keeps its own part of the batch.")
    loss_parallel: bool = Field(
        True, description="Keep the logits vocab-sharded (DTensor) for meshplan.cross_entropy instead of gathering them.")
    dropout_rng: Literal["per_shard", "single_device"] = Field(
        "per_shard", description="How dropout inside TP regions draws its masks. 'per_shard' (Megatron): each tp "
                                 "rank draws from its own stream (one draw of the shared stream + the tp rank), "
                                 "statistically the same as one full mask, but not the single-device one. "
                                 "'single_device': every rank draws the mask of the global tensor from the shared "
                                 "generator and keeps its slice, so dropout equals the one-device run (any device, "
                                 "no communication, tp-times the RNG work: a CPU/testing path; on CUDA torch's "
                                 "OffsetBasedRNGTracker does this for DTensors).")
    save_gathered_inputs: bool = Field(
        False, description="Under sequence parallelism each block input is all-gathered once for its colwise "
                           "layers. false (Megatron-SP's memory): autograd keeps this rank's shard and the backward "
                           "gathers it again (one more all_gather per block input, started early to overlap); the "
                           "values are the same. true: keep the gathered input (torch's behaviour: tp times the "
                           "bytes, no extra collective).")
    adjust_head_counts: bool = Field(
        True, description="Divide stored head counts (n_heads, num_key_value_heads, …) of modules that own colwise "
                          "projections by tp, so models that reshape with them work on local shards.")
    rules: dict[str, Annotated[Rule, BeforeValidator(_normalise_rule)]] = Field(
        default_factory=dict, description="Module-path pattern ('*' = one path segment) → style name or {style: …, "
                                          "torch keyword arguments}. An exact path beats a wildcard.")

    @field_validator("rules")
    @classmethod
    def _check_patterns(cls, rules: dict) -> dict:
        for pattern in rules:
            if not pattern or any(not seg for seg in pattern.split(".")):
                raise ValueError(f"rule pattern {pattern!r} has an empty path segment")
        return rules

    @model_validator(mode="after")
    def _check_lm_head(self) -> "TensorParallel":
        heads = [p for p, r in self.rules.items() if isinstance(r, LmHead)]
        if len(heads) > 1 and not all("*" in p for p in heads):
            raise ValueError(f"more than one lm_head rule: {heads}")
        return self
