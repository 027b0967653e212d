"""The pure parts of checkpoints (no process group): the step folders on disk (atomic commit, latest complete,
keep-last-K, leftovers), the manifest and the data position's resume rule, the boxes DCP writes for shards it cannot
describe, the file packing of exports, and transformers' stacked experts read from per-expert tensors."""

from __future__ import annotations

import json

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from meshplan._torch import StridedShard
from meshplan.checkpoint.chunks import Boxes, as_boxes, boxes_of
from meshplan.checkpoint.directory import (DCP_METADATA, MANIFEST, commit, complete_steps, is_complete,
                                           latest_complete, outside_last, partial_dir, prune, step_dir, step_of)
from meshplan.checkpoint.export import pack_files
from meshplan.checkpoint.manifest import DataState, Manifest, check_resume
from meshplan.errors import PlanError
from meshplan.hf.checkpoint_keys import Merged

pytestmark = pytest.mark.fast


def _complete(root, step, manifest_step=None):
    d = step_dir(root, step)
    d.mkdir(parents=True)
    (d / DCP_METADATA).write_bytes(b"dcp")
    (d / MANIFEST).write_text(json.dumps({"step": step if manifest_step is None else manifest_step}))
    return d


def test_step_folders_sort_like_steps(tmp_path):
    assert step_dir(tmp_path, 40).name == "step-00000040" and step_of(step_dir(tmp_path, 40)) == 40
    assert partial_dir(step_dir(tmp_path, 40)).name == "step-00000040.partial"
    assert step_of(tmp_path / "step-00000040.partial") is None and step_of(tmp_path / "other") is None


def test_latest_complete_ignores_torn_and_foreign_folders(tmp_path):
    assert latest_complete(tmp_path / "missing") is None and latest_complete(tmp_path) is None
    _complete(tmp_path, 10)
    _complete(tmp_path, 20)
    torn = partial_dir(step_dir(tmp_path, 30))
    torn.mkdir()
    (torn / "__0_0.distcp").write_bytes(b"half")  # a rank died mid-save
    no_manifest = step_dir(tmp_path, 40)
    no_manifest.mkdir()
    (no_manifest / DCP_METADATA).write_bytes(b"dcp")  # renamed by hand without the manifest: not trusted
    _complete(tmp_path, 50, manifest_step=49)  # a manifest naming another step: a copy, not trusted
    bad_json = _complete(tmp_path, 60)
    (bad_json / MANIFEST).write_text("{not json")
    assert [s for s, _ in complete_steps(tmp_path)] == [10, 20]
    assert latest_complete(tmp_path) == step_dir(tmp_path, 20)
    assert is_complete(step_dir(tmp_path, 10)) and not is_complete(torn)


def test_commit_renames_and_replaces_a_step(tmp_path):
    final = step_dir(tmp_path, 7)
    for content in (b"first", b"second"):
        part = partial_dir(final)
        part.mkdir()
        (part / "x").write_bytes(content)
        commit(part, final)
        assert not part.exists() and (final / "x").read_bytes() == content
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000007"]  # no .replaced left behind


def test_keep_last_k():
    assert outside_last([10, 20, 30, 40], 2) == [10, 20]
    assert outside_last([40, 10, 30], 3) == [] and outside_last([1, 2], None) == [] and outside_last([1, 2], 0) == []


