"""Topology: every process group the meshes create equals the rank engine's groups."""

import random

import pytest
import torch.distributed as dist

import meshplan
from meshplan import Layout, PlanError
from meshplan.mesh.topology import MESH_KEYS, mesh_axes

pytestmark = pytest.mark.fast


def _check(topo):
    r = topo.layout
    for key in MESH_KEYS:
        grid_name, axes = mesh_axes(key)
        grid = r.mesh_grid if grid_name == "dense" else r.expert_grid
        want = grid.group_of(topo.rank, axes)
        mesh = topo[key]
        assert mesh.ndim == 1 and mesh.size() == len(want), key
        got = dist.get_process_group_ranks(mesh.get_group())
        assert sorted(got) == want, (key, got, want)
        assert mesh.mesh.tolist() == want, key
    # Megatron's kinds on the dense mesh: dp-cp == the dp_cp mesh, etc.
    assert r.dense_grid.group_of(topo.rank, "dp-cp") == topo["dp_cp"].mesh.tolist()
    assert r.dense_grid.group_of(topo.rank, "dp") == topo["dp"].mesh.tolist()


LAYOUTS = [
    ({"tp": 4}, 8), ({"tp": 2, "pp": 2}, 8), ({"tp": 2, "cp": 2, "dp_replicate": 2}, 16),
    ({"tp": 4, "pp": 2}, 16), ({"tp": 4, "pp": 2, "etp": 1, "ep": 4}, 16),
    ({"tp": 2, "pp": 2, "order": "pp-tp-dp"}, 8), ({"tp": 2, "cp": 2, "order": "cp-dp-tp-pp"}, 16),
    ({"tp": 2, "cp": 2, "pp": 2, "dp_replicate": 2, "dp_shard": 2}, 32),
    ({"tp": 4, "ep": 4, "etp": 2, "pp": 2, "cp": 2}, 64), ({"tp": 8, "order": "dp-tp"}, 64),
    ({"tp": 2, "ep": 2, "order": "ep-tp-dp-cp-pp"}, 8), ({"order": "spread", "pp": 2, "tp": 2}, 16),
]


@pytest.mark.parametrize("layout, world", LAYOUTS)
def test_mesh_groups_equal_engine(fake_pg, layout, world):
    rng = random.Random(world)
    for rank in sorted({0, world - 1, rng.randrange(world)}):
        with fake_pg(world, rank):
            topo = meshplan.build_mesh(layout)
            _check(topo)
            names = topo.dense.mesh_dim_names
            order = [a for a in topo.layout.order if a != "ep"]
            expect = []
            for a in reversed(order):
                expect += ["dp_replicate", "dp_shard"] if a == "dp" else [a]
            assert list(names) == expect


def test_default_dims(fake_pg):
    with fake_pg(16, 5):
        topo = meshplan.build_mesh(Layout(tp=2, dp_replicate=2, ep=2, etp=1))
        assert topo.dense.mesh_dim_names == ("pp", "dp_replicate", "dp_shard", "cp", "tp")
        assert topo.expert.mesh_dim_names == ("pp", "edp", "ep", "etp")
        assert tuple(topo.dense.shape) == (1, 2, 4, 1, 2) and tuple(topo.expert.shape) == (1, 8, 2, 1)
        assert (topo.data_rank, topo.data_world_size) == (2, 8)
        assert topo.tp_rank == 1 and topo.rdp_rank == 2


@pytest.mark.parametrize("world", [256, 1024])
def test_large_worlds(fake_pg, world):
    with fake_pg(world, world - 3):
        topo = meshplan.build_mesh({"tp": 8, "pp": 4, "cp": 2, "dp_replicate": 2, "ep": 8, "etp": 1})
        _check(topo)


def test_smp_accessors(fake_pg):
    with fake_pg(8, 6):
        topo = meshplan.build_mesh({"tp": 2, "pp": 2, "order": "pp-tp-dp"})
        assert (topo.pp_rank, topo.tp_rank, topo.rdp_rank, topo.dp_rank, topo.mp_rank) == (0, 1, 1, 3, 2)


def test_two_topologies_coexist(fake_pg):
    with fake_pg(16, 3):
        a = meshplan.build_mesh({"tp": 4})
        b = meshplan.build_mesh({"tp": 2, "pp": 2})
        assert a["tp"].mesh.tolist() == [0, 1, 2, 3] and b["tp"].mesh.tolist() == [2, 3]
        assert meshplan.current_topology() is None
        with a:
            assert meshplan.current_topology() is a
            with b:
                assert meshplan.current_topology() is b
            assert meshplan.current_topology() is a
        assert meshplan.current_topology() is None


