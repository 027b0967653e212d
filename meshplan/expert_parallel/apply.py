"""The ``expert_parallel`` section checked against model and layout, and applied.

:func:`check_expert_parallel` (shared by :func:`meshplan.parallelize` and ``meshplan check``) finds the MoE blocks
(each experts module's parent, holding one router), reads the expert count from the experts' parameters and
checks it against the layout with the valid values. :func:`apply_expert_parallel` shards every experts module
over ``ep`` (:class:`~meshplan.expert_parallel.experts.ExpertParallel`) and, under tensor parallelism, makes each
MoE block run on this tp rank's own tokens (:func:`~meshplan.expert_parallel.region.token_region`): its other
parameters (router, shared expert) stay whole and their gradients join the tp sum of the model's grad sync.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field, replace
from typing import Any

import torch.nn as nn

from meshplan.errors import PlanError
from meshplan.expert_parallel.experts import shared_inside
from meshplan.mesh.ranks import not_dividing
from meshplan.model_copies import stand_in
from meshplan.plan_file.expert_parallel import ExpertParallel, ExpertsRule, RouterRule, etp_problem, token_region_of
from meshplan.plan_file.patterns import match_rules

__all__ = ["MoeBlock", "EpApplied", "check_expert_parallel", "apply_expert_parallel", "moe_blocks", "expert_modules",
           "stand_in", "token_region_of"]

_TOP_K = ("top_k", "num_experts_per_tok")


@dataclass(frozen=True)
class MoeBlock:
    """One MoE block of the model.

    Attributes:
        path: the block (the experts module's parent). experts: the experts module's path.
        router: the router's path. num_experts: experts in the layer (dim 0 of the experts' parameters).
        interface: how the block calls the experts (``sorted``, ``topk`` or ``dense``).
        ffn: with etp > 1, ``((parameter, FFN dim, packed parts), …)`` of the experts (see
            :mod:`meshplan.expert_parallel.etp`); empty with etp 1.
        region: the module made a token region under tp (:mod:`meshplan.expert_parallel.region`): the block, or
            its parent when that holds several MoE blocks (Ernie 4.5 VL's ``mlp`` with ``text_moe`` and
            ``vision_moe``, which return flattened outputs its parent reshapes); see :func:`token_region_of`.
    """

    path: str
    experts: str
    router: str
    num_experts: int
    interface: str
    ffn: tuple[tuple[str, int, int], ...] = ()
    region: str = ""


@dataclass(frozen=True)
class EpApplied:
    """What :func:`apply_expert_parallel` did; recorded as :attr:`meshplan.state.ParallelState.expert_parallel`.

    Attributes:
        section: the validated section. blocks: the :class:`MoeBlock` of each MoE layer.
        ep, etp, edp: the expert mesh's degrees.
        expert_params: paths of the expert-sharded parameters (kept out of the dense data-parallel sharding;
            FSDP2 shards them over ``edp``).
        replicated: paths of the blocks' other parameters, whose gradients are summed over tp.
        adjusted: ``{experts path: (global, local)}`` stored ``num_experts`` counts divided by ep.
    """

    section: ExpertParallel
    blocks: tuple[MoeBlock, ...]
    ep: int
    etp: int
    edp: int
    expert_params: tuple[str, ...] = ()
    replicated: tuple[str, ...] = ()
    adjusted: dict[str, tuple[int, int]] = field(default_factory=dict)


def expert_modules(model: nn.Module, section: ExpertParallel | None) -> set[str]:
    """The experts modules ``section`` names; patterns that match nothing are :func:`check_expert_parallel`'s to
    report."""
    if section is None:
        return set()
    return set(match_rules(model, section.patterns(ExpertsRule), "", errors=[]))


def moe_blocks(model: nn.Module, section: ExpertParallel | None) -> set[str]:
    """The token regions of the MoE blocks ``section`` names (its experts modules' parents, or the module holding
    several: :func:`token_region_of`)."""
    return set(token_region_of({path.rpartition(".")[0] for path in expert_modules(model, section)}).values())


def _interface(module: nn.Module, rule: ExpertsRule, where: str) -> str:
    if rule.interface is not None:
        return rule.interface
    params = [p for p in inspect.signature(module.forward).parameters.values()
              if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if (found := {1: "dense", 2: "sorted", 3: "topk"}.get(len(params))) is None:
        raise PlanError(f"{where}: {type(module).__name__}.forward takes {len(params)} positional inputs; expected 1 "
                        f"(x, every token once per expert: interface dense), 2 (x_sorted, counts: interface sorted) "
                        f"or 3 (hidden, top_k_index, top_k_weights: interface topk); say `interface:` in the rule")
    return found


def _num_experts(module: nn.Module, path: str, layout: Any, where: str) -> int:
    """The expert count of an experts module: dim 0 of its grouped weights, the largest where they differ
    (LongCat's zero-computation experts: ``gate_up_proj`` holds a row block per expert, routed and identity alike,
    ``down_proj`` only the routed ones), which ep cannot split alike (ep 1 only; etp counts their rows once)."""
    shapes = {n: tuple(p.shape) for n, p in module.named_parameters(recurse=False)}
    if not shapes:
        raise PlanError(f"{where}: experts module {path} ({type(module).__name__}) has no parameters of its own; "
                        f"expected grouped weights [E, …]")
    sizes = {s[0] if s else 0 for s in shapes.values()}
    if 0 in sizes or (len(sizes) > 1 and layout.ep > 1):
        raise PlanError(f"{where}: the parameters of experts module {path} disagree on the expert count (dim 0): "
                        f"{shapes}; expected grouped weights [E, …] with one E to split over ep({layout.ep})"
                        + ("" if 0 in sizes else "; unequal counts (zero-computation experts without weights of "
                           "their own) cannot be split over ep: set layout.ep: 1"))
    if why := not_dividing("ep", layout.ep, "the {n} experts of " + path, max(sizes)):
        raise PlanError(f"{where}: {why}")
    return max(sizes)


def _top_k(block: nn.Module, router: nn.Module) -> int | None:
    for mod in (router, block):
        for name in _TOP_K:
            k = getattr(mod, name, None)
            if isinstance(k, int) and not isinstance(k, bool):
                return k
    return None


def check_expert_parallel(model: nn.Module, section: ExpertParallel, layout: Any, where: str = "expert_parallel",
                          tp_rules: Any = None) -> tuple[MoeBlock, ...]:
    """The MoE blocks of ``model`` that ``section`` names, checked against the resolved ``layout``.

    Args:
        tp_rules: the ``tensor_parallel`` rules; under tp > 1 none may claim a module inside an MoE block.

    Raises:
        PlanError: a pattern that matches nothing, ``etp`` > 1, an expert count ``ep`` does not divide, a block
            without exactly one router, a router outside every block, top-k above the expert count, an experts
            interface that cannot be read, a tensor-parallel rule inside an MoE block.
    """
    why = etp_problem(layout.etp, layout.tp)
    if why:
        raise PlanError(f"{where}: {why}")
    matched = match_rules(model, section.rules, f"{where}.rules")
    routers = [p for p, (_, r) in matched.items() if isinstance(r, RouterRule)]
    blocks, claimed = [], set()
    for path, (pattern, rule) in matched.items():
        if not isinstance(rule, ExpertsRule):
            continue
        if "." not in path:
            raise PlanError(f"{where}.rules.{pattern!r}: experts module {path!r} must sit inside an MoE block (its "
                            f"parent holds the router)")
        module = model.get_submodule(path)
        parent = path.rsplit(".", 1)[0]
        mine = [r for r in routers if r.startswith(parent + ".")]
        if len(mine) != 1:
            raise PlanError(f"{where}.rules: MoE block {parent} (parent of experts {path}) holds {len(mine)} router "
                            f"modules {mine}; expected exactly one (style: router)")
        claimed.update(mine)
        experts = _num_experts(module, path, layout, f"{where}.rules.{pattern!r}")
        if why := shared_inside(module, path, layout.ep):
            raise PlanError(f"{where}.rules.{pattern!r}: {why}")
        k = _top_k(model.get_submodule(parent), model.get_submodule(mine[0]))
        if k is not None and not 1 <= k <= experts:
            raise PlanError(f"{where}: MoE block {parent} routes each token to top_k({k}) of {experts} experts; "
                            f"expected 1 <= top_k <= {experts}")
        ffn = ()
        if layout.etp > 1:
            from meshplan.expert_parallel.etp import ffn_dims, model_dim
            dims = ffn_dims(module, model_dim(model.get_submodule(mine[0]), experts), layout.etp,
                            f"{where}.rules.{pattern!r}")
            ffn = tuple((n, d, k) for n, (d, k) in dims.items())
        blocks.append(MoeBlock(parent, path, mine[0], experts, _interface(module, rule, f"{where}.rules.{pattern!r}"),
                               ffn))
    regions = token_region_of([b.path for b in blocks])
    blocks = [replace(b, region=regions[b.path]) for b in blocks]
    stray = sorted(set(routers) - claimed)
    if stray:
        raise PlanError(f"{where}.rules: router {stray[0]} is in no MoE block (the parent of an experts module)")
    from meshplan.expert_parallel.region import layer_region_problem
    if layer_region_problem(blocks, layout.tp, layout.etp):
        raise PlanError(f"{where}: {layer_region_problem(blocks, layout.tp, layout.etp)}")
    if tp_rules:  # any tensor_parallel section makes the blocks token regions, even at tp 1
        _no_tp_inside(model, blocks, tp_rules, where)
    _recorded_inside(model, blocks, layout, where)
    return tuple(blocks)


def _recorded_inside(model: nn.Module, blocks: list[MoeBlock], layout: Any, where: str) -> None:
    """transformers records ``router_logits`` for its load-balancing loss (``output_router_logits``) with a hook on
    a module class; inside a token region (tp > 1, etp 1) that module sees each tp rank's own tokens, so the loss
    would differ from one device. The region's own outputs are gathered first (equal): Ernie 4.5 VL records them."""
    config = getattr(model, "config", None)
    if layout.tp == 1 or layout.etp > 1 or getattr(config, "output_router_logits", False) is not True:
        return
    for owner in model.modules():
        spec = (getattr(type(owner), "_can_record_outputs", None) or {}).get("router_logits")
        cls = spec if isinstance(spec, type) else getattr(spec, "target_class", None)
        for b in blocks if isinstance(cls, type) else ():
            inner = [n for n, m in model.get_submodule(b.region).named_modules() if n and isinstance(m, cls)]
            if inner:
                raise PlanError(f"{where}: the model records router_logits for its load-balancing loss "
                                f"({type(config).__name__}.output_router_logits: True) from {b.region}.{inner[0]} "
                                f"({cls.__name__}), inside the MoE block {b.region}, which under tp({layout.tp}) "
                                f"with etp 1 sees each tp rank's own tokens: the loss would differ from one device; "
                                f"set output_router_logits: False, or layout.etp = tp (the block then sees the tp "
                                f"group's whole token set)")


