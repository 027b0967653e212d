"""Training data: text corpora tokenized once into memory-mapped token files, packed into fixed-length samples
whose order is a function of ``(seed, sample index)`` only (any layout, any resume sees the same batches)."""

from meshplan.data.corpus import corpus_files, tokenize_corpus
from meshplan.data.packed import PackedTokens
from meshplan.data.tokens import TokenFile, write_tokens

__all__ = ["PackedTokens", "TokenFile", "corpus_files", "tokenize_corpus", "write_tokens"]
