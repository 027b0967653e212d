"""``meshplan check``'s per-rank figures and one rank's view (``check --rank R``, ``meshplan.check(..., rank=R)``):
the parameter, gradient and optimizer bytes counted on the model's own parameters (its stages, tp, the experts over
ep, FSDP2's shard) equal ``meshplan estimate``'s (:func:`meshplan.solver.memory.rank_memory`) on every rank of the
example plans at their worlds, and on rank 0, a middle and the last rank of Llama-3-405B's shape on the meta
device at tp 8 x pp 16 x fsdp 128 (16,384 ranks)."""

from __future__ import annotations

import json

import pytest
import torch
import yaml

import meshplan
from meshplan.checks.explain import summary_lines
from meshplan.checks.model_shape import shape_of_model
from meshplan.cli.main import main
from meshplan.errors import PlanError
from meshplan.plan_file.document import Plan
from meshplan.solver.memory import rank_memory
from meshplan.solver.placement import Placement
from meshplan.solver.plans import candidate_from_plan

pytestmark = pytest.mark.fast

SMALL = dict(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=128, ffn_dim=128, max_seq_len=64, dropout=0.0)
#: Llama-3-405B's sizes (meta-llama/Llama-3.1-405B config.json) in the example Llama
L405 = dict(dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, vocab_size=128256, ffn_dim=53248, max_seq_len=8192,
            dropout=0.0)
LLAMA_CFG = json.dumps({k: v for k, v in SMALL.items() if k not in ("max_seq_len", "dropout")})


def _model(kind: str, meta: bool = False, **sizes):
    import llama
    import moe
    with torch.device("meta" if meta else "cpu"):
        if kind == "moe":
            return moe.build(moe.ModelArgs(**SMALL, moe_hidden=96, n_experts=8, top_k=2, capacity_factor=None,
                                           aux_loss_coef=0.0))
        return llama.build(llama.ModelArgs(**{**SMALL, **sizes}))


def _estimated(model, plan: Plan, world: int, rank: int) -> tuple[float, float, float]:
    """``meshplan estimate``'s parameter, gradient and optimizer bytes of ``rank`` (``estimate --rank``: its own
    FSDP2 chunks, the last ranks of a group shorter)."""
    shape, warning = shape_of_model(model)
    assert warning is None, warning
    lay = plan.layout.resolve(world)
    m = plan.pipeline.microbatches if plan.pipeline else 1
    cand, train = candidate_from_plan(plan, world, 64, lay.dp_replicate * lay.dp_shard * m)
    place = Placement(cand, shape.layers, 8)
    mem = rank_memory(shape, cand, train, place, place.pp_rank_of(rank), rank=rank)
    return mem.params, mem.grads, mem.optimizer


def _by_kind(rows) -> dict:
    """``{(axis, kind, group size): (calls, bytes)}`` of a rank view's collectives."""
    out: dict = {}
    for x in rows:
        c, b = out.get((x["axis"], x["kind"], x["group_size"]), (0, 0))
        out[x["axis"], x["kind"], x["group_size"]] = (c + x["count"], b + x["bytes"])
    return out


def _solver_by_kind(model, plan: Plan, world: int, rank: int) -> dict:
    """The same sums straight from the solver's terms (``step_collectives``, what ``estimate`` times)."""
    from meshplan.checks.rank_view import _SEQ
    from meshplan.solver.collectives import step_collectives
    shape, _ = shape_of_model(model)
    lay = plan.layout.resolve(world)
    m = plan.pipeline.microbatches if plan.pipeline else 1
    cand, train = candidate_from_plan(plan, world, _SEQ, lay.dp_replicate * lay.dp_shard * m)
    place = Placement(cand, shape.layers, 8)
    out: dict = {}
    for x in step_collectives(shape, cand, train, place, place.pp_rank_of(rank)):
        if x.group.size > 1:
            c, b = out.get((x.axis, x.kind, x.group.size), (0, 0))
            out[x.axis, x.kind, x.group.size] = (c + x.count, b + int(x.count * x.nbytes))
    return out


