"""Cut a model that is not a block stack into pipeline stages at named modules, by tracing.

``torch.distributed.pipelining.pipeline`` exports the model (``torch.export``) with a split marker before each
split point (``SplitPoint.BEGINNING``) and cuts the graph there: stage ``k`` runs from split point ``k-1`` up to
split point ``k``, so ``split_points=["layer3"]`` on a ResNet gives the seeds' ``seq1`` (stem, ``layer1``,
``layer2``) and ``seq2`` (``layer3`` … ``fc``). Each stage module is an ``fx.GraphModule`` whose submodules
keep the model's paths (``layer3.0.conv1``) and whose parameters *are* the model's (the same tensor objects),
so its state-dict keys are the original names. Tracing adds keys the model's state dict does not have (a
non-persistent buffer, a plain tensor attribute lifted to a constant): :func:`stage_state_dict` gives a stage's
part of the model's state dict under the model's names, and the parts of all stages together are the whole.

Tracing specialises shapes: ``example_args`` must be one *microbatch* (the shapes each stage will see). The
model's ``forward`` methods are restored after tracing (``pipeline`` patches the split modules').
"""

from __future__ import annotations

import contextlib
import linecache
import os
import sysconfig
import traceback
import warnings
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.nn as nn

from meshplan.errors import PlanError
from meshplan.plan_file.patterns import is_pattern, match_rules

__all__ = ["TracedStages", "check_split_points", "traced_stages", "stage_state_dict"]

_NOT_USER_CODE = (os.path.dirname(torch.__file__), os.path.dirname(__file__), sysconfig.get_paths()["stdlib"])


@dataclass
class TracedStages:
    """This rank's traced stages.

    Attributes:
        modules: the stage modules (``fx.GraphModule``), one per entry of ``stage_indices``.
        stage_indices: which stages of the pipeline they are.
        num_stages: stages of the whole pipeline.
        info: ``Pipe.info()``: the split graph ``build_stage`` needs to wire stages together.
    """

    modules: list[nn.Module]
    stage_indices: list[int]
    num_stages: int
    info: Any

    def build(self, device: torch.device, group: Any = None) -> list[Any]:
        """The ``_PipelineStage`` objects of these stages (for a ``torch.distributed.pipelining`` schedule): each
        module's factory ops moved to ``device`` (tracing burnt the trace device in), then ``build_stage``."""
        from torch.distributed.pipelining import build_stage

        from meshplan._torch import retarget_graph_device
        out = []
        for module, i in zip(self.modules, self.stage_indices):
            retarget_graph_device(module, device)
            out.append(build_stage(module, i, self.info, device, group))
        return out


def check_split_points(model: nn.Module, split_points: Sequence[str], num_stages: int,
                       where: str = "pipeline.split_points") -> None:
    """Check split points without tracing: one module path each (no pattern, not the root), ``num_stages - 1``
    of them, no repeats.

    Raises:
        PlanError: says which split point, what was found and what was expected (a path that names no module
            gets the closest module paths).
    """
    points = list(split_points)
    if num_stages < 1 or len(points) != num_stages - 1:
        raise PlanError(f"{where}: {len(points)} split points {points} for {num_stages} stages; expected "
                        f"num_stages - 1 = {max(num_stages - 1, 0)} (each split point starts a stage after the first)")
    for p in points:
        if not isinstance(p, str) or not p or is_pattern(p):
            raise PlanError(f"{where}: split point {p!r} is not a module path; expected one module of "
                            f"{type(model).__name__} such as 'layer3' (no pattern, not the root)")
    dup = sorted({p for p in points if points.count(p) > 1})
    if dup:
        raise PlanError(f"{where}: split points {dup} appear more than once; expected distinct module paths")
    match_rules(model, {p: p for p in points}, where)


def _module_paths(model: nn.Module) -> dict[int, str]:
    return {id(m): name for name, m in model.named_modules(remove_duplicate=False)}


