"""@meshplan.plan: the plan travels with the class, instances parallelized on construction inside a
topology, subclasses extend the rules."""

import copy

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, distribute_tensor

import meshplan
from _local import assert_close_rel, local_ranks
from examples.decorated import PlannedLlama, PlannedLlamaWithAdapter
from examples.llama import Transformer, tiny_args
from meshplan import PlanError

pytestmark = pytest.mark.fast


def test_plan_attached_and_extended():
    base = PlannedLlama.__meshplan_plan__
    ext = PlannedLlamaWithAdapter.__meshplan_plan__
    assert base.source == "plans/llama.yaml" and base.layout.tp == 2
    assert set(ext.tensor_parallel.rules) == set(base.tensor_parallel.rules) | {"adapter.up", "adapter.down"}
    assert ext.tensor_parallel.rules["output"] == base.tensor_parallel.rules["output"]
    assert ext.source == "plans/llama.yaml (extended by PlannedLlamaWithAdapter)"
    assert "adapter.up" not in base.tensor_parallel.rules  # the parent is unchanged


def test_plain_construction_outside_a_topology():
    model = PlannedLlamaWithAdapter(tiny_args())
    assert not any(isinstance(p, DTensor) for p in model.parameters())
    assert "_meshplan_init_depth" not in model.__dict__


def test_parallelized_on_construction_after_subclass_init():
    torch.manual_seed(0)
    ref = PlannedLlamaWithAdapter(tiny_args())
    tokens = torch.randint(0, 128, (2, 16))
    ref_loss = meshplan.cross_entropy(ref(tokens), tokens)
    ref_loss.backward()
    with local_ranks(2):
        with meshplan.build_mesh({"tp": 2}) as topo:
            model = PlannedLlamaWithAdapter(tiny_args())  # the adapter exists before the plan is applied
        assert model.adapter.up.weight.placements[0].dim == 0 and model.adapter.down.weight.placements[0].dim == 1
        assert model.layers[0].attention.wq.weight.to_local().shape == (32, 64)
        with torch.no_grad():  # weights drawn inside the simulation differ per rank: copy the reference's
            for p, q in zip(model.parameters(), ref.parameters()):
                p.copy_(distribute_tensor(q.detach(), topo["tp"], p.placements))
        loss = meshplan.cross_entropy(model(tokens), tokens)
        assert_close_rel(loss, ref_loss)
        loss.backward()
        for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
            assert_close_rel(p.grad, q.grad)


def test_parallelize_later_uses_the_class_plan():
    model = PlannedLlama(tiny_args())
    with local_ranks(2):
        meshplan.parallelize(model, mesh=meshplan.build_mesh({"tp": 2}))
        assert isinstance(model.output.weight, DTensor)
    with pytest.raises(PlanError, match="no plan given and Transformer has none attached"):
        meshplan.parallelize(Transformer(tiny_args()), mesh=None)


def test_undecorated_subclass_finishes_init_first():
    seen = []

    class Late(PlannedLlama):
        def __init__(self, args):
            super().__init__(args)
            seen.append(isinstance(self.output.weight, DTensor))  # not parallelized yet
            self.extra = nn.Identity()

    with local_ranks(2), meshplan.build_mesh({"tp": 2}):
        model = Late(tiny_args())
    assert seen == [False] and isinstance(model.output.weight, DTensor)


def test_parallelized_once_whatever_the_nesting(monkeypatch):
    """Nested super().__init__ parallelizes once, at the end; a decorated class without its own __init__ too.
    Nothing is stored on the instance but the one state record."""
    import meshplan.apply
    calls, real = [], meshplan.apply.parallelize
    monkeypatch.setattr(meshplan.apply, "parallelize", lambda m, *a, **k: calls.append(type(m).__name__) or real(m, *a, **k))

    class Deeper(PlannedLlamaWithAdapter):
        def __init__(self, args):
            super().__init__(args)
            self.tail = nn.Identity()

    with local_ranks(2), meshplan.build_mesh({"tp": 2}):
        plain, deeper = PlannedLlama(tiny_args()), Deeper(tiny_args())
    assert calls == ["PlannedLlama", "Deeper"]
    assert isinstance(plain.output.weight, DTensor) and isinstance(deeper.adapter.up.weight, DTensor)
    assert meshplan.parallel_state(deeper).plan is Deeper.__meshplan_plan__
    assert [k for k in vars(deeper) if "meshplan" in k] == ["_meshplan_state"]


def test_auto_false_and_bad_targets():
    @meshplan.plan("plans/llama.yaml", auto=False)
    class Manual(Transformer):
        pass

    with local_ranks(2), meshplan.build_mesh({"tp": 2}):
        assert not isinstance(Manual(tiny_args()).output.weight, DTensor)
    with pytest.raises(PlanError, match="decorates nn.Module classes"):
        meshplan.plan("plans/llama.yaml")(object)
    with pytest.raises(PlanError, match=r"@meshplan.plan on Bad: tensor_parallel.rules.x: Input tag 'sideways'"):
        @meshplan.plan({"tensor_parallel": {"rules": {"x": "sideways"}}})
        class Bad(nn.Module):
            pass


def test_extension_errors_name_the_parent_file():
    with pytest.raises(PlanError, match=r"plans/llama.yaml \(extended by Sub\): tensor_parallel.sequence_parallel"):
        @meshplan.plan({"tensor_parallel": {"sequence_parallel": "sideways"}})
        class Sub(PlannedLlama):
            pass


def test_meshplan_plan_is_the_decorator():
    import importlib
    import pkgutil
    from meshplan.decorator import plan
    assert meshplan.plan is plan  # no module of that name shadows it, however meshplan was imported
    public = {name: getattr(meshplan, name) for name in meshplan.__all__}
    for info in pkgutil.walk_packages(meshplan.__path__, "meshplan."):  # every module of the house
        if not info.name.endswith("__main__"):
            importlib.import_module(info.name)
    assert {name: getattr(meshplan, name) for name in meshplan.__all__} == public  # no folder shadows a name
    assert meshplan.plan is plan and meshplan.init is importlib.import_module("meshplan.mesh.runtime").init
    assert copy.deepcopy(PlannedLlama.__meshplan_plan__) == PlannedLlama.__meshplan_plan__
