"""dropout_rng: single_device: dropout > 0 under TP equals one device (LocalTensorMode, one step).

The masks are drawn for the global tensor from the shared generator and sliced
per rank, so the example Llama (SDPA dropout_p, resid and FFN dropout) and
transformers' Llama (attention_dropout) match a single-device step to fp32
rounding, for tp 2 and 4, sequence parallelism off / on / batch, loss_parallel
on and off. The real-process (gloo, 3 AdamW steps, activation checkpointing)
counterpart is tests/dist/tp_worker.py.
"""

import copy
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

import llama
import meshplan
from _local import (assert_close_rel, distribute, from_ranks, local_ranks, make_mesh, rank_values,
                    replicated)
from meshplan import PlanError
from meshplan.tensor_parallel.dropout.single_device import SingleDeviceDropout, sdpa_math
from meshplan.tensor_parallel.dropout.per_shard import TpRng

pytestmark = pytest.mark.fast
warnings.filterwarnings("ignore", message=".*loss_type=None.*")
PLAN = meshplan.load_plan("plans/llama.yaml")
P = 0.1


def plan_with(**tp):
    d = PLAN.model_dump(exclude_unset=True)
    d["tensor_parallel"].update(tp)
    d.pop("layout", None)
    return d


def rel(a, b):
    a = a.full_tensor() if isinstance(a, DTensor) else a
    vals = rank_values(a)
    return max(float((v.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)) for v in vals.values())


# ------------------------------------------------ what one device draws ----


def test_reconstruction_is_bitwise_single_device():
    """Pins torch's CPU dropout: F.dropout = x * empty_like(x).bernoulli_(1-p).div_(1-p); SDPA's math path."""
    torch.manual_seed(0)
    x = torch.randn(2, 5, 8)
    torch.manual_seed(1)
    a = F.dropout(x, P)
    torch.manual_seed(1)
    assert torch.equal(a, x * torch.empty_like(x).bernoulli_(1 - P).div_(1 - P))
    for kw, hk in [(dict(is_causal=True), 4), (dict(scale=0.3), 4), (dict(is_causal=True, enable_gqa=True), 2),
                   (dict(attn_mask=torch.rand(2, 1, 6, 6) > 0.3), 4), (dict(attn_mask=torch.randn(6, 6)), 4)]:
        q = torch.randn(2, 4, 6, 8, requires_grad=True)
        k, v = (torch.randn(2, hk, 6, 8, requires_grad=True) for _ in range(2))
        torch.manual_seed(5)
        ref = F.scaled_dot_product_attention(q, k, v, dropout_p=P, **kw)
        gref = torch.autograd.grad(ref.square().sum(), (q, k, v))
        torch.manual_seed(5)
        noise = torch.empty(2, 4, 6, 6).bernoulli_(1 - P).div_(1 - P)
        out = sdpa_math(q, k, v, noise=noise, **kw)
        grads = torch.autograd.grad(out.square().sum(), (q, k, v))
        assert torch.equal(out, ref) and all(torch.equal(g, h) for g, h in zip(grads, gref)), kw


@pytest.mark.parametrize("placements,shape", [([Shard(1)], (2, 7, 4)), ([Shard(0)], (4, 3, 4)),
                                              ([Replicate()], (2, 3, 4)), ([Partial()], (2, 3, 4))])
def test_dtensor_dropout_equals_one_device(placements, shape):
    """Global mask, this rank's slice (uneven Shard(1) of 7 over 4 included); Partial keeps the full mask."""
    x = torch.randn(shape)
    torch.manual_seed(3)
    ref = F.dropout(x, P)
    with local_ranks(4):
        mesh = make_mesh(4, ("tp",))
        sdd = SingleDeviceDropout(mesh)
        holder = nn.Dropout(P)
        sdd.attach(holder, "drop", "shared")
        if isinstance(placements[0], Partial):  # four quarters that sum to x
            dx = DTensor.from_local(replicated(x / 4), mesh, placements, run_check=False)
        else:
            dx = distribute(x, mesh, placements)
        torch.manual_seed(3)
        out = holder(dx)
        assert out.placements == dx.placements
        assert_close_rel(out, ref, 1e-6)


# ------------------------------------------------- the example Llama ----