def test_prune_keeps_last_k_and_removes_older_leftovers(tmp_path):
    for s in (1, 2, 3, 4):
        _complete(tmp_path, s)
    partial_dir(step_dir(tmp_path, 2)).mkdir()  # torn, older than the newest: removed
    partial_dir(step_dir(tmp_path, 9)).mkdir()  # newer than the newest complete: maybe in flight, kept
    gone = prune(tmp_path, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000003", "step-00000004", "step-00000009.partial"]
    assert len(gone) == 3


def test_manifest_round_trip_and_refusals():
    m = Manifest(step=5, extra={"lr": [0.1]}, data=DataState(8, 1, 40), world_size=4, layout="tp=2", plan="abc",
                 optimizer="saved", rng=True)
    again = Manifest.from_json(json.loads(json.dumps(m.to_json())), "ckpt/step-5")
    assert again == m and again.same_layout(4, "tp=2", "abc") and not again.same_layout(2, "tp=2", "abc")
    with pytest.raises(PlanError, match=r"ckpt: manifest format 99 is newer than this meshplan's \(1\)"):
        Manifest.from_json({**m.to_json(), "format": 99}, "ckpt")
    with pytest.raises(PlanError, match=r"unknown manifest fields \['surprise'\]"):
        Manifest.from_json({**m.to_json(), "surprise": 1}, "ckpt")


def test_data_position_resumes_at_the_saved_sample():
    saved = DataState(global_batch=8, seed=3, samples_seen=40)
    assert saved.advanced(2).samples_seen == 56
    assert check_resume(saved, DataState(8, 3), "ckpt") == saved
    with pytest.raises(PlanError) as e:
        check_resume(saved, DataState(16, 3), "ckpt/step-5")
    assert str(e.value).startswith("ckpt/step-5: the global batch size was 8 when saved, 16 now")
    assert "from sample 40 on, 16 per step instead of 8" in str(e.value) and "--allow-batch-change" in str(e.value)
    assert check_resume(saved, DataState(16, 3), "ckpt", allow_batch_change=True) == DataState(16, 3, 40)
    with pytest.raises(PlanError, match="the data seed was 3 when saved, 4 now"):
        check_resume(saved, DataState(8, 4), "ckpt", allow_batch_change=True)  # another stream: always refused


def test_boxes_of_packed_and_plain_shards(fake_pg):
    """A packed _StridedShard holds one box per fused part (DCP's one-box description would misplace it); a plain
    Shard stays a DTensor DCP writes itself."""
    with fake_pg(2, rank=1):
        mesh = init_device_mesh("cpu", (2,))
        packed = DTensor.from_local(torch.arange(6.0).reshape(3, 2), mesh, [StridedShard(0, split_factor=3)],
                                    run_check=False, shape=torch.Size((6, 2)), stride=(2, 1))
        boxes = boxes_of(packed)
        assert [(o, s) for o, s, _ in boxes] == [((1, 0), (1, 2)), ((3, 0), (1, 2)), ((5, 0), (1, 2))]
        assert [b.tolist() for _, _, b in boxes] == [[[0.0, 1.0]], [[2.0, 3.0]], [[4.0, 5.0]]]  # views of the shard
        plain = DTensor.from_local(torch.zeros(3, 2), mesh, [Shard(0)], run_check=False)
        out = as_boxes({"packed": packed, "plain": plain, "lr": 0.1})
        assert isinstance(out["packed"], Boxes) and out["plain"] is plain and out["lr"] == 0.1
        items = out["packed"].__create_write_items__("w", None)
        assert [tuple(i.index.offset) for i in items] == [(1, 0), (3, 0), (5, 0)]
        assert tuple(out["packed"].size()) == (6, 2)


def test_pack_files():
    assert pack_files([("a", 4), ("b", 4), ("c", 9), ("d", 1)], 8) == [["a", "b"], ["c"], ["d"]]
    assert pack_files([("a", 4)], 1) == [["a"]]


class _Slice:
    def __init__(self, t):
        self.t = t

    def get_shape(self):
        return list(self.t.shape)

    def __getitem__(self, index):
        return self.t[index]


def test_merged_experts_read_only_the_asked_rows():
    """Mixtral's per-expert w1 (gate) and w3 (up) [F, H] as the stacked gate_up_proj [E, 2F, H]."""
    w1 = [torch.randn(3, 2) for _ in range(4)]
    w3 = [torch.randn(3, 2) for _ in range(4)]
    full = torch.cat([torch.stack(w1), torch.stack(w3)], dim=1)
    merged = Merged([[_Slice(t) for t in w1], [_Slice(t) for t in w3]], cat_dim=1)
    assert merged.get_shape() == (4, 6, 2)
    for index in [(slice(0, 4), slice(0, 6), slice(0, 2)), (slice(2, 4), slice(1, 5), slice(0, 2)),
                  (slice(1, 2), slice(3, 6), slice(1, 2))]:
        assert torch.equal(merged[index], full[index])
    down = Merged([[_Slice(t) for t in w1]], cat_dim=None)
    assert torch.equal(down[(slice(1, 3), slice(0, 3), slice(0, 2))], torch.stack(w1)[1:3])


def test_restart_store_prefixes_keys_with_the_restart_count(monkeypatch):
    """A restarted torchrun group writes its rendezvous keys apart from the dead group's (mesh/elastic.py)."""
    import datetime

    import torch.distributed as dist

    from meshplan.mesh.elastic import restart_store
    timeout = datetime.timedelta(seconds=10)
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    assert restart_store(timeout) is None  # not under a torchrun agent: init_process_group reads env://
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timeout)
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(server.port))
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    restart_store(timeout).set("rank_1", b"addr")
    assert server.get("meshplan/restart2/rank_1") == b"addr"


