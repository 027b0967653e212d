"""The solver's validity rules: every rejection reason reachable, each in the words ``meshplan.parallelize`` /
``meshplan check`` use for the same layout (the same functions: Layout.resolve, not_dividing, check_seq_len,
schedule_problem, etp_problem), and the search's bookkeeping."""

from __future__ import annotations

import pytest

import meshplan
from meshplan.context_parallel.chunks import check_seq_len
from meshplan.plan_file.layout import Layout
from meshplan.plan_file.stages import schedule_problem
from meshplan.solver.candidate import Candidate, Training
from meshplan.solver.presets import cluster_preset, model_preset
from meshplan.solver.rules import REASONS, problem
from meshplan.solver.search import Space, search
from meshplan.solver.shape import ModelShape

pytestmark = pytest.mark.fast

SMALL = ModelShape(layers=4, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=128, name="small")
MOE = ModelShape(layers=4, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=128, experts=4, top_k=2, moe_ffn=96,
                 name="moe")
RUN = Training(seq=64, global_batch=8, dtype="float32")

#: reason → (shape, candidate, training, device): one input each rule rejects
CASES = {
    "layout": (SMALL, Candidate(pp=2, vpp=1, dp_shard=2, cp=2, order="tp-cp-ep-pp-dp", schedule="1f1b",
                                micro_batch=1, microbatches=4), RUN, "cuda"),
    "heads": (SMALL.__class__(**{**SMALL.__dict__, "heads": 6, "hidden": 96, "kv_heads": 6}), Candidate(tp=4, etp=4),
              RUN, "cuda"),
    "kv_heads": (SMALL, Candidate(tp=4, etp=4, micro_batch=8), RUN, "cuda"),
    "vocab": (SMALL.__class__(**{**SMALL.__dict__, "vocab": 129}), Candidate(tp=2, etp=2, micro_batch=8), RUN, "cuda"),
    "ffn": (SMALL.__class__(**{**SMALL.__dict__, "ffn": 129}), Candidate(tp=2, etp=2, micro_batch=8), RUN, "cuda"),
    "experts": (MOE, Candidate(ep=3, dp_shard=3, micro_batch=1, microbatches=1), Training(seq=64, global_batch=3), "cuda"),
    "etp": (MOE, Candidate(tp=2, etp=4, dp_shard=2, micro_batch=4), RUN, "cuda"),
    "sequence": (SMALL, Candidate(cp=2, dp_shard=1, micro_batch=8), Training(seq=66, global_batch=8), "cuda"),
    "blocks": (SMALL, Candidate(pp=4, vpp=2, schedule="interleaved_1f1b", micro_batch=1, microbatches=8), RUN, "cuda"),
    "schedule": (SMALL, Candidate(pp=2, schedule="1f1b", micro_batch=8, microbatches=1), RUN, "cuda"),
    "batch": (SMALL, Candidate(dp_shard=3, micro_batch=1, microbatches=3), RUN, "cuda"),
    "device": (SMALL, Candidate(cp=2, micro_batch=8), Training(seq=64, global_batch=8, cp_method="torch_ring"), "cpu"),
}


@pytest.mark.parametrize("reason", list(CASES))
def test_each_reason_is_reachable(reason):
    shape, cand, train, device = CASES[reason]
    found = problem(shape, cand, train, device)
    assert found is not None and found[0] == reason, found


def test_every_reason_has_a_case():
    assert set(CASES) | {"memory"} == set(REASONS)


def test_memory_reason_from_the_search():
    tiny = cluster_preset("h100-80g").__class__(**{**cluster_preset("h100-80g").__dict__, "memory": 1e6})
    res = search(SMALL, RUN, tiny, 4, Space(ac=("none",), micro_batches=(8,)))
    assert not res.valid and res.reasons()["memory"] > 0
    msg = next(r.message for r in res.rejected if r.reason == "memory")
    assert "GiB usable" in msg and "activations" in msg


def test_same_words_as_the_layout_and_schedule_rules():
    cand = CASES["layout"][1]
    with pytest.raises(meshplan.PlanError) as e:
        Layout(pp=2, cp=2, order="tp-cp-ep-pp-dp").resolve(8)
    assert problem(SMALL, cand, RUN)[1] == f"layout: {e.value}"
    assert problem(SMALL, *CASES["sequence"][1:3])[1] == check_seq_len(66, 2, True, 1)
    assert problem(SMALL, *CASES["schedule"][1:3])[1] == schedule_problem("1f1b", 1, 2, 1)


def _check_errors(plan: dict, world: int, **model_kw) -> list[str]:
    import llama
    args = llama.tiny_args(n_layers=4, **model_kw)
    return [str(e) for e in meshplan.check(llama.build(args), plan, world_size=world).errors]


def test_kv_heads_wording_matches_check():
    import yaml
    tp = yaml.safe_load(open("plans/llama.yaml"))["tensor_parallel"]
    errors = _check_errors({"layout": {"tp": 4}, "tensor_parallel": tp}, 4, n_heads=4, n_kv_heads=2)
    solver = problem(SMALL, Candidate(tp=4, etp=4, micro_batch=8), RUN)[1]
    core = "tp(4) does not divide"
    assert core in solver and "valid tp: 1, 2" in solver
    assert any(core in e and "valid tp: 1, 2" in e for e in errors), errors


def test_split_backward_beside_other_parallelism_is_refused_alike():
    plan = {"layout": {"pp": 2, "vpp": 2}, "blocks": {"pattern": "layers.*"},
            "pipeline": {"schedule": "zbv_zero_bubble", "microbatches": 4}}
    errors = _check_errors(plan, 4)
    cand = Candidate(pp=2, vpp=2, dp_shard=2, schedule="zbv_zero_bubble", micro_batch=1, microbatches=4)
    solver = problem(SMALL, cand, RUN)
    assert solver[0] == "schedule" and "splits each backward" in solver[1]
    assert any(solver[1] in e for e in errors), errors
    assert not _check_errors({**plan, "layout": {"pp": 2, "vpp": 2, "dp_shard": 1}}, 2)  # pipeline alone: runs
    tp = problem(SMALL, cand.with_(tp=2, etp=2, dp_shard=1, micro_batch=2), RUN)
    assert tp[0] == "schedule" and "tp(2)" in tp[1]


def test_search_bookkeeping_and_ranking():
    res = search(SMALL, RUN, cluster_preset("h100-80g"), 8)
    assert res.valid and res.enumerated >= len(res.valid) + len(res.rejected)
    times = [e.step_time for e in res.valid]
    assert times == sorted(times)
    assert set(res.reasons()) <= set(REASONS)
    for e in res.valid[:20]:
        assert problem(SMALL, e.candidate, RUN) is None
        assert e.memory.total <= 80e9 * 0.9


def test_pinned_degrees_and_a_16k_prefix():
    res = search(model_preset("llama3-405b"), Training(seq=8192, global_batch=2048), cluster_preset("h100-80g"),
                 16384, Space(fixed={"tp": 8, "pp": 16}, micro_batches=(1,), ac=("full",)))
    assert res.valid and all(e.candidate.tp == 8 and e.candidate.pp == 16 for e in res.valid)
