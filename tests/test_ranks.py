"""Rank engine: the seeds' examples verbatim, a Megatron reference, properties, speed."""

import sys
import time
from itertools import permutations

import pytest
from hypothesis import given, settings, strategies as st

from meshplan.plan_file.layout import GROUP_KINDS, Layout
from meshplan.mesh.ranks import RankGrid, pipeline_end_groups

pytestmark = pytest.mark.fast


def megatron_reference(world, parallel_size, mask):
    """Megatron-LM's generate_masked_orthogonal_rank_groups, written out independently
    from its documented formulas (prefix products over the order, masked decompose)."""
    def prefix(a):
        out, acc = [], 1
        for x in a:
            out.append(acc)
            acc *= x
        return out

    def decompose(index, shape):
        idx = []
        for s in shape:
            idx.append(index % s)
            index //= s
        return idx

    masked = [s for s, m in zip(parallel_size, mask) if m]
    unmasked = [s for s, m in zip(parallel_size, mask) if not m]
    gs = prefix(parallel_size)
    ms = [d for d, m in zip(gs, mask) if m]
    us = [d for d, m in zip(gs, mask) if not m]
    group_size = 1
    for s in masked:
        group_size *= s
    out = []
    for gi in range(world // group_size):
        g = decompose(gi, unmasked)
        out.append([sum(a * b for a, b in zip(decompose(r, masked), ms)) + sum(a * b for a, b in zip(g, us))
                    for r in range(group_size)])
    return out


def test_megatron_tp4_pp2_dp2_seed():
    r = Layout(tp=4, pp=2).resolve(16)
    assert r.groups("dp") == [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]]
    assert r.groups("tp") == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    assert r.groups("pp") == [[0, 8], [1, 9], [2, 10], [3, 11], [4, 12], [5, 13], [6, 14], [7, 15]]
    # dp_group_index = tp_rank + pp_rank * tp_size (the seed's formula (1))
    for tp_rank in range(4):
        for pp_rank in range(2):
            assert r.groups("dp")[tp_rank + pp_rank * 4] == [tp_rank + d * 4 + pp_rank * 8 for d in range(2)]


def test_megatron_etp1_pp2_ep4_edp2_seed():
    r = Layout(tp=4, pp=2, etp=1, ep=4).resolve(16)
    assert (r.etp, r.ep, r.edp, r.pp) == (1, 4, 2, 2)
    assert r.groups("ep") == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    assert r.groups("edp") == [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]]
    assert r.groups("pp") == [[0, 8], [1, 9], [2, 10], [3, 11], [4, 12], [5, 13], [6, 14], [7, 15]]
    assert r.groups("etp") == [[i] for i in range(16)]  # etp 1: 16 groups of one


SMP_TABLE = """GPU0: pp_rank 0, tp_rank 0, rdp_rank 0, dp_rank 0, mp_rank 0 GPU1: pp_rank 1, tp_rank 0, rdp_rank 0, dp_rank 0, mp_rank 1 GPU2: pp_rank 0, tp_rank 1, rdp_rank 0, dp_rank 1, mp_rank 2 GPU3: pp_rank 1, tp_rank 1, rdp_rank 0, dp_rank 1, mp_rank 3 GPU4: pp_rank 0, tp_rank 0, rdp_rank 1, dp_rank 2, mp_rank 0 GPU5: pp_rank 1, tp_rank 0, rdp_rank 1, dp_rank 2, mp_rank 1 GPU6: pp_rank 0, tp_rank 1, rdp_rank 1, dp_rank 3, mp_rank 2 GPU7: pp_rank 1, tp_rank 1, rdp_rank 1, dp_rank 3, mp_rank 3"""


def _parse_smp(text):
    out = []
    for chunk in text.split("GPU")[1:]:
        _, rest = chunk.split(":", 1)
        out.append({k: int(v) for k, v in (item.strip().rsplit(" ", 1) for item in rest.split(","))})
    return out