@pytest.mark.parametrize("box_bytes", [None, 1000])
def test_single_process_save_load_list_and_export(tmp_path, capsys, monkeypatch, box_bytes):
    """Without a process group: save, the CLI's listing, load into another init, ``meshplan export``; with boxes
    of at most 1000 bytes too (every tensor of more than 1000 bytes stored as several boxes of whole rows)."""
    import warnings

    from meshplan.checkpoint import save as save_module
    from meshplan.checkpoint.safe_read import read_metadata
    if box_bytes is not None:
        monkeypatch.setattr(save_module, "SAVE_BOX_BYTES", box_bytes)

    import llama
    import meshplan
    from meshplan.cli.main import main
    from safetensors.torch import load_file
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    torch.manual_seed(0)
    model = llama.build(llama.tiny_args())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.zeros(1, 4, dtype=torch.long)).sum().backward()
    opt.step()
    meshplan.save(tmp_path / "step-00000001", model, opt, step=1, extra={"note": "x"})
    chunks = read_metadata(tmp_path / "step-00000001").state_dict_metadata["model.tok_embeddings.weight"].chunks
    # 128 x 64 fp32 rows of 256 bytes: 3 rows a box
    assert len(chunks) == (1 if box_bytes is None else 43), len(chunks)
    partial_dir(step_dir(tmp_path, 2)).mkdir()
    assert main(["checkpoints", str(tmp_path)]) == 0
    listing = capsys.readouterr().out
    assert "step-00000001  step 1" in listing and "optimizer saved" in listing and "step-00000002.partial  torn" in listing
    torch.manual_seed(1)
    other = llama.build(llama.tiny_args())
    other_opt = torch.optim.AdamW(other.parameters(), lr=1e-3)
    saved = meshplan.load(tmp_path / "step-00000001", other, other_opt)
    assert saved.step == 1 and saved.extra == {"note": "x"} and saved.rng_restored
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), other.state_dict().values()))
    assert torch.equal(opt.state_dict()["state"][0]["exp_avg"], other_opt.state_dict()["state"][0]["exp_avg"])
    with torch.device("meta"):  # built on meta: allocated, buffers computed, filled; the optimizer re-pointed
        meta = llama.build(llama.tiny_args())
    meta_opt = torch.optim.AdamW(meta.parameters(), lr=1e-3)
    meshplan.load(tmp_path / "step-00000001", meta, meta_opt)
    assert not any(t.is_meta for t in [*meta.parameters(), *meta.buffers()])
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), meta.state_dict().values()))
    assert all(torch.equal(a, b) for a, b in zip(model.buffers(), meta.buffers()))  # freqs_cis: not saved
    assert meta_opt.param_groups[0]["params"][0] is next(meta.parameters())
    assert torch.equal(opt.state_dict()["state"][0]["exp_avg"], meta_opt.state_dict()["state"][0]["exp_avg"])
    x = torch.randint(0, 128, (2, 8))
    assert torch.equal(model(x), meta(x))
    assert main(["export", str(tmp_path), str(tmp_path / "out")]) == 0
    exported = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert exported.keys() == model.state_dict().keys()
    assert all(torch.equal(exported[k], v) for k, v in model.state_dict().items())
    assert main(["export", str(tmp_path / "nothing"), str(tmp_path / "o2")]) == 2
    assert "neither a complete checkpoint nor a folder holding one" in capsys.readouterr().err
