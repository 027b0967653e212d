"""Axes as units (:mod:`meshplan.axis`, :mod:`meshplan.axes`): the shape, the ordered list, and where an axis is
named and reached. Every axis is a unit: AXES = (pp, tp, cp, ep, dp); each axis' set of files outside its folder
that name it, and of files whose code reaches it (issue 26's coupling measure), may only shrink."""

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
    "axes.py", "solver/units.py",  # the ordered list, and its torch-free half that the solver reads (spec layer)
    "plan_file/context_parallel.py", "plan_file/document.py", "plan_file/layout.py", "plan_file/stages.py",
    "plan_file/data_parallel.py",  # the plan as data
    "mesh/ranks.py", "mesh/topology.py", "mesh/rank_table.py", "viz/rank_grid.py", "faults/watch.py",  # mesh dims
    "data_parallel/mode.py", "data_parallel/unit.py", "data_parallel/wrap.py",  # cp as a data axis, in dp's unit
    "tensor_parallel/check/validate.py",  # tp's static check: cp's degree in its world-size hints
    "solver/candidate.py", "solver/placement.py", "solver/search.py", "solver/rules.py",  # the degree searched
    "cli/args.py", "cli/solve.py", "cli/solve_flags.py", "convert/accelerate.py",  # flags and other formats' keys
    "state.py", "_torch.py",
    # issues 27-30: the trainer (the sections it fills, the shapes it checks, the layout degrees it launches), the
    # converters' cp sections, the rank view's shares, packed documents under pp, numerics without the dp section
    "cli/train.py", "convert/common.py", "convert/formats.py", "data/packed.py", "plan_file/training.py", "solver/report.py", "trainer/checks.py", "trainer/defaults.py",
    # keyword inputs under pp: the stage inputs name cp's document ids
    "pipeline/inputs.py",
}


EP_MENTION = re.compile(r"expert_parallel|expert parallel|\bep\b")
#: files outside expert_parallel/ that may name it (47 before it became a unit, these 38 after; docs/house.md): the
#: ordered list, the plan section and the ep/etp/edp degrees (layout, mesh, CLI flags, converters, the solver's
#: enumeration, groups and the model's MoE terms), edp as a data axis (FSDP2 over the experts), the record's field,
#: checkpoints' docstrings, transformers' MoE interop, explain's per-module totals, the tp token regions' checks
EP_ALLOWED = {
    "axes.py", "solver/units.py", "state.py",
    "plan_file/document.py", "plan_file/expert_parallel.py", "plan_file/hf_aliases.py", "plan_file/layout.py",
    "plan_file/stages.py",
    "mesh/rank_table.py", "mesh/ranks.py", "mesh/topology.py", "viz/rank_grid.py", "viz/model_draw.py",
    "cli/args.py", "cli/convert.py", "cli/solve.py", "cli/solve_flags.py",
    "convert/accelerate.py", "convert/common.py", "convert/formats.py", "convert/hf_document.py",
    "solver/candidate.py", "solver/compute.py", "solver/memory.py", "solver/placement.py", "solver/rules.py",
    "solver/search.py", "solver/moe_costs.py",  # an eager expert loop's cost: the local experts are experts / ep
    "solver/terms.py",  # the blocks' local tensors (moved from memory.py: tp's costs read them)
    "data_parallel/wrap.py",  # edp: FSDP2 over the experts
    "checkpoint/chunks.py", "checkpoint/export.py", "checkpoint/load.py", "checkpoint/save.py",
    "hf/checkpoint_keys.py", "hf/convert.py", "hf/moe.py",
    "checks/explain.py", "tensor_parallel/check/regions.py", "tensor_parallel/check/validate.py",
    # issues 27-30: the trainer (the sections it fills, the shapes it checks, the layout degrees it launches), the
    # converters' cp sections, the rank view's shares, packed documents under pp, numerics without the dp section
    "checks/rank_view.py", "cli/train.py", "solver/report.py",
    "solver/overheads.py",  # issue 31: the optimizer's DTensor dispatch when ep shards the experts
}

