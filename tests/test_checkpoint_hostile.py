"""Crafted and hand-edited checkpoint folders: no meshplan command or API runs their code, and every refusal is one
line naming the file (and the field).

A crafted ``.metadata`` (or a crafted non-tensor entry) holds a pickle whose loading creates a file; torch's own
reader creates it (the positive control), ``meshplan export``, ``meshplan checkpoints`` and ``meshplan.load`` never
do. Hand-edited manifests (``saved_at: "yesterday"``, ``1e300``, a list for a mapping) and garbage metadata end in
exit 2 and one line.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import warnings

import pytest
import torch

import meshplan
from meshplan.checkpoint.directory import DCP_METADATA, MANIFEST
from meshplan.errors import PlanError
from conftest import drop_fake_process_group, fake_process_group
from test_fuzz_plans import cli_outcome

pytestmark = pytest.mark.fast


class _Payload:
    """Unpickling it calls ``open(path, "w")``: the file appears iff the loader ran code."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


class _Nested:
    """Unpickling it runs ``os.system("touch path")``."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A real single-process checkpoint of the tiny Llama (model, AdamW after one step)."""
    import llama
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    root = tmp_path_factory.mktemp("ckpt")
    drop_fake_process_group()  # one process: no rank of a leftover fake group may be planned to write
    torch.manual_seed(0)
    model = llama.build(llama.tiny_args())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.zeros(1, 4, dtype=torch.long)).sum().backward()
    opt.step()
    meshplan.save(root / "step-00000001", model, opt, step=1)
    return root / "step-00000001", model, opt


def _copy(saved, tmp_path):
    root = tmp_path / "ckpts"
    shutil.copytree(saved[0], root / "step-00000001")
    return root, root / "step-00000001"


def _crafted_metadata(folder, canary, kind):
    """Replace ``folder/.metadata`` by a pickle that creates ``canary`` when loaded."""
    if kind == "bare":
        data = pickle.dumps(_Payload(canary))
    elif kind == "inside":  # the real Metadata with the payload in a field torch never looks at
        with open(folder / DCP_METADATA, "rb") as f:
            md = pickle.load(f)
        md.planner_data = {"x": _Nested(canary)}
        data = pickle.dumps(md)
    else:  # a payload behind a protocol-0 GLOBAL opcode
        data = f"cos\nsystem\n(Vtouch {canary}\ntR.".encode()
    (folder / DCP_METADATA).write_bytes(data)


@pytest.mark.parametrize("kind", ["bare", "inside", "protocol0"])
def test_crafted_metadata_runs_nothing(saved, tmp_path, kind):
    from torch.distributed.checkpoint import FileSystemReader
    root, folder = _copy(saved, tmp_path)
    canary = tmp_path / "ran"
    _crafted_metadata(folder, canary, kind)
    try:
        FileSystemReader(folder).read_metadata()  # the positive control: torch's reader runs it
    except Exception:  # noqa: BLE001 - the payload's return value is no Metadata
        pass
    assert canary.exists(), "the payload does not work: the test would prove nothing"
    canary.unlink()
    code, _, err = cli_outcome(["export", str(folder), str(tmp_path / "out")])
    assert code == 2 and ".metadata: refused: it names" in err and "could run code" in err, err
    code, _, err = cli_outcome(["export", str(root), str(tmp_path / "out")])
    assert code == 2 and ".metadata: refused" in err, err
    assert cli_outcome(["checkpoints", str(root)])[0] in (0, 2)
    with pytest.raises(PlanError, match=r"\.metadata: refused: it names '(io\.open|builtins\.open|posix\.system|os\.system)'"):
        meshplan.load(folder, saved[1], saved[2])
    assert not canary.exists()


def test_crafted_non_tensor_entry_runs_nothing(saved, tmp_path):
    """A hyperparameter entry (DCP stores non-tensors as pickles) holding the payload: refused by the load."""
    import torch.distributed.checkpoint as dcp
    from meshplan.checkpoint.state import gather_state
    _, folder = _copy(saved, tmp_path)
    canary = tmp_path / "ran"
    state = gather_state(saved[1], saved[2], None)
    key = next(k for k, v in state.items() if k.endswith(".lr"))
    state[key] = _Payload(canary)
    manifest = (folder / MANIFEST).read_text()
    shutil.rmtree(folder)
    dcp.save(state, checkpoint_id=str(folder), no_dist=True)
    (folder / MANIFEST).write_text(manifest)
    with pytest.raises(PlanError, match=rf"checkpoint entry '{key}': refused, not plain data"):
        meshplan.load(folder, saved[1], saved[2])
    assert not canary.exists()