def _no_tp_inside(model: nn.Module, blocks: list[MoeBlock], tp_rules: Any, where: str) -> None:
    for path, (pattern, rule) in match_rules(model, tp_rules, "tensor_parallel.rules", errors=[]).items():
        for b in blocks:
            if path == b.region or path.startswith(b.region + "."):
                raise PlanError(f"tensor_parallel.rules.{pattern!r} ({rule.style}) claims {path}, inside the MoE "
                                f"block {b.region}, a token region of plain tensors ({where}); remove "
                                f"the rule: the block's parameters outside the experts stay whole and their "
                                f"gradients are summed over tp")


def apply_expert_parallel(model: nn.Module, section: ExpertParallel, topology: Any, blocks: tuple[MoeBlock, ...],
                          tensor_parallel: Any = None, finalizer: Any = None) -> EpApplied:
    """Shard the experts of ``blocks`` (from :func:`check_expert_parallel`) over ``topology["ep"]``; under tp > 1
    each block runs on its tp rank's tokens and its other parameters' gradients are summed over tp.

    Args:
        tensor_parallel: the model's :class:`~meshplan.tensor_parallel.apply.TpApplied` (needed when tp > 1).
        finalizer: the model's :class:`~meshplan.gradients.GradFinalizer` (handed by :func:`meshplan.parallelize`),
            which the token regions add their tp sums to.

    Raises:
        PlanError: tp > 1 without a tensor_parallel section, a tensor-parallel rule inside an MoE block.
    """
    from torch.distributed.tensor.parallel import parallelize_module

    from meshplan.expert_parallel.experts import ExpertParallel as ExpertsStyle
    lay = topology.layout
    src = None if any(p.is_meta for p in model.parameters()) else 0
    expert_params, adjusted = [], {}
    mesh = topology.expert["ep", "etp"] if lay.etp > 1 else topology["ep"]
    for b in blocks:
        module = model.get_submodule(b.experts)
        style = ExpertsStyle(interface=b.interface, ffn={n: (d, k) for n, d, k in b.ffn})
        parallelize_module(module, mesh, style, src_data_rank=src)
        expert_params += [f"{b.experts}.{n}" for n, _ in module.named_parameters()]  # data-parallel over edp
        stored = vars(module).get("num_experts")
        if isinstance(stored, int) and stored == b.num_experts and lay.ep > 1:
            module.num_experts = adjusted.setdefault(b.experts, (stored, stored // lay.ep))[1]
    replicated = []
    if lay.tp > 1 or tensor_parallel is not None:  # a tensor_parallel section makes the stream a DTensor, even at tp 1
        from meshplan.expert_parallel.region import token_regions
        replicated = token_regions(model, blocks, topology, tensor_parallel, set(expert_params), finalizer)
    return EpApplied(section, blocks, lay.ep, lay.etp, lay.edp, tuple(expert_params), tuple(replicated), adjusted)
