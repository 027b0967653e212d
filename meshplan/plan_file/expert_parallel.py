"""The ``expert_parallel`` plan section, as data: mixture-of-experts layers on the folded expert mesh.

Two styles, by module-path pattern (``*`` = one path segment):

* ``experts``: a grouped-experts module (parameters ``[E, …]``, experts on dim 0) sharded over ``layout.ep``
  (and each expert's FFN over ``etp`` when ``etp`` = ``tp`` > 1); token copies go to their expert's rank and back by
  all-to-all with uneven splits. Its gradients are summed over ``edp`` (FSDP2 shards it over ``edp``).
* ``router``: the router, replicated; its gradients are summed over the dense data axes like any dense
  parameter.

The MoE block is the module holding both (the experts' parent). Under tensor parallelism with ``etp: 1`` it runs
on this tp rank's own tokens (its sequence shard); its parameters outside the experts (router, shared expert) stay
whole on every tp rank and their gradients are summed over tp. With ``etp`` = ``tp`` it runs on the tp group's
whole token set. Torch-free; applied by :mod:`meshplan.expert_parallel`; see ``docs/expert-parallel.md``.

Example (YAML)::

    layout: {tp: 2, ep: 2, etp: 1}
    expert_parallel:
      rules:
        layers.*.moe.experts: experts
        layers.*.moe.router: router
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union, get_args

from pydantic import BeforeValidator, Field, field_validator

from meshplan.plan_file.strict import Strict

__all__ = ["ExpertParallel", "ExpertsRule", "RouterRule", "EXPERT_STYLE_NAMES", "INTERFACES", "etp_problem",
           "token_region_of"]

Interface = Literal["sorted", "topk", "dense"]
#: the ways a grouped-experts module is called
INTERFACES: tuple[str, ...] = get_args(Interface)


class ExpertsRule(Strict):
    """Grouped experts sharded over ``ep`` on dim 0, their token rows dispatched and combined by all-to-all."""

    style: Literal["experts"] = Field(description="Shard the experts (dim 0 of every parameter) over ep.")
    interface: Interface | None = Field(
        None, description="How the block calls the experts module. sorted: forward(x_sorted, counts), rows sorted "
                          "by expert with counts[E] rows each (torchtitan's GroupedExperts). topk: "
                          "forward(hidden, top_k_index, top_k_weights), one row per token (transformers' "
                          "MixtralExperts and kin). dense: forward(x), x holding every token once per expert, "
                          "expert-major (E equal blocks of rows, each pre-scaled by its router weight: Llama 4's "
                          "experts). Default: read from the forward's signature (1 input: dense, 2: sorted, 3: topk).")


class RouterRule(Strict):
    """The router: replicated, gradients summed over the dense data axes (and over tp, whose ranks route their
    own tokens)."""

    style: Literal["router"] = Field(description="Replicate the router; it routes this rank's own tokens.")


ExpertRule = Annotated[Union[ExpertsRule, RouterRule], Field(discriminator="style")]
#: the expert-parallel style names, read from the rule classes
EXPERT_STYLE_NAMES: tuple[str, ...] = tuple(get_args(c.model_fields["style"].annotation)[0]
                                            for c in get_args(get_args(ExpertRule)[0]))

#: transformers' ``base_model_ep_plan`` strings → meshplan rules (``grouped_gemm`` names the experts' bare
#: parameters, which the ``experts`` rule on their module covers)
HF_EP_ALIASES: dict[str, dict[str, Any]] = {
    "ep_dispatch_experts": {"style": "experts", "interface": "topk"},
    "ep_router": {"style": "router"},
}


def _normalise(v: Any) -> Any:
    if isinstance(v, str):
        return dict(HF_EP_ALIASES.get(v.strip(), {"style": v.strip()}))
    return v


class ExpertParallel(Strict):
    """The ``expert_parallel`` plan section: ``experts`` and ``router`` rules on the folded expert mesh."""

    rules: dict[str, Annotated[ExpertRule, BeforeValidator(_normalise)]] = Field(
        ..., description="Module-path pattern ('*' = one path segment) → experts | router (or {style: experts, "
                         "interface: …}). Every pattern must match; each experts module's parent (the MoE block) "
                         "must hold one router.")

    @field_validator("rules")
    @classmethod
    def _needs_experts(cls, rules: dict) -> dict:
        for pattern in rules:
            if not pattern or any(not seg for seg in pattern.split(".")):
                raise ValueError(f"rule pattern {pattern!r} has an empty path segment")
        if not any(isinstance(r, ExpertsRule) for r in rules.values()):
            raise ValueError("expert_parallel.rules names no experts module (style: experts)")
        return rules

    def patterns(self, kind: type) -> dict[str, Any]:
        """The rules of one style class (:class:`ExpertsRule` or :class:`RouterRule`)."""
        return {p: r for p, r in self.rules.items() if isinstance(r, kind)}


def etp_problem(etp: int, tp: int) -> str | None:
    """Why ``etp`` cannot fold with ``tp`` (meshplan folds experts as etp 1 or etp = tp), or None.

    Example::

        >>> etp_problem(2, 4)[:24]
        'layout.etp(2) must be 1 '
    """
    if etp in (1, tp):
        return None
    return (f"layout.etp({etp}) must be 1 (whole experts on each ep rank, each tp rank routing its own tokens) or "
            f"tp({tp}) (each expert's FFN split over the tp group); valid etp: {', '.join(map(str, sorted({1, tp})))}")


def token_region_of(blocks: set[str] | list[str]) -> dict[str, str]:
    """``{MoE block path: the module that becomes its token region}``: the block itself, or its parent when the
    parent holds two or more of ``blocks`` as direct named children (one region around them all, taking and
    returning the residual stream); never a list of blocks (numbered children: Gemma 4's MoE blocks are its
    decoder layers, and a ``ModuleList`` has no forward for a region's hooks).

    Example::

        >>> token_region_of(["layers.0.mlp.text_moe", "layers.0.mlp.vision_moe", "layers.1.moe"])
        {'layers.0.mlp.text_moe': 'layers.0.mlp', 'layers.0.mlp.vision_moe': 'layers.0.mlp', 'layers.1.moe': 'layers.1.moe'}
    """
    parents: dict[str, int] = {}
    named = [b for b in blocks if not b.rpartition(".")[2].isdigit()]
    for b in named:
        parents[b.rpartition(".")[0]] = parents.get(b.rpartition(".")[0], 0) + 1
    return {b: b.rpartition(".")[0] if b in named and "." in b and parents[b.rpartition(".")[0]] > 1 else b
            for b in blocks}
