"""Text on disk to a token file: ``.txt`` files (one document each) and ``.jsonl`` files (one document per line),
tokenized once with the model's own tokenizer and cached beside the data.

The cache's name is a hash of the files (names, sizes, modification times) and of the tokenizer, so a changed
corpus or tokenizer is tokenized again and an unchanged one is mapped at once.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Callable, Iterator

from meshplan.data.tokens import TokenFile, write_tokens

__all__ = ["corpus_files", "tokenize_corpus"]

TEXT_SUFFIXES = (".txt", ".md", ".jsonl")


def corpus_files(folder: str | Path) -> list[Path]:
    """The corpus files under ``folder`` (recursively, sorted), or the one file ``folder`` names.

    Raises:
        ValueError: a missing path, or a folder with no ``.txt``/``.md``/``.jsonl`` file.
    """
    folder = Path(folder)
    if folder.is_file():
        return [folder]
    if not folder.is_dir():
        raise ValueError(f"data {folder}: no such file or folder")
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES
                   and ".meshplan" not in p.parts)
    if not files:
        raise ValueError(f"data {folder}: no {'/'.join(TEXT_SUFFIXES)} file in it")
    return files


def _documents(files: list[Path], key: str) -> Iterator[str]:
    for path in files:
        if path.suffix != ".jsonl":
            yield path.read_text(encoding="utf-8")
            continue
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"data {path}:{n}: not JSON ({e.msg})") from None
            if not isinstance(row, dict) or not isinstance(row.get(key), str):
                raise ValueError(f"data {path}:{n}: expected an object with a string {key!r}; "
                                 f"got {type(row).__name__} with keys {sorted(row)[:5] if isinstance(row, dict) else []}")
            yield row[key]


def tokenize_corpus(folder: str | Path, encode: Callable[[str], list[int]], *, vocab_size: int, eos_id: int | None,
                    tokenizer_id: str, cache: str | Path | None = None, text_key: str = "text") -> TokenFile:
    """The token file of a text corpus, tokenized now or read from the cache.

    Args:
        folder: a corpus folder or file.
        encode: text → token ids (the model's tokenizer, without special tokens).
        vocab_size: the model's vocabulary size (every id must be below it).
        eos_id: the end-of-document id appended after each document, or None.
        tokenizer_id: names the tokenizer in the cache key (its folder and vocabulary hash).
        cache: the cache folder; default ``<folder>/.meshplan`` (``<file's folder>/.meshplan`` for a file).
        text_key: the JSONL field holding the text.

    Returns:
        The memory-mapped token file.

    Raises:
        ValueError: a missing or empty corpus, a bad JSONL line, an id the vocabulary does not hold.
    """
    files = corpus_files(folder)
    root = Path(folder) if Path(folder).is_dir() else Path(folder).parent
    h = hashlib.sha256(json.dumps([tokenizer_id, vocab_size, eos_id, text_key] +
                                  [[str(p), p.stat().st_size, p.stat().st_mtime_ns] for p in files]).encode())
    out = Path(cache or root / ".meshplan") / f"tokens-{h.hexdigest()[:16]}.bin"
    if out.is_file() and out.with_suffix(".json").is_file():
        return TokenFile.open(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    docs = (encode(text) for text in _documents(files, text_key))
    return write_tokens(out, docs, vocab_size=vocab_size, eos_id=eos_id,
                        meta={"source": str(Path(folder).resolve()), "files": len(files), "tokenizer": tokenizer_id})
