"""Tests for meshplan.tensor_parallel.cpu_attention: DTensor sharding of CPU fused SDPA.

All distributed work is simulated in one process with LocalTensorMode over a
"fake" process group (tests/_local.py): inside the mode every DTensor's local
tensor is a LocalTensor holding one shard per simulated rank, and collectives
run for all ranks at once. References are computed on plain tensors outside
the mode.
"""

import contextlib
import copy
import inspect
import warnings
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate, Shard

from _local import LocalTensor, assert_close_rel, distribute, local_ranks, make_mesh, rank_values, shutdown
from meshplan.tensor_parallel import cpu_attention as attention
from meshplan.tensor_parallel.cpu_attention import CPU_ATTENTION_OPS, register_cpu_attention_rule

pytestmark = pytest.mark.fast

WORLD = 4
aten = torch.ops.aten
FWD, BWD = CPU_ATTENTION_OPS


@pytest.fixture(scope="module", autouse=True)
def _rule_registered():
    register_cpu_attention_rule()  # process-wide; stays registered after this module
    yield
    shutdown()  # destroy the fake process group local_ranks() left initialised


@contextlib.contextmanager
def simulated(shape=(WORLD,), names=("tp",)):
    """Simulate WORLD ranks (fake PG + LocalTensorMode) and build a CPU mesh."""
    with local_ranks(WORLD) as mode:
        yield mode, make_mesh(shape, names)


