"""meshplan.training.loss: vocab-parallel cross-entropy vs F.cross_entropy, simulated ranks (LocalTensorMode)."""

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.debug import CommDebugMode

from _local import assert_close_rel, assert_ranks_agree, distribute, local_ranks, make_mesh, on_rank
from meshplan._torch import dtensor_op_handlers
from meshplan.training.loss import cross_entropy, loss_parallel

pytestmark = pytest.mark.fast

ALL_REDUCE = torch.ops.c10d_functional.all_reduce


def _data(shape, seed=0, ignore_every=3):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g) * 3
    t = torch.randint(0, shape[-1], shape[:-1], generator=g)
    t.view(-1)[::ignore_every] = -100
    return x, t


def _reference(x, t, reduction, gout=None, **kw):
    xr = x.clone().requires_grad_()
    ref = F.cross_entropy(xr.flatten(0, -2), t.flatten(), reduction=reduction, **kw)
    if reduction == "none":
        ref = ref.reshape(t.shape)
    ref.backward(gout if gout is not None else torch.ones_like(ref))
    return ref.detach(), xr.grad


def _target_placements(placements, ndim):
    return [Replicate() if isinstance(p, Shard) and p.dim % ndim == ndim - 1 else p for p in placements]


def _run(x, t, world, mesh_shape, names, placements, reduction, gout=None, **kw):
    """Forward under CommDebugMode, backward under another; returns the checked counts."""
    ref, ref_grad = _reference(x, t, reduction, gout, **kw)
    with local_ranks(world):
        mesh = make_mesh(mesh_shape, names)
        logits = distribute(x, mesh, placements, requires_grad=True)
        tgt = distribute(t, mesh, _target_placements(placements, x.ndim))
        with CommDebugMode() as fwd:
            loss = cross_entropy(logits, tgt.to_local(), reduction=reduction, **kw)
        assert not isinstance(loss, DTensor)
        if reduction == "none":
            assert_close_rel(DTensor.from_local(loss, mesh, tgt.placements, run_check=False), ref)
            g = distribute(gout, mesh, tgt.placements).to_local() if gout is not None else torch.ones_like(loss)
        else:
            assert loss.dim() == 0
            assert_ranks_agree(loss)
            assert_close_rel(loss, ref)
            g = None
        with CommDebugMode() as bwd:
            loss.backward(g)
        assert isinstance(logits.grad, DTensor) and logits.grad.placements == logits.placements
        assert_close_rel(logits.grad, ref_grad)
    return dict(fwd.get_comm_counts()), bwd.get_total_counts()


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("shape", [(2, 5, 16), (10, 19)], ids=["bsV", "NV-uneven"])
@pytest.mark.parametrize("tp", [2, 4])
def test_parity_1d_tp(tp, shape, reduction):
    x, t = _data(shape)
    gout = torch.randn(shape[:-1]) if reduction == "none" else None
    fwd, bwd = _run(x, t, tp, (tp,), ("tp",), [Shard(-1)], reduction, gout)
    assert fwd == {ALL_REDUCE: 3} and bwd == 0


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_parity_2d_dp_tp_global_mean(reduction):
    x, t = _data((4, 3, 16))
    t[:2] = -100  # the whole first dp shard is ignored: its local mean would be nan
    fwd, bwd = _run(x, t, 4, (2, 2), ("dp", "tp"), [Shard(0), Shard(2)], reduction)
    # the global token count is folded into the 3rd all-reduce (over the flattened dp x tp group)
    assert fwd == {ALL_REDUCE: 3} and bwd == 0


def test_mean_is_global_not_mean_of_local_means():
    x, t = _data((4, 6, 16), ignore_every=2)
    t[2:, :5] = -100  # dp shards get different valid counts (rows 0-1: 12, rows 2-3: 2)
    ref, _ = _reference(x, t, "mean")
    local_means = [F.cross_entropy(x[i : i + 2].flatten(0, 1), t[i : i + 2].flatten()) for i in (0, 2)]
    assert not torch.allclose(ref, sum(local_means) / 2)  # the choice is observable
    with local_ranks(4):
        mesh = make_mesh((2, 2), ("dp", "tp"))
        loss = cross_entropy(distribute(x, mesh, [Shard(0), Shard(2)]), distribute(t, mesh, [Shard(0), Replicate()]))
        assert_close_rel(loss, ref)