PP_MENTION = re.compile(r"pipeline|\bpp\b")
#: files outside pipeline/ that may name it (57 on ac64207 before it became a unit, these 51 after; docs/house.md):
#: the ordered list and the unit's shape, the plan section and the pp/vpp degrees (layout, stage arithmetic, rank
#: math, the mesh, CLI flags, converters, the solver's enumeration, groups and per-rank reports), the record's field
#: and its readers (loading, materialize, FSDP2's stage roots, clipping's stage weights, train_step's pp > 1 without
#: stages), the other units naming the pipeline (cp refuses split: trace; costs per pipeline rank), checkpoints' and
#: faults' docstrings and the p2p group the fault watch names, the check report's JSON key, the schedule timeline
PP_ALLOWED = {
    "axes.py", "solver/units.py", "axis.py", "state.py", "_torch.py",
    "plan_file/document.py", "plan_file/layout.py", "plan_file/pipeline.py", "plan_file/stages.py",
    "mesh/rank_table.py", "mesh/ranks.py", "mesh/topology.py", "viz/rank_grid.py",
    "cli/args.py", "cli/plans.py", "cli/solve.py", "cli/solve_flags.py", "convert/accelerate.py", "convert/hf_document.py",
    "solver/candidate.py", "solver/cluster.py", "solver/collectives.py", "solver/memory.py", "solver/placement.py",
    "solver/plans.py", "solver/report.py", "solver/rules.py", "solver/search.py", "solver/step.py", "solver/terms.py",
    "weights/load.py", "weights/materialize.py", "data_parallel/wrap.py", "data_parallel/costs.py", "training/clip.py", "training/step.py",
    "context_parallel/apply.py", "context_parallel/check.py", "context_parallel/costs.py",
    "context_parallel/runtime.py", "expert_parallel/__init__.py", "expert_parallel/check.py",
    "expert_parallel/costs.py", "tensor_parallel/costs.py",
    "checkpoint/export.py", "checkpoint/load.py", "checkpoint/save.py", "checkpoint/state.py",
    "faults/report.py", "faults/watch.py",
    "checks/report.py", "tensor_parallel/check/validate.py", "viz/__init__.py", "viz/model_draw.py", "viz/timeline.py",
    # issues 27-30: the trainer (the sections it fills, the shapes it checks, the layout degrees it launches), the
    # converters' cp sections, the rank view's shares, packed documents under pp, numerics without the dp section
    "cli/train.py", "context_parallel/batch.py", "plan_file/training.py", "trainer/checks.py", "trainer/defaults.py", "trainer/loop.py",
    # issue 27: accumulate_unsharded's meaning under a pipeline; issue 31: the profile's and the solver's priced
    # pipeline actions
    "plan_file/data_parallel.py", "profile/overheads.py", "profile/run.py", "profile/worker.py", "solver/overheads.py",
}


DP_MENTION = re.compile(r"data_parallel|DataParallel|data parallel")
#: files outside data_parallel/ that name data parallelism (32 at ac64207, these 29 since it became a unit; the
#: regex counts the section, its record and the words, not the dp degrees every layout names nor FSDP2 in docstrings):
#: the ordered list and the Axis shape (its data_parallel field), the plan as data (section, its legacy spellings, the
#: stage arithmetic), the mesh's data dims, the record's field and the one public entry that attaches it outside
#: parallelize (standalone.py), the solver's own dp terms (once per step, not a unit's per-microbatch terms),
#: converters and transformers' interop, the tp gradient finaliser it re-installs, train_step's public docstring,
#: the other units that ask it for their gradients (ep's edp, cp's data ranks)
DP_ALLOWED = {
    "axes.py", "solver/units.py", "axis.py", "state.py", "standalone.py", "_torch.py",
    "plan_file/blocks.py", "plan_file/data_parallel.py", "plan_file/document.py", "plan_file/pipeline.py",
    "plan_file/stages.py",
    "mesh/runtime.py", "mesh/topology.py", "viz/rank_grid.py",
    "solver/candidate.py", "solver/cluster.py", "solver/plans.py", "solver/rules.py", "cli/solve.py", "cli/solve_flags.py",
    "convert/common.py", "convert/deepspeed.py", "hf/convert.py", "context_parallel/hf_check.py",
    "expert_parallel/unit.py", "pipeline/probe.py", "pipeline/traced.py",
    "tensor_parallel/apply.py", "tensor_parallel/dropout/single_device.py", "gradients.py",
    "training/step.py",
    # issues 27-30: the trainer (the sections it fills, the shapes it checks, the layout degrees it launches), the
    # converters' cp sections, the rank view's shares, packed documents under pp, numerics without the dp section
    "checks/numerics.py", "convert/accelerate.py", "plan_file/training.py", "trainer/defaults.py",
    # issue 27: a pipeline stage reduce-scattering FSDP2 gradients every microbatch (accumulate_unsharded false);
    # issue 31: the optimizer's DTensor dispatch under FSDP2
    "pipeline/apply.py", "pipeline/reducing.py", "pipeline/unit.py", "solver/overheads.py",
}


