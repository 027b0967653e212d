"""The rehearsal of one rank of a big job (``benchmarks/rehearsal.py``) on a smaller shape: Llama-3-8B's shapes at
world 1,024 (tp 8 × pp 2 × dp_shard 64) on a ``fake`` group, one rank at a time, on the meta device. What the rank
holds, measured from its local tensors, equals ``meshplan estimate``'s bytes for that rank exactly: parameters,
gradients and AdamW's state. The last rank of an FSDP2 group holds short chunks (16,032 vocabulary rows per tp
rank over 64: 251 rows on the first 63, 219 on the last), which the estimate counts given the rank. An expert rank
too: Mixtral 8x22B's shapes on the example MoE (tp 8 × ep 8, etp 1, pp 2: edp 64)."""

from __future__ import annotations

import json

import pytest
import torch
import yaml

from benchmarks.rehearsal import plan_data, rehearse_rank
from conftest import drop_fake_process_group
from meshplan.cli.main import main
from meshplan.solver.memory import chunk_rows as _rows

pytestmark = pytest.mark.fast

LAYOUT, WORLD = {"tp": 8, "pp": 2}, 1024


@pytest.fixture(autouse=True)
def _no_leftover_group():
    """A rehearsal makes its own fake group of the big world: drop the one ``tests/_local.py`` keeps for its next
    use (left by an earlier test in this process)."""
    drop_fake_process_group()


@pytest.mark.parametrize("rank", [511, 512, 1023])  # first stage's last rank, last stage's first and last
def test_rank_holds_what_estimate_says(rank, tmp_path, capsys):
    got = rehearse_rank("llama3-8b", LAYOUT, WORLD, rank, microbatches=2, block=False)
    assert got["coords"]["pp"] == rank // 512
    assert got["measured"]["params"] == got["estimate"]["params"], got
    assert got["measured"]["grads"] == got["estimate"]["grads"], got
    assert got["measured"]["optimizer"] == got["estimate"]["optimizer"], got
    (tmp_path / "plan.yaml").write_text(yaml.safe_dump(plan_data(LAYOUT, 2)))
    capsys.readouterr()
    assert main(["estimate", str(tmp_path / "plan.yaml"), "--preset", "llama3-8b", "--world-size", str(WORLD),
                 "--seq", "8192", "--global-batch", "128", "--rank", str(rank), "--format", "json"]) == 0
    cli = json.loads(capsys.readouterr().out)["rank"]
    assert {k: cli[k] for k in ("params", "grads", "optimizer")} == got["estimate"], cli
    assert {k: cli[k] for k in got["coords"]} == got["coords"]
    assert got["groups_missing"] == [], got
    assert got["blocks"] == ([16, 0, 15] if rank < 512 else [16, 16, 31])


def test_fsdp_chunks_are_torch_chunks():
    for rows in (1, 7, 30, 16032, 16033):
        for d in (1, 2, 3, 8, 64, 128):
            want = [len(c) for c in torch.arange(rows).chunk(d)]
            want += [0] * (d - len(want))
            assert [_rows(rows, d, i) for i in range(d)] == want, (rows, d)
            assert _rows(rows, d, None) == max(want)


def test_estimate_without_rank_is_the_most_loaded():
    from meshplan.solver.memory import rank_memory
    from meshplan.solver.placement import Placement
    from meshplan.solver.plans import candidate_from_plan
    from meshplan.solver.presets import model_preset
    from meshplan.plan_file.document import Plan
    plan = Plan.from_data(plan_data(LAYOUT, 2), source="rehearsal")
    cand, train = candidate_from_plan(plan, WORLD, 8192, 2 * 64, microbatches=2)
    shape = model_preset("llama3-8b")
    place = Placement(cand, shape.layers, 8)
    most = rank_memory(shape, cand, train, place, 1).params
    each = [rank_memory(shape, cand, train, place, 1, rank=r).params for r in range(512, 1024, 8)]
    assert most == max(each) > min(each)


def test_estimate_rank_outside_the_world_is_refused(tmp_path, capsys):
    (tmp_path / "plan.yaml").write_text(yaml.safe_dump(plan_data(LAYOUT, 2)))
    rc = main(["estimate", str(tmp_path / "plan.yaml"), "--preset", "llama3-8b", "--world-size", str(WORLD),
               "--seq", "8192", "--global-batch", "128", "--rank", str(WORLD)])
    err = capsys.readouterr().err
    assert rc == 2 and "--rank 1024: outside world size 1024; expected 0..1023" in err, err


@pytest.mark.parametrize("rank", [0, 1023])  # each edp rank 1/64 of the one local expert (550.0 / 549.3 MB params;
# before the inner-dim shard edp 0 held the expert whole, 33.8 GB, and edp 63 none, 20.9 MB)
def test_expert_rank_holds_what_estimate_says(rank):
    layout = {"tp": 8, "ep": 8, "etp": 1, "pp": 2}  # world 1024: dp_shard 64, edp = 1024 / (etp·ep·pp) = 64
    got = rehearse_rank("mixtral-8x22b", layout, WORLD, rank, microbatches=2, block=False)
    assert got["coords"]["edp"] == (0 if rank == 0 else 63)
    assert {k: got["measured"][k] for k in got["estimate"]} == got["estimate"], got
    assert got["fsdp_units"][0] == got["fsdp_units"][1], got["fsdp_units"]
    assert got["groups_missing"] == [], got


def test_one_block_collectives_and_fsdp_units_are_the_solvers():
    """One block's worth at the preset's shapes, forward and backward on the meta device over the rank's tp group:
    every collective (kind, group size, calls) the solver's tp terms predict; FSDP2's units on the rank (those
    gathering parameters of their own) the solver's count (blocks, experts, the root with the embedding/head)."""
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "benchmarks/rehearsal.py", "--preset", "llama3-8b", "--world", str(WORLD),
                          "--layout", "tp=8,pp=2", "--microbatches", "2", "--rank", "1023"],
                         capture_output=True, text=True, check=True)  # its own process: its own fake group
    got = json.loads(out.stdout.strip().splitlines()[-1])
    block = got["block"]
    assert {k: v[0] for k, v in block["measured"].items()} == {k: v[0] for k, v in block["solver"].items()}, block
    assert block["measured"]["all_gather@8"][1] == block["solver"]["all_gather@8"][1]
    assert block["measured"]["reduce_scatter@8"][1] == block["solver"]["reduce_scatter@8"][1]
    assert got["fsdp_units"][0] == got["fsdp_units"][1], got["fsdp_units"]
