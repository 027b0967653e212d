"""Generate the ``parallelize_module`` plan for the ``tensor_parallel`` section.

What an expert writes by hand: with sequence parallelism the residual stream
is a ``Shard(1)`` DTensor (global shape kept, so models that derive positions
or masks from the hidden states' shape still work); norms run
``SequenceParallel``; the parent that fans out to colwise projections gets one
input conversion (all-gather) for the whole block; rowwise outputs
reduce-scatter back; the embedding reduce-scatters; the lm_head gathers its
input. Without SP the stream is a plain replicated tensor and each block
converts it once. Per layer that is exactly 2 all-gathers + 2 reduce-scatters
each way with SP, 2 all-reduces each way without.

What each style means (the modules it fits, its sizes, layouts and torch style) is
:data:`meshplan.tensor_parallel.style_table.STYLES`; applying the plan is
:func:`meshplan.tensor_parallel.apply.apply_tensor_parallel`.
"""

from __future__ import annotations

from typing import Any

import torch.nn as nn
from torch.distributed.tensor.parallel import ParallelStyle

from meshplan._torch import DropoutNd
from meshplan.errors import PlanError
from meshplan.mesh.ranks import divisors_text, not_dividing
from meshplan.plan_file.patterns import match_rules
from meshplan.plan_file.tensor_parallel import TensorParallel
from meshplan.tensor_parallel.head_params import HeadParamsParallel
from meshplan.tensor_parallel.layouts import Stream, StyleArgs, placement
from meshplan.tensor_parallel.packed import features, uses_packed_style
from meshplan.tensor_parallel.style_table import STYLES, StyleSpec
from meshplan.tensor_parallel.styles import PrepareHiddenInput, hidden_arg_name

__all__ = ["generate_tp_plan", "rules_where"]


def rules_where(source: str | None) -> str:
    """Where error messages say a rule is: ``"plan.yaml: tensor_parallel.rules"``."""
    return f"{source}: tensor_parallel.rules" if source else "tensor_parallel.rules"


def _check_divisible(where: str, path: str, what: str, n: int, tp: int) -> None:
    why = not_dividing("tp", tp, what, n)
    if why:
        raise PlanError(f"{where}: module {path!r}: {why}")