def _pictured(report, plan) -> int:
    """The model picture's bytes of the rank (its title's ``data-bytes``), checked against its panel and boxes."""
    from meshplan.viz.model_draw import model_picture
    items = [dict(getattr(x, "data", ())) for x in model_picture(report, plan, []).items]
    data = next(t for t in items if t.get("bytes"))
    assert data["rank"] == report.rank_view["rank"] and data["parameters"] == report.rank_view["parameters"]
    boxes = sum(t["rank-bytes"] for t in items if "rank-bytes" in t)
    assert boxes == sum(r["bytes_per_rank"] for r in report.modules)
    stages = [t["mine"] for t in items if "stage" in t]
    assert stages == [str(s["mine"]).lower() for s in report.rank_view["layout"]["stages"]]
    return data["bytes"]


def _checked(report) -> tuple[int, int, int]:
    v = report.rank_view
    assert report.ok and v is not None, report.errors
    assert report.totals["bytes_per_rank"] == v["parameter_bytes"]
    return v["parameter_bytes"], v["gradient_bytes"], v["optimizer_bytes"]


@pytest.mark.parametrize("path,world,kind", [("plans/llama_3d.yaml", 8, "llama"), ("plans/moe.yaml", 4, "moe"),
                                             ("plans/llama_pp.yaml", 4, "llama")])
def test_every_rank_equals_the_estimate(path, world, kind):
    model, plan = _model(kind), Plan.from_data(yaml.safe_load(open(path)), source=path)
    for rank in range(world):
        report = meshplan.check(model, plan, world, rank=rank)
        assert _checked(report) == _estimated(model, plan, world, rank), rank
        assert _pictured(report, plan) == _estimated(model, plan, world, rank)[0], rank


def test_llama_405b_shape_on_the_meta_device_equals_the_estimate():
    """tp 8 x pp 16 x fsdp 128: rank 0 holds the embedding, a middle rank 8 blocks, the last the head; was
    50,735,300,608 per rank (189.0 GiB: tp only) before the view counted pp and FSDP."""
    model = _model("llama", meta=True, **L405)
    data = yaml.safe_load(open("plans/llama_3d.yaml"))
    data["layout"], data["pipeline"]["microbatches"] = {"tp": 8, "pp": 16, "dp_shard": 128}, 16
    plan = Plan.from_data(data, source="llama_405b")
    middle = None
    for rank in (0, 8 * 8 * 128 + 3, 16383):
        report = meshplan.check(model, plan, 16384, rank=rank)
        middle = report.rank_view["collectives"] if rank == 8195 else middle
        assert _checked(report) == _estimated(model, plan, 16384, rank), rank
        assert report.totals["parameters_per_rank"] < 30_000_000  # 405e9 / 16384 = 24.7M on average
        assert _by_kind(report.rank_view["collectives"]) == _solver_by_kind(model, plan, 16384, rank), rank
        assert _pictured(report, plan) == _estimated(model, plan, 16384, rank)[0], rank
    groups = {(x["kind"], x["group"]): x["ranks"] for x in middle}
    assert groups["all_gather", "tp"] == list(range(8192, 8200))  # rank 8195: pp 8, dp 0, tp 3 (tp-cp-dp-pp)
    assert groups["all_gather", "dp_shard"] == list(range(8195, 9216, 8))
    assert groups["send", "pp"] == [7171, 9219]  # pp 7 and pp 9 at the same tp and dp
    assert report.rank_view["coordinates"] == {"tp": 7, "cp": 0, "pp": 15, "dp": 127, "dp_shard": 127,
                                               "dp_replicate": 0}
    assert report.rank_view["stages"] == ["stage 15: layers.119-125, norm, output"]
    notes = summary_lines(report, unsharded=False)  # the model picture's notes (check --format svg|png)
    assert "22,284,160 per rank (rank 16383: 85.0 MiB; gradients 85.0 MiB, optimizer 170.0 MiB)" in notes[0]