def qkv(b=2, hq=8, hkv=8, s=16, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda h: torch.randn(b, h, s, d, generator=g)  # noqa: E731
    return mk(hq), mk(hkv), mk(hkv), torch.randn(b, hq, s, d, generator=g)


def reference(q, k, v, grad_out, **kw):
    """Single-device SDPA forward and grads of q, k, v (kv expanded via repeat_interleave)."""
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    n_rep = q.shape[1] // k.shape[1]
    kk, vv = (t.repeat_interleave(n_rep, dim=1) for t in leaves[1:])
    out = F.scaled_dot_product_attention(leaves[0], kk, vv, **kw)
    out.backward(grad_out)
    return out.detach(), [t.grad for t in leaves]


def sharded_sdpa(mesh, placements, q, k, v, grad_out, expand_kv=True, **kw):
    """Run SDPA on DTensors; return the output and q/k/v grads as DTensors."""
    dq, dk, dv = (distribute(t, mesh, placements, requires_grad=True) for t in (q, k, v))
    kk, vv = dk, dv
    n_rep = q.shape[1] // k.shape[1]
    if expand_kv and n_rep > 1:
        kk, vv = dk.repeat_interleave(n_rep, dim=1), dv.repeat_interleave(n_rep, dim=1)
    elif n_rep > 1:
        kw["enable_gqa"] = True
    out = F.scaled_dot_product_attention(dq, kk, vv, **kw)
    out.backward(distribute(grad_out, mesh, out.placements))
    return out, [dq.grad, dk.grad, dv.grad]


def check(out, grads, ref_out, ref_grads, placements):
    """Placements are the sharded ones (no silent Replicate fallback) and numerics match."""
    assert out.placements == tuple(placements)
    assert_close_rel(out, ref_out, tol=1e-5)
    for g, rg in zip(grads, ref_grads):
        assert g.placements == tuple(placements)
        assert_close_rel(g, rg, tol=1e-5)


# ---------------------------------------------------------------- pins ------


def test_private_api_pins():
    """Every torch-private name meshplan.tensor_parallel.cpu_attention relies on, as it relies on it."""
    from meshplan._torch import (
        OpSchema,
        OpStrategy,
        StrategyType,
        expand_to_full_mesh_op_strategy,
        is_tensor_evenly_shardable_on_dim,
        sharding_propagator,
    )

    assert {"args_schema", "kwargs_schema"} <= set(OpSchema.__dataclass_fields__)
    assert callable(OpSchema.get_mesh_from_args)
    assert isinstance(OpStrategy.ndim, property) and isinstance(OpStrategy.shape, property)
    assert issubclass(OpStrategy, StrategyType)
    params = inspect.signature(expand_to_full_mesh_op_strategy).parameters
    assert {"input_index", "is_valid_strategy_cb"} <= set(params)
    assert list(inspect.signature(is_tensor_evenly_shardable_on_dim).parameters) == [
        "shape", "spec", "dim",
    ]
    prop = sharding_propagator()
    assert isinstance(prop.op_strategy_funcs, dict)
    assert isinstance(prop.op_to_rules, dict)
    assert isinstance(prop.op_single_dim_strategy_funcs, dict)
    assert list(inspect.signature(prop.register_op_strategy).parameters)[:2] == [
        "op_overload", "strategy_func",
    ]


def test_op_schemas_pinned():
    """The strategies index tensors by these positions and the ``attn_mask`` kwarg."""
    fwd = [(a.name, a.kwarg_only) for a in FWD._schema.arguments]
    assert fwd == [
        ("query", False), ("key", False), ("value", False), ("dropout_p", False),
        ("is_causal", False), ("attn_mask", True), ("scale", True),
    ]
    assert [r.name for r in FWD._schema.returns] == ["output", "logsumexp"]
    bwd = [a.name for a in BWD._schema.arguments]
    assert bwd == [
        "grad_out", "query", "key", "value", "out", "logsumexp",
        "dropout_p", "is_causal", "attn_mask", "scale",
    ]
    assert len(BWD._schema.returns) == 3


def test_cpu_sdpa_dispatches_to_fused_cpu_kernel():
    """With dropout_p == 0, CPU SDPA (plain, causal, masked, GQA) hits exactly these ops."""
    from meshplan._torch import TorchDispatchMode

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.add(func)
            return func(*args, **(kwargs or {}))

    q, k, v, _ = qkv(hkv=4)
    mask = torch.ones(16, 16, dtype=torch.bool).tril()
    for kw in ({}, {"is_causal": True}, {"attn_mask": mask}, {"enable_gqa": True}):
        seen = set()
        kv = k if kw.get("enable_gqa") else q
        leaves = [t.clone().requires_grad_() for t in (q, kv, kv)]
        with Record():
            F.scaled_dot_product_attention(*leaves, **kw).sum().backward()
        assert FWD in seen and BWD in seen, kw


def test_torch_has_cuda_rules_but_not_cpu():
    prop = DTensor._op_dispatcher.sharding_propagator
    for op in (
        aten._scaled_dot_product_flash_attention.default,
        aten._scaled_dot_product_flash_attention_backward.default,
        aten._scaled_dot_product_efficient_attention.default,
        aten._scaled_dot_product_cudnn_attention.default,
    ):
        assert op in prop.op_strategy_funcs
    assert prop.op_strategy_funcs[FWD] is attention._cpu_flash_fwd_strategy
    assert prop.op_strategy_funcs[BWD] is attention._cpu_flash_bwd_strategy


# --------------------------------------------------------- registration ----


def test_register_twice_is_harmless():
    prop = DTensor._op_dispatcher.sharding_propagator
    before = dict(prop.op_strategy_funcs)
    assert register_cpu_attention_rule() == []
    assert register_cpu_attention_rule() == []
    assert prop.op_strategy_funcs == before
    q, k, v, go = qkv()
    ref_out, ref_grads = reference(q, k, v, go, is_causal=True)
    with simulated() as (_, mesh):
        out, grads = sharded_sdpa(mesh, [Shard(1)], q, k, v, go, is_causal=True)
        check(out, grads, ref_out, ref_grads, [Shard(1)])


def test_without_rule_torch_fails_and_register_fills_only_missing_ops():
    prop = DTensor._op_dispatcher.sharding_propagator
    q, k, v, _ = qkv(b=1, hq=4, hkv=4, s=12, d=8)  # a shape no other test caches
    sentinel = object()
    with mock.patch.dict(prop.op_strategy_funcs):  # restored on exit
        del prop.op_strategy_funcs[FWD], prop.op_strategy_funcs[BWD]
        with simulated() as (_, mesh):
            dq = distribute(q, mesh, [Shard(1)])
            # causal: torch's decomposition-based fallback gives up at once (non-causal
            # forward would be traced through the decomposition, ~1 min, and the
            # backward op has no decomposition at all)
            with pytest.raises(NotImplementedError, match="does not have a sharding strategy"):
                F.scaled_dot_product_attention(dq, dq, dq, is_causal=True)
        prop.op_strategy_funcs[BWD] = sentinel  # pretend torch already had a rule
        assert register_cpu_attention_rule() == [FWD]
        assert prop.op_strategy_funcs[BWD] is sentinel
        assert register_cpu_attention_rule() == []
    assert prop.op_strategy_funcs[BWD] is attention._cpu_flash_bwd_strategy


# ------------------------------------------------------------- numerics ----


@pytest.mark.parametrize("is_causal", [False, True])
def test_head_sharded_forward_backward(is_causal):
    q, k, v, go = qkv()
    ref_out, ref_grads = reference(q, k, v, go, is_causal=is_causal)
    with simulated() as (_, mesh):
        out, grads = sharded_sdpa(mesh, [Shard(1)], q, k, v, go, is_causal=is_causal)
        check(out, grads, ref_out, ref_grads, [Shard(1)])
        # each rank holds 2 of the 8 heads, computed locally
        local = out.to_local()
        assert isinstance(local, LocalTensor) and local.shape == (2, 2, 16, 16)
        for r, shard in rank_values(out).items():
            torch.testing.assert_close(shard, ref_out[:, 2 * r : 2 * r + 2], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("expand_kv", [True, False], ids=["repeat_interleave", "enable_gqa"])
def test_gqa_head_sharded(expand_kv):
    q, k, v, go = qkv(hq=8, hkv=4)
    ref_out, ref_grads = reference(q, k, v, go, is_causal=True)
    with simulated() as (_, mesh):
        out, grads = sharded_sdpa(
            mesh, [Shard(1)], q, k, v, go, expand_kv=expand_kv, is_causal=True
        )
        check(out, grads, ref_out, ref_grads, [Shard(1)])


def test_gqa_uneven_kv_heads_falls_back_to_replicate():
    """2 kv heads cannot be split evenly over 4 ranks: correct, but replicated."""
    q, k, v, go = qkv(hq=8, hkv=2)
    ref_out, ref_grads = reference(q, k, v, go, is_causal=True)
    with simulated() as (_, mesh):
        dq = distribute(q, mesh, [Shard(1)])
        dk, dv = (distribute(t, mesh, [Replicate()]) for t in (k, v))
        out = F.scaled_dot_product_attention(dq, dk, dv, is_causal=True, enable_gqa=True)
        assert out.placements == (Replicate(),)
        assert_close_rel(out, ref_out, tol=1e-5)


def test_batch_and_head_sharded_2d_mesh():
    q, k, v, go = qkv(b=4, hq=8, hkv=4)
    ref_out, ref_grads = reference(q, k, v, go, is_causal=True)
    with simulated(shape=(2, 2), names=("dp", "tp")) as (_, mesh):
        out, grads = sharded_sdpa(mesh, [Shard(0), Shard(1)], q, k, v, go, is_causal=True)
        check(out, grads, ref_out, ref_grads, [Shard(0), Shard(1)])


@pytest.mark.parametrize("mask_heads", [False, True], ids=["mask_ss", "mask_bhss"])
def test_attn_mask(mask_heads):
    q, k, v, go = qkv()
    shape = (2, 8, 16, 16) if mask_heads else (16, 16)
    mask = torch.randn(shape)
    ref_out, ref_grads = reference(q, k, v, go, attn_mask=mask)
    with simulated() as (_, mesh):
        dmask = distribute(mask, mesh, [Shard(1) if mask_heads else Replicate()])
        out, grads = sharded_sdpa(mesh, [Shard(1)], q, k, v, go, attn_mask=dmask)
        check(out, grads, ref_out, ref_grads, [Shard(1)])


# -------------------------------------------------------------- dropout ----


def test_fused_cpu_kernel_rejects_dropout():
    q, _, _, _ = qkv()
    with pytest.raises(RuntimeError, match="Currently do not support dropout > 0"):
        FWD(q, q, q, 0.5, False)


def test_dropout_on_cpu_dtensor_uses_rank_local_rng():
    """Documented limitation: no DTensor RNG tracker on CPU, so shards share masks.

    dropout_p > 0 takes SDPA's math path (bernoulli_ on the local shard). On a
    CPU mesh DTensor warns and runs it on each rank's own generator; with equal
    seeds every head shard draws the same mask, unlike single-device dropout.
    """
    one_head = torch.randn(1, 1, 16, 16)
    x = one_head.expand(1, 8, 16, 16).contiguous()  # every head identical
    with simulated() as (_, mesh):
        dx = distribute(x, mesh, [Shard(1)])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = F.scaled_dot_product_attention(dx, dx, dx, dropout_p=0.5)
        assert any("random operators may not have complete support on cpu" in str(w.message)
                   for w in caught)
        assert out.placements == (Shard(1),)
        shards = rank_values(out)
        for r in range(1, WORLD):
            assert torch.equal(shards[r], shards[0])  # same mask on every rank
        assert not torch.equal(shards[0][:, 0], shards[0][:, 1])  # but not across local heads


def test_causal_dropout_on_dtensor_fails():
    """Math path + is_causal builds a plain-tensor mask that DTensor refuses."""
    q, _, _, _ = qkv()
    with simulated() as (_, mesh):
        dq = distribute(q, mesh, [Shard(1)])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with pytest.raises(RuntimeError, match="got mixed torch.Tensor and DTensor"):
                F.scaled_dot_product_attention(dq, dq, dq, dropout_p=0.1, is_causal=True)


# ------------------------------------------- the example Llama under TP ----


@pytest.mark.parametrize(
    "head_reshape,use_local_output",
    [("infer", True), ("infer", False), ("stored", False)],
)
def test_example_llama_attention_tensor_parallel(head_reshape, use_local_output):
    """examples/llama.py with torch TP styles on its attention, fwd + bwd vs one device.

    With ``use_local_output=False`` q/k/v stay DTensors, SDPA needs this rule, and
    the plain ``freqs_cis`` buffer must become a Replicate DTensor (else RoPE fails
    with "aten.mul.Tensor got mixed torch.Tensor and DTensor").
    """
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    from llama import build, tiny_args

    torch.manual_seed(0)
    ref = build(tiny_args(n_heads=8, n_kv_heads=4, head_reshape=head_reshape))
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    model = copy.deepcopy(ref)
    ref_out = ref(tokens)
    ref_out.sum().backward()
    plan = {}
    for i in range(len(ref.layers)):
        for name in ("wq", "wk", "wv"):
            plan[f"layers.{i}.attention.{name}"] = ColwiseParallel(
                use_local_output=use_local_output
            )
        plan[f"layers.{i}.attention.wo"] = RowwiseParallel()
    with simulated() as (_, mesh):
        parallelize_module(model, mesh, plan)
        if not use_local_output:
            model.freqs_cis = distribute(model.freqs_cis, mesh, [Replicate()])
        out = model(tokens)
        out.sum().backward()
        assert_close_rel(out, ref_out.detach(), tol=1e-5)  # checked on every rank
        for name in ("wq", "wk", "wo"):
            grad = getattr(model.layers[0].attention, name).weight.grad
            assert isinstance(grad, DTensor)
            assert_close_rel(grad, getattr(ref.layers[0].attention, name).weight.grad, tol=1e-5)


def test_example_llama_stored_head_reshape_breaks_on_local_shards():
    """Documented in examples/llama.py: "stored" needs the parallelizer to adjust counts."""
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    from llama import build, tiny_args

    model = copy.deepcopy(build(tiny_args(n_heads=8, n_kv_heads=4, head_reshape="stored")))
    with simulated() as (_, mesh):
        parallelize_module(model, mesh, {"layers.0.attention.wq": ColwiseParallel()})
        with pytest.raises(RuntimeError, match="is invalid for input of size"):
            model(torch.zeros(2, 16, dtype=torch.long))
