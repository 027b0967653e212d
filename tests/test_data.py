"""Training data: token files, the keyed sample order, packing, the held-out split and the text corpus cache."""

import json

import pytest
import torch

from meshplan.data import PackedTokens, TokenFile, tokenize_corpus, write_tokens
from meshplan.data.order import held_out, permute

pytestmark = pytest.mark.fast


@pytest.mark.parametrize("n", [1, 2, 3, 7, 16, 100, 1000, 4097])
def test_permute_is_a_bijection(n):
    for key in (0, 1, 12345):
        assert sorted(permute(i, n, key) for i in range(n)) == list(range(n))


def test_permute_keys_differ_and_refuse_outside():
    assert [permute(i, 100, 1) for i in range(100)] != [permute(i, 100, 2) for i in range(100)]
    with pytest.raises(ValueError, match="outside 0..9"):
        permute(10, 10, 0)


def test_held_out_fraction():
    n, f = 20000, 0.1
    got = sum(held_out(j, 3, f) for j in range(n))
    sigma = (n * f * (1 - f)) ** 0.5
    assert abs(got - n * f) < 6 * sigma  # fixed: six binomial standard deviations of a 0.1 split of 20000


def test_token_file_round_trip_and_mismatch(tmp_path):
    tf = write_tokens(tmp_path / "c.bin", [[1, 2, 3], [4]], vocab_size=10, eos_id=0)
    assert tf.tokens.tolist() == [1, 2, 3, 0, 4, 0] and tf.meta["documents"] == 2
    assert TokenFile.open(tmp_path / "c.bin").tokens.dtype == torch.uint16
    side = json.loads((tmp_path / "c.json").read_text())
    (tmp_path / "c.json").write_text(json.dumps({**side, "count": 7}))
    with pytest.raises(ValueError, match="12 bytes, but c.json says 7 tokens"):
        TokenFile.open(tmp_path / "c.bin")
    with pytest.raises(ValueError, match="token id 10 outside the vocabulary 0..9"):
        write_tokens(tmp_path / "d.bin", [[10]], vocab_size=10, eos_id=None)
    with pytest.raises(ValueError, match="needs e.bin and e.json"):
        TokenFile.open(tmp_path / "e.bin")


def _data(tmp_path, n_tokens=1000, seq=8, **kw):
    docs = [list(range(1 + d, 1 + d + 13)) for d in range(0, n_tokens, 14)]
    return PackedTokens(write_tokens(tmp_path / "c.bin", docs, vocab_size=2000, eos_id=0), seq_len=seq, **kw)


def test_every_token_is_a_target_once_per_epoch(tmp_path):
    data = _data(tmp_path)
    n = data.windows()
    targets = torch.cat([data.sample(i)[1:] for i in range(n)])
    stream = data.tokens.tokens.to(torch.int64)
    assert sorted(targets.tolist()) == sorted(stream[1:1 + n * data.seq_len].tolist())
    assert [data.sample(i).tolist() for i in range(n)] != [data.sample(n + i).tolist() for i in range(n)]


def test_batches_are_layout_invariant(tmp_path):
    data = _data(tmp_path, seed=5)
    whole = data.batch(3, 8)
    parts = [data.batch(3, 8, data_rank=r, data_world=4) for r in range(4)]
    for k in whole:
        assert torch.equal(whole[k], torch.cat([p[k] for p in parts]))
    again = _data(tmp_path, seed=5).batch(3, 8)
    assert all(torch.equal(whole[k], again[k]) for k in whole)
    assert torch.equal(whole["labels"][:, :-1], whole["input_ids"][:, 1:])


def test_positions_restart_after_each_document():
    tf = TokenFile(path=None, tokens=torch.tensor([5, 6, 0, 7, 8, 9, 0, 4]), vocab_size=10, eos_id=0, meta={})
    data = PackedTokens(tf, seq_len=7)
    assert data.positions(data.sample(0)[:-1]).tolist() == [0, 1, 2, 0, 1, 2, 3]


def test_split_and_refusals(tmp_path):
    data = _data(tmp_path, seed=1, eval_fraction=0.25)
    train, held = set(data._splits["train"]), set(data._splits["eval"])
    assert held and not train & held and len(train | held) == (len(data.tokens) - 1) // 8
    assert data.batch(0, 2, split="eval")["input_ids"].shape == (2, 8)
    with pytest.raises(ValueError, match=r"holds \d+ samples of 9 tokens, fewer than one global batch of 1000"):
        data.batch(0, 1000)
    with pytest.raises(ValueError, match="not divisible by the data-parallel size 3"):
        data.batch(0, 8, data_world=3)
    with pytest.raises(ValueError, match="fewer than one sample of seq_len \\+ 1 = 2001"):
        _data(tmp_path, seq=2000)


def test_corpus_is_tokenized_once(tmp_path):
    (tmp_path / "a.txt").write_text("hello world")
    (tmp_path / "b.jsonl").write_text('{"text": "one"}\n\n{"text": "two three"}\n')
    calls = []

    def encode(text):
        calls.append(text)
        return [len(w) for w in text.split()]

    tf = tokenize_corpus(tmp_path, encode, vocab_size=50, eos_id=0, tokenizer_id="words")
    assert tf.tokens.tolist() == [5, 5, 0, 3, 0, 3, 5, 0] and len(calls) == 3
    assert tokenize_corpus(tmp_path, encode, vocab_size=50, eos_id=0, tokenizer_id="words").path == tf.path
    assert len(calls) == 3  # cached
    (tmp_path / "c.jsonl").write_text('{"txt": 1}\n')
    with pytest.raises(ValueError, match=r"c.jsonl:1: expected an object with a string 'text'"):
        tokenize_corpus(tmp_path, encode, vocab_size=50, eos_id=0, tokenizer_id="words")
    with pytest.raises(ValueError, match="no such file or folder"):
        tokenize_corpus(tmp_path / "nope", encode, vocab_size=50, eos_id=0, tokenizer_id="words")
