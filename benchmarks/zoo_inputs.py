"""The zoo's keyword inputs: packed documents under cp (``cpdoc``), position ids and a padding mask under pp (``ppkw``).

The other axes feed the token ids alone. These two feed a dict of keyword arguments (the ones the model's
``forward`` names), the same on one device and on the ranks:

* ``cpdoc``: the rows pack documents of :data:`DOCS` tokens (``position_ids`` restarting per document, no
  ``attention_mask``, ``use_cache: False``): transformers masks the documents apart on one device
  (``masking_utils.find_packed_sequence_indices``); every length is a multiple of ``2·cp = 4``, so context
  parallelism lays the batch out per document, balanced by work (``context_parallel/documents.py``), where no
  layer has a sliding window.
* ``ppkw``: ``position_ids`` (starting at :data:`OFFSET`) and a right-padded 2-D ``attention_mask``
  (:data:`PADS` masked tokens at the end of each row: no query is left without a key), which every pipeline
  stage gets (``pipeline/inputs.py``).
"""

from __future__ import annotations

import inspect
from typing import Any

#: document lengths per row (``ROWS`` rows of ``SEQ`` tokens; each a multiple of 2·cp for cp 2)
DOCS = ((4, 12), (8, 4, 4), (16,), (12, 4))
#: ``ppkw``: the first position id, and the masked tokens at the end of each row
OFFSET, PADS = 3, (0, 2, 5, 1)
KW_AXES = ("cpdoc", "ppkw")


def _names(model) -> tuple[str | None, set[str]]:
    """The forward's first positional parameter (the token ids) and every named parameter."""
    params = list(inspect.signature(model.forward).parameters.values())
    first = next((p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)), None)
    return first, {p.name for p in params if p.kind is not p.VAR_KEYWORD}


def packed_positions(rows: int, seq: int):
    """``(rows, seq)`` position ids restarting per document of :data:`DOCS` (row ``i`` uses ``DOCS[i % 4]``)."""
    import torch
    out = [torch.cat([torch.arange(n) for n in DOCS[i % len(DOCS)]]) for i in range(rows)]
    assert all(len(r) == seq for r in out), (seq, DOCS)
    return torch.stack(out)


def step_inputs(model, axis: str, x) -> tuple[Any, str | None]:
    """``(inputs, why_not)``: the token ids ``x`` alone (the other axes), or the axis' keyword inputs; ``why_not``
    says why the model cannot take them (then the axis is ``-``)."""
    import torch
    if axis not in KW_AXES:
        return x, None
    first, names = _names(model)
    if first is None or "position_ids" not in names:
        return x, f"{type(model).__name__}.forward takes no position_ids"
    rows, seq = x.shape
    kw: dict = {first: x}
    if axis == "cpdoc":
        kw["position_ids"] = packed_positions(rows, seq)
    else:
        kw["position_ids"] = torch.arange(OFFSET, OFFSET + seq).expand(rows, seq).contiguous()
        if "attention_mask" in names:
            kw["attention_mask"] = (torch.arange(seq)[None, :] < seq - torch.tensor(PADS)[:rows, None]).long()
    if "use_cache" in names:
        kw["use_cache"] = False
    return kw, None


def rows_of(inputs: Any, lo: int, hi: int) -> Any:
    """Rows ``lo:hi`` of the token ids or of every per-row tensor of a keyword dict (other values whole)."""
    import torch
    if not isinstance(inputs, dict):
        return inputs[lo:hi]
    return {k: v[lo:hi] if isinstance(v, torch.Tensor) and v.dim() else v for k, v in inputs.items()}


def call(model, inputs: Any):
    """The model on ``inputs``: keyword arguments for a dict, else the token ids."""
    return model(**inputs) if isinstance(inputs, dict) else model(inputs)
