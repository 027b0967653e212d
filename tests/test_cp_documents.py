"""Packed documents laid out per document (document-major order, balanced by work): the layout's arithmetic, the
batch it shards, and both cp methods on it equal to one dense attention in true order (float64, fixed tolerance).
The transformers Llama under it, trained by ``train_step``: tests/dist/cp_worker.py (``*_by_docs`` cases)."""

import pytest
import torch

from test_cp_ring import close, dense, inputs, run_ring
from test_cp_windows import _ranks
from meshplan.context_parallel.batch import documents_of, position_ids_of, shard_batch
from meshplan.context_parallel.chunks import document_pairs, document_positions, rank_positions
from meshplan.context_parallel.documents import document_index, document_order, virtual_documents
from meshplan.context_parallel.masks import AttentionMask

pytestmark = pytest.mark.fast

#: per batch row, mixed lengths (multiples of 8: cp 2 and cp 4), one row a single document
ROWS = [[8, 16, 8], [32], [24, 8]]


def _ids(rows=ROWS):
    return torch.cat([position_ids_of(lengths) for lengths in rows])


def _orders(cp, rows=ROWS):
    return torch.tensor([document_order(lengths, cp) for lengths in rows])


def test_order_holds_each_documents_head_and_tail_on_every_rank():
    for cp in (2, 4):
        for lengths in ROWS:
            order = document_order(lengths, cp)
            assert sorted(order) == list(range(sum(lengths)))
            for r in range(cp):
                held = [order[p] for p in rank_positions(sum(lengths), cp, r, True)]
                assert sorted(held) == sorted(document_positions(lengths, cp, r))
    assert document_order([4, 6], 2) is None


@pytest.mark.parametrize("cp", [2, 4])
def test_document_index_balances_kept_pairs(cp):
    index = [document_index(_ids(), cp, r) for r in range(cp)]
    for row, lengths in enumerate(ROWS):
        work = [document_pairs(index[r][row].tolist(), lengths) for r in range(cp)]
        assert len(set(work)) == 1, work  # the row layout gives [52, 76] at cp 2 for row 0
    assert document_index(_ids([[8, 16, 8], [30, 2]]), 2, 0) is None  # a length not a multiple of 4: row layout
    assert document_index(_ids([[32]]), 2, 0) is None  # one document: the row layout is the same


def test_virtual_documents_from_gathered_ids():
    ids = _ids()
    virtual = ids.gather(1, _orders(2))
    docs = virtual_documents(virtual, 2)
    assert torch.equal(docs, documents_of(ids).gather(1, _orders(2)))
    with pytest.raises(ValueError, match="not in document-major order"):
        virtual_documents(ids, 2)  # the row order of a packed row


def test_shard_batch_moves_labels_and_positions_with_their_tokens():
    ids = _ids()
    tokens = torch.arange(3 * 32).view(3, 32)
    batch = {"input_ids": tokens, "labels": tokens + 1000, "position_ids": ids}
    for r in range(2):
        x, y, shift = shard_batch(batch, batch["labels"], cp=2, rank=r, load_balance=True, documents="position_ids")
        want = document_index(ids, 2, r)
        assert torch.equal(x["input_ids"], tokens.gather(1, want)) and torch.equal(y, x["labels"])
        assert torch.equal(x["position_ids"], ids.gather(1, want)) and torch.equal(x["labels"], x["input_ids"] + 1000)
    x, _, _ = shard_batch(batch, batch["labels"], cp=2, rank=0, load_balance=True)  # not asked: the row layout
    assert torch.equal(x["input_ids"], tokens[:, rank_positions(32, 2, 0, True)])


def _qkvd(kv_heads):
    """q, k, v, dout with 3 batch rows (one per row of ROWS), float64."""
    return [torch.cat([t, t[:1].flip(-2)]) for t in inputs(kv_heads=kv_heads)]


def _virtual(t, order):
    return t.gather(2, order[:, None, :, None].expand(-1, t.shape[1], -1, t.shape[-1]))


