"""Real gloo processes: meshplan.init, the layout fingerprint, topology groups, collectives on each mesh."""

import os

import torch
import torch.distributed as dist

import meshplan
from _launch import run_cases
from meshplan.topology import MESH_KEYS, mesh_axes

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
    from meshplan.runtime import _check_same_layout
    mine = "tp=2" if dist.get_rank() != 1 else "tp=4"
    try:
        _check_same_layout(mine)
    except meshplan.PlanError as e:
        assert "ranks disagree on the layout" in str(e) and "tp=2 vs tp=4" in str(e), str(e)
        return "raised"
    raise AssertionError("no error")


def setup():
    return None


if __name__ == "__main__":
    topo = meshplan.init({"tp": 2})
    assert meshplan.current_topology() is None
    with topo:
        assert meshplan.current_topology() is topo
        assert dist.get_backend() == "gloo"
        run_cases({"init_and_groups": case_init_and_groups, "mismatch": case_mismatch_fails_everywhere})
