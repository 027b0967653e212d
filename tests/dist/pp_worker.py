"""Real gloo processes: pipeline parallelism (± TP, ± FSDP) vs one device over 3 AdamW steps with clipping.

Every case trains the examples' Llama (or transformers' Llama) in float64 through ``meshplan.parallelize`` +
``meshplan.train_step`` beside a float64 one-device run (``tests/_float64.py``; gloo reduces float64) and checks,
on every rank, each parameter it holds (‖Δ‖/‖ref‖ ≤ ``RTOL``), each step's loss and pre-clip norm (``RTOL``
relative), and that the state-dict keys of all ranks together are the full model's. ``RTOL`` is the one fixed
tolerance of ``_float64`` (1e-9): in float32, AdamW's per-element scaling turned reordering noise into 6.3e-5
on ``tok_embeddings`` of the 4-layer model at tp 2 and 2.7e-5 between one full-batch backward and 4 accumulated
ones; in float64 both are ~1e-15.
"""

import functools
import os

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import meshplan
from _float64 import RTOL, float64_model, keep_float64
from _launch import run_cases
from dp_worker import TP_RULES, sum_ce  # the tensor-parallel plan and summed loss of the data-parallel cases
from llama import build, tiny_args
from examples import hf_models
from pp_meta import meta_checkpoint, meta_materialize

HF_RULES = meshplan.load_plan("plans/hf_llama.yaml").tensor_parallel.model_dump(mode="json")["rules"]

CP_HF = {"attention": "model.layers.*.self_attn"}
WORLD = int(os.environ["WORLD_SIZE"])
GLOBAL_BATCH, SEQ, STEPS, LR, MAX_NORM = 8, 16, 3, 1e-3, 0.5
def global_batch(step, vocab):
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randint(0, vocab, (GLOBAL_BATCH, SEQ), generator=g)
    y = torch.randint(0, vocab, (GLOBAL_BATCH, SEQ), generator=g)
    keep = torch.rand(GLOBAL_BATCH, SEQ, generator=g) < torch.linspace(0.05, 1.0, GLOBAL_BATCH)[:, None]
    return x, torch.where(keep, y, -100)


def logits_ce(out, y):
    """The summed loss of a transformers model's output (its logits: a pipelined model's loss function gets the
    ModelOutput class it returns without a pipeline) or of plain logits; of a base model's output (no head), the
    square of its last hidden state projected on a fixed vector, over the valid targets."""
    h = getattr(out, "last_hidden_state", None)
    if h is not None:
        w = torch.arange(h.shape[-1], dtype=h.dtype).mul(0.7).sin()
        return ((h @ w).square() * (y != -100)).sum()
    return sum_ce(out.logits if hasattr(out, "logits") else out, y)


def packed_ids(step):
    """Position ids restarting per document (transformers' padding-free packing) of the global batch, different
    per row and step: rows of one to three documents, one crossing the cp head-tail chunk edges."""
    from meshplan.context_parallel.batch import position_ids_of
    shapes = [[5, 11], [SEQ], [3 + step, SEQ - 3 - step], [4, 4, 8], [1, 15], [7, 9], [2, 3, 11], [9, 7]]
    return torch.cat([position_ids_of(lengths) for lengths in shapes])


def no_side(step, rows=slice(None)):
    return {}


def packed_side(step, rows=slice(None)):
    """The keyword inputs of packed documents: restarting position ids, no cache (with one, transformers ignores
    the packing, on one device too)."""
    return {"position_ids": packed_ids(step)[rows], "use_cache": False}