def test_end_destroys_only_the_groups_the_topology_made(fake_pg):
    """The end of ``with meshplan.init`` on a process group it did not create destroys every group its topology
    made (each dim of the dense and expert mesh, the flattened meshes, an adopted group) and drops the root
    meshes' references to them, and keeps the world and the groups of other live topologies (issue 31: 596
    threads per rank after one calibration launch)."""
    from torch.distributed.distributed_c10d import _world
    with fake_pg(16, 3):
        outer = meshplan.init({"tp": 2, "pp": 2})
        alone = meshplan.build_mesh({"cp": 2})
        with meshplan.init({"tp": 2, "cp": 2, "ep": 2}) as inner:
            extra = dist.new_group([2, 3], group_desc="pp_embedding")
            inner.adopt_group(extra, "pp_embedding")
            made = inner.job.own_groups(inner)
            # dense pp, dp_replicate, dp_shard, cp, tp; expert pp, edp, ep, etp; dp, dp_cp, dp_shard_cp, tp_cp; extra
            assert len(made) == 14 and extra in made and dist.group.WORLD not in made
            kept = outer.job.own_groups(outer) + alone.process_groups()
            assert not {g.group_name for g in made} & {g.group_name for g in kept if g is not dist.group.WORLD}
        assert not any(g in _world.pg_map for g in made) and all(g in _world.pg_map for g in kept)
        assert not {g.group_name for g in made} & (set(inner.dense._pg_registry) | set(inner.expert._pg_registry))
        outer.close()
        assert all(g in _world.pg_map for g in alone.process_groups())  # no job: its groups are its caller's


def test_context_copies_do_not_own_the_topology(fake_pg):
    """torch's backward stashes ``contextvars.copy_context()`` in the thread-local state every collective
    captures; a strong reference there let a gloo worker thread drop the topology's last reference (and with
    it a process group) during interpreter exit: ``terminate called without an active exception``."""
    import contextvars
    import gc
    import weakref
    with fake_pg(8, 0):
        topo = meshplan.build_mesh({"tp": 2})
        with topo:
            ctx = contextvars.copy_context()
        assert ctx.run(meshplan.current_topology) is topo
        ref = weakref.ref(topo)
        del topo
        gc.collect()
        assert ref() is None and ctx.run(meshplan.current_topology) is None


def test_errors(fake_pg):
    with pytest.raises(PlanError, match="needs an initialized process group"):
        meshplan.build_mesh({"tp": 2})
    with fake_pg(8, 0):
        with pytest.raises(PlanError, match=r"tp\(3\) does not divide world_size\(8\); valid tp: 1, 2, 4, 8"):
            meshplan.build_mesh({"tp": 3})
        with pytest.raises(PlanError, match="layout: tpp: Extra inputs"):
            meshplan.build_mesh({"tpp": 3})
        with pytest.raises(PlanError, match=r"resolved for world_size\(16\) but the process group has 8"):
            meshplan.build_mesh(Layout(tp=2).resolve(16))
        topo = meshplan.build_mesh({"tp": 2})
        with pytest.raises(KeyError, match="unknown mesh 'xx'"):
            topo["xx"]


def test_private_flatten_api_pinned():
    """meshplan relies on DeviceMesh._flatten (topology.py): fail loudly if torch drops it."""
    from torch.distributed.device_mesh import DeviceMesh
    import inspect
    assert "mesh_dim_name" in inspect.signature(DeviceMesh._flatten).parameters


def test_str_is_one_readable_line(fake_pg):
    """The banner examples/train.py prints: degrees above 1, outermost first, not the Topology(...) repr."""
    with fake_pg(16, 5):
        topo = meshplan.build_mesh(Layout(tp=2, pp=2, ep=2, etp=1))
        assert str(topo) == ("rank 5 of 16: pp 2 × dp_shard 4 × tp 2 (order tp-cp-ep-dp-pp, innermost first); "
                             "experts: pp 2 × edp 4 × ep 2")
    with fake_pg(4, 0):
        assert str(meshplan.build_mesh(Layout(tp=4))) == "rank 0 of 4: tp 4 (order tp-cp-ep-dp-pp, innermost first)"
