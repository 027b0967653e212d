"""Meta-device init and sharded loading, checked shard by shard on each simulated rank (fake group, rank r).

(Loading a full dict broadcast from rank 0 needs real collectives: tests/test_dist_hf.py.)
"""

import pytest
import torch
import torch.nn as nn
from safetensors.torch import save_file
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

import llama
import meshplan
from examples.hf_models import FACTORIES
from meshplan import PlanError
from meshplan.weights.shards import local_slices, take_slices

pytestmark = pytest.mark.fast
RANKS = (0, 1)


class _Mesh:
    def __init__(self, sizes, coord):
        self.sizes, self.coord = sizes, coord

    def size(self, i=0):
        return self.sizes[i]

    def get_coordinate(self):
        return self.coord


def test_local_slices():
    assert local_slices((10, 4), [Shard(0)], _Mesh([4], [3])) == [[(9, 10)], [(0, 4)]]  # torch.chunk: 3,3,3,1
    assert local_slices((4, 12), [_StridedShard(1, split_factor=3)], _Mesh([2], [1])) == \
        [[(0, 4)], [(2, 4), (6, 8), (10, 12)]]
    assert local_slices((6,), [Replicate()], _Mesh([2], [1])) == [[(0, 6)]]
    full = torch.arange(48).reshape(4, 12)
    got = take_slices(lambda s: full[s], [[(0, 4)], [(2, 4), (6, 8), (10, 12)]])
    assert got.tolist() == [[r * 12 + c for c in (2, 3, 6, 7, 10, 11)] for r in range(4)]


@pytest.mark.parametrize("coord,rows", [((0, 0), (0, 2)), ((0, 1), (4, 6)), ((1, 0), (2, 4)), ((1, 1), (6, 8))])
def test_local_slices_fsdp_over_tp(coord, rows):
    """FSDP2 over a tensor-parallel Shard(0) (dp, tp): tp shards first, dp each tp shard: torch's
    _StridedShard docstring table ((dp, tp) = (0, 1) holds rows 4-5)."""
    got = local_slices((8, 8), [_StridedShard(0, split_factor=2), Shard(0)], _Mesh([2, 2], list(coord)))
    assert got == [[rows], [(0, 8)]]


def test_local_slices_fsdp_of_size_one_over_ep():
    """Experts' FSDP2 over edp 1 in front of ep 2: plain ep halves (materialize put rank 1's rows wrong before)."""
    assert local_slices((4, 3), [_StridedShard(0, split_factor=2), Shard(0)], _Mesh([1, 2], [0, 1])) == \
        [[(2, 4)], [(0, 3)]]


def shard_of(t, full):
    return take_slices(lambda s: full[s], local_slices(tuple(t.shape), t.placements, t.device_mesh))


def assert_shards(model, reference):
    ref = reference.state_dict()
    for k, t in model.state_dict().items():
        want = shard_of(t, ref[k]) if hasattr(t, "placements") else ref[k]
        got = t.to_local() if hasattr(t, "placements") else t
        assert torch.equal(got, want), k


def parallel_meta(factory, plan):
    with torch.device("meta"):
        model = factory()
    return meshplan.parallelize(model, plan, meshplan.build_mesh({"tp": 2}))


@pytest.mark.parametrize("rank", RANKS)
def test_meta_init_equals_cpu_construction(fake_pg, rank):
    """examples/llama.py draws its parameters only in init_weights(): the CPU model is the reference."""
    torch.manual_seed(0)
    cpu = llama.build(llama.tiny_args())
    with fake_pg(2, rank):
        model = meshplan.materialize(parallel_meta(lambda: llama.build(llama.tiny_args()), "plans/llama.yaml"), seed=0)
        assert all(p.device.type == "cpu" for p in model.parameters())
        assert model.freqs_cis.device.type == "cpu" and torch.equal(model.freqs_cis, cpu.freqs_cis)
        assert_shards(model, cpu)


def hf_reference(factory, seed=0):
    """transformers' own one-device meta-model init: to_empty, tie, seed, initialize_weights()."""
    with torch.device("meta"):
        ref = factory()
    ref.to_empty(device="cpu")
    ref.tie_weights()
    torch.manual_seed(seed)
    ref.initialize_weights()
    return ref


@pytest.mark.parametrize("name", ["llama", "qwen2", "gpt2"])
@pytest.mark.parametrize("rank", RANKS)
def test_meta_init_equals_hf_one_device_init(fake_pg, name, rank):
    factory, plan = FACTORIES[name]
    ref = hf_reference(factory)
    with fake_pg(2, rank):
        model = meshplan.materialize(parallel_meta(factory, plan), seed=0)
        assert_shards(model, ref)
        if name == "gpt2":  # tied lm_head stays tied; the GPT-2 scaled c_proj init (set by the parent) applied
            assert model.lm_head.weight is model.transformer.wte.weight
            assert float(ref.transformer.h[0].attn.c_proj.weight.std()) < 0.015