def _packed(spec: StyleSpec, mod: nn.Module, o: dict, tp: int, where: str, path: str) -> int:
    """The packed count of a colwise/rowwise rule on a packed weight or a ``Conv1D``, its sizes checked.

    Raises:
        PlanError: the module is not a Linear/Conv1D, or ``packed x tp`` does not divide its features.
    """
    if features(mod) is None:
        raise PlanError(f"{where}: module {path!r} is {type(mod).__name__}; style {spec.name} with packed needs "
                        f"nn.Linear or Conv1D")
    k = int(o.get("packed") or 1)
    what, n = spec.sharded_dim(mod)
    if n % (k * tp):
        valid = divisors_text(n // k) if n % k == 0 else "none"
        raise PlanError(f"{where}: module {path!r}: packed({k}) x tp({tp}) does not divide {what}({n}); "
                        f"valid tp: {valid}")
    return k


def _style(spec: StyleSpec, mod: nn.Module, o: dict, layouts: dict, tp: int, stream: Stream, where: str,
           path: str) -> ParallelStyle | None:
    """One module's fresh torch style, after checking that the style fits it and tp divides its sizes."""
    packed = None
    if spec.packable and uses_packed_style(mod, o.get("packed") or 1):  # packed fused weights, transformers' Conv1D
        packed = _packed(spec, mod, o, tp, where, path)
    else:
        if spec.needs and not isinstance(mod, spec.needs):
            raise PlanError(f"{where}: module {path!r} is {type(mod).__name__}; style {spec.name} needs "
                            f"{spec.needs_text()}")
        if spec.sharded_dim is not None:
            what, n = spec.sharded_dim(mod)
            _check_divisible(where, path, what + spec.size_note, n, tp)
    return spec.build(StyleArgs(layouts, stream, o, packed))


def generate_tp_plan(model: nn.Module, section: TensorParallel, tp: int, source: str | None = None
                     ) -> tuple[dict[str, Any], dict[str, Any]]:
    """The path → torch ``ParallelStyle`` dict for ``model`` (fresh style objects every call).

    Args:
        model: the model to parallelize (not changed).
        section: the plan's ``tensor_parallel`` section.
        tp: the tensor-parallel degree.
        source: the plan file, for error messages.

    Returns:
        ``(plan, meta)``: ``meta`` holds ``fanout`` (parents converted once per block), ``local_heads``
        (parents that see this rank's heads), ``head_norms``, ``summed_params`` (``head_params``' shared
        parameters, ``path.name``), ``norm_dropouts``, the matched rules and the
        model's modules by path.

    Raises:
        PlanError: a rule matching nothing, conflicting rules, a style that does not fit
            its module, or a size tp does not divide (with the valid tp values).
    """
    where = rules_where(source)
    stream = Stream.of(section)
    matched = match_rules(model, section.rules, where)
    modules = dict(model.named_modules())
    plan: dict[str, Any] = {}
    fanout: dict[str, None] = {}
    local_heads: dict[str, None] = {}  # parents with a colwise child whose local output is this rank's heads
    head_norms: list[str] = []
    summed_params: list[str] = []
    norm_dropouts: list[str] = []
    per_rule: dict[int, tuple[dict, dict]] = {}  # one per rule, not per module (126-layer models: 1.6k modules)
    for path, (pattern, rule) in matched.items():
        spec, mod, parent = STYLES[rule.style], modules[path], path.rpartition(".")[0]
        if id(rule) not in per_rule:
            o = rule.overrides()
            per_rule[id(rule)] = (o, spec.layouts(o, stream))
        o, layouts = per_rule[id(rule)]
        if spec.gives_local_heads(o):
            local_heads[parent] = None
        style = _style(spec, mod, o, layouts, tp, stream, f"{where}.{pattern!r}", path)
        if style is not None:
            plan[path] = style
        if spec.parent_converts_input(o):
            fanout[parent] = None
        if spec.stream_module and isinstance(mod, DropoutNd):
            norm_dropouts.append(path)
        if spec.on_local_heads:
            head_norms.append(path)  # runs unchanged on local heads; its grads join the gradient finaliser's tp sum
        if spec.head_params:
            own = {n for n, _ in mod.named_parameters(recurse=False)}  # a wildcard may match layers without one
            summed_params += [f"{path}.{n}" if path else n for n in o.get("summed", ()) if n in own]
    _convert_once(model, modules, plan, fanout, stream, section.save_gathered_inputs)
    return plan, {"fanout": list(fanout), "local_heads": list(local_heads), "head_norms": head_norms,
                  "summed_params": summed_params, "norm_dropouts": norm_dropouts, "matched": matched, "modules": modules}


def _convert_once(model: nn.Module, modules: dict[str, nn.Module], plan: dict[str, Any], fanout: dict[str, None],
                  stream: Stream, save_gathered: bool = True) -> None:
    """One input conversion (stream → replicate) on each parent of colwise children, unless the user
    prepared it by hand. A ``head_params`` style on the parent applies the conversion too (one style per path)."""
    arg_names: dict[type, str | None] = {}  # inspect.signature once per class
    for parent in fanout:
        if parent in plan and not isinstance(plan[parent], HeadParamsParallel):
            continue  # the user prepared it by hand
        target = modules[parent] if parent else model
        if "forward" in target.__dict__:
            name = hidden_arg_name(target)
        elif type(target) in arg_names:
            name = arg_names[type(target)]
        else:
            name = arg_names[type(target)] = hidden_arg_name(target)
        prepare = PrepareHiddenInput(input_layout=placement(stream.layout), desired_layout=placement("replicate"),
                                     arg_name=name, save_gathered=save_gathered)
        if parent in plan:
            plan[parent].prepare = prepare
        else:
            plan[parent] = prepare
