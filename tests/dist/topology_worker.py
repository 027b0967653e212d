"""Real gloo processes: meshplan.init, the layout and plan fingerprints, topology groups, collectives on each mesh."""

import copy
import os
import time

import torch
import torch.distributed as dist

import meshplan
from _launch import run_cases
from meshplan.mesh.topology import MESH_KEYS, mesh_axes

WORLD = int(os.environ["WORLD_SIZE"])
LAYOUTS = {4: [{"tp": 2}, {"tp": 2, "pp": 2, "order": "pp-tp-dp"}, {"cp": 2, "dp_replicate": 2}],
           8: [{"tp": 2, "pp": 2}, {"tp": 2, "dp_replicate": 2, "ep": 2, "etp": 1}, {"tp": 2, "cp": 2, "pp": 2}]}


def case_init_and_groups():
    out = []
    for layout in LAYOUTS[WORLD]:
        topo = meshplan.build_mesh(layout)
        for key in MESH_KEYS:
            grid_name, axes = mesh_axes(key)
            grid = topo.layout.mesh_grid if grid_name == "dense" else topo.layout.expert_grid
            want = grid.group_of(topo.rank, axes)
            t = torch.tensor([float(dist.get_rank())])
            dist.all_reduce(t, group=topo[key].get_group())  # the group really is those ranks
            assert t.item() == sum(want), (layout, key, t.item(), want)
        out.append(topo.layout.fingerprint())
    return out


def case_mismatch_fails_everywhere():
    from meshplan.mesh.runtime import _check_same_layout
    mine = "tp=2" if dist.get_rank() != 1 else "tp=4"
    try:
        _check_same_layout(mine)
    except meshplan.PlanError as e:
        assert "ranks disagree on the layout" in str(e) and "tp=2 vs tp=4" in str(e), str(e)
        return "raised"
    raise AssertionError("no error")


PLAN = {"layout": {"tp": 2},
        "tensor_parallel": {"sequence_parallel": False, "loss_parallel": False,
                            "rules": {"layers.*.a": "colwise", "layers.*.b": "rowwise"}}}


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.b(self.a(x))


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([_Block()])

    def forward(self, x):
        return self.layers[0](x)


def _rank_plan():
    """Rank 1 loads another plan: another sequence_parallel and another rule for ``layers.*.b``."""
    plan = copy.deepcopy(PLAN)
    if dist.get_rank() == 1:
        plan["tensor_parallel"]["sequence_parallel"] = True
        plan["tensor_parallel"]["rules"]["layers.*.b"] = "colwise"
    return plan


def _raises_plan_error(fn):
    t = time.monotonic()
    try:
        fn()
    except meshplan.PlanError as e:
        return {"message": str(e), "seconds": time.monotonic() - t}
    raise AssertionError("no PlanError")


def case_init_plan_mismatch():
    """meshplan.init(plan) compares the whole plan, not only the layout: every rank fails, at once."""
    return _raises_plan_error(lambda: meshplan.init(_rank_plan()))


def case_parallelize_plan_mismatch():
    """init with one plan everywhere, then parallelize with another plan on rank 1: every rank fails, at once."""
    topo = meshplan.init(copy.deepcopy(PLAN))
    out = _raises_plan_error(lambda: meshplan.parallelize(_Net(), _rank_plan(), topo))
    same = meshplan.parallelize(_Net(), copy.deepcopy(PLAN), topo)  # the same plan everywhere still works
    assert same(torch.ones(2, 8)).shape == (2, 8)
    return out


def setup():
    return None


if __name__ == "__main__":
    topo = meshplan.init({"tp": 2}, timeout_s=120)  # a hang in a case fails in 2 minutes, not 10
    assert meshplan.current_topology() is None
    with topo:
        assert meshplan.current_topology() is topo
        assert dist.get_backend() == "gloo"
        run_cases({"init_and_groups": case_init_and_groups, "mismatch": case_mismatch_fails_everywhere,
                   "init_plan_mismatch": case_init_plan_mismatch,
                   "parallelize_plan_mismatch": case_parallelize_plan_mismatch})
