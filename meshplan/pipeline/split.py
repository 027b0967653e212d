"""Cut a block-stack model into pipeline stages that keep the original parameter names.

The blocks (the ``blocks`` section's pattern, e.g. ``layers.*``) are children of one container (a
``ModuleList``/``ModuleDict``/``Sequential``). Stage ``s`` of ``pp·vpp`` runs a contiguous run of them; the
first stage also runs the modules with parameters registered before the container (the embedding), the last
those registered after it (final norm, head). A stage is a *view* of the model: a shallow copy whose container
holds its blocks under their original keys (so ``layers.5.attention.wq.weight`` keeps its name) and
pass-throughs in the other stages' block slots, and whose end modules of other stages are pass-throughs
(``nn.Identity``); what it receives and sends is taken at its blocks (:mod:`meshplan.pipeline.ends`), so the
model's code before and after the blocks runs on the first and last stage only. The model itself is pruned to
the union of this rank's stages, so its ``state_dict`` is this rank's part of the full one and the keys of all
ranks together are the full model's.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass

import torch.nn as nn

from meshplan._torch import module_view
from meshplan.errors import PlanError
from meshplan.pipeline.ends import Boundary, Skipped, install_ends
from meshplan.plan_file.patterns import match_pattern
from meshplan.plan_file.pipeline import Pipeline
from meshplan.plan_file.stages import balanced, local_stage_ids  # noqa: F401  (re-exported)

__all__ = ["StageSplit", "plan_split", "balanced", "prune", "stage_view", "local_stage_ids"]

#: the module types whose children can be blocks (a stage holds a new one of the same type with its blocks)
_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)


@dataclass(frozen=True)
class StageSplit:
    """Which blocks and end modules each stage runs.

    Attributes:
        container: path of the module holding the blocks (``layers``).
        keys: per stage, the container keys of its blocks (``("0", "1")``).
        first: modules only the first stage runs; ``last``: only the last.
    """

    container: str
    keys: tuple[tuple[str, ...], ...]
    first: tuple[str, ...]
    last: tuple[str, ...]

    @property
    def num_stages(self) -> int:
        return len(self.keys)


def _container(model: nn.Module, blocks: list[str], where: str) -> str:
    parents = {b.rpartition(".")[0] for b in blocks}
    if len(parents) != 1:
        raise PlanError(f"{where}: the blocks {blocks[0]!r}, … have {len(parents)} parents "
                        f"({', '.join(sorted(parents))}); pipelining cuts the children of ONE container; found "
                        f"{len(parents)}, expected 1 (set blocks.pattern to e.g. layers.*)")
    container = parents.pop()
    holder = model.get_submodule(container) if container else model
    if not isinstance(holder, _CONTAINERS):
        raise PlanError(f"{where}: the blocks {blocks[0]!r}, … are children of {container or '(root)'!r}, a "
                        f"{type(holder).__name__}; found no block container, expected the children of a "
                        f"ModuleList/ModuleDict/Sequential (set blocks.pattern to its children, e.g. layers.*)")
    return container


def _end_modules(model: nn.Module, container: str) -> tuple[list[str], list[str]]:
    """Modules with parameters registered before / after the container, at each level above it, in the model's
    module order (``model.norm`` before ``lm_head``)."""
    first, last = [], []
    parts = container.split(".") if container else []
    node, prefix = model, ""
    for name in parts:
        before = True
        for child_name, child in node.named_children():
            path = prefix + child_name
            if child_name == name:
                before = False
            elif any(True for _ in child.parameters()):
                (first if before else last).append(path)
        node, prefix = getattr(node, name), prefix + name + "."
    order = {path: i for i, (path, _) in enumerate(model.named_modules(remove_duplicate=False))}
    return sorted(first, key=order.__getitem__), sorted(last, key=order.__getitem__)


def _stage_sizes(section: Pipeline, keys: list[str], container: str, n_stages: int, where: str) -> list[int]:
    n = len(keys)
    if section.split_points is None:
        sizes = balanced(n, n_stages, section.first_stage_fewer_blocks, section.last_stage_fewer_blocks)
        if min(sizes) < 1:
            raise PlanError(f"{where}: {n} blocks cannot fill {n_stages} stages (pp·vpp) with first_stage_fewer_"
                            f"blocks {section.first_stage_fewer_blocks} and last_stage_fewer_blocks "
                            f"{section.last_stage_fewer_blocks}; found {sizes} blocks per stage, expected at least 1 "
                            f"each: lower pp·vpp or the fewer_blocks settings")
        return sizes
    if len(section.split_points) != n_stages - 1:
        raise PlanError(f"{where}.split_points: {n_stages} stages (pp·vpp) need {n_stages - 1} split points, got "
                        f"{len(section.split_points)}: {list(section.split_points)}")
    paths = [f"{container}.{k}" if container else k for k in keys]
    starts = []
    for i, point in enumerate(section.split_points):
        if point not in paths:
            valid = f"one of {paths[1]!r} … {paths[-1]!r}" if len(paths) > 2 else repr(paths[-1])
            raise PlanError(f"{where}.split_points[{i}]: {point!r} is not a block; found none, expected {valid} "
                            f"(where a stage begins)")
        starts.append(paths.index(point))
    bounds = [0, *starts, n]
    if any(b >= c for b, c in zip(bounds, bounds[1:])):
        raise PlanError(f"{where}.split_points: {list(section.split_points)} start stages 1… at blocks {starts} "
                        f"of {paths[0]!r} … {paths[-1]!r}; found a stage with no block, expected block indices "
                        f"increasing from 1 (stage 0 starts at {paths[0]!r})")
    return [c - b for b, c in zip(bounds, bounds[1:])]


def plan_split(model: nn.Module, section: Pipeline, block_pattern: str, n_stages: int,
               where: str = "pipeline") -> StageSplit:
    """Assign the model's blocks and end modules to ``n_stages`` stages.

    Raises:
        PlanError: blocks under several containers, fewer blocks than stages, split points that are not
            blocks (or out of order, or not ``n_stages - 1``), end modules that do not exist.
    """
    try:
        blocks = match_pattern(model, block_pattern, f"{where} (the stage unit, blocks.pattern)")
    except PlanError as e:
        raise PlanError(f"{e}; expected the pattern of the model's repeated blocks (blocks.pattern), or, for a "
                        f"model that is not a block stack, pipeline.split: trace with split_points") from None
    container = _container(model, blocks, where)
    holder = model.get_submodule(container) if container else model
    keys = [name for name, _ in holder.named_children()]
    if len(keys) < n_stages:
        raise PlanError(f"{where}: {len(keys)} blocks in {container!r} cannot fill {n_stages} stages (pp·vpp); "
                        f"expected at least {n_stages} blocks")
    sizes = _stage_sizes(section, keys, container, n_stages, where)
    cuts = [sum(sizes[:s]) for s in range(n_stages + 1)]
    first, last = _end_modules(model, container)
    first = list(section.first_stage_modules) if section.first_stage_modules is not None else first
    last = list(section.last_stage_modules) if section.last_stage_modules is not None else last
    for key, paths in (("first_stage_modules", first), ("last_stage_modules", last)):
        for p in paths:
            try:
                model.get_submodule(p)
            except AttributeError:
                close = difflib.get_close_matches(p, [n for n, _ in model.named_modules() if n], n=3)
                raise PlanError(f"{where}.{key}: {type(model).__name__} has no module {p!r}; found none, expected a "
                                f"module path{' (closest: ' + ', '.join(close) + ')' if close else ''}") from None
    return StageSplit(container, tuple(tuple(keys[cuts[s]:cuts[s + 1]]) for s in range(n_stages)),
                      tuple(first), tuple(last))


def _replace(root: nn.Module, path: str, new: nn.Module, copies: dict[str, nn.Module]) -> None:
    """Set ``path`` of ``root`` to ``new``, shallow-copying the modules above it (``copies``, by path, are the
    views already made) so that the original model is untouched."""
    parent_path, _, name = path.rpartition(".")
    parent = root
    walked = ""
    for part in parent_path.split(".") if parent_path else []:
        walked = f"{walked}.{part}" if walked else part
        if walked not in copies:
            copies[walked] = module_view(getattr(parent, part))
            setattr(parent, part, copies[walked])
        parent = copies[walked]
    setattr(parent, name, new)


def _subset(container: nn.Module, keys: tuple[str, ...]) -> nn.Module:
    holder = type(container)()
    for k in keys:
        holder.add_module(k, container.get_submodule(k))
    return holder


def _slots(container: nn.Module, split: StageSplit, stage: int, boundary: Boundary) -> nn.Module:
    """A container of the same type with every block slot: this stage's blocks, pass-throughs for the others'
    (the first one after this stage's blocks notes what the stage sends)."""
    holder, mine = type(container)(), split.keys[stage]
    after = [k for s in range(stage + 1, split.num_stages) for k in split.keys[s]]
    for k in (k for keys in split.keys for k in keys):
        holder.add_module(k, container.get_submodule(k) if k in mine else
                          Skipped(boundary, sends=bool(after) and k == after[0]))
    return holder


def stage_view(model: nn.Module, split: StageSplit, stage: int) -> nn.Module:
    """Stage ``stage`` of ``model``: a view sharing its parameters, with only that stage's blocks and end modules
    (the other stages' block slots pass through; see :mod:`meshplan.pipeline.ends` for what it receives and
    sends)."""
    if not split.container:  # the model is the container (an nn.Sequential of blocks)
        return _subset(model, split.keys[stage])
    view, copies, boundary = module_view(model), {}, Boundary()
    slots = _slots(model.get_submodule(split.container), split, stage, boundary)
    _replace(view, split.container, slots, copies)
    if stage != 0:
        for p in split.first:
            _replace(view, p, nn.Identity(), copies)
    if stage != split.num_stages - 1:
        for p in split.last:
            _replace(view, p, nn.Identity(), copies)
    ends = (slots.get_submodule(split.keys[stage][0]), slots.get_submodule(split.keys[stage][-1]))
    install_ends(view, ends, boundary, first=stage == 0,
                 last=stage == split.num_stages - 1)
    return view


def prune(model: nn.Module, split: StageSplit, stages: list[int]) -> None:
    """Keep in ``model`` only what ``stages`` run (in place): the union of their blocks and end modules."""
    keys = tuple(k for s in sorted(stages) for k in split.keys[s])
    if not split.container:
        for k in [k for k, _ in model.named_children() if k not in keys]:
            delattr(model, k)
        return
    holder = model.get_submodule(split.container)
    parent, _, name = split.container.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, name, _subset(holder, keys))
    for p in split.first if 0 not in stages else ():
        parent, _, name = p.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, name, nn.Identity())
    for p in split.last if split.num_stages - 1 not in stages else ():
        parent, _, name = p.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, name, nn.Identity())
