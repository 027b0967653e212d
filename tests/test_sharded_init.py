"""``materialize(mode="sharded")``: initializers on local shards with draws keyed by (seed, name, global index).

Checked on each simulated rank (fake group, rank r): every rank's shards equal the slices of ONE full tensor per
parameter, the one a single process draws in sharded mode (layout invariance, which makes replicas bit-identical),
under tp, FSDP2, pp from meta (tied ends), ep, activation checkpointing; the per-tensor moments of the draws within
6 sigma of the sampling error (fixed by the sample size); the fans of kaiming/xavier from the global shape;
whole-tensor initializers (orthogonal_) run whole for their tensor; what cannot be done per shard is refused.
"""

import math

import pytest
import torch
import torch.nn as nn

import meshplan
from examples.hf_models import FACTORIES
from meshplan import PlanError
from meshplan.plan_file.document import Plan
from test_init_load import parallel_meta, shard_of
from test_pipeline_meta import factory as pp_factory, plan as pp_plan

pytestmark = pytest.mark.fast


def one_device(make, **kw):
    """The reference: a single process, no parallelism, sharded mode (plain tensors: every index held)."""
    with torch.device("meta"):
        model = make()
    return meshplan.materialize(model, seed=0, device="cpu", mode="sharded", **kw).state_dict()


def assert_slices_of(model, full: dict) -> int:
    """Every tensor of ``model`` (this rank's shards) equals its slice of ``full``; returns the elements held."""
    held = 0
    for k, t in model.state_dict().items():
        k = k.replace("_checkpoint_wrapped_module.", "")
        got = t.to_local() if hasattr(t, "placements") else t
        want = shard_of(t, full[k]) if hasattr(t, "placements") else full[k]
        assert torch.equal(got, want), k
        held += got.numel()
    return held


# ---------------------------------------------------------------- the choice of mode


def test_plan_section_and_call_choose_the_mode(fake_pg):
    assert Plan.from_data({"init": {"mode": "sharded"}}).init.mode == "sharded"
    assert Plan.from_data({"init": {}}).init.mode == "exact"
    with pytest.raises(PlanError, match=r"init.mode"):
        Plan.from_data({"init": {"mode": "fast"}})
    with pytest.raises(PlanError, match=r"init.seed"):
        Plan.from_data({"init": {"seed": 1}})
    make, plan = FACTORIES["llama"]
    sharded_plan = {**Plan.from_data(meshplan.load_plan(plan).model_dump()).model_dump(), "init": {"mode": "sharded"}}
    full = one_device(make)
    with fake_pg(2, 1):
        exact = meshplan.materialize(parallel_meta(make, plan), seed=0)  # the default: exact
        w = exact.model.layers[0].mlp.up_proj.weight
        assert not torch.equal(w.to_local(), shard_of(w, full["model.layers.0.mlp.up_proj.weight"]))
        with torch.device("meta"):
            model = make()
        topo = meshplan.build_mesh({"tp": 2})
        assert_slices_of(meshplan.materialize(meshplan.parallelize(model, sharded_plan, topo), seed=0), full)
        with torch.device("meta"):
            model = make()
        model = meshplan.parallelize(model, sharded_plan, topo)
        meshplan.materialize(model, seed=0, mode="exact")  # the call wins over the plan
        assert torch.equal(model.model.layers[0].mlp.up_proj.weight.to_local(), w.to_local())
        with pytest.raises(PlanError, match=r"materialize: mode='fast'; expected one of 'exact', 'sharded'"):
            meshplan.materialize(parallel_meta(make, plan), seed=0, mode="fast")


# ---------------------------------------------------------------- layout invariance on every axis


@pytest.mark.parametrize("name,world", [("llama", 2), ("qwen2", 2), ("gpt2", 2), ("llama", 4)])
def test_tp_shards_are_slices_of_the_one_process_tensors(fake_pg, name, world):
    """tp 2 and tp 4 (gpt2's packed q|k|v, qwen2's biases, vocab-parallel embeddings): the same full tensors."""
    factory, plan = FACTORIES[name]
    make = (lambda: factory(num_key_value_heads=4)) if world == 4 else factory
    full = one_device(make)
    if True:
        for rank in range(world):
            with fake_pg(world, rank):
                with torch.device("meta"):
                    model = make()
                model = meshplan.parallelize(model, plan, meshplan.build_mesh({"tp": world}))
                assert_slices_of(meshplan.materialize(model, seed=0, mode="sharded"), full)