def _untraceable(model: nn.Module, exc: BaseException, where: str) -> PlanError:
    """One message for an export failure: the innermost module of ``model`` being called, the innermost line of
    code outside torch, and the first line of torch's reason."""
    cause = exc.__cause__ or exc
    paths, module, line = _module_paths(model), None, None
    for frame, lineno in traceback.walk_tb(cause.__traceback__):
        obj = frame.f_locals.get("self")
        if isinstance(obj, nn.Module) and id(obj) in paths:
            module = f"{paths[id(obj)] or '<root>'} ({type(obj).__name__})"
        fname = frame.f_code.co_filename
        if not fname.startswith(_NOT_USER_CODE):
            code = linecache.getline(fname, lineno).strip()
            line = f"{fname}:{lineno} in {frame.f_code.co_name}" + (f" `{code}`" if code else "")
    reason = (str(cause).strip().splitlines() or [""])[0]
    return PlanError(f"{where}: torch.export cannot trace {type(model).__name__} at module {module or '<unknown>'}"
                     f"{f', {line}' if line else ''}: {type(cause).__name__}: {reason}; expected a model torch.export "
                     f"captures as one graph (no data-dependent control flow, no graph breaks): make that module "
                     f"traceable, or split the model as a block stack instead of at named modules")


def _restore_forwards(model: nn.Module, split_points: Sequence[str]) -> None:
    from meshplan._torch import remove_split_marker
    for p in split_points:
        remove_split_marker(model.get_submodule(p))


@contextlib.contextmanager
def _no_cache(model: nn.Module) -> Any:
    """A transformers model traced with ``config.use_cache`` off (restored after): with it on, the forward returns
    a ``DynamicCache``, which torch.export cannot put in a graph's output (and training never reads it)."""
    config = getattr(model, "config", None)
    before = getattr(config, "use_cache", None)
    if before:
        config.use_cache = False
    try:
        yield
    finally:
        if before:
            config.use_cache = before


def _trace(model: nn.Module, example_args: tuple, example_kwargs: dict | None, split_points: Sequence[str],
           where: str) -> Any:
    from torch.distributed.pipelining import SplitPoint, pipeline
    try:
        with warnings.catch_warnings():  # torch 2.13's own deprecation, raised when Pipe deep-copies a graph
            warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")
            with _no_cache(model):
                return pipeline(model, mb_args=tuple(example_args), mb_kwargs=example_kwargs,
                                split_spec={p: SplitPoint.BEGINNING for p in split_points})
    except Exception as e:  # torch wraps every export failure in one RuntimeError
        raise _untraceable(model, e, where) from e
    finally:
        _restore_forwards(model, split_points)


def _stage_modules(pipe: Any, split_points: Sequence[str], where: str) -> list[nn.Module]:
    try:
        return [pipe.get_stage_module(i) for i in range(pipe.num_stages)]
    except AttributeError:  # torch numbers stages by the graph pieces it cut, an empty piece has no module
        raise PlanError(f"{where}: split points {list(split_points)} leave a stage empty (a split point before "
                        f"anything forward runs, or two with nothing in between); expected every stage to run "
                        f"something") from None


def _check_pipe(pipe: Any, split_points: Sequence[str], num_stages: int, where: str) -> list[nn.Module]:
    """The traced pipeline's stage modules, checked: the stages asked for, each split point starting its stage,
    no parameter on two stages."""
    modules = _stage_modules(pipe, split_points, where)
    if pipe.replicated_params:
        index = {id(m): i for i, m in enumerate(modules)}
        children = dict(pipe.split_gm.named_children())
        shared = "; ".join(", ".join(f"stage {index.get(id(children.get(k)), k)}: {n!r}" for k, n in use.items())
                           for use in pipe.replicated_params)
        raise PlanError(f"{where}: parameters used by more than one traced stage ({shared}); expected each "
                        f"parameter on one stage (tracing copies a shared parameter per stage and nothing keeps the "
                        f"copies equal): move the split points so that its users share a stage")
    found = {p: [i for i, m in enumerate(modules) if p in dict(m.named_modules())] for p in split_points}
    if len(modules) != num_stages or any(s[:1] != [k + 1] for k, s in enumerate(found.values())):
        where_found = ", ".join(f"{p!r} in stage(s) {s or 'none'}" for p, s in found.items())
        raise PlanError(f"{where}: tracing cut {len(modules)} stages with split points {list(split_points)} "
                        f"({where_found}); expected {num_stages} stages, split point k starting stage k + 1: "
                        f"give split points in the order forward calls them, each a module forward calls exactly "
                        f"once")
    _check_contiguous(modules, split_points, where)
    return modules


