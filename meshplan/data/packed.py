"""Fixed-length training samples cut from a token file: sample ``i`` is a function of ``(seed, i)`` only.

The token stream is cut into windows of ``seq_len + 1`` tokens that overlap by one (window ``j`` starts at
``j·seq_len``), so every token but the first is a target exactly once per epoch. A hash of ``(seed, j)`` puts a
window in the held-out split (:func:`~meshplan.data.order.held_out`); the training windows are read in a keyed
random order that changes every epoch (:func:`~meshplan.data.order.permute`). Documents are packed across window
boundaries as they come (Megatron's and nanoGPT's packing): ``position_ids`` restart after every end-of-document
token, which transformers reads as packed sequences and meshplan's context parallelism as document masks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from meshplan.data.order import held_out, permute, splitmix64
from meshplan.data.tokens import TokenFile

__all__ = ["PackedTokens"]


@dataclass(frozen=True)
class PackedTokens:
    """The packed samples of one token file.

    Args:
        tokens: the token file.
        seq_len: tokens per sample (inputs; each sample reads ``seq_len + 1``).
        seed: keys the split and the order.
        eval_fraction: the held-out share of windows (0 for none).

    Raises:
        ValueError: a corpus with fewer than one window, or a split left empty.

    Example::

        >>> data = PackedTokens(TokenFile.open("corpus.bin"), seq_len=512, seed=0)  # doctest: +SKIP
        >>> batch = data.batch(step=0, global_batch=8, data_rank=0, data_world=2)    # doctest: +SKIP
        >>> batch["input_ids"].shape                                                  # doctest: +SKIP
        torch.Size([4, 512])
    """

    tokens: TokenFile
    seq_len: int
    seed: int = 0
    eval_fraction: float = 0.0
    _splits: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        n = (len(self.tokens) - 1) // self.seq_len if self.seq_len > 0 else 0
        if n < 1:
            raise ValueError(f"corpus {self.tokens.path}: {len(self.tokens)} tokens, fewer than one sample of "
                             f"seq_len + 1 = {self.seq_len + 1}")
        evals = [j for j in range(n) if held_out(j, self.seed, self.eval_fraction)] if self.eval_fraction else []
        held = set(evals)
        self._splits["train"] = [j for j in range(n) if j not in held]
        self._splits["eval"] = evals
        if not self._splits["train"]:
            raise ValueError(f"corpus {self.tokens.path}: all {n} windows are held out by eval_fraction "
                             f"{self.eval_fraction}; lower it")

    def windows(self, split: str = "train") -> int:
        """How many windows the split holds (samples per epoch)."""
        return len(self._splits[split])

    def sample(self, i: int, split: str = "train") -> torch.Tensor:
        """Sample ``i`` of the split: ``seq_len + 1`` token ids (int64).

        Raises:
            ValueError: an empty split.
        """
        ws = self._splits[split]
        if not ws:
            raise ValueError(f"corpus {self.tokens.path}: the {split!r} split is empty (eval_fraction "
                             f"{self.eval_fraction} of {self.windows('train')} windows)")
        epoch, k = divmod(i, len(ws))
        key = splitmix64((self.seed << 20) ^ epoch ^ (0xE7A1 if split == "eval" else 0))
        start = ws[permute(k, len(ws), key)] * self.seq_len
        return self.tokens.tokens[start:start + self.seq_len + 1].to(torch.int64)

    def positions(self, x: torch.Tensor) -> torch.Tensor:
        """Position ids of inputs ``x`` (``(..., seq_len)``): they restart after each end-of-document id."""
        ar = torch.arange(x.shape[-1]).expand_as(x)
        if self.tokens.eos_id is None:
            return ar.clone()
        start = torch.zeros_like(x, dtype=torch.int64)
        start[..., 1:] = torch.where(x[..., :-1] == self.tokens.eos_id, ar[..., 1:], 0)
        return ar - start.cummax(dim=-1).values

    def batch(self, step: int, global_batch: int, data_rank: int = 0, data_world: int = 1,
              split: str = "train") -> dict[str, torch.Tensor]:
        """This data rank's share of step ``step``'s global batch: ``input_ids``, ``labels``, ``position_ids``.

        Step ``s`` holds samples ``s·global_batch …``; data rank ``r`` of ``d`` takes the contiguous
        ``global_batch / d`` of them from ``r·global_batch / d``, so every layout sees the same global batch.

        Raises:
            ValueError: a global batch the data ranks do not divide, or larger than the split.
        """
        if global_batch % data_world:
            raise ValueError(f"global batch {global_batch} is not divisible by the data-parallel size {data_world}")
        if global_batch > self.windows(split):
            raise ValueError(f"corpus {self.tokens.path}: the {split!r} split holds {self.windows(split)} samples "
                             f"of {self.seq_len + 1} tokens, fewer than one global batch of {global_batch}; "
                             f"use a larger corpus, a smaller global batch or a shorter seq_len")
        local = global_batch // data_world
        first = step * global_batch + data_rank * local
        seqs = torch.stack([self.sample(i, split) for i in range(first, first + local)])
        x = seqs[:, :-1]
        return {"input_ids": x, "labels": seqs[:, 1:], "position_ids": self.positions(x)}