def test_plan_without_tensor_parallel_counts_the_fsdp_shard():
    model, plan = _model("llama"), Plan.from_data({"version": 1, "layout": {}}, source="fsdp4")
    report = meshplan.check(model, plan, 4)
    n = sum(-(-p.shape[0] // 4) * (p.numel() // p.shape[0]) for p in model.parameters())
    assert report.totals["parameters_per_rank"] == n and report.totals["bytes_per_rank"] == 4 * n


def test_rank_outside_the_world_is_refused():
    model, plan = _model("llama"), Plan.from_data(yaml.safe_load(open("plans/llama_3d.yaml")), source="p")
    with pytest.raises(PlanError, match=r"p: rank 8 is outside the world: expected 0 <= rank < 8"):
        meshplan.check(model, plan, 8, rank=8)


def _cli(capsys, *argv):
    code = main(["check", "plans/llama_3d.yaml", "--model", "examples.llama:build", "--config", LLAMA_CFG,
                 "--world-size", "8", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_rank_view(capsys):
    code, out, err = _cli(capsys, "--rank", "5")
    assert code == 0 and err == ""
    lines = out.splitlines()
    i = lines.index("rank 5: tp 1/2, pp 1/2, dp 0/2, dp_shard 0/2")
    assert lines[i + 1] == "  stage 1: layers.2-3, norm, output"
    assert lines[i + 2] == ("  parameters 20,640 in 20 tensors: 80.6 KiB, gradients 80.6 KiB, "
                            "optimizer (AdamW) 161.3 KiB")
    assert lines[i + 3] == "  FSDP2 shards the dense parameters over dp_shard (2 ranks)"
    assert lines[i + 4:i + 8] == [  # the units as the data axis' wrap makes them (ends.end_groups), bytes each
        "  FSDP2 (fully_shard) wraps 4 units over dp_shard (5, 7), in this order (this rank's bytes):",
        "    2 blocks (layers.2 … layers.3): 36.2 KiB each",
        "    head [norm, output] of stage 1: 8.1 KiB, kept gathered after forward",
        "    the root stage 1: 0 B (holds nothing)"]
    assert lines[i + 8] == "  collectives per step (the solver's terms; bytes at sequence 8,192, one sequence per microbatch):"
    assert lines[i + 9] == "    send over pp (peers 1): 2 calls, 2.0 MiB (pp: activations and their gradients)"
    assert lines[i + 10].startswith("    recv over pp (peers 1): 2 calls, 2.0 MiB")
    assert any(x.startswith("    all_gather over tp (ranks 4, 5): 26 calls, 52.0 MiB (tp: block inputs (forward)") for x in lines)
    assert "    reduce_scatter over dp_shard (ranks 5, 7): 3 calls, 161.2 KiB (dp: block gradients, head gradients)" in lines
    assert "20,640 per rank (rank 5: 80.6 KiB" in out
    code, out, _ = _cli(capsys, "--rank", "5", "--format", "json")
    doc = json.loads(out)
    assert doc["rank"]["parameter_bytes"] == doc["totals"]["bytes_per_rank"] == 20640 * 4
    code, out, _ = _cli(capsys)  # default: rank 0's totals, no view lines
    assert code == 0 and "per rank (rank 0:" in out and "\nrank 0:" not in out


def test_cli_rank_outside_the_world_is_one_line_exit_2(capsys):
    code, out, err = _cli(capsys, "--rank", "8")
    assert code == 2 and out == ""
    assert err.strip().splitlines() == ["meshplan: error: check --rank: rank 8 is outside the world: expected 0 <= rank < 8"]


def test_a_layout_given_beside_the_plan_is_the_one_counted():
    """``layout=`` overrides the plan's: the view counts the layout checked (fsdp over 4, not the plan's tp 2)."""
    model, plan = _model("llama"), Plan.from_data(yaml.safe_load(open("plans/llama.yaml")), source="llama")
    report = meshplan.check(model, plan, 4, layout={"tp": 1})
    n = sum(-(-p.shape[0] // 4) * (p.numel() // p.shape[0]) for p in model.parameters())
    assert report.rank_view["coordinates"]["dp_shard"] == 0 and report.totals["parameters_per_rank"] == n


def test_explain_rows_are_the_ranks_bytes():
    """The explain table's per-module column is the rank's (check --rank R): every parameter of llama_3d is under a
    rule, so the rows sum to the rank's parameter bytes; a module on another stage holds 0 there."""
    model, plan = _model("llama"), Plan.from_data(yaml.safe_load(open("plans/llama_3d.yaml")), source="3d")
    for rank in range(8):
        report = meshplan.check(model, plan, 8, rank=rank)
        rows = {r["module"]: r["bytes_per_rank"] for r in report.modules}
        assert sum(rows.values()) == report.rank_view["parameter_bytes"] == _estimated(model, plan, 8, rank)[0]
        first = report.rank_view["coordinates"]["pp"] == 0
        assert (rows["tok_embeddings"] > 0, rows["output"] > 0, rows["layers.3.attention.wq"] > 0) == \
               (first, not first, not first)


def test_each_axis_of_the_rank_layout():
    """What each axis gives the rank: FSDP2's units and group, the pipeline stages, the experts, the chunks."""
    model, plan = _model("moe"), Plan.from_data(yaml.safe_load(open("plans/moe.yaml")), source="moe")
    lay = meshplan.check(model, plan, 4, rank=3).rank_view["layout"]
    (share,) = lay["shares"]  # the experts of ep rank 1 (the axis' rank_share)
    assert (share["axis"], share["text"], share["cells"]) == ("ep", "experts 4-7 of 8 (ep rank 1 of 2) in 4 modules", [])
    assert share["data"]["modules"] == [f"layers.{i}.moe.experts" for i in range(4)]
    w = lay["wrapping"]
    assert (w["mode"], w["over_axes"], w["ranks"], w["experts_over"], w["experts_ranks"], w["roots"]) == \
           ("fsdp", ["dp_shard"], [1, 3], "edp", [1, 3], ["(the model)"])
    assert w["blocks"] == [f"layers.{i}" for i in range(4)] and lay["stages"] == []
    model, plan = _model("llama"), Plan.from_data(yaml.safe_load(open("plans/llama_cp.yaml")), source="cp")
    lay = meshplan.check(model, plan, 4, rank=3).rank_view["layout"]
    (share,) = lay["shares"]
    assert (share["axis"], share["text"], share["data"]["chunks"]) == ("cp", "sequence chunks 1, 2 of 4 (cp rank 1 of 2)", [1, 2])
    assert share["cells"] == [["c0", False], ["c1", True], ["c2", True], ["c3", False]]
    assert lay["wrapping"]["over_axes"] == ["cp"]  # FSDP2 over dp_shard x cp: cp 2 at world 4, tp 2
    model, plan = _model("llama"), Plan.from_data(yaml.safe_load(open("plans/llama_3d.yaml")), source="3d")
    lay = meshplan.check(model, plan, 8, rank=5).rank_view["layout"]
    assert [(s["stage"], s["pp_rank"], s["mine"], s["text"]) for s in lay["stages"]] == \
           [(0, 0, False, "tok_embeddings, layers.0-1"), (1, 1, True, "layers.2-3, norm, output")]
    assert lay["wrapping"]["blocks"] == ["layers.2", "layers.3"] and lay["wrapping"]["roots"] == ["stage 1"]


def _received(fake_pg, monkeypatch, model, plan: Plan, world: int, rank: int) -> list[str]:
    """The units ``fully_shard`` receives when ``parallelize`` runs ``plan`` on a meta copy of ``model`` as ``rank``
    of a fake group of ``world``: each unit's module paths (``,``-joined), a root (the model or a stage view) as
    ``root``."""
    import torch.distributed.fsdp as fsdp
    from meshplan.model_copies import meta_copy
    real, got = fsdp.fully_shard, []
    meta = meta_copy(model)
    modules = {id(m): (p, m) for p, m in meta.named_modules()}  # the modules held too: no id is reused

    def path(m):  # the meta model's path of m ("" for the model), or None for another module (a stage view)
        p, known = modules.get(id(m), (None, None))
        return p if known is m else None

    def spy(module, *args, **kwargs):
        mods = module if isinstance(module, list) else [module]
        got.append(",".join(path(m) for m in mods) if path(mods[0]) else "root")
        return real(module, *args, **kwargs)

    monkeypatch.setattr(fsdp, "fully_shard", spy)
    with fake_pg(world, rank):
        meshplan.parallelize(meta, plan, meshplan.build_mesh(plan.layout))
    return got


@pytest.mark.parametrize("case,world,ranks", [
    ("plans/llama_3d.yaml", 8, [0, 5]),  # pp x tp x FSDP2: the embedding unit on stage 0, the head on stage 1
    ("plans/moe.yaml", 4, [3]),  # the experts over edp first
    ("tied", 2, [0]),  # a tied head: no end units, the root holds the embedding and the head
    ("vpp", 4, [0, 3]),  # 2 stages per rank: a root each, the embedding in stage 0's, the head in stage 3's
    ("moe_ep1", 4, [0]),  # ep 1: the experts still wrapped over edp first
    ("moe_none", 2, [0, 1]),  # data parallelism none, edp 2 (tp 2, etp 1): the experts' units alone
    ("vocab", 4, [0, 3]),  # ends vocab_parallel: no embedding/head unit, the root holds the norm
    ("vocab_pp", 4, [0, 3]),  # and pipelined (pp 2 x dp_shard 2): stage 0's root holds nothing
])
def test_check_and_picture_name_the_units_fully_shard_receives(fake_pg, monkeypatch, case, world, ranks):
    """``check --rank R`` and the model picture list FSDP2's units as the data axis' wrap makes them (the rule of
    :func:`meshplan.data_parallel.ends.end_groups`, which ``end_units`` applies): the same modules, in the order
    ``fully_shard`` receives them on that rank (a meta model on a fake process group), and their bytes sum to the
    rank's parameter bytes."""
    from meshplan.checks.rank_layout import unit_texts
    from meshplan.viz.model_draw import model_picture
    if case == "tied":
        model, plan = _model("llama", tie_embeddings=True), Plan.from_data({"version": 1, "layout": {}}, source="t")
    elif case == "vpp":
        model = _model("llama")
        plan = Plan.from_data({"version": 1, "layout": {"pp": 2, "vpp": 2}, "blocks": {"pattern": "layers.*"},
                               "pipeline": {"schedule": "interleaved_1f1b", "microbatches": 2}}, source="vpp")
    elif case.startswith("vocab"):
        pp = {"layout": {"pp": 2}, "blocks": {"pattern": "layers.*"}, "pipeline": {"schedule": "1f1b",
                                                                                  "microbatches": 2}}
        model = _model("llama")
        plan = Plan.from_data({"version": 1, "layout": {}, **(pp if case == "vocab_pp" else {}),
                               "data_parallel": {"ends": "vocab_parallel"}}, source=case)
    elif case.startswith("moe_"):
        data = yaml.safe_load(open("plans/moe.yaml"))
        data["layout"] = {"tp": 2, "ep": 1, "etp": 1}
        if case == "moe_none":
            data["data_parallel"] = {"mode": "none"}
        model, plan = _model("moe"), Plan.from_data(data, source=case)
    else:
        model, plan = _model("moe" if "moe" in case else "llama"), Plan.from_data(yaml.safe_load(open(case)), source=case)
    for rank in ranks:
        report = meshplan.check(model, plan, world, rank=rank)
        units = report.rank_view["layout"]["wrapping"]["units"]
        listed = [",".join(u["modules"]) or "root" for u in units]
        assert listed == _received(fake_pg, monkeypatch, model, plan, world, rank), rank
        wrapped = report.rank_view["parameter_bytes"] if case != "moe_none" else sum(
            b for p, b in report.rank_view["module_bytes"].items() if ".moe.experts" in p)
        vocab = report.rank_view["layout"]["wrapping"]["vocab_parallel"]
        assert sum(u["bytes"] for u in units + vocab) == wrapped > 0, rank
        if case.startswith("vocab"):  # embedding and head rows/n on their own; torch's embedding grad: Replicate
            assert _checked(report) == _estimated(model, plan, world, rank), rank
            ends = {"vocab": ["tok_embeddings", "output"], "vocab_pp": ["tok_embeddings"] if rank < 2 else ["output"]}
            assert [u["modules"][0] for u in vocab] == ends[case] and all(u["bytes"] > 0 for u in vocab), rank
            norm = 0 if case == "vocab_pp" and rank < 2 else 64 * 4 // (4 if case == "vocab" else 2)  # its shard
            assert (units[-1]["kind"], units[-1]["bytes"]) == ("root", norm), rank
            assert any("vocab-parallel over dp_shard (rows/" in t for t in unit_texts(
                report.rank_view["layout"]["wrapping"])), rank
        items = [dict(getattr(x, "data", ())) for x in model_picture(report, plan, []).items]
        pictured = next(t["fsdp-units"] for t in items if "fsdp-units" in t).split(";")
        assert [p if not p.startswith("root:") else "root" for p in pictured] == listed, rank
    if case == "tied":
        assert [(u["kind"], u["modules"]) for u in units] == [("block", [f"layers.{i}"]) for i in range(4)] + [
            ("root", [])] and units[-1]["bytes"] > 0
