"""MoE blocks as token regions (``meshplan.expert_parallel.region``), tp ranks simulated in one process: a block
that returns a tuple (gpt-oss: ``(hidden, router_scores)``) has its first output put back on the residual stream
and its per-token extras gathered to the whole token set in one device's order, equal to one device on every tp
rank (forward and the input gradient, float64); an extra that is not per token (a scalar auxiliary loss) is
refused with the fix; the token region of an MoE block is its parent when that holds several (Ernie 4.5 VL)."""


import pytest
import torch
import torch.nn as nn

from _local import assert_close_rel, assert_ranks_agree, local_ranks, make_mesh, replicated
from meshplan import PlanError
from meshplan.expert_parallel.apply import token_region_of
from meshplan.expert_parallel.region import _input_hook, _output_hook
from meshplan.tensor_parallel.layouts import Stream

pytestmark = pytest.mark.fast

B, S, H, K = 2, 8, 4, 2


class TupleBlock(nn.Module):
    """Returns ``(hidden, per-token scores [B·S, K], per-token [B, S, K])`` like gpt-oss's GptOssMLP, plus an
    optional scalar (an auxiliary loss)."""

    def __init__(self, scalar: bool = False):
        super().__init__()
        self.w = nn.Parameter(torch.linspace(-1, 1, H * K, dtype=torch.float64).reshape(H, K))
        self.scalar = scalar

    def forward(self, x):
        scores = (x.reshape(-1, H) @ self.w).softmax(-1)
        out = (x * 2, scores, scores.reshape(*x.shape[:2], K))
        return out + ((scores.square().mean(),) if self.scalar else ())


def _run(block, x, sequence_parallel: bool, **kwargs):
    """The block as a token region on a tp 2 mesh, on the replicated input ``x`` (and ``kwargs``, replicated):
    its outputs (full tensors)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard
    mesh = make_mesh(2, ("tp",))
    stream = Stream(sequence_parallel, False)
    block.register_forward_pre_hook(_input_hook(mesh, stream, False), with_kwargs=True)
    block.register_forward_hook(_output_hook("layers.0.mlp", mesh, stream, False))
    xd = DTensor.from_local(replicated(x), mesh, (Replicate(),)).redistribute(
        mesh, (Shard(1) if sequence_parallel else Replicate(),))
    return block(xd, **{k: replicated(v) for k, v in kwargs.items()})


@pytest.mark.parametrize("sequence_parallel", [True, False])
def test_tuple_outputs_match_one_device(sequence_parallel):
    block, x = TupleBlock(), torch.randn(B, S, H, dtype=torch.float64)
    ref = block(x)
    with local_ranks(2):
        out = _run(block, x, sequence_parallel)
        assert len(out) == 3
        assert_close_rel(out[0], ref[0], tol=1e-12)  # back on the residual stream (a DTensor)
        for got, want in zip(out[1:], ref[1:]):  # whole token set, one device's order, on every tp rank
            assert tuple(got.shape) == tuple(want.shape)
            assert_close_rel(assert_ranks_agree(got), want, tol=1e-12)


class HashRouted(nn.Module):
    """Routes by token id like DeepSeek V4's hash router (``tid2eid[input_ids.reshape(-1)]``, ``input_ids=`` a
    keyword argument of the MoE block): the ids must be cut like the tokens."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.linspace(-1, 1, H * K, dtype=torch.float64).reshape(H, K))
        self.register_buffer("tid2eid", torch.tensor([[0], [1], [1], [0], [1]]))

    def forward(self, x, input_ids=None):
        scores = (x.reshape(-1, H) @ self.w).softmax(-1)
        picked = scores.gather(1, self.tid2eid[input_ids.reshape(-1)])  # [B·S, 1]: fails on uncut ids
        return x * picked.reshape(*x.shape[:2], 1)


@pytest.mark.parametrize("sequence_parallel", [True, False])
def test_a_per_token_keyword_input_is_cut_like_the_tokens(sequence_parallel):
    """deepseek_v4 at tp 2 × ep 2 (etp 1) raised 'index [16, 2] … self [8, 4]': keyword inputs stayed whole."""
    block, x = HashRouted(), torch.randn(B, S, H, dtype=torch.float64)
    ids = torch.arange(B * S).reshape(B, S) % 5
    ref = block(x, input_ids=ids)
    with local_ranks(2):
        out = _run(block, x, sequence_parallel, input_ids=ids)
        assert_close_rel(out, ref, tol=1e-12)