def _true(t, order):
    return torch.empty_like(t).scatter_(2, order[:, None, :, None].expand(-1, t.shape[1], -1, t.shape[-1]), t)


MASKS = [AttentionMask(), AttentionMask(softcap=2.0)]


@pytest.mark.parametrize("mask", MASKS, ids=repr)
@pytest.mark.parametrize("cp", [2, 4])
def test_ring_in_document_major_order_equals_one_device(cp, mask):
    """The ring on the virtual order with virtual document ids: forward and q/k/v grads equal dense attention over
    the true order with true document ids (the layout changes which rank computes what, not the result)."""
    q, k, v, dout = _qkvd(2)
    order, scale = _orders(cp), q.shape[-1] ** -0.5
    truth = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = dense(*truth, mask, scale, documents_of(_ids()))
    want = torch.autograd.grad(ref, truth, dout)
    docs = virtual_documents(_ids().gather(1, order), cp)
    res = run_ring(cp, True, mask, *(_virtual(t, order) for t in (q, k, v, dout)), documents=docs)
    got = [torch.zeros_like(_virtual(t, order)) for t in (q, q, k, v)]
    for idx, *parts in res.values():
        for g, p in zip(got, parts):
            g[:, :, idx] = p
    assert close(_true(got[0], order), ref.detach())
    for g, w in zip(got[1:], want):
        assert close(_true(g, order), w)


@pytest.mark.parametrize("mask", MASKS, ids=repr)
@pytest.mark.parametrize("cp", [2, 4])
def test_allgather_in_document_major_order_equals_one_device(monkeypatch, cp, mask):
    q, k, v, dout = _qkvd(4)
    order = _orders(cp)
    truth = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = dense(*truth, mask, q.shape[-1] ** -0.5, documents_of(_ids()))
    want = torch.autograd.grad(ref, truth, dout)
    virt = [_virtual(t, order).requires_grad_() for t in (q, k, v)]
    docs = virtual_documents(_ids().gather(1, order), cp)
    local = torch.arange(32 // cp)
    out = _ranks(monkeypatch, *virt, cp, True, False, attn_mask=mask.keep(local, local), mask=mask, documents=docs)
    assert close(_true(out.detach(), order), ref.detach())
    for g, w in zip(torch.autograd.grad(out, virt, _virtual(dout, order)), want):
        assert close(_true(g, order), w)


def test_benchmark_smoke():
    """benchmarks/cp.py --documents at a tiny size: every rank's kept pairs equal under the work layout."""
    from benchmarks.cp_documents import main
    text = main(["--seq", "256", "--cp", "2", "--steps", "1", "--rows", "long first"])
    rows = [line.split(" | ") for line in text.splitlines() if line.startswith("| long first")]
    assert [(r[3], r[4], r[6]) for r in rows] == [("tokens", "allgather_kv", "3.15"), ("tokens", "ring", "3.15"),
                                                  ("work", "allgather_kv", "1.00"), ("work", "ring", "1.00")]


def test_layout_only_where_the_runtime_masks_documents():
    """The per-document layout needs documents read as packing, a method that takes them, batch positions and no
    window (a window measures true distances, which the layout stretches): otherwise the row layout."""
    from meshplan.context_parallel.runtime import CpRuntime
    rt = CpRuntime(group=None, cp=2, rank=0, load_balance=True, seq_dim=1, attend=None, positions_kwarg="position_ids",
                   buffer=None, buffer_dim=0, patterns=("a",), attention_paths=("a",), inject_mask=True,
                   layer_masks={"a": None})
    ids = {"position_ids": _ids()}
    assert rt.documents_layout_possible(ids)
    assert not rt.documents_layout_possible({**ids, "use_cache": True})
    assert not rt.documents_layout_possible({**ids, "attention_mask": torch.ones(3, 32)})
    assert not rt.documents_layout_possible({"input_ids": _ids()})
    for other in ({"layer_masks": {"a": AttentionMask(window=8)}}, {"masked": False}, {"buffer": "freqs"}):
        assert not CpRuntime(**{**rt.__dict__, **other}).documents_layout_possible(ids), other