def test_axes_are_frozen_values_in_order():
    assert [a.name for a in AXES] == ["pp", "tp", "cp", "ep", "dp"]  # parallelize's order: split → tensor → context → expert → data
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


def named_outside(folder: str, mention: re.Pattern) -> set[str]:
    """Files outside ``meshplan/<folder>/`` whose text matches ``mention`` (``benchmarks/coupling.py``'s "named")."""
    return {str(f.relative_to(PKG)) for f in PKG.rglob("*.py")
            if not f.is_relative_to(PKG / folder) and mention.search(f.read_text())}


def test_context_parallelism_is_named_only_where_allowed():
    """The measure of issue 26: files outside ``context_parallel/`` that mention it (docs/house.md)."""
    found = named_outside("context_parallel", MENTION)
    assert found <= ALLOWED, f"context parallelism named outside its unit: {sorted(found - ALLOWED)}"


def test_expert_parallelism_is_named_only_where_allowed():
    """The same measure for the second unit: files outside ``expert_parallel/`` that mention it."""
    found = named_outside("expert_parallel", EP_MENTION)
    assert found <= EP_ALLOWED, f"expert parallelism named outside its unit: {sorted(found - EP_ALLOWED)}"


def _reaching(folder: str) -> set[str]:
    """Files outside ``meshplan/<folder>/`` whose code reaches the axis (issue 26's coupling measure, as
    ``benchmarks/coupling.py`` counts it): an import of the folder at any depth, or a read of its record
    (``state.<folder>``, ``.<folder> is (not) None``; each axis' record field is named as its folder)."""
    imports = re.compile(rf"(from|import)\s+meshplan\.{folder}\b")
    record = re.compile(rf"\bstate\.{folder}\b|\.{folder} is not None|\.{folder} is None")
    return {str(f.relative_to(PKG)) for f in PKG.rglob("*.py") if not f.is_relative_to(PKG / folder)
            and (imports.search(text := f.read_text()) or record.search(text))}


#: the files outside context_parallel/ and data_parallel/ whose code reaches them (1 and 5 on ac64207): the ordered
#: lists; dp's also the records' owner and the public apply_data_parallel, which attaches its own record
CP_REACH = {"axes.py", "solver/units.py",
            # the trainer's and the converters' pre-run seq-length and section checks (torch-free chunks.py)
            "convert/formats.py", "trainer/checks.py"}
DP_REACH = {"axes.py", "solver/units.py", "standalone.py", "state.py"}


def test_context_and_data_parallelism_are_reached_only_through_their_units():
    for folder, allowed in (("context_parallel", CP_REACH), ("data_parallel", DP_REACH)):
        found = _reaching(folder)
        assert found <= allowed, f"code outside {folder}/ reaching it: {sorted(found - allowed)}; ask the axes"


#: files outside expert_parallel/ whose code reaches it (issue 26's "≤ 5"; 7 on ac64207 and 6f74993: also checks/explain.py,
#: checks/validate.py, data_parallel/wrap.py, hf/moe.py, now behind Axis.tp_exempt, token_regions, data_shard and
#: the torch-free token_region_of): the ordered lists, and transformers' ep_plan written from the plan's section
EP_COUPLED = {"axes.py", "solver/units.py", "convert/hf_document.py"}