def run_llama(tp, sp, lp, args, batch=4, seq=16, seed=0):
    torch.manual_seed(seed)
    ref = llama.build(args)
    tokens = torch.randint(0, args.vocab_size, (batch, seq))
    labels = torch.randint(0, args.vocab_size, (batch, seq))
    labels[0, :5] = -100
    model = copy.deepcopy(ref)
    torch.manual_seed(7)  # the dropout masks' seed
    ref_loss = F.cross_entropy(ref(tokens).flatten(0, 1), labels.flatten(), ignore_index=-100)
    ref_loss.backward()
    errs = {}
    with local_ranks(tp):
        meshplan.parallelize(model, plan_with(sequence_parallel=sp, loss_parallel=lp, dropout_rng="single_device"),
                             meshplan.build_mesh({"tp": tp}))
        assert isinstance(meshplan.parallel_state(model).tensor_parallel.rng, SingleDeviceDropout)
        n = batch // tp
        x = from_ranks({r: tokens[r * n:(r + 1) * n] for r in range(tp)}) if sp == "batch" else tokens
        torch.manual_seed(7)
        logits = model(x)
        if lp:
            loss = meshplan.cross_entropy(logits, labels)
        elif sp == "batch":
            y = from_ranks({r: labels[r * n:(r + 1) * n] for r in range(tp)})
            loss = F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum") / (labels != -100).sum()
        else:
            loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        loss.backward()
        if sp != "batch" or lp:  # batch without loss_parallel: each rank's loss is its part of the sum
            errs["loss"] = rel(loss, ref_loss.detach())
        refp = dict(ref.named_parameters())
        for name, p in model.named_parameters():
            errs[name] = rel(p.grad, refp[name].grad)
    return errs


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("sp", [True, False, "batch"])
@pytest.mark.parametrize("lp", [True, False])
def test_parity_example_llama_with_dropout(tp, sp, lp):
    errs = run_llama(tp, sp, lp, llama.tiny_args(n_kv_heads=4, dropout=P))
    worst = max(errs, key=errs.get)
    assert errs[worst] <= 1e-5, (worst, errs[worst])


def test_parity_gqa_and_stored_head_counts():
    """kv heads repeated by the model (n_kv_heads 2, tp 2), heads reshaped with the adjusted stored counts."""
    errs = run_llama(2, True, True, llama.tiny_args(dropout=0.3, head_reshape="stored"))
    assert max(errs.values()) <= 1e-5, errs


def test_dropout_really_drops():
    """The parity above is not vacuous: the masks change the gradients."""
    errs_a = run_llama(2, True, True, llama.tiny_args(n_kv_heads=4, dropout=P), seed=0)
    torch.manual_seed(0)
    m = llama.build(llama.tiny_args(n_kv_heads=4, dropout=P))
    tokens = torch.randint(0, 128, (4, 16))
    torch.manual_seed(7)
    a = m(tokens)
    m.eval()
    assert (a - m(tokens)).norm() / a.norm() > 1e-2 and max(errs_a.values()) <= 1e-5


# ------------------------------------------------- transformers' Llama ----


