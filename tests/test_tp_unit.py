"""Tensor parallelism as a unit (:mod:`meshplan.tensor_parallel.unit`) and the model's ONE gradient finaliser
(:mod:`meshplan.gradients`): created once by ``parallelize``, handed to the axes, never made by an axis."""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

import pytest
import torch

import meshplan
from llama import build, tiny_args
from meshplan import PlanError
from meshplan.gradients import GradFinalizer

pytestmark = pytest.mark.fast

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "meshplan"
TP_MENTION = re.compile(r"tensor_parallel|tensor parallel")
#: files outside tensor_parallel/ that name its section or behaviour (54 on ac64207, before it became a unit; these
#: after, docs/house.md): the ordered lists (axes.py, solver/units.py) and the Axis shape; the plan section, what a
#: style means and its aliases (plan_file/, decorator, converters, CLI,
#: transformers' tp_plan interop); the static checks and rehearsals of `meshplan check` (checks/: the unit's check
#: calls validate.py's); the pipeline's boundary layouts and rule pruning, the token regions of expert parallelism,
#: FSDP2 beside it; checkpoints' and weights' docstrings; the record's field (state.py); torch's private APIs
TP_ALLOWED = {
    "axes.py", "solver/units.py", "axis.py", "state.py", "_torch.py", "blocks.py", "decorator.py",
    "checkpoint/chunks.py", "weights/shards.py", "faults/agree.py", "mesh/runtime.py", "mesh/ranks.py",
    "checks/dry_run.py", "checks/explain.py", "checks/offline.py", "checks/shadow.py",
    "cli/args.py", "cli/solve.py", "cli/solve_flags.py",
    "context_parallel/attention.py",
    "convert/__init__.py", "convert/common.py", "convert/deepspeed.py", "convert/formats.py", "convert/hf_document.py",
    "convert/torch_source.py",
    "data_parallel/fsdp.py", "data_parallel/mode.py", "data_parallel/wrap.py",
    "expert_parallel/apply.py", "expert_parallel/check.py", "expert_parallel/experts.py", "expert_parallel/region.py",
    "hf/convert.py", "hf/mla.py", "hf/moe.py", "hf/structure.py", "hf/styles.py",
    "pipeline/apply.py", "pipeline/unit.py", "pipeline/ends.py", "pipeline/probe.py", "pipeline/traced.py",
    "plan_file/blocks.py", "plan_file/document.py", "plan_file/expert_parallel.py", "plan_file/hf_aliases.py",
    "plan_file/patterns.py", "plan_file/pipeline.py", "plan_file/tensor_parallel.py", "plan_file/layout_text.py",
    "plan_file/style_semantics.py",
    "solver/candidate.py", "solver/collectives.py", "solver/plans.py", "solver/presets.py",
    "viz/model.py", "viz/model_draw.py", "viz/rank_grid.py",
    # issues 27-30: the trainer (the sections it fills, the shapes it checks, the layout degrees it launches), the
    # converters' cp sections, the rank view's shares, packed documents under pp, numerics without the dp section
    "trainer/checks.py", "trainer/defaults.py",
    # issue 31: the Megatron-level recompute policy (keeps reduced row-parallel outputs), the priced DTensor dispatch
    "recompute.py", "solver/overheads.py",
}
RULES = {"layers.*.attention.wq": "colwise", "layers.*.attention.wk": "colwise", "layers.*.attention.wv": "colwise",
         "layers.*.attention.wo": "rowwise", "layers.*.feed_forward.w1": "colwise",
         "layers.*.feed_forward.w3": "colwise", "layers.*.feed_forward.w2": "rowwise"}
SP_RULES = {**RULES, "layers.*.attention_norm": "norm", "layers.*.ffn_norm": "norm", "norm": "norm",
            "tok_embeddings": "embedding", "output": "lm_head"}
#: without sequence parallelism: nothing replicated has a partial gradient
PLAIN = {"tensor_parallel": {"sequence_parallel": False, "rules": RULES}}


def test_tensor_parallelism_is_named_only_where_allowed():
    """The measure of issue 26 for the tensor axis: files outside ``tensor_parallel/`` that name it."""
    from test_axes import named_outside
    found = named_outside("tensor_parallel", TP_MENTION)
    assert found <= TP_ALLOWED, f"tensor parallelism named outside its unit: {sorted(found - TP_ALLOWED)}"


def _imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
    return out