def reference(make, vocab, microbatches, side=no_side):
    """One device in float64, the same microbatches accumulated (the pipeline's sums in the order they are made);
    ``side(step)``: the global batch's keyword inputs, cut into the same microbatches."""
    torch.manual_seed(0)
    model = float64_model(make())
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, norms = [], []
    for s in range(STEPS):
        x, y = global_batch(s, vocab)
        n, loss, kw = int((y != -100).sum()), 0.0, side(s)
        for i, (xm, ym) in enumerate(zip(x.chunk(microbatches), y.chunk(microbatches))):
            kwm = {k: v.chunk(microbatches)[i] if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
            part = logits_ce(model(xm, **kwm), ym) / n
            part.backward()
            loss += float(part)
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        losses.append(float(loss))
        opt.step()
        opt.zero_grad()
    return model, losses, norms


def topo_dp(layout):
    """Data-parallel ranks of ``layout`` on this world: each splits its rows into the microbatches."""
    return WORLD // (layout.get("pp", 1) * layout.get("tp", 1) * layout.get("cp", 1))  # dp_replicate × dp_shard


def compare(layout, schedule="1f1b", microbatches=4, n_layers=4, tp=False, sp=True, lp=False, dp=None, hf=False,
            tiny=None, tiny_config=None, packed=False, cp=None, **pipe):
    """Train the pipelined model; every parameter this rank holds, the losses and norms vs one device.

    ``hf``: transformers' ``LlamaForCausalLM`` (its stages return ``ModelOutput``s) with plans/hf_llama.yaml's
    rules, instead of the examples' Llama. ``tiny``: a transformers model type, built by ``tiny_hf`` in float64
    (``tiny_config``: more config values). ``packed``: each row packs documents (:func:`packed_side`: keyword
    inputs every stage gets); ``cp``: a context_parallel section (the layout's cp)."""
    tied = pipe.pop("tied", False)
    if tiny:
        make, vocab, container = tiny_hf(tiny, n_layers, sdpa=cp is not None, **(tiny_config or {}))
        rules = None
        pipe.setdefault("blocks", {"pattern": container + ".*"})
    elif hf:
        make, vocab, rules = functools.partial(hf_models.llama, num_hidden_layers=n_layers), 128, HF_RULES
        pipe.setdefault("blocks", {"pattern": "model.layers.*"})
    else:
        args = tiny_args(n_layers=n_layers, **({"tie_embeddings": True} if tied else {}))
        make, vocab, rules = functools.partial(build, args), args.vocab_size, TP_RULES
    side = packed_side if packed else no_side
    if packed:  # teeth: the packing changes the one-device loss by far more than RTOL
        x, y = global_batch(0, vocab)
        with torch.no_grad():
            torch.manual_seed(0)
            m = float64_model(make())
            alone, docs = (float(logits_ce(m(x, **kw), y)) for kw in ({"use_cache": False}, side(0)))
        assert abs(alone - docs) > 100 * RTOL * abs(alone), (alone, docs)
    ref, ref_losses, ref_norms = reference(make, vocab, microbatches * topo_dp(layout), side)
    blocks = pipe.pop("blocks", None)
    plan = {"layout": layout, "pipeline": {"schedule": schedule, "microbatches": microbatches, **pipe},
            **({"blocks": blocks} if blocks else {})}
    if tp:
        plan["tensor_parallel"] = {"sequence_parallel": sp, "loss_parallel": lp, "rules": rules}
    if dp is not None:
        plan["data_parallel"] = dp
    if cp is not None:
        plan["context_parallel"] = cp
    topo = meshplan.build_mesh(layout)
    torch.manual_seed(0)
    model = meshplan.parallelize(float64_model(make()), plan, topo)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    loss_fn = (lambda out, y: meshplan.cross_entropy(out.logits if hf else out, y, reduction="sum")) if lp \
        else logits_ce
    rows = GLOBAL_BATCH // topo.data_world_size
    r = topo.data_rank
    results = []
    for s in range(STEPS):
        x, y = global_batch(s, vocab)
        kw = side(s, slice(r * rows, (r + 1) * rows))
        xr = {"input_ids": x[r * rows:(r + 1) * rows], **kw} if kw else x[r * rows:(r + 1) * rows]
        batch = (xr, y[r * rows:(r + 1) * rows])
        results.append(meshplan.train_step(model, batch, loss_fn, opt, max_grad_norm=MAX_NORM))
    keys = sorted(model.state_dict())
    everyone = [None] * WORLD
    dist.all_gather_object(everyone, keys)  # collectives first, asserts after: a rank that fails one must not
    union = sorted({k for ks in everyone for k in ks})  # leave the others waiting in a gather
    ref_params = dict(ref.named_parameters(remove_duplicate=False))
    rels = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        full = p.full_tensor() if isinstance(p, DTensor) else p
        want = ref_params[name.replace("_checkpoint_wrapped_module.", "")]
        rels[name] = float((full.detach() - want.detach()).norm() / want.detach().norm())
    names, worst = list(rels), max(rels.values())
    assert worst <= RTOL, max(rels.items(), key=lambda kv: kv[1])
    for res, loss, norm in zip(results, ref_losses, ref_norms):
        assert abs(res.loss - loss) <= RTOL * abs(loss), (res.loss, loss)
        assert abs(res.grad_norm - norm) <= RTOL * norm, (res.grad_norm, norm)
    assert union == sorted(ref.state_dict()), (set(ref.state_dict()) ^ set(union))
    return {"worst": worst, "loss": [r.loss for r in results], "params": len(names)}


#: non-trivial settings of the code outside the blocks (transformers' Granite defaults are 1.0: a no-op)
OUTSIDE = {"granite": {"embedding_multiplier": 12.0, "logits_scaling": 8.0, "residual_multiplier": 0.5},
           "cohere": {"logit_scale": 0.25}, "gemma2": {"final_logit_softcapping": 0.5}}


def tiny_hf(arch, n_layers, sdpa=False, **config):
    """``(make, vocab, block container)`` of a tiny transformers ``arch`` with ``n_layers`` layers, in float64
    (gloo reduces float64; the one-device run then differs only by reordering, ~1e-16); ``sdpa``: in SDPA (what
    context parallelism routes), not the tiny config's eager attention."""
    import warnings

    from meshplan.hf.tiny_models import tiny_model

    def make():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model, why = tiny_model(arch, layers=n_layers, **{**OUTSIDE.get(arch, {}), **config})
        assert model is not None, why
        if sdpa:
            model.config._attn_implementation = "sdpa"
        return model.double().train()  # dropouts are 0 in tiny configs
    model = make()
    container = next(n for n, m in model.named_modules()
                     if isinstance(m, torch.nn.ModuleList) and len(m) == n_layers)
    return make, model.config.vocab_size, container


def load_full(layout, tied=False):
    """A full checkpoint (rank 0's dict) loads into the pipelined model: each rank takes its stages' keys, into a
    CPU-built model and into one built on the meta device (its RoPE table computed as on one device)."""
    args = tiny_args(n_layers=4, **({"tie_embeddings": True} if tied else {}))
    torch.manual_seed(1)
    full = build(args)
    plan = {"layout": layout, "pipeline": {"schedule": "1f1b", "microbatches": 2}}
    topo = meshplan.build_mesh(layout)
    torch.manual_seed(2)  # other weights: loading must replace every one
    model = meshplan.parallelize(build(args), plan, topo)
    meshplan.load_full_state_dict(model, full.state_dict() if dist.get_rank() == 0 else None)
    want = dict(full.named_parameters(remove_duplicate=False))
    for name, p in model.named_parameters(remove_duplicate=False):
        assert torch.equal(p.detach(), want[name].detach()), name
    with torch.device("meta"):
        meta = meshplan.parallelize(build(args), plan, topo)
    meshplan.load_full_state_dict(meta, full.state_dict() if dist.get_rank() == 0 else None)
    for name, p in meta.named_parameters(remove_duplicate=False):
        assert torch.equal(p.detach(), want[name].detach()), name
    assert torch.equal(meta.freqs_cis, full.freqs_cis)
    return {"worst": 0.0, "loss": [], "params": len(list(model.parameters()))}


P2 = {"pp": 2}
CASES_2 = {
    "gpipe": lambda: compare(P2, "gpipe"),
    "1f1b": lambda: compare(P2, "1f1b"),
    "interleaved_1f1b": lambda: compare({"pp": 2, "vpp": 2}, "interleaved_1f1b", n_layers=8),
    "looped_bfs": lambda: compare({"pp": 2, "vpp": 2}, "looped_bfs", n_layers=8),
    "interleaved_zero_bubble": lambda: compare({"pp": 2, "vpp": 2}, "interleaved_zero_bubble", n_layers=8),
    "zbv_zero_bubble": lambda: compare({"pp": 2, "vpp": 2}, "zbv_zero_bubble", n_layers=8),
    "dualpipev": lambda: compare({"pp": 2, "vpp": 2}, "dualpipev", n_layers=8),
    "split_points": lambda: compare(P2, "1f1b", split_points=["layers.1"]),
    "fewer_first": lambda: compare(P2, "gpipe", n_layers=5, first_stage_fewer_blocks=1),
    "tied": lambda: compare(P2, "1f1b", tied=True),
    "tied_zbv": lambda: compare({"pp": 2, "vpp": 2}, "zbv_zero_bubble", n_layers=4, tied=True),
    "load_full": lambda: load_full(P2),
    "load_full_tied": lambda: load_full(P2, tied=True),
    "tied_i1f1b": lambda: compare({"pp": 2, "vpp": 2}, "interleaved_1f1b", n_layers=4, tied=True),
    "hf_llama_1f1b": lambda: compare(P2, "1f1b", hf=True),
    # tp rules at tp 1 (a solver's plan keeps its rule sections): the stream is a one-rank DTensor at the boundary
    "tp_rules_at_tp1": lambda: compare(P2, "1f1b", n_layers=2, tp=True, sp=True, lp=True),
    # from the meta device: a transformers checkpoint loaded into each rank's stages; seeded materialize
    "meta_checkpoint": lambda: meta_checkpoint(P2, HF_RULES),
    "meta_materialize": lambda: meta_materialize(P2, TP_RULES),
}
#: transformers decoders with code outside the blocks (issue 24): logit scales (Cohere, Granite), soft-capping
#: (Gemma2), embedding multipliers (Granite, Gemma's normalizer), per-layer sliding/full masks (Gemma2/3, Cohere2)
ZOO = ["cohere", "granite", "gemma2", "gemma3_text", "cohere2", "olmo2"]
CASES_2.update({f"zoo_{arch}": functools.partial(compare, P2, "1f1b", tiny=arch) for arch in ZOO})
#: base models (no head): the last stage gives the last hidden state, the loss function the model's output class
BASE = ["qwen3_vl_text", "eurobert"]
CASES_2.update({f"zoo_base_{arch}": functools.partial(compare, P2, "1f1b", tiny=arch) for arch in BASE})
# split: trace on a config with transformers' default use_cache=True (a DynamicCache in the output broke export)
CASES_2["zoo_trace_granite"] = functools.partial(compare, P2, "1f1b", tiny="granite",
                                                 tiny_config={"use_cache": True}, split="trace",
                                                 split_points=["model.layers.2"], blocks=None)
#: packed documents (position ids restarting per document) as keyword inputs every stage gets: transformers'
#: Llama (the examples'), Qwen2 and Mistral (tiny zoo configs, sliding windows of 8), two schedules each
CASES_2.update({
    "packed_hf_llama_gpipe": lambda: compare(P2, "gpipe", hf=True, packed=True),
    "packed_hf_llama_i1f1b": lambda: compare({"pp": 2, "vpp": 2}, "interleaved_1f1b", n_layers=4, hf=True, packed=True),
    "packed_qwen2_1f1b": lambda: compare(P2, "1f1b", tiny="qwen2", packed=True),
    "packed_mistral_zbv": lambda: compare({"pp": 2, "vpp": 2}, "zbv_zero_bubble", tiny="mistral", packed=True),
})
#: the sweep of docs/pipeline.md (MESHPLAN_PP_ZOO=1): a further list of decoders the suite does not train
SWEEP = ["cohere", "cohere2", "granite", "gemma2", "gemma3_text", "olmo2", "starcoder2", "stablelm", "mistral",
         "phi", "qwen2", "falcon", "gpt_neox", "exaone4", "olmo", "gemma", "glm4", "helium", "smollm3", "gpt2"]
if os.environ.get("MESHPLAN_PP_ZOO"):
    CASES_2 = {f"sweep_{arch}": functools.partial(compare, P2, "1f1b", tiny=arch) for arch in SWEEP}
def sharded_init(layout):
    """materialize() with the plan's ``init: {mode: sharded}`` on pp 2 × tp 2 from meta, then 3 SGD steps."""
    from init_sharded import sharded_then_train
    from pp_meta import _plan
    args = tiny_args(n_layers=4)
    plan = {**_plan(layout, TP_RULES), "blocks": {"pattern": "layers.*"}, "init": {"mode": "sharded"}}
    return sharded_then_train(lambda: build(args), plan, layout, args.vocab_size, mode=None)


CASES_4 = {
    "pp2_tp2_sp_lp": lambda: compare({"pp": 2, "tp": 2}, "1f1b", n_layers=2, tp=True, sp=True, lp=True),
    "pp2_tp2_nosp": lambda: compare({"pp": 2, "tp": 2}, "gpipe", n_layers=2, tp=True, sp=False),
    "pp2_dp2": lambda: compare({"pp": 2}, "1f1b", dp={}),
    # FSDP2 reduce-scatters every microbatch (meshplan.pipeline.reducing.ReducingStage), not once per step
    "pp2_dp2_reduce_each": lambda: compare({"pp": 2}, "1f1b", dp={"accumulate_unsharded": False}),
    # the embedding and head sharded by rows over the 2 data ranks (data_parallel.ends: vocab_parallel), no FSDP2 unit
    "pp2_dp2_vocab_ends": lambda: compare({"pp": 2}, "1f1b", dp={"ends": "vocab_parallel"}),
    "pp2_dp2_vocab_ends_reduce_each": lambda: compare({"pp": 2}, "gpipe", dp={"ends": "vocab_parallel",
                                                                              "accumulate_unsharded": False}),
    "pp2_dp2_vocab_ends_tied": lambda: compare({"pp": 2}, "1f1b", tied=True, dp={"ends": "vocab_parallel"}),
    "pp2_dp2_vocab_ends_chunked_rs": lambda: compare({"pp": 2}, "1f1b", dp={
        "ends": "vocab_parallel", "reduce_scatter": "chunked", "accumulate_unsharded": False,
        "prefetch": False}),
    "hf_llama_pp2_dp2_vocab_ends": lambda: compare({"pp": 2}, "1f1b", hf=True, dp={"ends": "vocab_parallel"}),
    "meta_checkpoint_dp2_vocab_ends": lambda: meta_checkpoint({"pp": 2}, HF_RULES, {"ends": "vocab_parallel"}),
    "pp4": lambda: compare({"pp": 4}, "1f1b", n_layers=4),
    "pp2_ddp": lambda: compare({"pp": 2, "dp_replicate": 2, "dp_shard": 1}, "gpipe", dp={"mode": "ddp"}),
    "hf_llama_pp2_tp2_sp_lp": lambda: compare({"pp": 2, "tp": 2}, "1f1b", n_layers=2, tp=True, sp=True, lp=True,
                                              hf=True),
    "meta_checkpoint_tp2": lambda: meta_checkpoint({"pp": 2, "tp": 2}, HF_RULES),
    "meta_materialize_tp2": lambda: meta_materialize({"pp": 2, "tp": 2}, TP_RULES),
    "sharded_init_pp2_tp2": lambda: sharded_init({"pp": 2, "tp": 2}),
    # packed documents composed: tp 2 (sequence parallel, loss parallel) and cp 2 (its root hook on each stage view
    # gathers the document ids from the position ids; the step shards them per cp rank)
    "packed_hf_llama_pp2_tp2": lambda: compare({"pp": 2, "tp": 2}, "1f1b", n_layers=2, tp=True, sp=True, lp=True,
                                               hf=True, packed=True),
    "packed_hf_llama_pp2_cp2": lambda: compare({"pp": 2, "cp": 2}, "gpipe", hf=True, packed=True, cp=CP_HF),
    "packed_qwen2_pp2_cp2": lambda: compare({"pp": 2, "cp": 2}, "1f1b", tiny="qwen2", packed=True, cp=CP_HF),
    # checkpointed blocks recompute after the later microbatches' forwards: each gets its own forward's documents
    # (context_parallel/replay.py; was 8.7% off: the last microbatch's masks)
    "packed_hf_llama_pp2_cp2_checkpointed": lambda: compare({"pp": 2, "cp": 2}, "gpipe", hf=True, packed=True,
                                                            cp=CP_HF, blocks={"pattern": "model.layers.*",
                                                                              "activation_checkpointing": {"mode": "full"}}),
}

CASES_8 = {
    "pp2_hsdp": lambda: compare({"pp": 2, "dp_replicate": 2, "dp_shard": 2}, "1f1b", microbatches=2, dp={"mode": "hsdp"}),
    "pp2_dp2_tp2": lambda: compare({"pp": 2, "tp": 2}, "1f1b", n_layers=2, tp=True, sp=True, lp=True, dp={}),
}

def launch_cases():
    """This launch's cases and the context they run in (``tests/dist/suite_worker.py`` runs several workers' in one
    launch)."""
    return {2: CASES_2, 4: CASES_4, 8: CASES_8}[WORLD], keep_float64


if __name__ == "__main__":
    dist.init_process_group("gloo")
    with keep_float64():
        run_cases(launch_cases()[0])
