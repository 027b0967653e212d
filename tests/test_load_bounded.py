"""Bad checkpoints are refused before anything large is allocated (issue 27): a model of about 4.8 GB fp32 built
on the meta device, and checkpoints whose headers describe it with one flaw each (a shape, a missing key, an extra
key, a dtype that cannot be cast). :func:`meshplan.load` (DCP metadata) and :func:`meshplan.load_safetensors`
(the files' headers) refuse from the headers alone, naming the tensor, the numbers and the file: afterwards the
model's parameters are still on the meta device and this process's peak RSS grew by less than ``MAX_PEAK``.

The checkpoints hold headers only: a DCP folder whose ``.metadata`` describes every tensor (no shard files), a
safetensors file whose header describes every tensor and whose data is a hole (a sparse file), so the tests cost
neither disk nor memory.
"""

import dataclasses
import json
import pickle
import struct
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex, TensorProperties,
                                                   TensorStorageMetadata)

import llama
import meshplan
from meshplan import PlanError
from meshplan.checkpoint.safe_read import read_metadata

pytestmark = pytest.mark.fast

#: the most a refusal may add to this process's peak RSS (the model: 4.8 GB)
MAX_PEAK = 64 * 2**20
BIG = llama.tiny_args(dim=2048, n_layers=16, n_heads=16, n_kv_heads=16, ffn_dim=8192, vocab_size=32000,
                      max_seq_len=256)
ST_DTYPES = {torch.float32: "F32", torch.complex64: "C64", torch.int64: "I64"}
#: each flaw: (what it does to {name: (shape, dtype)}, what the error says for DCP, for safetensors)
FLAWS = {
    "shape": (lambda h: h.update({"layers.3.attention.wq.weight": ((2048, 1024), torch.float32)}),
              r"model.layers.3.attention.wq.weight: checkpoint shape \(2048, 1024\), model \(2048, 2048\)",
              r"big.safetensors: layers.3.attention.wq.weight: checkpoint shape \(2048, 1024\), model \(2048, 2048\)"),
    "missing": (lambda h: h.pop("norm.weight"), r"missing from the checkpoint: \['model.norm.weight'\]",
                r"missing keys \['norm.weight'\]"),
    "extra": (lambda h: h.update({"extra.weight": ((4,), torch.float32)}),
              r"in the checkpoint but in no rank's model: \['model.extra.weight'\]", r"unexpected keys \['extra.weight'\]"),
    "dtype": (lambda h: h.update({"norm.weight": ((2048,), torch.complex64)}),
              r"model.norm.weight: checkpoint dtype complex64, model float32 \(cannot be cast: complex into float",
              r"big.safetensors: norm.weight: checkpoint dtype C64, model float32 \(cannot be cast: complex into float"),
}


def big_meta():
    with torch.device("meta"):
        return llama.build(BIG)


def header(flaw):
    """The big model's ``{name: (shape, dtype)}`` with ``flaw`` applied."""
    out = {k: (tuple(v.shape), v.dtype) for k, v in big_meta().state_dict().items()}
    FLAWS[flaw][0](out)
    return out


def dcp_folder(path: Path, head) -> Path:
    """A complete meshplan checkpoint folder whose DCP metadata describes ``head``, each shard said to lie in the
    folder's (tiny) data file: a refusal from the metadata never reads it."""
    torch.manual_seed(0)
    meshplan.save(path, llama.build(llama.tiny_args()), step=1)  # the manifest, a data file
    info = next(iter(read_metadata(path).storage_data.values()))  # torch's storage record, copied
    md, stored = {}, {}
    for k, (shape, dt) in head.items():
        zero = torch.Size([0] * len(shape))
        md[f"model.{k}"] = TensorStorageMetadata(TensorProperties(dtype=dt), torch.Size(shape),
                                                 [ChunkStorageMetadata(zero, torch.Size(shape))])
        stored[MetadataIndex(f"model.{k}", zero)] = dataclasses.replace(info, offset=0, length=1)
    (path / ".metadata").write_bytes(pickle.dumps(Metadata(state_dict_metadata=md, storage_data=stored)))
    return path


def safetensors_file(path: Path, head) -> Path:
    """A safetensors file whose header describes ``head``; its data a hole of the right length."""
    meta, offset = {}, 0
    for k, (shape, dt) in head.items():
        n = torch.Size(shape).numel() * torch.empty((), dtype=dt).element_size()
        meta[k] = {"dtype": ST_DTYPES[dt], "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    text = json.dumps(meta).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        f.truncate(8 + len(text) + offset)
    return path


def _status(field):
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith(field + ":"))
    return int(line.split()[1]) * 1024


def refused_within_bounds(load, match):
    """``load(model)`` on a fresh big meta model raises ``match``; parameters stay meta; the peak RSS grew less
    than ``MAX_PEAK`` (the first call warms imports and caches and is not measured)."""
    with pytest.raises(PlanError, match=match):
        load(big_meta())
    model = big_meta()
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM, the peak RSS
    before = _status("VmRSS")
    with pytest.raises(PlanError, match=match):
        load(model)
    grown = _status("VmHWM") - before
    assert all(p.is_meta for p in model.parameters()) and all(b.is_meta for b in model.buffers())
    assert sum(p.numel() for p in model.parameters()) * 4 > 4.5e9  # the model it did not allocate
    assert grown < MAX_PEAK, grown


@pytest.mark.parametrize("flaw", FLAWS)
def test_dcp_load_refuses_bad_checkpoint_before_allocating(tmp_path, flaw):
    path = dcp_folder(tmp_path / "step-1", header(flaw))
    refused_within_bounds(lambda m: meshplan.load(path, m), rf"meshplan.load\({path}\): .*{FLAWS[flaw][1]}")


@pytest.mark.parametrize("flaw", FLAWS)
def test_load_safetensors_refuses_bad_checkpoint_before_allocating(tmp_path, flaw):
    path = safetensors_file(tmp_path / "big.safetensors", header(flaw))
    refused_within_bounds(lambda m: meshplan.load_safetensors(m, path), rf"load_safetensors\({path}\): .*"
                                                                      rf"{FLAWS[flaw][2]}.*refused before allocating")
