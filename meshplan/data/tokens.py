"""A pre-tokenized corpus on disk: one flat file of token ids, memory-mapped (the nanoGPT/Megatron style).

``NAME.bin`` holds the ids back to back (``uint16`` when the vocabulary fits, else ``int32``); ``NAME.json`` says the
dtype, the count, the vocabulary size and the end-of-document id, and where the tokens came from. Reading maps the
file: a rank touches only the pages of the windows it reads, so a corpus larger than memory costs nothing to open.
"""

from __future__ import annotations

import json
import mmap
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import torch

__all__ = ["TokenFile", "write_tokens"]

_DTYPES = {"uint16": torch.uint16, "int32": torch.int32}


@dataclass(frozen=True)
class TokenFile:
    """A memory-mapped token file and what its sidecar says.

    Attributes:
        path: the ``.bin`` file.
        tokens: a 1-D tensor over the mapped file (no copy; read-only by convention).
        vocab_size: the vocabulary the ids were written for.
        eos_id: the id that ends each document, or None (documents not marked).
        meta: the whole sidecar (source, tokenizer, document count, …).
    """

    path: Path
    tokens: torch.Tensor
    vocab_size: int
    eos_id: int | None
    meta: dict

    @classmethod
    def open(cls, path: str | Path) -> "TokenFile":
        """Map ``path`` (``X.bin``, its sidecar ``X.json`` beside it).

        Raises:
            ValueError: a missing file or sidecar, or a file whose size disagrees with its sidecar.
        """
        path = Path(path)
        side = path.with_suffix(".json")
        if not path.is_file() or not side.is_file():
            raise ValueError(f"token file {path}: needs {path.name} and {side.name} side by side "
                             f"(write them with meshplan.data.write_tokens)")
        meta = json.loads(side.read_text())
        dtype = _DTYPES.get(meta.get("dtype"))
        count = int(meta.get("count", -1))
        if dtype is None or count * dtype.itemsize != path.stat().st_size:
            raise ValueError(f"token file {path}: {path.stat().st_size} bytes, but {side.name} says "
                             f"{count} tokens of {meta.get('dtype')!r}; rewrite it")
        tokens = torch.empty(0, dtype=dtype)
        if count:
            with open(path, "rb") as f:
                mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)  # private pages: nothing writes the file
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                tokens = torch.frombuffer(mm, dtype=dtype, count=count)
        return cls(path, tokens, int(meta["vocab_size"]), meta.get("eos_id"), meta)

    def __len__(self) -> int:
        return self.tokens.numel()


def write_tokens(path: str | Path, docs: Iterable[list[int]], *, vocab_size: int, eos_id: int | None,
                 meta: dict[str, Any] | None = None) -> TokenFile:
    """Write documents of token ids as one token file, ``eos_id`` after each document.

    Args:
        path: the ``.bin`` file to write (its ``.json`` sidecar goes beside it); written to a temporary name and
            renamed, so a crash leaves no half file under the real name.
        docs: the documents, each a list of ids below ``vocab_size``.
        vocab_size: the vocabulary size (ids must be below it).
        eos_id: appended after every document, or None.
        meta: more facts for the sidecar (source files, tokenizer).

    Returns:
        The written file, mapped.

    Raises:
        ValueError: an id outside ``[0, vocab_size)``.
    """
    path = Path(path)
    dtype = "uint16" if vocab_size <= 1 << 16 else "int32"
    tmp = path.with_suffix(".bin.tmp")
    count = n_docs = 0
    with open(tmp, "wb") as f:
        for doc in docs:
            ids = list(doc) + ([eos_id] if eos_id is not None else [])
            bad = [t for t in ids if not 0 <= t < vocab_size]
            if bad:
                raise ValueError(f"{path}: document {n_docs} has token id {bad[0]} outside the vocabulary "
                                 f"0..{vocab_size - 1}")
            t = torch.tensor(ids, dtype=torch.int64).to(_DTYPES[dtype])
            f.write(bytes(t.untyped_storage()))
            count, n_docs = count + len(ids), n_docs + 1
    side = {"dtype": dtype, "count": count, "documents": n_docs, "vocab_size": vocab_size, "eos_id": eos_id,
            **(meta or {})}
    path.with_suffix(".json").write_text(json.dumps(side, indent=1, sort_keys=True))
    tmp.replace(path)
    return TokenFile.open(path)
