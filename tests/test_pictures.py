"""The pictures of ``meshplan ranks|check --format svg|png`` and ``check --schedule``: rendered headless, parsed
as XML, and their content checked against the data they draw (groups, explain rows, torch's schedules)."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from collections import Counter, defaultdict

import pytest

from meshplan.cli.main import main
from meshplan.pipeline.order import executed_steps
from meshplan.plan_file.layout import Layout
from meshplan.viz.drawing import Drawing
from meshplan.viz.rank_grid import group_colour, rank_grid
from meshplan.viz.timeline import simulate, timeline

pytestmark = pytest.mark.fast
NS = "{http://www.w3.org/2000/svg}"
LLAMA_CFG = '{"dim": 64, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 128, "ffn_dim": 128}'


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _svg(text: str) -> ET.Element:
    return ET.fromstring(text)  # valid XML or it raises


def _cells(root: ET.Element, **want) -> list[ET.Element]:
    return [e for e in root.iter(f"{NS}rect") if all(e.get(f"data-{k}") == v for k, v in want.items())]


@pytest.mark.parametrize("argv, kinds", [
    (dict(world=16, tp=4, pp=2), ["tp", "dp", "pp"]),  # Megatron's worked example (seeds)
    (dict(world=16, tp=1, pp=2, ep=4, etp=1), ["dp", "pp", "ep", "edp"]),  # its MoE part: ETP1-PP2-EP4-EDP2
    (dict(world=8, tp=2, pp=2), ["tp", "dp", "pp"]),  # smp's 8 GPUs
    (dict(world=16, tp=2, cp=2, dp_replicate=2), ["tp", "cp", "dp", "dp_shard", "dp_replicate"]),
])
def test_rank_grid_panels_groups_and_colours(argv, kinds):
    world = argv.pop("world")
    r = Layout(**argv).resolve(world)
    root = _svg(rank_grid(r, gpus_per_node=8).to_svg())
    titles = [e for e in root.iter(f"{NS}text") if e.get("data-kind")]
    assert [t.get("data-kind") for t in titles] == kinds
    for t in titles:
        kind = t.get("data-kind")
        groups = rank_grid.__globals__["_groups"](r, kind)
        assert int(t.get("data-groups")) == len(groups) and t.text.startswith(f"{kind} groups")
        cells = _cells(root, kind=kind)
        assert sorted(int(c.get("data-rank")) for c in cells) == list(range(world))
        for c in cells:  # each cell: its group, that group's colour in the kind's hue
            gi = int(c.get("data-group"))
            assert int(c.get("data-rank")) in groups[gi] and c.get("fill") == group_colour(kind, gi)
    labels = [e.text for e in root.iter(f"{NS}text")]
    assert "node 0" in labels and f"node {world // 8 - 1}" in labels


def test_rank_grid_node_boundaries_when_nodes_are_wide():
    r = Layout(tp=8).resolve(64)
    d = rank_grid(r, gpus_per_node=32)  # 32 per node: 16 columns, boundary lines between cells
    thick = [it for it in d.items if type(it).__name__ == "Line" and it.width == 3]
    assert thick and "1 span nodes" not in d.to_svg() and "0 span nodes" in d.to_svg()


def test_svg_escapes_text():
    d = Drawing(10, 10)
    d.text(0, 0, "<&>\"'", data={"x": "a<b"})
    d.rect(0, 0, 1, 1, title="</title><script>")
    root = _svg(d.to_svg())
    assert [e.text for e in root.iter(f"{NS}text")] == ["<&>\"'"]
    assert next(root.iter(f"{NS}title")).text == "</title><script>"


def test_ranks_cli_svg_and_png(capsys, tmp_path):
    code, out, _ = run(capsys, "ranks", "--world-size", "16", "--tp", "4", "--pp", "2", "--format", "svg",
                       "--gpus-per-node", "8")
    assert code == 0 and _svg(out) is not None and "rank 13: dp group 5" in out
    f = tmp_path / "r.png"
    code, out, _ = run(capsys, "ranks", "--world-size", "16", "--tp", "4", "--format", "png", "-o", str(f))
    assert code == 0 and out == "" and f.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f.stat().st_size > 10_000


# ---------------------------------------------------------------- pipeline schedules

ALL_SCHEDULES = [("gpipe", 4, 1, 4), ("gpipe", 2, 1, 1), ("1f1b", 4, 1, 8), ("1f1b", 3, 1, 3),
                 ("interleaved_1f1b", 2, 2, 4), ("interleaved_1f1b", 4, 2, 8), ("looped_bfs", 2, 3, 4),
                 ("interleaved_zero_bubble", 2, 2, 4), ("interleaved_zero_bubble", 4, 2, 8),
                 ("zbv_zero_bubble", 2, 2, 4), ("zbv_zero_bubble", 4, 2, 8), ("dualpipev", 2, 2, 4),
                 ("dualpipev", 4, 2, 8)]


def _torch_actions(schedule, pp, vpp, m):
    """What torch's runtime runs: its own schedule visualiser's action lists (with comms: the executed list)."""
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

    from meshplan.pipeline.stages import schedule_class
    ops = get_schedule_ops(schedule_class(schedule), pp, m, num_stages_per_rank=vpp, with_comms=True)
    out = []
    for rank in ops:
        steps = []
        for a in rank:
            if a is None or a.computation_type.value not in ("F", "B", "I", "W", "OVERLAP_F_B"):
                continue
            steps += [str(s) for s in (a.sub_actions or (a,))]
        out.append(steps)
    return out


@pytest.mark.parametrize("schedule, pp, vpp, m", ALL_SCHEDULES)
def test_timeline_cells_are_the_schedules_actions(schedule, pp, vpp, m):
    steps = executed_steps(schedule, pp, vpp, m)
    if vpp > 1:
        assert [[str(s) for s in r] for r in steps] == _torch_actions(schedule, pp, vpp, m)
    kinds = Counter(s.kind for r in steps for s in r)
    assert kinds["F"] == pp * vpp * m and kinds["B"] + kinds["I"] == pp * vpp * m and kinds["W"] == kinds["I"]
    root = _svg(timeline(steps, f"{schedule}").to_svg())
    by_rank = defaultdict(list)
    for c in _cells(root):
        if c.get("data-kind") in ("F", "B", "I", "W"):
            by_rank[int(c.get("data-rank"))].append(c)
    for rank, row in enumerate(steps):
        cells = sorted(by_rank[rank], key=lambda c: float(c.get("x")))
        assert [f"{c.get('data-stage')}{c.get('data-kind')}{c.get('data-mb')}" for c in cells] == \
            [str(s) for s in row]
    legend = {e.text for e in root.iter(f"{NS}text")}
    assert "weight grad" in legend if kinds["W"] else "weight grad" not in legend


def test_single_stage_schedules_run_their_loops():
    """1F1B: rank r runs pp - r forwards first, then alternates; GPipe: every forward, then every backward."""
    for rank, row in enumerate(executed_steps("1f1b", 4, 1, 8)):
        kinds = "".join(s.kind for s in row)
        warm = 4 - rank
        assert kinds == "F" * warm + "BF" * (8 - warm) + "B" * warm, (rank, kinds)
        assert [s.microbatch for s in row if s.kind == "B"] == list(range(8))
    assert all("".join(s.kind for s in r) == "F" * 4 + "B" * 4 for r in executed_steps("gpipe", 3, 1, 4))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_bubble_of_gpipe_and_1f1b(schedule):
    pp, m = 4, 8
    placed = simulate(executed_steps(schedule, pp, 1, m))
    span = max(p.end for r in placed for p in r)
    assert span == 3 * (m + pp - 1)  # (F + B) per microbatch plus the fill and drain: bubble (p-1)/(m+p-1)
    for r in placed:
        assert all(a.end <= b.start for a, b in zip(r, r[1:]))  # a rank runs one step at a time


def test_check_schedule_cli(capsys, tmp_path):
    code, out, _ = run(capsys, "check", "plans/llama_3d.yaml", "--schedule")
    assert code == 0 and "rank 0: 0F0@0 0F1@1 0B0@4 0B1@7" in out and "idle 33.3%" in out
    code, out, err = run(capsys, "check", "plans/llama_3d.yaml", "--schedule", "--format", "json")
    doc = json.loads(out)
    assert code == 0 and len(doc["ranks"]) == 2 and doc["schedule"] == "1f1b" and doc["span"] == 9
    code, out, err = run(capsys, "check", "plans/llama_3d.yaml", "--schedule", "--pp", "4", "--world-size", "16")
    assert code == 2 and "1f1b needs at least pp(4) microbatches" in err and err.count("\n") == 1
    f = tmp_path / "s.svg"
    code, _, _ = run(capsys, "check", "plans/llama_3d.yaml", "--schedule", "--format", "svg", "-o", str(f),
                     "--model", "examples.llama:build", "--config", LLAMA_CFG, "--world-size", "8")
    text = f.read_text()
    assert code == 0 and "stage 1: layers.2-3, norm, output" in text and _svg(text) is not None
    code, _, err = run(capsys, "check", "plans/hf_llama.yaml", "--schedule")
    assert code == 2 and "the plan has no pipeline section" in err and err.count("\n") == 1


def test_timeline_is_wide_enough_for_its_texts():
    """A short schedule drew a canvas narrower than its title ("… 2 microbatche" clipped): every text fits."""
    from meshplan.viz.drawing import Text, text_width
    d = timeline(executed_steps("1f1b", 2, 1, 2), "plans/llama_3d.yaml: 1f1b, pp 2 × vpp 1, 2 microbatches")
    texts = [t for t in d.items if isinstance(t, Text) and t.anchor == "start"]
    assert texts and all(t.x + text_width(t.text, t.size) * (1.15 if t.weight == "bold" else 1) <= d.width
                         for t in texts)


# ---------------------------------------------------------------- the model picture


def test_model_picture_layouts_and_collectives(capsys, tmp_path):
    code, out, _ = run(capsys, "check", "plans/llama_3d.yaml", "--model", "examples.llama:build", "--config",
                       LLAMA_CFG, "--world-size", "8", "--format", "json")
    report = json.loads(out)
    f = tmp_path / "m.svg"
    code, _, _ = run(capsys, "check", "plans/llama_3d.yaml", "--model", "examples.llama:build", "--config",
                     LLAMA_CFG, "--world-size", "8", "--format", "svg", "-o", str(f))
    root = _svg(f.read_text())
    assert code == 0
    boxes = {c.get("data-module"): c.get("data-style") for c in root.iter(f"{NS}rect") if c.get("data-module")}
    rules = {r["rule"]: r["style"] for r in report["modules"] if r["rule"] != "(colwise parent)"}
    assert boxes == rules  # one box per rule, with its style
    texts = [e for e in root.iter(f"{NS}text")]
    acts = [t.get("data-activation") for t in texts if t.get("data-activation")]
    assert acts[0] == "input: Replicate" and acts[-1] == "Shard(-1) vocab-sharded logits → loss"
    assert "Shard(1) sequence-sharded" in acts and "Replicate" in acts and "Shard(-1) local shards" in acts
    drawn = Counter(c for t in texts if t.get("data-forward") for c in t.get("data-forward").split(","))
    per_block = Counter(c for r in report["modules"] if r["module"].startswith("layers.0.") for c in r["forward"])
    ends = Counter(c for r in report["modules"] if not r["module"].startswith("layers.") for c in r["forward"])
    assert drawn == per_block + ends  # each boundary's collectives once per drawn block
    assert any("layers.* : 4 blocks" in (t.text or "") for t in texts)
    assert any("stage 1 (pp rank 1): layers.2-3, norm, output" in (t.text or "") for t in texts)


def test_model_picture_png(capsys, tmp_path):
    f = tmp_path / "m.png"
    code, _, _ = run(capsys, "check", "plans/hf_llama.yaml", "--model", "examples.hf_models:llama", "--format", "png",
                     "-o", str(f))
    assert code == 0 and f.read_bytes()[:4] == b"\x89PNG"


def test_model_picture_of_one_rank(capsys, tmp_path):
    """``check --rank R --format svg``: the rank's figures in the title, its share beside each box, the pipeline
    stages with its own marked, FSDP2's units (each block, the stage's head unit, then the stage root: the units
    fully_shard receives, tests/test_rank_view.py) with the rank's bytes of each, and their ranks."""
    f = tmp_path / "m.svg"
    code, _, _ = run(capsys, "check", "plans/llama_3d.yaml", "--model", "examples.llama:build", "--config",
                     LLAMA_CFG, "--world-size", "8", "--rank", "5", "--format", "svg", "-o", str(f))
    root = _svg(f.read_text())
    assert code == 0
    texts = [t for t in root.iter(f"{NS}text")]
    title = next(t for t in texts if t.get("data-bytes"))
    assert (title.get("data-rank"), title.get("data-parameters"), title.get("data-bytes")) == ("5", "20640", "82560")
    shares = {t.get("data-module"): t.text for t in texts if t.get("data-rank-bytes")}
    assert shares["tok_embeddings"] == "rank 5: not held, 0 B" and shares["output"] == "rank 5: held, 8.00 KiB"
    assert shares["layers.*.attention_norm"] == "rank 5: 2 of 4 held, 256 B"
    assert sum(int(t.get("data-rank-bytes")) for t in texts if t.get("data-rank-bytes")) == 82560
    stages = [(c.get("data-stage"), c.get("data-mine")) for c in root.iter(f"{NS}rect") if c.get("data-stage")]
    assert stages == [("0", "false"), ("1", "true")]
    fsdp = [t.text for t in texts if t.get("data-fsdp")]
    assert fsdp == ["FSDP2 (fully_shard) wraps 4 units over dp_shard (ranks 5, 7), in this order:",
                    "2 blocks (layers.2 … layers.3): 36.25 KiB each",
                    "head [norm, output] of stage 1: 8.12 KiB, kept gathered after forward",
                    "the root stage 1: 0 B (holds nothing)"]
    units = next(t.get("data-fsdp-units") for t in texts if t.get("data-fsdp-units"))
    assert units == "layers.2;layers.3;norm,output;root:stage 1"
    assert any((t.get("data-frame") or "").endswith("FSDP2 wraps each (dp_shard)") for t in texts)