def test_gradient_through_an_extra_matches_one_device():
    block, x = TupleBlock(), torch.randn(B, S, H, dtype=torch.float64)
    block(x)[1].square().sum().backward()
    want = block.w.grad.clone()
    block.w.grad = None
    with local_ranks(2):
        _run(block, x, True)[1].square().sum().backward()
        grad = block.w.grad  # each tp rank: its own tokens' share; the model's tp grad sync sums them
        from _local import rank_values
        total = sum(rank_values(grad).values())
    assert torch.allclose(total, want, rtol=1e-12, atol=0)


def test_a_scalar_extra_is_refused_with_the_fix():
    block, x = TupleBlock(scalar=True), torch.randn(B, S, H, dtype=torch.float64)
    with local_ranks(2), pytest.raises(PlanError, match=r"MoE block layers.0.mlp returns output\[3\] of shape \(\), "
                                                        r"not per token .*set layout.etp = tp"):
        _run(block, x, True)


def test_a_flattened_first_output_is_refused():
    class Flat(nn.Module):
        def forward(self, x):
            return x.flatten(), x.sum()
    with local_ranks(2), pytest.raises(PlanError, match=r"MoE block layers.0.mlp returned \(32,\) for its input "
                                                        r"\(2, 4, 4\); a token region needs"):
        _run(Flat(), torch.randn(B, S, H, dtype=torch.float64), True)


def test_the_region_is_the_parent_holding_several_blocks():
    regions = token_region_of(["layers.1.mlp.text_moe", "layers.1.mlp.vision_moe", "layers.2.mlp", "moe"])
    assert regions == {"layers.1.mlp.text_moe": "layers.1.mlp", "layers.1.mlp.vision_moe": "layers.1.mlp",
                       "layers.2.mlp": "layers.2.mlp", "moe": "moe"}


def test_stand_in_keeps_a_tuple_blocks_arity():
    """The split probe's and shadow run's stand-in for an MoE block returns what the block's caller unpacks:
    gpt-oss's decoder layer does ``hidden, _ = self.mlp(x)`` (its MLP ends ``return hidden_states, router_scores``)."""
    from meshplan.expert_parallel.apply import stand_in

    class GptOssLike(nn.Module):
        def forward(self, x):
            scores = x.reshape(-1, H).softmax(-1)
            return x * 2, scores
    x = torch.randn(3, 8, H)
    block, plain = GptOssLike(), nn.Linear(H, H)
    stand_in(block)
    stand_in(plain)
    hidden, _ = block(x)
    assert hidden.shape == x.shape and plain(x).shape == x.shape


class FlatHidden(nn.Module):
    """Returns ``(hidden [B·S, H], router logits [B·S, K])`` like Llama 4's Llama4TextMoe (its decoder layer
    reshapes the hidden to the residual's shape)."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.linspace(-1, 1, H * K, dtype=torch.float64).reshape(H, K))

    def forward(self, x):
        h = x.reshape(-1, H)
        logits = h @ self.w
        return h * logits.sum(-1, keepdim=True), logits


@pytest.mark.parametrize("sequence_parallel", [True, False])
def test_a_flattened_hidden_output_matches_one_device(sequence_parallel):
    """llama4_text at tp 2 was refused ('returned (8, 4) for its input (1, 8, 4)'): a [B·S, hidden] first output
    goes back on the residual stream: as [B, S, hidden] on a sequence-parallel (DTensor) stream, flattened again
    on a plain one, equal to one device's."""
    block, x = FlatHidden(), torch.randn(B, S, H, dtype=torch.float64)
    ref = block(x)
    shape = (B, S, H) if sequence_parallel else (B * S, H)
    with local_ranks(2):
        out = _run(block, x, sequence_parallel)
        assert tuple(out[0].shape) == shape
        assert_close_rel(out[0], ref[0].reshape(shape), tol=1e-12)
        assert_close_rel(assert_ranks_agree(out[1]), ref[1], tol=1e-12)