def test_the_finaliser_module_is_neutral():
    """It imports no axis folder and not the state module (function-level imports included)."""
    from meshplan.axes import AXES
    names = _imports(PKG / "gradients.py")
    assert "meshplan.state" not in names
    assert not [n for n in names for a in AXES if n.startswith(f"meshplan.{a.section}")], names


def test_only_parallelize_and_the_finaliser_module_create_one():
    """``GradFinalizer(`` is called in ``apply.py`` (the model's one) and ``gradients.py`` (outside parallelize)."""
    calls = {str(f.relative_to(PKG)) for f in PKG.rglob("*.py") if "GradFinalizer()" in f.read_text()}
    assert calls == {"apply.py", "gradients.py"}


def test_the_tp_record_is_frozen(fake_pg):
    with fake_pg(2):
        model = meshplan.parallelize(build(tiny_args()), PLAIN,
                                     meshplan.build_mesh({"tp": 2}))
    applied = meshplan.parallel_state(model).tensor_parallel
    with pytest.raises(dataclasses.FrozenInstanceError):
        applied.finalizer = None  # type: ignore[misc]


def test_one_finaliser_handed_to_tensor_parallelism(fake_pg):
    """Sequence parallelism's norm weights: tracked in the one finaliser ``parallelize`` created."""
    with fake_pg(2):
        model = meshplan.parallelize(build(tiny_args()), {"tensor_parallel": {
            "sequence_parallel": True, "loss_parallel": False, "rules": SP_RULES}}, meshplan.build_mesh({"tp": 2}))
    state = meshplan.parallel_state(model)
    assert isinstance(state.gradients, GradFinalizer) and state.gradients.active
    assert state.grad_sync is state.gradients is state.tensor_parallel.finalizer
    assert "norm.weight" in state.gradients.names


def test_without_anything_to_sum_there_is_no_grad_sync(fake_pg):
    with fake_pg(2):
        model = meshplan.parallelize(build(tiny_args()), PLAIN,
                                     meshplan.build_mesh({"tp": 2}))
    state = meshplan.parallel_state(model)
    assert state.gradients is not None and not state.gradients.active
    assert state.grad_sync is None and state.tensor_parallel.finalizer is None


def test_expert_parallelism_adds_to_the_handed_finaliser(fake_pg):
    """The MoE blocks' plain parameters join the one finaliser; the tp record is not written to."""
    import moe
    plan = meshplan.load_plan("plans/moe.yaml")
    with fake_pg(8):
        topo = meshplan.build_mesh(plan.layout)
        with torch.device("meta"):
            model = moe.build(moe.tiny_args(n_experts=8, shared_expert=True))
        meshplan.parallelize(model, plan, topo)
    state = meshplan.parallel_state(model)
    assert state.grad_sync is state.gradients
    assert "layers.0.moe.shared_expert.w1.weight" in state.gradients.plain
    assert state.tensor_parallel.finalizer in (None, state.gradients)


def test_a_bare_device_mesh_with_a_tp_dim(fake_pg):
    """``parallelize`` still takes a torch DeviceMesh: the unit's mesh is its ``tp`` dim (no Topology)."""
    from torch.distributed.device_mesh import init_device_mesh
    with fake_pg(4):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        model = meshplan.parallelize(build(tiny_args()), PLAIN, mesh)
        state = meshplan.parallel_state(model)
        assert state.topology is None and model.layers[0].attention.wq.weight.device_mesh.mesh_dim_names == ("tp",)
        with pytest.raises(PlanError, match=r"the mesh has dims \('dp', 'cp'\); meshplan needs a 'tp' dim"):
            meshplan.parallelize(build(tiny_args()), PLAIN,
                                 init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp")))
    with pytest.raises(PlanError, match="mesh must be a meshplan Topology or a torch DeviceMesh, got int"):
        meshplan.parallelize(build(tiny_args()), PLAIN, 3)


def test_check_and_parallelize_run_the_same_static_checks(fake_pg):
    """The unit's check (``meshplan check``) and its prepare (``parallelize``) refuse the same rule."""
    plan = {"layout": {"tp": 2}, "tensor_parallel": {"sequence_parallel": False,
                                                     "rules": {**RULES, "layers.*.nothing": "colwise"}}}
    with torch.device("meta"):
        model = build(tiny_args())
    report = meshplan.check(model, plan, dry_run=False)
    assert not report.ok
    with fake_pg(2), pytest.raises(PlanError) as e:
        meshplan.parallelize(model, plan, meshplan.build_mesh({"tp": 2}))
    assert str(report.errors[0]) in str(e.value)