@pytest.mark.parametrize("layout,world", [({"tp": 2, "dp_shard": 2}, 4), ({"pp": 2}, 2), ({"pp": 2, "tp": 2}, 4),
                                          ({"pp": 2, "dp_shard": 2}, 4)])
@pytest.mark.parametrize("tied", [False, True])
def test_fsdp_and_pipeline_from_meta(fake_pg, layout, world, tied):
    """FSDP2 shards, pipeline stages from meta (tied embedding and head equal on first and last stage), with
    activation checkpointing renaming the blocks' parameters: each rank holds only its part, equal to the one
    process's tensors; ranks that replicate a shard (dp replicas of a tp shard, tp-replicated norms) agree."""
    make = pp_factory(tie_word_embeddings=tied)
    full = one_device(make)
    plan = pp_plan(layout) if "pp" in layout else {**pp_plan({"tp": 2, **layout}), "pipeline": None}
    plan["blocks"] = {"pattern": "model.layers.*", "activation_checkpointing": {"mode": "full"}}
    total = sum(t.numel() for t in full.values())
    for rank in range(world):
        with fake_pg(world, rank):
            with torch.device("meta"):
                model = make()
            model = meshplan.parallelize(model, plan, meshplan.build_mesh(layout))
            held = assert_slices_of(meshplan.materialize(model, seed=0, mode="sharded"), full)
            assert held < total


def test_expert_parallel(fake_pg):
    """Experts sharded over ep 2 (× tp 2 on the attention): each rank's experts are its rows of the full tensors."""
    from moe import build, tiny_args
    ep_rules = {"layers.*.moe.experts": "experts", "layers.*.moe.router": "router"}
    tp_rules = {"tok_embeddings": "embedding", "layers.*.attention.wq": "colwise", "layers.*.attention.wk": "colwise",
                "layers.*.attention.wv": "colwise", "layers.*.attention.wo": "rowwise", "output": "lm_head"}
    args = tiny_args(aux_loss_coef=0.0, capacity_factor=None)
    full = one_device(lambda: build(args))
    for layout, world in (({"ep": 2}, 2), ({"ep": 2, "tp": 2}, 4)):
        plan = {"layout": layout, "expert_parallel": {"rules": ep_rules}}
        if "tp" in layout:
            plan["tensor_parallel"] = {"sequence_parallel": False, "rules": tp_rules}
        for rank in range(world):
            with fake_pg(world, rank):
                with torch.device("meta"):
                    model = build(args)
                model = meshplan.parallelize(model, plan, meshplan.build_mesh(layout))
                assert_slices_of(meshplan.materialize(model, seed=0, mode="sharded"), full)


# ---------------------------------------------------------------- distributions, fans, whole-tensor initializers


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(1024, 256, padding_idx=5)
        self.up = nn.Linear(256, 512)
        self.down = nn.Linear(512, 256)


NET_PLAN = {"tensor_parallel": {"sequence_parallel": False,
                                "rules": {"emb": "embedding", "up": "colwise", "down": "rowwise"}}}


def net_init(m):
    """transformers-like: a padded embedding's row zeroed through a view; xavier (fans from the full shape);
    torch's kaiming-uniform reset (bias bound from the weight's full fan-in)."""
    if isinstance(m, nn.Embedding):
        nn.init.normal_(m.weight, std=0.02)
        nn.init.zeros_(m.weight[m.padding_idx])
    elif isinstance(m, nn.Linear) and m.out_features == 512:
        nn.init.xavier_normal_(m.weight)
        nn.init.zeros_(m.bias)
    elif isinstance(m, nn.Linear):
        m.reset_parameters()


def assert_moments(x: torch.Tensor, mean: float, var: float, fourth: float) -> None:
    """Sample mean and variance within 6 sigma of their sampling error, from n and the law's moments only."""
    x = x.double().flatten()
    n = x.numel()
    assert abs(float(x.mean()) - mean) <= 6 * math.sqrt(var / n)
    assert abs(float(x.var()) - var) <= 6 * math.sqrt((fourth - var ** 2) / n)