def test_expert_parallelism_is_reached_only_through_its_unit():
    """The coupling may only shrink: the rest of meshplan asks the axes (MoE experts over edp, explain's totals,
    the token regions of the tp checks), not the folder or its record."""
    found = _reaching("expert_parallel")
    assert found <= EP_COUPLED, f"code outside expert_parallel/ reaching it: {sorted(found - EP_COUPLED)}"


def test_the_expert_hooks_the_other_axes_ask():
    """ep's token regions are its MoE blocks (what tp's static checks take, handed through the axes); its experts are
    exempt from tp in explain's totals, and wrapped over edp by dp's wrap (Axis.data_shard)."""
    import torch.nn as nn

    from meshplan.axes import _regions
    from meshplan.plan_file.document import as_plan
    ep, tp = (next(a for a in AXES if a.name == n) for n in ("ep", "tp"))
    model = nn.Module()
    model.layers = nn.ModuleList(nn.Module() for _ in range(2))
    for layer in model.layers:
        layer.moe = nn.Module()
        layer.moe.experts = nn.Linear(2, 2)
    plan = as_plan({"expert_parallel": {"rules": {"layers.*.moe.experts": {"style": "experts"}}}})
    assert tp.hears_regions and not any(a.hears_regions for a in AXES if a is not tp)
    blocks = {"layers.0.moe", "layers.1.moe"}
    assert _regions(tp, model, plan)["token_regions"]() == blocks == ep.token_regions(model, plan)
    assert _regions(ep, model, plan) == {} and ep.data_shard is not None
    exempt = ep.tp_exempt(model, plan, {"ep": 2})
    assert exempt.modules == {"layers.0.moe.experts", "layers.1.moe.experts"} and exempt.degree == 2
    assert exempt.reason("layers.1.moe.router").startswith("in an MoE block") and exempt.reason("layers.1") is None
    assert ep.tp_exempt(model, as_plan({}), {}) is None


def test_pipeline_parallelism_is_named_only_where_allowed():
    """The same measure for the pipeline unit: files outside ``pipeline/`` that mention it."""
    found = named_outside("pipeline", PP_MENTION)
    assert found <= PP_ALLOWED, f"pipeline parallelism named outside its unit: {sorted(found - PP_ALLOWED)}"


def test_the_pipeline_unit_takes_the_step_and_narrows_tp_rules_to_its_stages():
    """A pipeline record hands train_step to the unit's schedule; its tp rule pruning keeps only this rank's."""
    import torch.nn as nn

    from meshplan.axes import step_runner
    from meshplan.plan_file.document import as_plan
    from meshplan.pipeline.stages import PipelineApplied
    from meshplan.pipeline.unit import AXIS
    from meshplan.plan_file.pipeline import Pipeline
    from meshplan.state import ParallelState
    assert step_runner(ParallelState()) is None and step_runner(None) is None
    record = PipelineApplied(section=Pipeline(microbatches=2), stage_ids=[1], num_stages=2)
    assert step_runner(ParallelState(pipeline=record)) is AXIS.run_step
    model = nn.Module()
    model.layers = nn.ModuleList([nn.Identity(), nn.Linear(2, 2)])  # layer 0 pruned: another stage's
    plan = as_plan({"tensor_parallel": {"rules": {"layers.0": "colwise", "layers.*": "rowwise"}}})
    assert list(AXIS.narrow(model, plan, record).tensor_parallel.rules) == ["layers.*"]
    assert AXIS.narrow(model, as_plan({}), record) == as_plan({})


#: the files outside pipeline/ whose code reaches it (11 on ac64207, 9 on 6f74993: cli/plans.py, context_parallel/apply.py,
#: data_parallel/wrap.py, solver/plans.py, weights/load.py and weights/materialize.py now ask the axes' hooks
#: roots, part, timeline, graphs and AxisTerms.decides): the ordered lists, and transformers' pp_plan interop
#: (convert/hf_document.py translates the pipeline section to and from another format). May only shrink.
PP_REACH = {"axes.py", "solver/units.py", "convert/hf_document.py",
            "trainer/checks.py"}  # the trainer's microbatch check reads the plan's pipeline section


