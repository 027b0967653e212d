"""A checkpointed block's recompute under context parallelism sees its own forward's state
(:mod:`meshplan.context_parallel.replay`); attention recomputed outside meshplan's checkpoint is refused."""

from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from meshplan.context_parallel.replay import checkpoint_contexts, refuse_outside, replaying, snapshot
from meshplan.errors import PlanError

pytestmark = pytest.mark.fast


class _Owner(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("table", torch.arange(8.0))


def _runtime(owner=None, documents=None):
    swapped = [(owner, "table", owner.table)] if owner is not None else []
    return SimpleNamespace(local_len=4, documents=documents, keeps={"k": 1}, buffer="table" if owner else None,
                           forwarding=1, replaying=0, _swapped=swapped)


def test_replaying_puts_the_forwards_state_back_and_takes_it_away():
    owner = _Owner()
    rt = _runtime(owner, documents=torch.zeros(1, 8))
    owner.table = torch.tensor([4.0, 5.0])  # the rows the root hook swapped in for this forward
    snap = snapshot(rt)
    owner.table = rt._swapped[0][2]  # the forward ended: the full table is back
    rt.local_len, rt.documents, rt.keeps, rt.forwarding = 2, None, {}, 0  # a later forward's state
    with replaying(rt, snap):
        assert torch.equal(owner.table, torch.tensor([4.0, 5.0])) and rt.local_len == 4 and rt.replaying == 1
        assert rt.keeps == {"k": 1} and rt.documents is snap.documents
    assert torch.equal(owner.table, torch.arange(8.0)) and rt.local_len == 2 and rt.documents is None
    assert rt.replaying == 0 and rt.keeps == {}


def test_checkpoint_contexts_carry_the_rows_to_the_recompute():
    """torch's checkpoint with the pair: the recompute reads the rows its forward read, not the table's."""
    owner = _Owner()
    rt = _runtime(owner)
    w = torch.ones(2, requires_grad=True)
    seen = []

    def block(x):
        seen.append(owner.table.clone())
        return (x * w * owner.table[:2]).sum()

    owner.table = torch.tensor([4.0, 5.0])
    out = checkpoint(block, torch.ones(2), use_reentrant=False, context_fn=checkpoint_contexts(rt))
    owner.table = torch.arange(8.0)  # the root's forward hook put the full table back
    rt.forwarding = 0
    out.backward()
    assert [t.tolist() for t in seen] == [[4.0, 5.0], [4.0, 5.0]] and w.grad.tolist() == [4.0, 5.0]
    assert torch.equal(owner.table, torch.arange(8.0))


def test_checkpoint_contexts_wrap_a_selective_policy():
    from meshplan.recompute import context_fn
    rt = _runtime()
    fwd, _ = checkpoint_contexts(rt, context_fn([torch.ops.aten.mm.default], None))()
    x = torch.ones(2, 2, requires_grad=True)
    out = checkpoint(lambda t: (t @ t).sum(), x, use_reentrant=False,
                     context_fn=checkpoint_contexts(rt, context_fn([torch.ops.aten.mm.default], None)))
    out.backward()
    assert x.grad.tolist() == [[4.0, 4.0], [4.0, 4.0]] and type(fwd).__name__ == "_Both"


def test_attention_outside_a_forward_is_refused_only_with_per_forward_state():
    owner = _Owner()
    refuse_outside(_runtime(), "layers.0.attention")  # inside a forward
    plain = _runtime()
    plain.forwarding = 0
    refuse_outside(plain, "layers.0.attention")  # no buffer, no documents: nothing per forward
    with_table = _runtime(owner)
    with_table.forwarding = 0
    with pytest.raises(PlanError, match=r"layers.0.attention ran outside the model's forward.*rows of table.*"
                                        r"blocks.activation_checkpointing"):
        refuse_outside(with_table, "layers.0.attention")
    docs = _runtime(documents=torch.zeros(1, 4))
    docs.forwarding = 0
    with pytest.raises(PlanError, match="packed documents"):
        refuse_outside(docs, "a")
    docs.replaying = 1
    refuse_outside(docs, "a")  # meshplan's recompute, given its forward's documents
