"""The one mask value both context-parallel methods read: its block answers agree with the dense keep-matrix."""

import itertools

import pytest
import torch

from meshplan.context_parallel.masks import AttentionMask

pytestmark = pytest.mark.fast

MASKS = [AttentionMask(causal=c, window=w) for c in (True, False) for w in (None, 1, 3, 7)]


@pytest.mark.parametrize("mask", MASKS, ids=repr)
def test_block_answers_match_dense(mask):
    pos = torch.arange(16)
    dense = mask.keep(pos, pos)
    dense = torch.ones(16, 16, dtype=torch.bool) if dense is None else dense
    for q_lo, q_hi, k_lo, k_hi in itertools.product(range(0, 16, 4), range(4, 17, 4), range(0, 16, 4), range(4, 17, 4)):
        if q_lo >= q_hi or k_lo >= k_hi:
            continue
        block = dense[q_lo:q_hi, k_lo:k_hi]
        assert mask.reaches(q_lo, q_hi, k_lo, k_hi) == bool(block.any())
        assert mask.covers(q_lo, q_hi, k_lo, k_hi) == bool(block.all())
        assert mask.pairs(q_lo, q_hi, k_lo, k_hi) == int(block.sum())


def test_window_follows_transformers_sliding_window():
    # transformers' sliding_window_overlay keeps kv_idx > q_idx - sliding_window
    m = AttentionMask(causal=True, window=3)
    keep = m.keep(torch.arange(6), torch.arange(6))
    assert keep[5].tolist() == [False, False, False, True, True, True]


def test_documents_and_plain():
    doc = torch.tensor([0, 0, 1, 1])
    keep = AttentionMask(causal=True).keep(torch.arange(4), torch.arange(4), doc, doc)
    assert keep.tolist() == [[True, False, False, False], [True, True, False, False],
                             [False, False, True, False], [False, False, True, True]]
    assert AttentionMask(causal=False).keep(torch.arange(3), torch.arange(3)) is None
    assert AttentionMask(causal=False).plain and not AttentionMask(causal=False, softcap=30.0).plain


@pytest.mark.parametrize("bad", [{"window": 0}, {"softcap": 0.0}, {"softcap": -1.0}])
def test_refuses_bad_values(bad):
    with pytest.raises(ValueError):
        AttentionMask(**bad)