def test_pipeline_coupling_only_shrinks():
    found = _reaching("pipeline")
    assert found <= PP_REACH, f"code outside pipeline/ reaching it: {sorted(found - PP_REACH)}; ask the axes instead"


def test_the_pipeline_hooks_answer_for_its_record():
    """What dp wraps as roots, what the weight loaders hold, and cp's refusal come from the pipeline's hooks."""
    import torch.nn as nn

    from meshplan.axes import held_part, roots
    from meshplan.pipeline.stages import PipelineApplied
    from meshplan.pipeline.unit import AXIS
    from meshplan.plan_file.document import as_plan
    from meshplan.plan_file.pipeline import Pipeline
    from meshplan.state import ParallelState
    model, view = nn.Linear(2, 2), nn.Identity()
    record = PipelineApplied(section=Pipeline(microbatches=2), stage_ids=[1], num_stages=2, views=[view],
                             full_keys=("a.weight", "b.weight"))
    assert roots(model, ParallelState()) == [model] and roots(model, None) == [model]
    assert roots(model, ParallelState(pipeline=record)) == [view]
    assert held_part(ParallelState()) is None
    assert held_part(ParallelState(pipeline=record)) == ("pipeline stages [1]", ("a.weight", "b.weight"))
    traced = as_plan({"pipeline": {"microbatches": 2, "split": "trace", "split_points": ["layers.1"]}})
    assert AXIS.graphs(traced) == "pipeline.split: trace"
    assert AXIS.graphs(as_plan({"pipeline": {"microbatches": 2}})) == ""


def test_data_parallelism_is_named_only_where_allowed():
    """The same measure for the third unit: files outside ``data_parallel/`` that name it (not apply.py, blocks.py,
    checks/data.py, checks/offline.py any more: parallelize, the blocks step and check reach it through AXES)."""
    found = named_outside("data_parallel", DP_MENTION)
    assert found <= DP_ALLOWED, f"data parallelism named outside its unit: {sorted(found - DP_ALLOWED)}"


def test_data_parallelism_is_the_last_unit_with_a_late_phase():
    """dp resolves in prepare, wraps in finish (after the blocks and the stages), owns train_step's microbatch knobs
    and the data dims; the solver's per-microbatch loops leave it to their own dp terms."""
    from meshplan.axes import COST_AXES, data_dims
    dp = AXES[-1]
    assert dp.section == "data_parallel" and dp.data_axis and dp.accumulate is not None and not dp.in_solver
    assert [a.data_axis for a in AXES].count(True) == 1 and dp not in COST_AXES
    assert sorted(data_dims()) == ["cp", "dp_replicate", "dp_shard"]


def test_blocks_reason_comes_from_the_axes():
    """The blocks step runs for data ranks, the section, or expert gradients over edp (the axes' own reasons)."""
    from meshplan.blocks import blocks_reason
    from meshplan.plan_file.document import as_plan
    from meshplan.plan_file.layout import Layout
    moe = {"expert_parallel": {"rules": {"layers.*.moe.experts": {"style": "experts"}}}}
    assert blocks_reason(as_plan({}), Layout().resolve(1)) == ""
    assert blocks_reason(as_plan({}), Layout().resolve(2)) == "data parallelism over dp(2) x cp(1) shards each block"
    assert blocks_reason(as_plan({"data_parallel": {}}), None) == "the data_parallel section shards each block"
    assert blocks_reason(as_plan({"blocks": {}}), Layout().resolve(2)) == "the blocks section"
    lay = Layout(ep=2).resolve(4)
    assert blocks_reason(as_plan(moe), lay) == f"data parallelism over dp({lay.dp}) x cp(1) shards each block"
    lay = Layout(tp=4, ep=2, etp=1).resolve(4)  # dp 1, edp 2: expert parallelism's own reason
    assert blocks_reason(as_plan(moe), lay) == "expert gradients are summed over edp(2) by FSDP2/DDP, which wraps each block"


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