def test_draws_have_the_initializers_distributions_and_global_fans(fake_pg):
    torch.manual_seed(123)  # the global stream's state before does not matter: the keys do
    with torch.device("meta"):
        one = Net()
    full = meshplan.materialize(one, net_init, seed=0, device="cpu", mode="sharded").state_dict()
    emb = torch.cat([full["emb.weight"][:5], full["emb.weight"][6:]])
    assert float(full["emb.weight"][5].abs().sum()) == 0
    assert_moments(emb, 0.0, 0.02 ** 2, 3 * 0.02 ** 4)
    s = math.sqrt(2 / (256 + 512))  # xavier: fan_in + fan_out of the FULL [512, 256] weight
    assert_moments(full["up.weight"], 0.0, s ** 2, 3 * s ** 4)
    assert float(full["up.bias"].abs().sum()) == 0
    b = 1 / math.sqrt(512)  # kaiming_uniform(a=sqrt(5)) and the bias bound: the FULL fan-in 512 (a shard has 256)
    assert float(full["down.weight"].abs().max()) <= b
    assert_moments(full["down.weight"], 0.0, b * b / 3, b ** 4 / 5)
    assert float(full["down.bias"].abs().max()) <= b
    for rank in (0, 1):
        with fake_pg(2, rank):
            with torch.device("meta"):
                model = Net()
            model = meshplan.parallelize(model, NET_PLAN, meshplan.build_mesh({"tp": 2}))
            assert_slices_of(meshplan.materialize(model, net_init, seed=0, mode="sharded"), full)


def test_whole_tensor_initializer_runs_whole_for_its_tensor(fake_pg):
    """orthogonal_ reads the whole tensor: drawn whole (keyed generator) for that one parameter, the shard kept."""
    def init(m):
        if isinstance(m, nn.Linear):
            nn.init.orthogonal_(m.weight)
            nn.init.zeros_(m.bias)

    make = lambda: nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 64))  # noqa: E731
    with torch.device("meta"):
        one = make()
    full = meshplan.materialize(one, init, seed=0, device="cpu", mode="sharded").state_dict()
    w = full["0.weight"]
    assert torch.allclose(w @ w.T, torch.eye(32), atol=1e-5)
    plan = {"tensor_parallel": {"sequence_parallel": False, "rules": {"0": "colwise", "2": "rowwise"}}}
    for rank in (0, 1):
        with fake_pg(2, rank):
            with torch.device("meta"):
                model = make()
            model = meshplan.parallelize(model, plan, meshplan.build_mesh({"tp": 2}))
            assert_slices_of(meshplan.materialize(model, init, seed=0, mode="sharded"), full)


@pytest.mark.parametrize("init,match", [
    (lambda m: nn.init.normal_(m.weight.t()),
     r"mode='sharded'\): 2 \(Linear\): normal_ into a tensor that is not a parameter or its \[i\] / \[a:b\] view "
     r"\(\(16, 8\): torch.nn.init.normal_\); use mode='exact'"),
    (lambda m: m.weight.bernoulli_(0.5),
     r"mode='sharded'\): 2 \(Linear\): bernoulli_ into parameter '2.weight' has no keyed form"),
    (lambda m: nn.init.zeros_(m.weight.view(4, 32)),
     r"2 \(Linear\): view of parameter '2.weight' \(placements \(Shard\(dim=1\),\)\) is a copy, not a view of this "
     r"rank's shard, so a write through it would be lost"),
    (lambda m: nn.init.orthogonal_(m.weight[2:]),
     r"2 \(Linear\): orthogonal_ on a view of parameter '2.weight' reads the whole tensor; use mode='exact'"),
])
def test_what_cannot_be_done_per_shard_is_refused(fake_pg, init, match):
    def first_only(m):
        if isinstance(m, nn.Linear) and m.in_features == 16:
            init(m)

    for rank in (0, 1):
        with fake_pg(2, rank):
            with torch.device("meta"):
                model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
            plan = {"tensor_parallel": {"sequence_parallel": False, "rules": {"0": "colwise", "2": "rowwise"}}}
            model = meshplan.parallelize(model, plan, meshplan.build_mesh({"tp": 2}))
            with pytest.raises(PlanError, match=match):
                meshplan.materialize(model, first_only, seed=0, mode="sharded")


