"""Axes as units (:mod:`meshplan.axis`, :mod:`meshplan.axes`): the shape, the ordered list, and where an axis is
named. Context parallelism is the first unit; the other axes keep their own code paths until they join."""

from __future__ import annotations

import ast
import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest

from meshplan.axes import AXES
from meshplan.axis import Axis, AxisCosts

pytestmark = pytest.mark.fast

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "meshplan"
MENTION = re.compile(r"context_parallel|context parallel|\bcp\b")
#: files outside context_parallel/ that may name it: the ordered list, the torch-free plan section, the `cp` degree
#: of the layout and the mesh (rank math, data axes, the solver's enumeration and groups, CLI flags, converters),
#: the ParallelState field that owns its record, and torch's private APIs (pinned in _torch.py)
ALLOWED = {
    "axes.py",  # the ordered list
    "plan_file/context_parallel.py", "plan_file/document.py", "plan_file/layout.py", "plan_file/stages.py",
    "plan_file/data_parallel.py",  # the plan as data
    "mesh/ranks.py", "mesh/topology.py", "mesh/rank_table.py", "viz/rank_grid.py", "faults/watch.py",  # mesh dims
    "data_parallel/__init__.py", "data_parallel/fsdp.py", "blocks.py", "apply.py", "checks/validate.py",
    "training/step.py",  # cp as a data axis (dp·cp ranks hold different tokens)
    "solver/candidate.py", "solver/placement.py", "solver/search.py", "solver/rules.py",  # the degree searched
    "cli/args.py", "cli/solve.py", "convert/accelerate.py",  # flags and other formats' keys
    "state.py", "_torch.py",
}


EP_MENTION = re.compile(r"expert_parallel|expert parallel|\bep\b")
#: files outside expert_parallel/ that may name it (47 before it became a unit, these 38 after; docs/house.md): the
#: ordered list, the plan section and the ep/etp/edp degrees (layout, mesh, CLI flags, converters, the solver's
#: enumeration, groups and the model's MoE terms), edp as a data axis (FSDP2 over the experts), the record's field,
#: checkpoints' docstrings, transformers' MoE interop, explain's per-module totals, the tp token regions' checks
EP_ALLOWED = {
    "axes.py", "state.py",
    "plan_file/document.py", "plan_file/expert_parallel.py", "plan_file/hf_aliases.py", "plan_file/layout.py",
    "plan_file/stages.py",
    "mesh/rank_table.py", "mesh/ranks.py", "mesh/topology.py", "viz/rank_grid.py", "viz/model_draw.py",
    "cli/args.py", "cli/convert.py", "cli/solve.py",
    "convert/accelerate.py", "convert/common.py", "convert/formats.py", "convert/hf_document.py",
    "solver/candidate.py", "solver/compute.py", "solver/memory.py", "solver/placement.py", "solver/rules.py",
    "solver/search.py", "solver/terms.py",  # the blocks' local tensors (moved from memory.py: tp's costs read them)
    "blocks.py", "data_parallel/fsdp.py",
    "checkpoint/chunks.py", "checkpoint/export.py", "checkpoint/load.py", "checkpoint/save.py",
    "hf/checkpoint_keys.py", "hf/convert.py", "hf/moe.py",
    "checks/explain.py", "checks/regions.py", "checks/validate.py",
}


def test_axes_are_frozen_values_in_order():
    assert [a.name for a in AXES] == ["tp", "cp", "ep"]  # parallelize's order: tensor → context → expert
    for axis in AXES:
        assert isinstance(axis, Axis) and isinstance(axis.costs, AxisCosts)
        with pytest.raises(dataclasses.FrozenInstanceError):
            axis.name = "x"  # type: ignore[misc]
        assert callable(axis.check) and callable(axis.prepare) and callable(axis.apply)
        assert callable(axis.shard_batch) and callable(axis.report_lines)


def test_axes_import_without_torch():
    code = "import sys, meshplan.axes, meshplan.solver.search\nassert 'torch' not in sys.modules, 'torch imported'\n"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_an_axis_folder_never_imports_the_state_module():
    """``parallelize`` alone attaches the records an axis' apply returns."""
    for axis in AXES:
        folder = PKG / axis.section
        for f in folder.glob("*.py"):
            for node in ast.walk(ast.parse(f.read_text())):
                names = ([node.module] if isinstance(node, ast.ImportFrom) else
                         [a.name for a in node.names] if isinstance(node, ast.Import) else [])
                assert "meshplan.state" not in names, f"{f.relative_to(ROOT)}:{node.lineno} imports meshplan.state"


def test_context_parallelism_is_named_only_where_allowed():
    """The measure of issue 26: files outside ``context_parallel/`` that mention it (docs/house.md)."""
    found = {str(f.relative_to(PKG)) for f in PKG.rglob("*.py")
             if not f.is_relative_to(PKG / "context_parallel") and MENTION.search(f.read_text())}
    assert found <= ALLOWED, f"context parallelism named outside its unit: {sorted(found - ALLOWED)}"


def test_expert_parallelism_is_named_only_where_allowed():
    """The same measure for the second unit: files outside ``expert_parallel/`` that mention it."""
    found = {str(f.relative_to(PKG)) for f in PKG.rglob("*.py")
             if not f.is_relative_to(PKG / "expert_parallel") and EP_MENTION.search(f.read_text())}
    assert found <= EP_ALLOWED, f"expert parallelism named outside its unit: {sorted(found - EP_ALLOWED)}"


def test_opaque_modules_are_the_moe_blocks_of_the_plan():
    """What the split probe and the shadow run stand in for comes from the axes (ep: its MoE blocks)."""
    import torch.nn as nn

    from meshplan.axes import opaque_modules
    from meshplan.plan_file.document import as_plan

    class Moe(nn.Module):
        def __init__(self):
            super().__init__()
            self.router, self.experts = nn.Linear(4, 2), nn.Linear(4, 4)

    model = nn.Module()
    model.layers = nn.ModuleList([nn.Module() for _ in range(2)])
    for layer in model.layers:
        layer.moe = Moe()
    rules = {"layers.*.moe.experts": {"style": "experts"}, "layers.*.moe.router": {"style": "router"}}
    assert opaque_modules(model, as_plan({"expert_parallel": {"rules": rules}})) == ("layers.0.moe", "layers.1.moe")
    assert opaque_modules(model, as_plan({})) == ()


def test_report_lines_empty_without_a_summary():
    from meshplan.axes import report_lines
    from meshplan.checks.report import Report
    assert report_lines(Report(source="p", model="m", tp=1, world_size=1)) == []


def test_shard_batch_is_identity_without_records():
    from meshplan.axes import shard_batch
    from meshplan.state import ParallelState
    x, y = object(), object()
    assert shard_batch(None, x, y, True, -100) == (x, y, True)
    assert shard_batch(ParallelState(), x, y) == (x, y, False)