def test_all_targets_ignored_matches_torch():
    x, t = _data((2, 3, 8))
    t.fill_(-100)
    ref, ref_grad = _reference(x, t, "mean")
    assert ref.isnan() and (ref_grad == 0).all()
    with local_ranks(2):
        mesh = make_mesh(2, ("tp",))
        logits = distribute(x, mesh, [Shard(2)], requires_grad=True)
        loss = cross_entropy(logits, t)
        loss.backward()
        assert assert_ranks_agree(loss).isnan()
        assert_close_rel(logits.grad, ref_grad)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_label_smoothing(reduction):
    x, t = _data((3, 4, 12))
    fwd, bwd = _run(x, t, 2, (2,), ("tp",), [Shard(2)], reduction, label_smoothing=0.1)
    assert fwd == {ALL_REDUCE: 3} and bwd == 0


def test_ignore_index_that_is_a_real_class():
    x, t = _data((12, 8), ignore_every=100)
    t[::2] = 5
    fwd, _ = _run(x, t, 2, (2,), ("tp",), [Shard(1)], "mean", ignore_index=5)
    assert fwd == {ALL_REDUCE: 3}


def test_backward_outside_any_context():
    x, t = _data((2, 3, 17))  # uneven vocab shards (9, 8)
    ref, ref_grad = _reference(x, t, "mean")
    with local_ranks(2):
        mesh = make_mesh(2, ("tp",))
        logits = distribute(x, mesh, [Shard(-1)], requires_grad=True)
        loss = cross_entropy(logits, t)
    loss.backward()  # no LocalTensorMode, no loss_parallel, nothing
    with local_ranks(2):
        assert_close_rel(loss, ref)
        assert_close_rel(logits.grad, ref_grad)


def test_unnamed_2d_mesh_uses_world_group():
    x, t = _data((4, 8))
    fwd, bwd = _run(x, t, 4, (2, 2), None, [Shard(0), Shard(1)], "mean")
    assert fwd == {ALL_REDUCE: 3} and bwd == 0


def test_dp_replicate_tp_shard():
    x, t = _data((4, 8))
    fwd, _ = _run(x, t, 4, (2, 2), ("dp", "tp"), [Replicate(), Shard(1)], "sum")
    assert fwd == {ALL_REDUCE: 3}


@pytest.mark.parametrize("reduction,count", [("mean", 1), ("sum", 1), ("none", 0)])
def test_batch_sharded_only(reduction, count):
    x, t = _data((4, 3, 8))
    fwd, bwd = _run(x, t, 2, (2,), ("dp",), [Shard(0)], reduction)
    assert sum(fwd.values()) == count and bwd == 0


def test_replicated_logits_no_collectives():
    x, t = _data((4, 8))
    fwd, bwd = _run(x, t, 2, (2,), ("tp",), [Replicate()], "mean")
    assert fwd == {} and bwd == 0


def test_dtensor_target_is_redistributed_locally():
    x, t = _data((4, 3, 16))
    ref, _ = _reference(x, t, "mean")
    with local_ranks(4):
        mesh = make_mesh((2, 2), ("dp", "tp"))
        logits = distribute(x, mesh, [Shard(0), Shard(2)])
        tgt = distribute(t, mesh, [Replicate(), Replicate()])
        with CommDebugMode() as comm:
            loss = cross_entropy(logits, tgt)
        assert comm.get_comm_counts() == {ALL_REDUCE: 3}
        assert_close_rel(loss, ref)


def test_plain_tensors_match_f_cross_entropy():
    x, t = _data((2, 3, 7))
    for reduction in ("mean", "sum", "none"):
        out = cross_entropy(x, t, reduction=reduction)
        ref = F.cross_entropy(x.flatten(0, -2), t.flatten(), reduction=reduction)
        torch.testing.assert_close(out, ref.reshape(t.shape) if reduction == "none" else ref)


def test_bfloat16_logits():
    x, t = _data((4, 16))
    with local_ranks(2):
        mesh = make_mesh(2, ("tp",))
        loss = cross_entropy(distribute(x.bfloat16(), mesh, [Shard(1)]), t)
        assert loss.dtype == torch.bfloat16
        assert_close_rel(loss.float(), F.cross_entropy(x, t), tol=1e-2)


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_float64_logits_stay_float64(reduction, smoothing):
    """float64 logits: computed in float64 (no float32 round trip), loss and gradient within 1e-12 of
    F.cross_entropy (float32 would be ~1e-7); the gradient's one-hot term used to be float32 and failed."""
    x, t = _data((2, 5, 16))
    x = x.double()
    ref, ref_grad = _reference(x, t, reduction, label_smoothing=smoothing)
    with local_ranks(2):
        mesh = make_mesh(2, ("tp",))
        logits = distribute(x, mesh, [Shard(-1)], requires_grad=True)
        loss = cross_entropy(logits, t, reduction=reduction, label_smoothing=smoothing)
        assert loss.dtype == torch.float64
        loss.backward(torch.ones_like(loss))
        assert logits.grad.dtype == torch.float64
        if reduction != "none":
            assert_close_rel(loss, ref, tol=1e-12)
        assert_close_rel(logits.grad, ref_grad, tol=1e-12)