@pytest.mark.parametrize("content, message", [
    (b"", r"\.metadata: not DCP checkpoint metadata \(EOFError"),
    (b"\x80\x05garbage", r"\.metadata: not DCP checkpoint metadata"),
    (pickle.dumps({"a": 1}), r"\.metadata: not DCP checkpoint metadata: expected a Metadata .* got dict"),
    (pickle.dumps([1] * 3), r"got list"),
    (b"\x80\x04" + b"(" * 100_000, r"\.metadata: not DCP checkpoint metadata"),
])
def test_garbage_metadata_is_one_line(saved, tmp_path, content, message):
    root, folder = _copy(saved, tmp_path)
    (folder / DCP_METADATA).write_bytes(content)
    code, _, err = cli_outcome(["export", str(root), str(tmp_path / "out")])
    assert code == 2
    with pytest.raises(PlanError, match=message):
        meshplan.load(folder, saved[1], saved[2])


@pytest.mark.parametrize("field, value, message", [
    ("saved_at", "yesterday", r"field 'saved_at': expected Unix seconds in \[0, 1e\+11\], got 'yesterday'"),
    ("saved_at", 1e300, r"field 'saved_at': expected Unix seconds .* got 1e\+300"),
    ("saved_at", float("nan"), r"field 'saved_at'.* got nan"),
    ("world_size", [1], r"field 'world_size': expected an integer >= 1, got \[1\]"),
    ("data", [1, 2], r"field 'data': expected a mapping of global_batch"),
    ("data", {"global_batch": "8", "seed": 0, "samples_seen": 0}, r"field 'data'"),
    ("extra", [], r"field 'extra': expected a mapping, got \[\]"),
    ("optimizer", "sometimes", r"field 'optimizer': expected one of \['saved', 'empty', 'none'\]"),
    ("rng", "yes", r"field 'rng': expected true or false"),
    ("layout", {"tp": 2}, r"field 'layout': expected a string or null"),
    ("format", "1", r"field 'format': expected an integer >= 0, got '1'"),
    ("step", True, r"field 'step': expected an integer >= 0, got True"),
])
def test_hand_edited_manifest_is_one_line_naming_the_field(saved, tmp_path, field, value, message):
    root, folder = _copy(saved, tmp_path)
    data = json.loads((folder / MANIFEST).read_text())
    data[field] = value
    (folder / MANIFEST).write_text(json.dumps(data))
    code, out, err = cli_outcome(["checkpoints", str(root)])
    if field != "step":  # step: true is no longer step 1, so the folder is not listed as complete
        assert code == 2 and f"{MANIFEST}: " in err and re_search(message, err), err
        with pytest.raises(PlanError, match=message):
            meshplan.load(folder, saved[1], saved[2])


@pytest.mark.parametrize("content, message", [
    (b"[1, 2]", r"expected a JSON mapping .* got list"), (b"{", r"not a JSON manifest"),
    (b"\xff\xfe", r"meshplan.json: not UTF-8 text"), (b'{"step": 1, "a": ' + b"[" * 50_000 + b"]" * 50_000 + b"}",
                                            r"not a JSON manifest"),
])
def test_unreadable_manifest_is_one_line(saved, tmp_path, content, message):
    from meshplan.checkpoint.manifest import read_manifest_file
    _, folder = _copy(saved, tmp_path)
    (folder / MANIFEST).write_bytes(content)
    with pytest.raises(PlanError, match=message):
        read_manifest_file(folder / MANIFEST)


def re_search(pattern, text):
    import re
    return re.search(pattern, text) is not None


def test_incomplete_checkpoint_is_one_line(tmp_path):
    """A save planned for 2 ranks of which one never wrote (a fake group: rank 1 writes nothing): ``export`` and
    ``meshplan.load`` name the first missing shard in one line instead of DCP's KeyError."""
    import llama
    torch.manual_seed(0)
    model = llama.build(llama.tiny_args())
    with fake_process_group(2):
        meshplan.save(tmp_path / "step-00000001", model, None, step=1)
    code, _, err = cli_outcome(["export", str(tmp_path), str(tmp_path / "out")])
    assert code == 2 and len(err.strip().splitlines()) == 1 and "is in no data file (an incomplete checkpoint" in err
    with pytest.raises(PlanError, match=r"is in no data file \(an incomplete checkpoint"):
        meshplan.load(tmp_path / "step-00000001", model, None)