def test_the_solver_sees_the_same_units_torch_free():
    """The solver (spec layer: never imports the runtime) reads each unit's torch-free half, ``TERMS`` of its
    folder's ``costs.py`` (:data:`meshplan.solver.units.UNITS`): the same axes, order, sections, cost terms, solver
    settings and example plans as :data:`AXES`."""
    from meshplan.plan_file.document import as_plan
    from meshplan.solver.units import UNITS
    assert len(UNITS) == len(AXES) and all(u is a.terms for u, a in zip(UNITS, AXES))  # the same values
    assert [(u.name, u.section) for u in UNITS] == [(a.name, a.section) for a in AXES]
    plans = [as_plan({}), as_plan({"context_parallel": {"method": "ring", "attention": "layers.*.attention"}}), as_plan({"expert_parallel": {"rules": {
        "layers.*.moe.experts": {"style": "experts"}, "layers.*.moe.router": {"style": "router"}}}})]
    assert [[u.training(p) for u in UNITS] for p in plans] == [[a.training(p) for a in AXES] for p in plans]


def test_data_axis_hears_the_other_axes_of_the_plan():
    """dp's check and prepare get the plan's other axes (Axis.data_axis): ep's DTensor experts refuse an integer
    reshard_after_forward as tp's parameters do, and ep's edp > 1 applies data parallelism without dp ranks."""
    from meshplan.axes import _others
    from meshplan.checks.report import Report
    from meshplan.data_parallel.mode import needed
    from meshplan.plan_file.document import as_plan
    from meshplan.plan_file.layout import Layout
    dp, ep = AXES[-1], next(a for a in AXES if a.section == "expert_parallel")
    moe = {"expert_parallel": {"rules": {"layers.*.moe.experts": {"style": "experts"}}}}
    plan = as_plan({**moe, "data_parallel": {"reshard_after_forward": 2}})
    assert _others(dp, plan) == ((ep,),) and _others(ep, plan) == ()
    report = Report(source="p", model="m", tp=1, world_size=4)
    dp.check(None, plan, Layout(ep=2).resolve(4), report, *_others(dp, plan))
    assert [str(e) for e in report.errors] == [
        "data_parallel.reshard_after_forward: 2 (an int) does not work with tensor-parallel (DTensor) parameters in "
        "torch 2.13; use true or false"]
    lay = Layout(tp=4, ep=2, etp=1).resolve(4)  # dp 1, edp 2
    assert not needed(as_plan(moe), lay) and needed(as_plan(moe), lay, asked=ep.data_parallel(lay))


#: Files outside tensor_parallel/ whose CODE reaches it (issue 26's coupling measure, benchmarks/coupling.py: an import
#: of the folder at any depth, or a read of its record / section: ``state.tensor_parallel``, ``.tensor_parallel is
#: (not) None``). 24 on ac64207, 19 on 6f74993, these 13 after; the set may only shrink. Kept, with why: the ordered lists and the
#: record's owner; the rehearsals of `meshplan check` above apply, which rehearse tp itself (the meta dry run and the
#: cross-shard shadow run apply tp's styles; explain tabulates its styles; offline runs the dry run when the plan
#: has the section and reports smallest_world); interop that translates other formats' tp sections (convert/,
#: hf/: hf/structure.py derives rules with the check's own region predicates, so a converted plan passes check);
#: expert parallelism's MoE blocks as tp token regions (etp over tp's packed layouts, the stream's placement, the tp
#: rules its check reads), decoupled by the ep unit's owner.
TP_REACH_ALLOWED = {
    "axes.py", "solver/units.py", "state.py",
    "checks/dry_run.py", "checks/explain.py", "checks/offline.py", "checks/shadow.py",
    "convert/formats.py", "hf/convert.py", "hf/structure.py",
    "expert_parallel/check.py", "expert_parallel/experts.py", "expert_parallel/region.py",
}


def test_tensor_parallelism_is_reached_only_where_allowed():
    """The code coupling of the tensor axis (issue 26): files outside ``tensor_parallel/`` that import it or read
    its record; ``data_parallel/mode.py`` asks :attr:`Axis.dtensor`, the pipeline's stages ``state.stream_dim``."""
    found = _reaching("tensor_parallel")
    assert found <= TP_REACH_ALLOWED, f"tensor parallelism reached outside its unit: {sorted(found - TP_REACH_ALLOWED)}"
