"""Generate and apply the ``parallelize_module`` plan for the ``tensor_parallel`` section.

What an expert writes by hand: with sequence parallelism the residual stream
is a ``Shard(1)`` DTensor (global shape kept, so models that derive positions
or masks from the hidden states' shape still work); norms run
``SequenceParallel``; the parent that fans out to colwise projections gets one
input conversion (all-gather) for the whole block; rowwise outputs
reduce-scatter back; the embedding reduce-scatters; the lm_head gathers its
input. Without SP the stream is a plain replicated tensor and each block
converts it once. Per layer that is exactly 2 all-gathers + 2 reduce-scatters
each way with SP, 2 all-reduces each way without.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import PrepareModuleInput, PrepareModuleOutput, SequenceParallel, parallelize_module

from meshplan.errors import PlanError
from meshplan.tensor_parallel.dropout.single_device import INHERIT, OUTSIDE, REGION, SHARED, SingleDeviceDropout
from meshplan.tensor_parallel.grad_sync import TpGradSync
from meshplan.tensor_parallel.heads import HEAD_ATTRS, adjust_heads, valid_tp
from meshplan.tensor_parallel.packed import needs_packed_style, packed_style
from meshplan.tensor_parallel.dropout.per_shard import TpRng
from meshplan.plan_file.patterns import match_rules
from meshplan.tensor_parallel.styles import (ColwiseParallel, PrepareHiddenInput, ReplicateParallel, RowwiseParallel, TableWiseEmbedding,
                     hidden_arg_name)
from meshplan.tensor_parallel.vocab_embedding import VocabParallelEmbedding
from meshplan.plan_file.tensor_parallel import TensorParallel, parse_layout

__all__ = ["generate_tp_plan", "apply_tensor_parallel", "TpApplied", "HEAD_ATTRS"]


@functools.lru_cache(maxsize=None)
def _parse(text: str):
    return parse_layout(text)  # placements are immutable: one object per layout text


def _lay(value, default):
    if value is None:
        return default
    if isinstance(value, list):
        return tuple(_parse(v) for v in value)
    return _parse(value)


@dataclass
class TpApplied:
    """What :func:`apply_tensor_parallel` did: the torch plan, adjusted head counts, the grad finaliser.

    ``finalizer`` is the live :class:`~meshplan.tensor_parallel.grad_sync.TpGradSync` (coalesced tp reduction of replicated grads;
    :func:`~meshplan.data_parallel.fsdp.apply_data_parallel` re-installs it on FSDP2's parameters);
    ``sequence_parallel`` the section's mode (``"batch"``: tp ranks hold different samples).
    """

    plan: dict[str, Any]
    head_counts: dict[str, dict[str, tuple[int, int]]] = field(default_factory=dict)
    finalizer: TpGradSync | None = None
    rng: TpRng | SingleDeviceDropout | None = None
    sequence_parallel: bool | str = False


def _where(source: str | None) -> str:
    return f"{source}: tensor_parallel.rules" if source else "tensor_parallel.rules"


def _check_divisible(where: str, path: str, what: str, n: int, tp: int) -> None:
    if n % tp:
        raise PlanError(f"{where}: module {path!r}: tp({tp}) does not divide {what}({n}); valid tp: {valid_tp(n)}")


def generate_tp_plan(model: nn.Module, section: TensorParallel, tp: int, source: str | None = None
                     ) -> tuple[dict[str, Any], dict[str, Any]]:
    """The path → torch ``ParallelStyle`` dict for ``model`` (fresh style objects every call).

    Returns:
        ``(plan, meta)``: ``meta`` holds ``fanout`` (parents converted once per block),
        ``norm_dropouts`` and the matched rules.

    Raises:
        PlanError: a rule matching nothing, conflicting rules, a style that does not fit
            its module, or a size tp does not divide (with the valid tp values).
    """
    where = _where(source)
    sp = section.sequence_parallel
    stream = Shard(1) if sp is True else Shard(0) if sp == "batch" else Replicate()
    local_stream = sp is False
    matched = match_rules(model, section.rules, where)
    modules = dict(model.named_modules())
    plan: dict[str, Any] = {}
    fanout: dict[str, None] = {}
    local_heads: dict[str, None] = {}  # parents with a colwise child whose local output is this rank's heads
    head_norms: list[str] = []
    norm_dropouts: list[str] = []
    overrides: dict[int, dict] = {}  # one per rule, not per module (126-layer models: 1.6k modules, 14 rules)
    for path, (pattern, rule) in matched.items():
        o = overrides.get(id(rule))
        if o is None:
            o = overrides[id(rule)] = rule.overrides()
        mod, style = modules[path], rule.style
        loc = f"{where}.{pattern!r}"
        if style == "colwise" and gives_local_shards(o):
            local_heads[path.rpartition(".")[0]] = None
        if needs_packed_style(mod, rule):  # packed fused weights, transformers' Conv1D
            plan[path] = packed_style(style, mod, o, tp, loc, path, stream, local_stream)
            if style == "colwise" and "input_layouts" not in o:
                fanout[path.rpartition(".")[0]] = None
            continue
        if style in ("colwise", "rowwise", "lm_head") and not isinstance(mod, (nn.Linear, nn.Embedding)):
            raise PlanError(f"{loc}: module {path!r} is {type(mod).__name__}; style {style} needs nn.Linear or nn.Embedding")
        if style in ("embedding", "embedding_colwise") and not isinstance(mod, nn.Embedding):
            raise PlanError(f"{loc}: module {path!r} is {type(mod).__name__}; style {style} needs nn.Embedding")
        if style == "colwise":
            n = mod.out_features if isinstance(mod, nn.Linear) else mod.embedding_dim
            _check_divisible(loc, path, "out_features" if isinstance(mod, nn.Linear) else "embedding_dim", n, tp)
            plan[path] = ColwiseParallel(input_layouts=_lay(o.get("input_layouts"), Replicate()),
                                         output_layouts=_lay(o.get("output_layouts"), Shard(-1)),
                                         use_local_output=o.get("use_local_output", True))
            if "input_layouts" not in o:
                fanout[path.rpartition(".")[0]] = None
        elif style == "rowwise":
            n = mod.in_features if isinstance(mod, nn.Linear) else mod.num_embeddings
            _check_divisible(loc, path, "in_features" if isinstance(mod, nn.Linear) else "num_embeddings", n, tp)
            plan[path] = RowwiseParallel(input_layouts=_lay(o.get("input_layouts"), Shard(-1)),
                                         output_layouts=_lay(o.get("output_layouts"), stream),
                                         use_local_output=o.get("use_local_output", local_stream))
        elif style == "norm":
            if sp is not False:
                plan[path] = SequenceParallel(sequence_dim=stream.dim, use_local_output=False)
            if isinstance(mod, nn.modules.dropout._DropoutNd):
                norm_dropouts.append(path)
        elif style == "embedding":
            _check_divisible(loc, path, "num_embeddings", mod.num_embeddings, tp)
            plan[path] = VocabParallelEmbedding(input_layouts=Shard(0) if sp == "batch" else Replicate(),
                                                output_layouts=_lay(o.get("output_layouts"), stream),
                                                use_local_output=local_stream)
        elif style == "embedding_colwise":
            _check_divisible(loc, path, "embedding_dim", mod.embedding_dim, tp)
            plan[path] = ColwiseParallel(input_layouts=Shard(0) if sp == "batch" else Replicate(),
                                         output_layouts=_lay(o.get("output_layouts"), stream),
                                         use_local_output=local_stream)
        elif style == "embedding_tables":
            plan[path] = TableWiseEmbedding()
        elif style == "lm_head":
            _check_divisible(loc, path, "out_features (vocab)", mod.out_features, tp)
            lp = section.loss_parallel
            out_default = Shard(-1) if lp else (Shard(0) if sp == "batch" else Replicate())
            plan[path] = ColwiseParallel(input_layouts=_lay(o.get("input_layouts"), stream),
                                         output_layouts=_lay(o.get("output_layouts"), out_default),
                                         use_local_output=o.get("use_local_output", not lp))
        elif style == "head_norm":
            head_norms.append(path)  # runs unchanged on local heads; its grads join TpGradSync's tp sum
        elif style == "replicate":
            plan[path] = ReplicateParallel(input_layouts=_lay(o.get("input_layouts"), Replicate()),
                                           use_local_output=o.get("use_local_output", True))
        elif style == "prepare_input":
            plan[path] = PrepareModuleInput(
                input_layouts=_lay(o.get("input_layouts"), None),
                desired_input_layouts=_lay(o.get("desired_input_layouts"), None),
                input_kwarg_layouts={k: parse_layout(v) for k, v in (rule.input_kwarg_layouts or {}).items()} or None,
                desired_input_kwarg_layouts={k: parse_layout(v) for k, v in (rule.desired_input_kwarg_layouts or {}).items()} or None,
                use_local_output=o.get("use_local_output", False))
        elif style == "prepare_output":
            plan[path] = PrepareModuleOutput(output_layouts=_lay(rule.output_layouts, None),
                                             desired_output_layouts=_lay(rule.desired_output_layouts, None),
                                             use_local_output=o.get("use_local_output", True))
        else:  # pragma: no cover - the discriminated union admits nothing else
            raise AssertionError(style)
    arg_names: dict[type, str | None] = {}  # inspect.signature once per class
    for parent in fanout:
        if parent in plan:
            continue  # the user prepared it by hand
        target = modules[parent] if parent else model
        if "forward" in target.__dict__:
            name = hidden_arg_name(target)
        elif type(target) in arg_names:
            name = arg_names[type(target)]
        else:
            name = arg_names[type(target)] = hidden_arg_name(target)
        plan[parent] = PrepareHiddenInput(input_layout=stream, desired_layout=Replicate(), arg_name=name)
    return plan, {"fanout": list(fanout), "local_heads": list(local_heads), "head_norms": head_norms,
                  "norm_dropouts": norm_dropouts, "matched": matched, "modules": modules}


def gives_local_shards(overrides: dict) -> bool:
    """Does a colwise rule hand its module's caller this rank's shard (local heads) as a plain tensor?
    Not when its output is gathered (``output_layouts: replicate``) or kept a DTensor (global shape)."""
    return overrides.get("output_layouts") in (None, "shard(-1)") and overrides.get("use_local_output", True)


def _tied_parameters(model: nn.Module) -> list[list[tuple[str, str]]]:
    owners: dict[int, list[tuple[str, str]]] = {}
    for mod_name, mod in model.named_modules(remove_duplicate=False):
        for p_name, p in mod.named_parameters(recurse=False):
            owners.setdefault(id(p), []).append((mod_name, p_name))
    return [v for v in owners.values() if len(v) > 1]


def _retie(model: nn.Module, tied: list[list[tuple[str, str]]], where: str) -> None:
    """Parallel styles replace parameters module by module; tie them again (same placement required)."""
    modules = dict(model.named_modules(remove_duplicate=False))
    for group in tied:
        params = [getattr(modules[m], n) for m, n in group]
        first = params[0]
        place = [getattr(p, "placements", None) for p in params]
        if any(pl != place[0] for pl in place):
            names = ", ".join(f"{m}.{n} ({pl})" for (m, n), pl in zip(group, place))
            raise PlanError(f"{where}: tied parameters get different placements: {names}; tie an 'embedding' "
                            f"(vocab-parallel, shard(0)) with an 'lm_head' (shard(0)), or untie them")
        for (m, n) in group[1:]:
            setattr(modules[m], n, first)


def apply_tensor_parallel(model: nn.Module, section: TensorParallel, tp_mesh: DeviceMesh,
                          source: str | None = None) -> TpApplied:
    """Parallelize ``model`` in place over the 1-D ``tp_mesh`` as ``section`` says.

    Beyond ``parallelize_module``: stored head counts divided by tp, one
    coalesced post-backward reduction of ``Partial`` gradients (norm weights
    under SP, ``replicate`` modules), and per-shard dropout streams.
    """
    tp = tp_mesh.size()
    where = _where(source)
    plan, meta = generate_tp_plan(model, section, tp, source)
    modules = meta["modules"]  # styles change modules in place: one traversal serves every step
    heads = adjust_heads(model, meta["local_heads"], tp, where, section.adjust_head_counts, modules)
    tied = _tied_parameters(model)
    if tp_mesh.device_type == "cpu" and any(r.style == "colwise" and r.overrides().get("use_local_output") is False
                                            for _, r in meta["matched"].values()):
        from meshplan.tensor_parallel.cpu_attention import register_cpu_attention_rule
        register_cpu_attention_rule()  # DTensor q/k/v reach SDPA: torch 2.13 has no CPU rule for it
    if tp > 1 or plan:
        # the plan's keys are exact paths: apply each style to its module directly (handing torch the dict
        # makes parallelize_module fnmatch every child of every level for every key: O(keys x children))
        # meta parameters hold no data: skip scattering them from rank 0 (18x cheaper per parameter)
        src = None if any(p.is_meta for p in model.parameters()) else 0
        for path, style in plan.items():
            parallelize_module(modules[path] if path else model, tp_mesh, style, src_data_rank=src)
    _retie(model, tied, where)
    summed = [f"{p}.{n}" if p else n for p in meta["head_norms"] for n, _ in modules[p].named_parameters()]
    finalizer = TpGradSync.for_model(model, tp_mesh, section.sequence_parallel, summed=summed)
    if finalizer is not None:
        finalizer.install(model)
    return TpApplied(plan=plan, head_counts=heads, finalizer=finalizer,
                     rng=_attach_rng(model, modules, meta, section, tp_mesh, where),
                     sequence_parallel=section.sequence_parallel)


def _attach_rng(model: nn.Module, modules: dict, meta: dict, section: TensorParallel, tp_mesh: DeviceMesh,
                where: str) -> TpRng | SingleDeviceDropout:
    """Dropout randomness per ``section.dropout_rng``: per-shard streams, or the single-device masks."""
    if section.dropout_rng == "single_device":  # draws nothing extra: TpRng's fork would consume the shared stream
        sdd = SingleDeviceDropout(tp_mesh, section.sequence_parallel,
                                  where.replace("tensor_parallel.rules", "tensor_parallel.dropout_rng"))
        sdd.attach(model, "", OUTSIDE)
        for parent in meta["fanout"]:
            sdd.attach(modules[parent] if parent else model, parent, REGION)
        shared = set(meta["norm_dropouts"])
        for path, mod in modules.items():
            if isinstance(mod, nn.modules.dropout._DropoutNd):
                sdd.attach(mod, path, SHARED if path in shared else INHERIT)
        return sdd
    rng = TpRng(tp_mesh.get_local_rank(), tp_mesh.device_type)
    for parent in meta["fanout"]:
        rng.fork(modules[parent] if parent else model)
    for path in meta["norm_dropouts"]:
        (rng.fork if section.sequence_parallel is not False else rng.shared)(modules[path])
    return rng