def test_materialize_plain_model_keeps_ties():
    factory, _ = FACTORIES["gpt2"]
    with torch.device("meta"):
        model = factory()
    meshplan.materialize(model, seed=0, device="cpu")
    assert model.lm_head.weight is model.transformer.wte.weight
    assert_shards(model, hf_reference(factory))


def test_custom_per_module_initializer(fake_pg):
    torch.manual_seed(3)
    ref = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))  # reset_parameters, module order
    plan = {"tensor_parallel": {"sequence_parallel": False, "rules": {"0": "colwise", "2": "rowwise"}}}
    with fake_pg(2, 1):
        with torch.device("meta"):
            model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
        meshplan.parallelize(model, plan, meshplan.build_mesh({"tp": 2}))
        meshplan.materialize(model, seed=3)
        assert_shards(model, ref)
        meshplan.materialize(model, init=lambda m: [nn.init.zeros_(p) for p in m.parameters(recurse=False)])
        assert all(float(p.to_local().abs().sum()) == 0 for p in model.parameters())


def test_initializer_reaching_two_levels_down_is_refused(fake_pg):
    class Inner(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = Inner()

    def init(m):
        if isinstance(m, Outer):
            nn.init.zeros_(m.inner.lin.weight)

    with torch.device("meta"):
        model = Outer()
    with pytest.raises(PlanError, match=r"initializer of Outer writes parameters of modules two levels below it "
                                        r"\(weight\)"):
        meshplan.materialize(model, init=init, device="cpu")


def save(model, path, **kw):
    model.save_pretrained(path, safe_serialization=True, **kw)


@pytest.mark.parametrize("name", ["llama", "gpt2"])
@pytest.mark.parametrize("rank", RANKS)
def test_load_safetensors_shards(fake_pg, tmp_path, name, rank):
    factory, plan = FACTORIES[name]
    torch.manual_seed(7)
    full = factory()
    save(full, tmp_path / "one")
    save(full, tmp_path / "many", max_shard_size="20KB")  # a sharded checkpoint with an index.json
    assert (tmp_path / "many" / "model.safetensors.index.json").is_file()
    with fake_pg(2, rank):
        for src in (tmp_path / "one", tmp_path / "many" / "model.safetensors.index.json"):
            model = meshplan.load_safetensors(parallel_meta(factory, plan), src)
            assert_shards(model, full)
            for b, want in zip(model.buffers(), full.buffers()):  # RoPE tables recomputed on meta params
                assert torch.equal(b, want)


def test_load_errors(fake_pg, tmp_path):
    factory, plan = FACTORIES["llama"]
    torch.manual_seed(0)
    sd = {k: v.contiguous() for k, v in factory().state_dict().items()}
    bad = dict(sd)
    bad.pop("lm_head.weight")
    bad["model.norm.weight"] = torch.ones(3)
    save_file(bad, tmp_path / "bad.safetensors")
    less = dict(sd)
    less.pop("lm_head.weight")
    less["extra"] = torch.zeros(1)
    save_file(less, tmp_path / "less.safetensors")
    with fake_pg(2, 0):
        with pytest.raises(PlanError, match=r"bad.safetensors: model.norm.weight: checkpoint shape \(3,\), model \(64,\)"):
            meshplan.load_safetensors(parallel_meta(factory, plan), tmp_path / "bad.safetensors")
        with pytest.raises(PlanError, match=r"missing keys \['lm_head.weight'\]; unexpected keys \['extra'\]"):
            meshplan.load_safetensors(parallel_meta(factory, plan), tmp_path / "less.safetensors")
        with pytest.raises(PlanError, match=r"missing keys \['lm_head.weight'\] \(the model is on the meta device: "
                                            r"they would stay uninitialized memory\)"):  # whatever strict says
            meshplan.load_safetensors(parallel_meta(factory, plan), tmp_path / "less.safetensors", strict=False)
        model = meshplan.materialize(parallel_meta(factory, plan), seed=0)  # materialized: the rest is kept
        meshplan.load_safetensors(model, tmp_path / "less.safetensors", strict=False)
        assert torch.equal(model.model.norm.weight.to_local(), sd["model.norm.weight"])
        with pytest.raises(PlanError, match="no safetensors checkpoint"):
            meshplan.load_safetensors(model, tmp_path / "nope")


@pytest.mark.parametrize("coord,rows", [((0, 0), [(0, 2), (4, 5)]), ((1, 0), [(5, 6), (8, 10)]),
                                        ((0, 1), [(2, 4), (6, 7)]), ((1, 1), [(7, 8), (10, 12)])])
def test_local_slices_fsdp_over_packed_tp(coord, rows):
    """FSDP2 (dp 2) over a packed q|k|v (3 parts of 4 rows, tp 2): tp rank t holds rows 2t..2t+1 of each part,
    and FSDP2 chunks THAT local tensor (6 rows) over dp; DTensor's label (split factor tp) names other rows."""
    got = local_slices((12, 4), [_StridedShard(0, split_factor=2), _StridedShard(0, split_factor=3)],
                       _Mesh([2, 2], list(coord)))
    assert got == [rows, [(0, 4)]]