@pytest.mark.parametrize("sp,lp", [(True, True), (False, False), (True, False), ("batch", True)])
def test_parity_hf_llama_attention_dropout(sp, lp):
    """attn_implementation 'sdpa' with GQA (enable_gqa=True on CPU), attention_dropout 0.1, tp 2."""
    from examples.hf_models import llama as hf_llama
    torch.manual_seed(0)
    ref = hf_llama(attention_dropout=P)
    assert ref.config._attn_implementation == "sdpa"
    ref.train()
    tokens = torch.randint(0, 128, (2, 16))
    labels = tokens.clone()
    labels[0, :3] = -100
    model = copy.deepcopy(ref)
    torch.manual_seed(7)
    out_ref = ref(input_ids=tokens)
    ref_loss = F.cross_entropy(out_ref.logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
    ref_loss.backward()
    data = meshplan.load_plan("plans/hf_llama.yaml").model_dump(exclude_unset=True)
    data.pop("layout", None)
    data["tensor_parallel"].update(sequence_parallel=sp, loss_parallel=lp, dropout_rng="single_device")
    with local_ranks(2):
        meshplan.parallelize(model, data, meshplan.build_mesh({"tp": 2}))
        x = from_ranks({r: tokens[r:r + 1] for r in range(2)}) if sp == "batch" else tokens
        torch.manual_seed(7)
        logits = model(input_ids=x).logits
        loss = meshplan.cross_entropy(logits, labels) if lp else F.cross_entropy(logits.flatten(0, 1),
                                                                                  labels.flatten())
        loss.backward()
        errs = {"loss": rel(loss, ref_loss.detach())}
        for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
            errs[n] = rel(p.grad, q.grad)
    assert max(errs.values()) <= 1e-5, max(errs.items(), key=lambda kv: kv[1])


# ------------------------------------------------------ what cannot map ----


def test_plain_tensor_in_tp_region_is_a_clear_error():
    """A dropout module not listed as 'norm' on the (plain, SP off) output of a rowwise projection."""
    model = llama.build(llama.tiny_args(n_kv_heads=4, dropout=P))
    d = plan_with(sequence_parallel=False, dropout_rng="single_device")
    del d["tensor_parallel"]["rules"]["layers.*.attention.resid_dropout"]
    with local_ranks(2):
        meshplan.parallelize(model, d, meshplan.build_mesh({"tp": 2}))
        with pytest.raises(PlanError, match=r"dropout_rng 'single_device': module 'layers.0.attention.resid_dropout': "
                                             r"dropout of a plain tensor of shape \(4, 16, 64\) inside a TP region; "
                                             r"found a plain \(local\) tensor whose sharding is unknown; expected"):
            model(torch.zeros(4, 16, dtype=torch.long))
        assert not meshplan.parallel_state(model).tensor_parallel.rng._stack  # hooks unwound on the error
        model.eval()
        model(torch.zeros(4, 16, dtype=torch.long))  # no dropout, no error


def test_functional_dropout_on_sharded_features_is_an_error():
    class Mlp(nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)

        def forward(self, x):
            return self.down(F.dropout(self.up(x), 0.2, self.training))

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.mlp = Mlp()

        def forward(self, x):
            return self.mlp(x)

    plan = {"tensor_parallel": {"sequence_parallel": False, "dropout_rng": "single_device",
                                "rules": {"mlp.up": "colwise", "mlp.down": "rowwise"}}}
    with local_ranks(2):
        model = meshplan.parallelize(Net(), plan, meshplan.build_mesh({"tp": 2}))
        with pytest.raises(PlanError, match=r"module 'mlp': dropout of a plain tensor of shape \(3, 8\) inside a TP "
                                             r"region"):
            model(torch.randn(3, 8))


def test_per_shard_is_the_default_and_unchanged():
    assert meshplan.Plan.from_data({"tensor_parallel": {}}).tensor_parallel.dropout_rng == "per_shard"
    with local_ranks(2):
        model = meshplan.parallelize(llama.build(llama.tiny_args(n_kv_heads=4, dropout=P)), plan_with(),
                                     meshplan.build_mesh({"tp": 2}))
        assert isinstance(meshplan.parallel_state(model).tensor_parallel.rng, TpRng)


def test_torch_dropout_variants_and_unmapped_feature_dropout():
    """torch.dropout / torch.dropout_ are mapped like F.dropout (bitwise); dropout2d on a DTensor is an error."""
    x = torch.randn(2, 6, 4)

    class Apply(nn.Module):
        def __init__(self, fn):
            super().__init__()
            self.fn = fn

        def forward(self, t):
            return self.fn(t)

    for fn in (lambda t: torch.dropout(t, 0.3, True), lambda t: torch.dropout_(t.clone(), 0.3, True)):
        torch.manual_seed(1)
        ref = fn(x)
        with local_ranks(2):
            mesh = make_mesh(2, ("tp",))
            m = Apply(fn)
            SingleDeviceDropout(mesh).attach(m, "", "outside")
            torch.manual_seed(1)
            assert_close_rel(m(distribute(x, mesh, [Shard(1)])), ref, 0.0)
    with local_ranks(2):
        mesh = make_mesh(2, ("tp",))
        m = nn.Dropout2d(0.3)
        SingleDeviceDropout(mesh).attach(m, "drop2d", "inherit")
        with pytest.raises(PlanError, match=r"module 'drop2d': dropout2d is not mapped; found a DTensor input"):
            m(distribute(x, mesh, [Shard(1)]))