def test_context_parallel_with_tp(fake_pg):
    """cp 2 × tp 2 on the example Llama (model-level init_weights(), RoPE buffer rebuilt): the same tensors."""
    import llama
    args = llama.tiny_args()
    make = lambda: llama.build(args)  # noqa: E731
    with torch.device("meta"):
        one = make()
    one = meshplan.materialize(one, seed=0, device="cpu", mode="sharded")
    full = one.state_dict()
    plan = {**meshplan.load_plan("plans/llama.yaml").model_dump(exclude_none=True, exclude={"layout"}),
            "context_parallel": {"attention": "layers.*.attention", "positions": {"buffer": "freqs_cis"}}}
    for rank in range(4):
        with fake_pg(4, rank):
            with torch.device("meta"):
                model = make()
            model = meshplan.parallelize(model, plan, meshplan.build_mesh({"cp": 2, "tp": 2}))
            assert_slices_of(meshplan.materialize(model, seed=0, mode="sharded"), full)
            assert torch.equal(model.freqs_cis, one.freqs_cis)


def test_trunc_normal_is_keyed_by_inverse_cdf(fake_pg):
    """torch 2.13's trunc_normal_ rejection-samples (temporaries, a reduction over ranks): in sharded mode it is the
    inverse-CDF form on keyed uniforms, within its bounds, with the truncated law's variance."""
    def init(m):
        if isinstance(m, nn.Linear):
            nn.init.trunc_normal_(m.weight, std=0.02, a=-0.03, b=0.03)
            nn.init.zeros_(m.bias)

    make = lambda: nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 256))  # noqa: E731
    with torch.device("meta"):
        one = make()
    full = meshplan.materialize(one, init, seed=0, device="cpu", mode="sharded").state_dict()
    beta = 1.5  # the bounds in standard deviations
    pdf, mass = math.exp(-beta ** 2 / 2) / math.sqrt(2 * math.pi), math.erf(beta / math.sqrt(2))
    var = 0.02 ** 2 * (1 - 2 * beta * pdf / mass)
    for k in ("0.weight", "2.weight"):
        assert float(full[k].abs().max()) <= 0.03
        assert_moments(full[k], 0.0, var, 3 * 0.02 ** 4)  # the normal's 4th moment bounds the truncated one's
    plan = {"tensor_parallel": {"sequence_parallel": False, "rules": {"0": "colwise", "2": "rowwise"}}}
    for rank in (0, 1):
        with fake_pg(2, rank):
            with torch.device("meta"):
                model = make()
            model = meshplan.parallelize(model, plan, meshplan.build_mesh({"tp": 2}))
            assert_slices_of(meshplan.materialize(model, init, seed=0, mode="sharded"), full)


def test_views_of_a_parameter_write_the_holders_elements(fake_pg):
    """weight[:, j], weight.narrow(1, a, n), weight[i], slices of slices (strided) of a rowwise (column-sharded)
    weight: each rank writes
    the elements of the view it holds, draws keyed by the elements' full indices.

    (In one process, DTensor's native sharding cache can hand a later simulated rank the mesh object, with its
    coordinate, of the first rank that ran the same layout; comparing through the parameter's own mesh stays
    consistent. The real ranks: tests/dist/init_sharded.py.)"""
    def init(m):
        if isinstance(m, nn.Linear) and m.in_features == 16:
            nn.init.zeros_(m.weight)
            nn.init.ones_(m.weight[:, 5])
            nn.init.constant_(m.weight.narrow(1, 3, 6), 2.0)
            nn.init.normal_(m.weight[2])
            nn.init.uniform_(m.weight[4:6, 7:10])
            nn.init.constant_(m.weight[1:7][2:4, 1:15:3], 3.0)  # a slice of a slice, strided: rows 3-4, cols 1, 4, ..
            nn.init.constant_(m.weight[:, 2:14][6, -1], 4.0)  # row 6, col 13

    make = lambda: nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))  # noqa: E731
    with torch.device("meta"):
        one = make()
    full = meshplan.materialize(one, init, seed=0, device="cpu", mode="sharded").state_dict()
    w = full["2.weight"]
    assert float(w[0, 3:9].sum()) == 12 and float(w[0, 9:].abs().sum()) == 0 and float(w[2].abs().min()) > 0
    assert w[3, 1:15:3].tolist() == [3.0] * 5 and float(w[6, 13]) == 4 and float(w[6, 12]) != 4
    plan = {"tensor_parallel": {"sequence_parallel": False, "rules": {"0": "colwise", "2": "rowwise"}}}
    for rank in (0, 1):
        with fake_pg(2, rank):
            with torch.device("meta"):
                model = make()
            model = meshplan.parallelize(model, plan, meshplan.build_mesh({"tp": 2}))
            got = meshplan.materialize(model, init, seed=0, mode="sharded")[2].weight
            assert torch.equal(got.to_local(), shard_of(got, w))  # the other tensors are not initialized here