@pytest.mark.parametrize("order", ["pp-tp-dp", "DTP"])
def test_smp_8gpu_table_verbatim(order):
    r = Layout(tp=2, pp=2, order=order).resolve(8)
    assert r.dp == 2  # rdp = 2 (smp's dp_size = world/pp = 4 includes tp)
    for rank, expected in enumerate(_parse_smp(SMP_TABLE)):
        assert r.smp_ranks(rank) == expected, rank
    assert r.groups("pp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert r.groups("tp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert r.groups("tp-dp") == [[0, 2, 4, 6], [1, 3, 5, 7]]  # smp DP_GROUP
    assert r.groups("tp-pp") == [[0, 1, 2, 3], [4, 5, 6, 7]]  # smp MP_GROUP


def test_smp_placement_aliases():
    # smp docs: DPT -> tp fastest, then pp, then rdp; PTD -> rdp fastest, then tp, then pp
    assert Layout(order="DPT").resolve(8).order[:3] == ("tp", "pp", "dp")
    assert Layout(order="cluster").resolve(8).order[:3] == ("tp", "pp", "dp")
    assert Layout(order="spread").resolve(8).order[:3] == ("dp", "pp", "tp")
    r = Layout(tp=2, pp=2, order="PTD").resolve(8)
    assert [(c["dp"], c["pp"], c["tp"]) for c in map(r.dense_grid.coords, range(8))] == [
        (0, 0, 0), (1, 0, 0), (0, 0, 1), (1, 0, 1), (0, 1, 0), (1, 1, 0), (0, 1, 1), (1, 1, 1)]


def test_embedding_groups():
    assert pipeline_end_groups([[0, 4, 8, 12], [1, 5, 9, 13]]) == ([[0, 12], [1, 13]], [[0], [1]])
    assert pipeline_end_groups([[3]]) == ([[3]], [[3]])
    r = Layout(tp=2, pp=4).resolve(16)
    assert r.groups("embd")[0] == [0, 12] and r.groups("pos_embd")[0] == [0]


def test_coords_roundtrip_and_rank_in_group():
    g = RankGrid(("tp", "cp", "dp", "pp"), (2, 3, 2, 2))
    for rank in range(g.world_size):
        assert g.rank(**g.coords(rank)) == rank
        for axes in ("tp", "dp-cp", "tp-pp", "cp-tp-dp-pp"):
            grp = g.group_of(rank, axes)
            assert grp in g.groups(axes)
            assert grp[g.rank_in_group(rank, axes)] == rank


ORDERS = ["-".join(p) for p in permutations(("tp", "cp", "ep", "dp", "pp"))]
KIND_MASKS = ["tp", "cp", "dp", "pp", "dp-cp", "tp-pp", "tp-dp", "tp-cp", "tp-dp-cp", "cp-pp", "tp-cp-dp-pp"]


@settings(max_examples=150, deadline=None)
@given(tp=st.sampled_from([1, 2, 3, 4]), cp=st.sampled_from([1, 2]), pp=st.sampled_from([1, 2, 3]),
       dp=st.sampled_from([1, 2, 4]), order=st.sampled_from(ORDERS), kind=st.sampled_from(KIND_MASKS))
def test_groups_equal_megatron_reference(tp, cp, pp, dp, order, kind):
    sizes = {"tp": tp, "cp": cp, "ep": 1, "dp": dp, "pp": pp}
    o = order.split("-")
    grid = RankGrid(tuple(o), tuple(sizes[a] for a in o))
    mask = [a in kind.split("-") for a in o]
    assert grid.groups(kind) == megatron_reference(grid.world_size, [sizes[a] for a in o], mask)


@settings(max_examples=100, deadline=None)
@given(tp=st.sampled_from([1, 2, 4]), cp=st.sampled_from([1, 2]), pp=st.sampled_from([1, 2, 4]),
       dp=st.sampled_from([1, 2, 3, 8]), ep=st.sampled_from([1, 2, 4]), order=st.sampled_from(ORDERS))
def test_properties_partition_sizes_orthogonal(tp, cp, pp, dp, ep, order):
    world = tp * cp * pp * dp
    try:
        r = Layout(tp=tp, cp=cp, pp=pp, ep=ep, order=order).resolve(world)
    except ValueError:
        return  # the rules reject it (covered by test_layout)
    expected = {"tp": tp, "cp": cp, "dp": dp, "pp": pp, "dp-cp": dp * cp, "tp-pp": tp * pp, "tp-dp": tp * dp,
                "tp-cp": tp * cp, "tp-dp-cp": tp * dp * cp, "ep": r.ep, "etp": r.etp, "edp": r.edp,
                "etp-ep": r.etp * r.ep, "etp-ep-pp": r.etp * r.ep * pp}
    for kind in GROUP_KINDS:
        groups = r.groups(kind)
        flat = sorted(x for g in groups for x in g)
        if kind not in ("embd", "pos_embd"):
            assert flat == list(range(world)), kind  # partitions the world
            assert all(len(g) == expected[kind] for g in groups), kind
        assert all(g == sorted(g) for g in groups)
        assert [g[0] for g in groups] == sorted(g[0] for g in groups)
    # orthogonal: a tp group and a dp group share exactly one rank when they meet
    for a, b in [("tp", "dp"), ("tp", "pp"), ("cp", "dp"), ("dp", "pp")]:
        for ga in r.groups(a):
            for gb in r.groups(b):
                assert len(set(ga) & set(gb)) <= 1


def test_large_world_against_reference():
    r = Layout(tp=8, cp=2, pp=8, ep=8, etp=1).resolve(4096)
    g = r.dense_grid
    for kind in ("dp", "tp-pp", "dp-cp"):
        mask = [a in kind.split("-") for a in g.order]
        assert g.groups(kind) == megatron_reference(4096, list(g.sizes), mask)
    eg = r.expert_grid
    assert eg.groups("ep") == megatron_reference(4096, list(eg.sizes), [a == "ep" for a in eg.order])


def test_fast_65536_ranks():
    """Groups at 65,536 ranks are linear work: bounded in this process's CPU seconds (not wall time, which a loaded
    CI box stretches: 0.79 s wall once for a 0.1 s job); a quadratic pass would take minutes."""
    r = Layout(tp=8, cp=2, pp=16, ep=8, etp=1).resolve(65536)
    for kind in ("tp", "dp", "pp", "dp-cp", "tp-dp-cp", "ep", "edp"):
        t = time.process_time()
        groups = r.groups(kind)
        assert time.process_time() - t < 5.0, kind
        assert sum(map(len, groups)) == 65536


def test_rank_engine_is_torch_free():
    import subprocess
    code = ("import sys; import meshplan.mesh.ranks, meshplan.plan_file.layout, meshplan.mesh.rank_table; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_grid_errors():
    with pytest.raises(ValueError, match="repeats"):
        RankGrid(("tp", "tp"), (2, 2))
    with pytest.raises(ValueError, match="not distinct axes"):
        RankGrid(("tp", "dp"), (2, 2)).groups("xx")
    with pytest.raises(ValueError, match=r"rank\(4\) is outside world_size\(4\)"):
        RankGrid(("tp", "dp"), (2, 2)).coords(4)