def test_errors():
    x, t = _data((4, 8))
    with pytest.raises(ValueError, match="reduction"):
        cross_entropy(x, t, reduction="avg")
    with pytest.raises(ValueError, match=r"target shape \(3,\)"):
        cross_entropy(x, t[:3])
    with local_ranks(4):
        mesh = make_mesh((2, 2), ("dp", "tp"))
        with pytest.raises(ValueError, match="at most one mesh dim"):
            cross_entropy(distribute(x, mesh, [Shard(1), Shard(1)]), t)
        with pytest.raises(ValueError, match=r"expected shape \(2,\).*got \(4,\)"):
            cross_entropy(distribute(x, mesh, [Shard(0), Shard(1)]), t)  # full target, sharded batch
        with pytest.raises(ValueError, match="Partial"):
            partial = DTensor.from_local(on_rank(distribute(x, mesh, [Replicate(), Shard(1)]).to_local(), 0),
                                         mesh, [Partial(), Shard(1)], run_check=False)
            cross_entropy(partial, t)
        with pytest.raises(ValueError, match="plain tensor"):
            cross_entropy(x, distribute(t, mesh, [Replicate(), Replicate()]))


def _handlers():
    return dict(dtensor_op_handlers())


def test_loss_parallel_wrapper_restores_after_exception_and_nests():
    before = _handlers()
    with pytest.raises(RuntimeError, match="boom"):
        with loss_parallel():
            assert _handlers() != before
            raise RuntimeError("boom")
    assert _handlers() == before
    with loss_parallel():
        with loss_parallel():
            pass
        assert _handlers() != before  # the inner exit must not unpatch
    assert _handlers() == before
    from torch.distributed.tensor.parallel import loss_parallel as torch_loss_parallel
    with torch_loss_parallel():  # inside torch's own: ours leaves the patch to the outer one
        with loss_parallel():
            pass
        assert _handlers() != before
    assert _handlers() == before


def test_loss_parallel_wrapper_runs_torch_path():
    x, t = _data((8, 16))
    ref, ref_grad = _reference(x, t, "mean")
    with local_ranks(2):
        mesh = make_mesh(2, ("tp",))
        logits = distribute(x, mesh, [Shard(1)], requires_grad=True)
        with loss_parallel():
            loss = F.cross_entropy(logits, t)
            loss.backward()  # torch's way: backward must be inside
        assert_close_rel(loss, ref)
        assert_close_rel(logits.grad, ref_grad)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_float64_logits_stay_float64(reduction):
    """float64 logits are computed in float64 (they were narrowed to fp32: 1e-8 off the one-device loss, which
    the zoo's float64 parity at 1e-9 caught), and their gradient is float64 to 1e-12."""
    x, t = _data((3, 6, 16))
    x = x.double()
    ref, ref_grad = _reference(x, t, reduction)
    with local_ranks(2):
        mesh = make_mesh((2,), ("tp",))
        logits = distribute(x, mesh, [Shard(2)], requires_grad=True)
        loss = cross_entropy(logits, t, reduction=reduction)
        loss.backward()
        assert loss.dtype == torch.float64 and logits.grad.dtype == torch.float64
        assert_close_rel(loss, ref, tol=1e-12)
        assert_close_rel(logits.grad, ref_grad, tol=1e-12)


def test_clip_norm_of_float64_grads():
    """clip_grad_norm_ on float64 gradients (it asked vector_norm to narrow them to fp32, which raises)."""
    from meshplan.training.clip import clip_grad_norm_
    p = torch.nn.Parameter(torch.ones(4, dtype=torch.float64))
    p.grad = torch.full((4,), 1.0 + 1e-12, dtype=torch.float64)
    assert clip_grad_norm_([p], 10.0, distributed=False) == pytest.approx(2 * (1.0 + 1e-12), rel=1e-15)
