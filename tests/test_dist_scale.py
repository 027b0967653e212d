"""``benchmarks/scale.py`` at its smallest size (``--size tiny``: hidden 64, 2 layers): every layout (tp 4,
pp 2 × tp 2, pp 2 × FSDP2 2, ep on the MoE, cp 2 × tp 2) and every start (materialize, load_safetensors,
meshplan.load) on 4 gloo processes, in two launches (the one-process launch writes the checkpoints). Each phase
reports on every rank, trains one step to a finite loss, holds less than the whole model, and its parameter,
gradient and AdamW bytes measured from its local tensors equal ``meshplan estimate --rank R``'s (AdamW's on the
MoE: 4 bytes a layer apart, one ``step`` tensor: the estimate counts the experts as three tensors, transformers
5.24 packs ``gate_up_proj``)."""

from __future__ import annotations

import math
import sys

import pytest

from tests._launch import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import scale  # noqa: E402

pytestmark = pytest.mark.dist


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    work = str(tmp_path_factory.mktemp("scale"))
    args = scale.parse_args(["--size", "tiny", "--steps", "1", "--launch-per", "all", "--work", work])
    return scale.run(args)


def test_every_phase_reports_on_every_rank(results):
    want = [(k, s) for k in scale.layout_plans() for s in scale.STARTS]
    for rank in range(4):
        phases = results["world"][rank]["phases"]
        assert [(p["layout"], p["start"]) for p in phases] == want
        for p in phases:
            assert not p.get("error", "").startswith("failed"), (rank, p)


def test_each_rank_holds_a_shard_and_trains(results):
    whole = {ph["layout"][4:]: ph["params"] for ph in results["one"][0]["phases"]}
    for rank in range(4):
        for p in results["world"][rank]["phases"]:
            if "error" in p:
                continue
            assert 0 < p["params"] < whole[results["layouts"][p["layout"]]["model"]], (rank, p)
            assert p["optimizer"] > 0 and all(math.isfinite(x) for x in p["loss"]), (rank, p)
            assert p["hwm_kib"] >= p["hwm_start_kib"] >= results["world"][rank]["baseline_kib"] // 2, p


def test_measured_bytes_equal_the_estimate(results):
    for rank in range(4):
        for p in results["world"][rank]["phases"]:
            est = results["est"][f"{p['layout']}:{rank}"]
            if "error" in p or est is None:
                continue
            assert p["params"] == est["params"] and p["grads"] == est["grads"], (rank, p["layout"], est)
            # AdamW: two moments shaped like each local parameter and a 4-byte step per parameter with state
            assert p["optimizer"] == 2 * p["params"] + 4 * p["states"], (rank, p)
            if p["layout"] != "ep":  # the estimate counts Mixtral's experts as 3 tensors a layer (w1, w2, w3);
                assert p["optimizer"] == est["optimizer"], (rank, p["layout"], est)  # transformers packs gate|up


def test_table_has_a_row_per_rank_and_phase(results):
    text = scale.table(results, results["layouts"])
    assert text.count("\n| tp4 | init |") == 4 and "peak / (p+g+opt+base)" in text
