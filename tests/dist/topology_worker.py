"""Real gloo processes: meshplan.init, the layout and plan fingerprints, topology groups, collectives on each mesh."""

import copy
import functools
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


def _on_rank1(plan: dict, path: tuple, value) -> dict:
    """``plan`` with ``plan[path[0]]…[path[-1]] = value`` on rank 1 only."""
    plan = copy.deepcopy(plan)
    if dist.get_rank() == 1:
        node = plan
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return plan


#: one mismatch on rank 1 each: (where it is caught, plan edit or None, what the model/torch does on rank 1)
MISMATCHES = {
    "sequence_parallel": ("meshplan.init", ("tensor_parallel", "sequence_parallel", True), None),
    "loss_parallel": ("meshplan.init", ("tensor_parallel", "loss_parallel", True), None),
    "rule": ("meshplan.parallelize", ("tensor_parallel", "rules", "layers.*.b", "colwise"), None),
    "fsdp_dtype": ("meshplan.parallelize", ("data_parallel", "param_dtype", "bfloat16"), None),
    "faults_timeout": ("meshplan.init", ("faults", "timeout_s", 30.0), None),
    "model_shape": ("meshplan.parallelize", None, "shape"),
    "model_layers": ("meshplan.parallelize", None, "layers"),
    "model_dtype": ("meshplan.parallelize", None, "dtype"),
    "torch_version": ("meshplan.init", None, "torch"),
    "world_layout": ("meshplan.init", ("layout", "tp", 4), None),
}


class _Wide(torch.nn.Module):
    """Like _Net; ``layers.0.b`` 8 -> 16 wide on rank 1 (``shape``), a second layer (``layers``), bf16 (``dtype``)."""

    def __init__(self, kind=None):
        super().__init__()
        self.layers = torch.nn.ModuleList([_Block()] + ([_Block()] if kind == "layers" else []))
        if kind == "shape":
            self.layers[0].b = torch.nn.Linear(8, 16)
        if kind == "dtype":
            self.to(torch.bfloat16)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def _mismatch(name):
    """Rank 1 differs in one way; every rank must raise the same PlanError at once, before any step."""
    where, edit, kind = MISMATCHES[name]
    base = copy.deepcopy(PLAN)
    if name == "fsdp_dtype":
        base["data_parallel"] = {"param_dtype": "float32"}
    plan = _on_rank1(base, edit[:-1], edit[-1]) if edit is not None and where == "meshplan.init" else base
    real = torch.__version__
    if kind == "torch" and dist.get_rank() == 1:
        torch.__version__ = "2.12.1+cpu"  # a rank on another image: simulated without installing another torch
    try:
        if where == "meshplan.init":
            return _raises_plan_error(lambda: meshplan.init(plan))
        topo = meshplan.init(base)
        rank1 = _on_rank1(base, edit[:-1], edit[-1]) if edit is not None else base
        model = _Wide(kind if dist.get_rank() == 1 else None)
        return _raises_plan_error(lambda: meshplan.parallelize(model, rank1, topo))
    finally:
        torch.__version__ = real


def case_every_group_has_the_plan_timeout():
    """Every group of the topology (DeviceMesh sub-groups and flattened ones included; torch gives those 30
    minutes whatever init_process_group said) waits faults.init_timeout_s, then faults.timeout_s after the first
    step."""
    from torch.distributed.device_mesh import init_device_mesh

    def seconds(group):
        return group._get_backend(torch.device("cpu")).options._timeout.total_seconds()
    bare = init_device_mesh("cpu", (WORLD // 2, 2), mesh_dim_names=("a", "b"))  # torch alone
    plan = {"layout": {"tp": 2, "pp": 2} if WORLD == 8 else {"tp": 2},
            "faults": {"init_timeout_s": 77, "timeout_s": 33, "heartbeat_s": 1}}
    topo = meshplan.init(plan)
    try:
        groups = topo.process_groups()
        first = {g.group_name: seconds(g) for g in groups}
        topo.faults.steady()
        return {"torch": seconds(bare.get_group("b")), "groups": len(groups), "init": sorted(set(first.values())),
                "steady": sorted({seconds(g) for g in groups})}
    finally:
        topo.faults.close()


def case_host_memory_kept():
    """meshplan.init on a CPU job keeps freed memory (mallopt): 4 MiB tensors allocated and freed again and again
    reuse their pages (without it glibc's default served each from a fresh mmap: 201,600 faults per 100 rounds
    of two, on the 2026-11-27 host), and a 64 MiB one (over glibc's largest mmap threshold) comes from the heap."""
    from test_host_memory import fault_rounds, mmapped_by_a_tensor
    return [mmapped_by_a_tensor(), fault_rounds(), mmapped_by_a_tensor(64)]


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
                   "parallelize_plan_mismatch": case_parallelize_plan_mismatch,
                   "group_timeouts": case_every_group_has_the_plan_timeout, "host_memory": case_host_memory_kept,
                   **{f"mismatch_{name}": functools.partial(_mismatch, name) for name in MISMATCHES}})