def _check_contiguous(modules: list[nn.Module], split_points: Sequence[str], where: str) -> None:
    """Every tensor a stage receives is contiguous: torch's stages receive into buffers of the traced strides and
    send what the stage returns, and gloo's (and NCCL's) send/recv take contiguous tensors only (EmbeddingGemma 2's
    hidden state at ``layers.1`` is a transpose: its stages hung, each rank failing its send or receive)."""
    for k, module in enumerate(modules[1:], start=1):
        for node in getattr(getattr(module, "graph", None), "nodes", ()):
            val = node.meta.get("val") if node.op == "placeholder" else None
            if isinstance(val, torch.Tensor) and not val.is_contiguous():
                raise PlanError(f"{where}: stage {k} (from split point {split_points[k - 1]!r}) receives "
                                f"{node.name} of shape {tuple(val.shape)} with strides {tuple(val.stride())}, not "
                                f"contiguous; torch's pipeline sends and receives contiguous tensors only: move the "
                                f"split point to a module whose input is contiguous, or use split: blocks")


def traced_stages(model: nn.Module, example_args: tuple, split_points: Sequence[str], num_stages: int,
                  stage_indices: Sequence[int], example_kwargs: dict | None = None,
                  where: str = "pipeline.split_points") -> TracedStages:
    """Trace ``model`` and cut it before each split point; return the stages ``stage_indices``.

    Args:
        model: any module ``torch.export`` can trace; its parameters become the stages' (shared, not copied).
        example_args: the positional inputs of ONE microbatch (tracing specialises shapes).
        split_points: module paths, in forward order; split point ``k`` is the first module of stage ``k + 1``.
        num_stages: stages of the whole pipeline (``len(split_points) + 1``).
        stage_indices: the stages this rank runs.
        example_kwargs: keyword inputs of one microbatch.
        where: prefix of error messages (plan key).

    Raises:
        PlanError: bad split points (see :func:`check_split_points`), a stage index out of range, a model
            ``torch.export`` cannot trace (names the module and the line), split points that cut other stages than
            asked, a parameter used by two stages.
    """
    check_split_points(model, split_points, num_stages, where)
    bad = [i for i in stage_indices if not 0 <= i < num_stages]
    if bad or not stage_indices:
        raise PlanError(f"{where}: stage indices {list(stage_indices)}; expected at least one, each in "
                        f"0..{num_stages - 1}")
    pipe = _trace(model, example_args, example_kwargs, split_points, where)
    modules = _check_pipe(pipe, split_points, num_stages, where)
    return TracedStages(modules=[modules[i] for i in stage_indices],
                        stage_indices=list(stage_indices), num_stages=num_stages, info=pipe.info())


def stage_state_dict(stage_module: nn.Module, model: nn.Module) -> dict[str, torch.Tensor]:
    """A traced stage's part of ``model.state_dict()``, under the model's names.

    A stage tensor is matched to the model's by identity (tracing shares them), else by name; keys tracing
    added (non-persistent buffers, lifted constants) are left out. Every key of every stage of one pipeline
    together are exactly the model's keys.
    """
    model_sd = model.state_dict(keep_vars=True)
    by_id: dict[int, list[str]] = {}
    for name, t in model_sd.items():
        by_id.setdefault(id(t), []).append(name)  # a tied tensor: every name the model gives it
    out = {}
    for name, t in stage_module.state_dict(keep_vars=True).items():
        for orig in by_id.get(id(t), [name] if name in model_sd else []):
            out[orig] = t.detach()
    return out
