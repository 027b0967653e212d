"""Real gloo processes: data parallelism (FSDP2/HSDP/replicate, ± TP) vs one device, collective counts.

Parity cases build the model and the one-device reference in float64 (``tests/_float64.py``; gloo reduces
float64), so reordered sums differ by ~1e-16 and ``tests/test_dist_dp.py`` holds every parameter, loss and norm to
the one fixed tolerance ``_float64.RTOL``. Collective counts, meta init and mixed precision run in float32."""

import os
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

import meshplan
from _float64 import RTOL, float64_model, keep_float64
from _launch import run_cases
from benchmarks._comm import CommLog
from llama import build, tiny_args
from meshplan.data_parallel.fsdp import apply_data_parallel
from meshplan.training.step import train_step

WORLD = int(os.environ["WORLD_SIZE"])
GLOBAL_BATCH, SEQ, STEPS, LR, MAX_NORM = 8, 16, 3, 1e-3, 0.5
TP_RULES = {
    "tok_embeddings": "embedding", "layers.*.attention_norm": "norm", "layers.*.attention.wq": "colwise",
    "layers.*.attention.wk": "colwise", "layers.*.attention.wv": "colwise", "layers.*.attention.wo": "rowwise",
    "layers.*.ffn_norm": "norm", "layers.*.feed_forward.w1": "colwise", "layers.*.feed_forward.w3": "colwise",
    "layers.*.feed_forward.w2": "rowwise", "norm": "norm", "output": "lm_head",
}


def sum_ce(out, y):
    if isinstance(out, DTensor):
        out = out.full_tensor()
    out = out.flatten(0, 1)
    return F.cross_entropy(out.to(torch.promote_types(out.dtype, torch.float32)), y.flatten(), reduction="sum")


def global_batch(step, vocab):
    """Tokens and targets with very uneven numbers of valid targets per row (some rows: none)."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randint(0, vocab, (GLOBAL_BATCH, SEQ), generator=g)
    y = torch.randint(0, vocab, (GLOBAL_BATCH, SEQ), generator=g)
    keep = torch.rand(GLOBAL_BATCH, SEQ, generator=g) < torch.linspace(0.05, 1.0, GLOBAL_BATCH)[:, None]
    keep[3] = False  # a row without a single valid token
    return x, torch.where(keep, y, -100)


def optimizer(params, kind="adamw"):
    """AdamW, or SGD with momentum (the regather cases, chosen when they ran in float32: AdamW divides fp32 noise
    by its own running size, at tp 4 a few 1e-5 after 3 steps)."""
    return torch.optim.AdamW(params, lr=LR) if kind == "adamw" else torch.optim.SGD(params, lr=0.05, momentum=0.9)


def reference(steps, args, opt_kind="adamw"):
    """One device, the full global batch, F.cross_entropy mean, torch's clip_grad_norm_, AdamW (or SGD)."""
    torch.manual_seed(0)
    model = float64_model(build(args))
    opt = optimizer(model.parameters(), opt_kind)
    losses, norms = [], []
    for s in range(steps):
        x, y = global_batch(s, args.vocab_size)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten(), ignore_index=-100)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        losses.append(float(loss))
        opt.step()
        opt.zero_grad()
    return model, losses, norms


def _build(layout, dp_section, args, tp, sp, lp, blocks=None, save=None, dtype=torch.float64):
    """The parallel model; ``dp_section`` None: a plan without a data_parallel section (tp only); ``blocks``: the
    blocks section (checkpointing)."""
    topo = meshplan.build_mesh(layout)
    torch.manual_seed(0)
    model = build(args).to(dtype)
    if tp:
        plan = {"tensor_parallel": {"sequence_parallel": sp, "loss_parallel": lp, "rules": TP_RULES}}
        if save is not None:
            plan["tensor_parallel"]["save_gathered_inputs"] = save
        if dp_section is not None:
            plan["data_parallel"] = dp_section
        if blocks is not None:
            plan["blocks"] = blocks
        meshplan.parallelize(model, plan, topo)  # TP, blocks, then FSDP (sp read from the model's state)
    else:
        apply_data_parallel(model, dp_section, topo, blocks=blocks)
    dp, r = topo.data_world_size, topo.data_rank
    if sp == "batch":  # smp: every tp rank loads its own part of the batch
        dp, r = dp * topo.layout.tp, r * topo.layout.tp + topo.tp_rank
    return model, dp, r


def _my_batches(steps, args, dp, r):
    """Per step: this data rank's rows of the global batch, and the global targets."""
    rows = GLOBAL_BATCH // dp
    for s in range(steps):
        x, y = global_batch(s, args.vocab_size)
        yield x[r * rows:(r + 1) * rows], y[r * rows:(r + 1) * rows], y


def parallel(layout, dp_section, steps, args, microbatches, tp=False, sp=True, lp=False, blocks=None, save=None,
             opt_kind="adamw", dtype=torch.float64):
    model, dp, r = _build(layout, dp_section, args, tp, sp, lp, blocks, save, dtype)
    opt = optimizer(model.parameters(), opt_kind)
    loss_fn = (lambda out, y: meshplan.cross_entropy(out, y, reduction="sum")) if lp else sum_ce
    results = []
    for *batch, _ in _my_batches(steps, args, dp, r):
        results.append(train_step(model, tuple(batch), loss_fn, opt, microbatches=microbatches, max_grad_norm=MAX_NORM))
    return model, results


def _final_grads(model):
    """After backward every gradient has its parameter's placement and local shape (no Partial left)."""
    for name, p in model.named_parameters():
        if isinstance(p, DTensor) and p.grad is not None:
            assert p.grad.placements == p.placements, (name, p.grad.placements, p.placements)
            assert p.grad.to_local().shape == p.to_local().shape, name


def hand_loop(layout, dp_section, steps, args, microbatches, sp=True, no_sync=False):
    """A hand-written loop, no train_step: loss / global count, one backward per microbatch, clip, AdamW."""
    model, dp, r = _build(layout, dp_section, args, True, sp, False)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    results = []
    for x, y, y_global in _my_batches(steps, args, dp, r):
        count = int((y_global != -100).sum())  # every rank knows the global batch here
        xs, ys = x.chunk(microbatches), y.chunk(microbatches)
        total = torch.zeros((), dtype=torch.float64)
        for i, (xm, ym) in enumerate(zip(xs, ys)):
            if no_sync:  # FSDP2 reduces only the last microbatch's (accumulated) gradients
                model.set_requires_gradient_sync(i == microbatches - 1)
            loss = sum_ce(model(xm), ym)
            (loss / count).backward()
            total += loss.detach().double()
            if not no_sync or i == microbatches - 1:
                _final_grads(model)
        norm = meshplan.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
        opt.zero_grad()
        dist.all_reduce(total)  # each data shard is held by WORLD / dp ranks
        results.append(SimpleNamespace(loss=float(total) * dp / WORLD / count, grad_norm=norm, num_tokens=count))
    return model, results


def compare(layout, section=None, microbatches=1, tp=False, sp=True, lp=False, hand=False, no_sync=False,
            no_dp=False, blocks=None, save=None, opt_kind="adamw", **model_kw):
    """One device vs ``layout``; ``save``: the plan's ``save_gathered_inputs`` (None: the default, false)."""
    args = tiny_args(**model_kw)
    ref, ref_losses, ref_norms = reference(STEPS, args, opt_kind)
    section = None if no_dp else section or {}
    if hand:
        model, results = hand_loop(layout, section, STEPS, args, microbatches, sp, no_sync)
    else:
        model, results = parallel(layout, section, STEPS, args, microbatches, tp, sp, lp, blocks, save, opt_kind)
    ref_params = dict(ref.named_parameters())
    worst, worst_name = 0.0, ""
    for name, p in model.named_parameters():
        full = p.full_tensor() if isinstance(p, DTensor) else p
        want = ref_params[name.replace("_checkpoint_wrapped_module.", "")]
        rel = float((full.detach() - want.detach()).norm() / want.detach().norm())
        worst, worst_name = max((worst, worst_name), (rel, name))
        assert rel <= RTOL, (name, rel)
    for res, loss, norm in zip(results, ref_losses, ref_norms):
        assert abs(res.loss - loss) <= RTOL * abs(loss), (res.loss, loss)
        assert abs(res.grad_norm - norm) <= RTOL * norm, (res.grad_norm, norm)
        assert norm > MAX_NORM  # clipping really happened
    return {"worst": worst, "worst_name": worst_name, "tokens": [r.num_tokens for r in results],
            "loss": [r.loss for r in results]}


def _model(layout, section, tp):
    args = tiny_args()
    topo = meshplan.build_mesh(layout)
    torch.manual_seed(0)
    model = build(args)
    if tp:
        meshplan.parallelize(model, {"tensor_parallel": {"sequence_parallel": True, "loss_parallel": False,
                                                         "rules": TP_RULES}, "data_parallel": section}, topo)
    else:
        apply_data_parallel(model, section, topo)
    rows = GLOBAL_BATCH // topo.data_world_size
    x, y = global_batch(0, args.vocab_size)
    return model, topo, (x[:rows], y[:rows])


def comm_counts(layout, section=None, tp=False, microbatches=1, eager=False, no_sync=False):
    """Collectives of one step (after a warm-up step), by op name; eager: the backwards of a hand-written loop."""
    model, topo, batch = _model(layout, section or {}, tp)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    train_step(model, batch, sum_ce, opt, microbatches=microbatches, max_grad_norm=MAX_NORM)
    if not eager:
        with CommLog() as counter:
            train_step(model, batch, sum_ce, opt, microbatches=microbatches, max_grad_norm=MAX_NORM)
        return dict(counter.by_group())
    per_backward = []
    for i, (x, y) in enumerate(zip(batch[0].chunk(microbatches), batch[1].chunk(microbatches))):
        if no_sync:
            model.set_requires_gradient_sync(i == microbatches - 1)
        with CommLog() as counter:
            sum_ce(model(x), y).backward()
        _final_grads(model)
        per_backward.append(dict(counter.by_group()))
    return per_backward[0] if microbatches == 1 else per_backward


def mixed_precision():
    """bf16 compute, fp32 reduction: close to the (float64) reference, sharded parameters stay fp32."""
    args = tiny_args()
    _, ref_losses, _ = reference(1, args)
    model, results = parallel({"dp_shard": 2}, {"param_dtype": "bfloat16", "reduce_dtype": "float32"}, 1, args, 2,
                              dtype=torch.float32)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert abs(results[0].loss - ref_losses[0]) < 2e-2 * ref_losses[0], (results[0].loss, ref_losses[0])
    return results[0].loss


def control_mean_of_means():
    """The test has teeth: per-rank means (what users get wrong) miss the reference by far more than RTOL."""
    args = tiny_args()
    ref, _, _ = reference(1, args)
    topo = meshplan.build_mesh({"dp_shard": 2})
    torch.manual_seed(0)
    model = apply_data_parallel(float64_model(build(args)), {"gradient_reduction": "mean"}, topo)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    x, y = global_batch(0, args.vocab_size)
    r, rows = topo.data_rank, GLOBAL_BATCH // 2
    xs, ys = x[r * rows:(r + 1) * rows], y[r * rows:(r + 1) * rows]
    loss = F.cross_entropy(model(xs).flatten(0, 1), ys.flatten(), ignore_index=-100)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    opt.step()
    ref_params = dict(ref.named_parameters())
    return max(float((p.full_tensor() - ref_params[n]).norm() / ref_params[n].norm())
               for n, p in model.named_parameters())


def vocab_ends_mean(**model_kw):
    """``gradient_reduction: mean`` divides the vocab-parallel ends' gradients as FSDP2 divides its units' (a tied
    weight once): after one backward of a per-rank mean loss, every gradient equals the one of the model with FSDP2
    ends."""
    args = tiny_args(**model_kw)
    topo, xs, ys = _dp2_rows(args)
    grads = []
    for ends in ("fsdp", "vocab_parallel"):
        torch.manual_seed(0)
        model = apply_data_parallel(float64_model(build(args)), {"gradient_reduction": "mean", "ends": ends}, topo)
        F.cross_entropy(model(xs).flatten(0, 1), ys.flatten(), ignore_index=-100).backward()
        grads.append({n: p.grad.full_tensor() for n, p in model.named_parameters()})
    return _worst_rel(*grads)


def _dp2_rows(args):
    """A dp_shard 2 topology and this rank's rows of step 0's global batch."""
    topo = meshplan.build_mesh({"dp_shard": 2})
    x, y = global_batch(0, args.vocab_size)
    rows = GLOBAL_BATCH // 2
    xs, ys = (t[topo.data_rank * rows:(topo.data_rank + 1) * rows] for t in (x, y))
    return topo, xs, ys


def _worst_rel(want, got):
    return max(float((g - want[n]).norm() / want[n].norm()) for n, g in got.items())


def vocab_ends_from_meta():
    """Meta → parallelize (vocab ends) → materialize: the replaced parameters still get their rows' gradients
    (each contribution sliced to the rank's rows, not the whole weight's kept) equal to the CPU-built model's."""
    args = tiny_args()
    topo, xs, ys = _dp2_rows(args)
    grads = []
    for device in ("cpu", "meta"):
        torch.manual_seed(0)
        with torch.device(device):
            model = build(args)
        model = meshplan.parallelize(model, {"data_parallel": {"ends": "vocab_parallel"}}, topo)
        if device == "meta":
            model = meshplan.materialize(model, seed=0)
        for _ in range(2):  # two contributions accumulated
            sum_ce(model(xs), ys).backward()
        _final_grads(model)
        emb = model.tok_embeddings.weight.grad.to_local()
        assert emb.untyped_storage().nbytes() == emb.numel() * emb.element_size(), "the whole gradient kept"
        grads.append({n: p.grad.full_tensor() for n, p in model.named_parameters()})
    return _worst_rel(*grads)


def chunked_reduce_scatter():
    """``ChunkedReduceScatter`` with pieces of 64 bytes (many per chunk, a short last one) equals gloo's
    reduce_scatter_tensor bit for bit, and frees its input."""
    from meshplan.data_parallel.chunked import ChunkedReduceScatter
    comm, group = ChunkedReduceScatter(piece_bytes=64), dist.group.WORLD
    x = torch.arange(1002.0, dtype=torch.float64) * (dist.get_rank() + 1.5)
    want = torch.empty(1002 // WORLD, dtype=torch.float64)
    dist.reduce_scatter_tensor(want, x.clone())
    got = comm.allocate((1002 // WORLD,), dtype=torch.float64, device=x.device)
    comm(output_tensor=got, input_tensor=x, group=group, op=dist.ReduceOp.SUM)
    assert torch.equal(got, want) and x.untyped_storage().nbytes() == 0, (got, want)
    return repr(comm)


def meta_init_and_load(layout):
    """FSDP2 over tensor-parallel Shard(0) weights (colwise, vocab-parallel embedding, lm_head): a meta-device
    model materialized with a seed equals the one-device model, and a full state dict loads into the right rows
    (each dp rank's slice of each tp shard, torch's _StridedShard order)."""
    args = tiny_args()
    plan = {"layout": layout, "tensor_parallel": {"sequence_parallel": True, "loss_parallel": True,
                                                  "rules": TP_RULES}, "data_parallel": {}}
    topo = meshplan.build_mesh(layout)
    torch.manual_seed(0)
    ref = build(args)
    with torch.device("meta"):
        model = meshplan.parallelize(build(args), plan, topo)
    meshplan.materialize(model, seed=0)
    want = dict(ref.named_parameters())
    wrong = [n for n, p in model.named_parameters() if not torch.equal(p.full_tensor(), want[n].detach())]
    assert not wrong, f"materialize: {wrong}"
    with torch.no_grad():
        for p in ref.parameters():
            p.mul_(-2.0)
    meshplan.load_state_dict(model, ref.state_dict() if dist.get_rank() == 0 else None)
    wrong = [n for n, p in model.named_parameters() if not torch.equal(p.full_tensor(), want[n].detach())]
    assert not wrong, f"load_state_dict: {wrong}"
    return {"parameters": len(want)}


def regather_counts(layout, **model_kw):
    """Collectives of one forward and one backward with save_gathered_inputs true and false (tp only)."""
    args = tiny_args(**model_kw)
    x, y = global_batch(0, args.vocab_size)
    out = {}
    for save in (True, False):
        model, _, _ = _build(layout, None, args, True, True, False, save=save)
        with CommLog() as fwd:
            loss = sum_ce(model(x), y)
        with CommLog() as bwd:
            loss.backward()
        out[str(save).lower()] = {"forward": dict(fwd.by_group()), "backward": dict(bwd.by_group())}
    return out


def sharded_init(layout):
    """materialize(mode="sharded") under ``layout``, then 3 SGD steps (tests/dist/init_sharded.py)."""
    from init_sharded import sharded_then_train  # imports pp_meta, which imports this module
    args = tiny_args()
    plan = {"layout": layout, "tensor_parallel": {"sequence_parallel": True, "rules": TP_RULES}}
    return sharded_then_train(lambda: build(args), plan, layout, args.vocab_size)


CASES_BY_WORLD = {
    4: {
        "regather_tp4": lambda: compare({"tp": 4}, tp=True, n_kv_heads=4, opt_kind="sgd"),
        "regather_tp4_saved": lambda: compare({"tp": 4}, tp=True, save=True, n_kv_heads=4, opt_kind="sgd"),
        "regather_tp2_fsdp_ac_full": lambda: compare({"dp_shard": 2, "tp": 2}, tp=True, blocks={
            "activation_checkpointing": {"mode": "full"}}),
        "regather_tp2_fsdp_ac_selective": lambda: compare({"dp_shard": 2, "tp": 2}, tp=True, blocks={
            "activation_checkpointing": {"mode": "selective", "ops": ["aten.mm.default"]}}),
        "regather_tp2_fsdp_ac_megatron": lambda: compare({"dp_shard": 2, "tp": 2}, tp=True, blocks={
            "activation_checkpointing": {"mode": "selective", "policy": "megatron"}}),
        "regather_tp2_fsdp_every2": lambda: compare({"dp_shard": 2, "tp": 2}, tp=True, n_layers=4, blocks={
            "activation_checkpointing": {"mode": "selective", "every": 2}}),
        "regather_tp2_fsdp_saved": lambda: compare({"dp_shard": 2, "tp": 2}, tp=True, save=True),
        "regather_counts_tp4": lambda: regather_counts({"tp": 4}, n_kv_heads=4),
        "meta_init_and_load_fsdp_tp": lambda: meta_init_and_load({"dp_shard": 2, "tp": 2}),
        "sharded_init_fsdp_tp": lambda: sharded_init({"dp_shard": 2, "tp": 2}),
        "sharded_init_views_tp4": lambda: __import__("init_sharded").views_on_real_ranks(),
        "fsdp_tp": lambda: compare({"dp_shard": 2, "tp": 2}, tp=True),
        "hsdp": lambda: compare({"dp_replicate": 2, "dp_shard": 2}, microbatches=2),
        "ddp_tp": lambda: compare({"dp_replicate": 2, "tp": 2}, tp=True),
        "fsdp_tp_loss_parallel": lambda: compare({"dp_shard": 2, "tp": 2}, microbatches=2, tp=True, lp=True),
        "fsdp_tp_batch": lambda: compare({"dp_shard": 2, "tp": 2}, microbatches=2, tp=True, sp="batch",
                                         blocks={"activation_checkpointing": {"mode": "full"}}),
        "fsdp_reshard2_accum2": lambda: compare({"dp_shard": 4}, {"reshard_after_forward": 2}, microbatches=2),
        "counts_fsdp_tp": lambda: comm_counts({"dp_shard": 2, "tp": 2}, tp=True),
        "counts_fsdp_tp_eager": lambda: comm_counts({"dp_shard": 2, "tp": 2}, tp=True, eager=True),
        "counts_fsdp_tp_eager_nosync2": lambda: comm_counts({"dp_shard": 2, "tp": 2}, tp=True, eager=True,
                                                            microbatches=2, no_sync=True),
        "loop_fsdp_tp": lambda: compare({"dp_shard": 2, "tp": 2}, hand=True),
        "loop_fsdp_tp_accum2": lambda: compare({"dp_shard": 2, "tp": 2}, microbatches=2, hand=True),
        "loop_fsdp_tp_nosync2": lambda: compare({"dp_shard": 2, "tp": 2}, microbatches=2, hand=True, no_sync=True),
        "loop_ddp_tp_accum2": lambda: compare({"dp_replicate": 2, "tp": 2}, microbatches=2, hand=True),
        "loop_fsdp_tp_batch": lambda: compare({"dp_shard": 2, "tp": 2}, microbatches=2, hand=True, sp="batch"),
        "counts_fsdp_tp_accum2": lambda: comm_counts({"dp_shard": 2, "tp": 2}, tp=True, microbatches=2),
        "counts_hsdp_accum2": lambda: comm_counts({"dp_replicate": 2, "dp_shard": 2}, microbatches=2),
        "hsdp_chunked_rs": lambda: compare({"dp_replicate": 2, "dp_shard": 2}, {"reduce_scatter": "chunked"},
                                           microbatches=2),
    },
    8: {
        "regather_tp4_fsdp2": lambda: compare({"dp_shard": 2, "tp": 4}, tp=True, n_kv_heads=4, opt_kind="sgd"),
        "hsdp_tp_accum2": lambda: compare({"dp_replicate": 2, "dp_shard": 2, "tp": 2}, blocks={
            "activation_checkpointing": {"mode": "selective", "every": 2, "ops": ["aten.mm.default"]}},
            microbatches=2, tp=True),
        "loop_hsdp_tp_nosync2": lambda: compare({"dp_replicate": 2, "dp_shard": 2, "tp": 2}, microbatches=2,
                                                hand=True, no_sync=True),
    },
    2: {
        "fsdp": lambda: compare({"dp_shard": 2}),
        "fsdp_accum2": lambda: compare({"dp_shard": 2}, microbatches=2),
        "fsdp_accum2_sharded": lambda: compare({"dp_shard": 2}, {"accumulate_unsharded": False}, microbatches=2),
        "ddp": lambda: compare({"dp_replicate": 2}, microbatches=2),
        "tp_only": lambda: compare({"tp": 2}, tp=True),
        "tp_only_batch": lambda: compare({"tp": 2}, microbatches=2, tp=True, sp="batch"),
        "tp_only_batch_no_dp_section": lambda: compare({"tp": 2}, microbatches=2, tp=True, sp="batch", no_dp=True),
        "loop_tp_only_accum2": lambda: compare({"tp": 2}, microbatches=2, hand=True, no_dp=True),
        "loop_tp_only_batch": lambda: compare({"tp": 2}, microbatches=2, hand=True, sp="batch", no_dp=True),
        "fsdp_vocab_ends": lambda: compare({"dp_shard": 2}, {"ends": "vocab_parallel"}),
        # hand-written: every gradient after each backward has its parameter's placement (_final_grads)
        "loop_fsdp_vocab_ends_accum2": lambda: compare({"dp_shard": 2}, {"ends": "vocab_parallel"}, microbatches=2,
                                                       hand=True),
        "fsdp_vocab_ends_accum2": lambda: compare({"dp_shard": 2}, {"ends": "vocab_parallel"}, microbatches=2),
        "fsdp_vocab_ends_accum2_sharded": lambda: compare(
            {"dp_shard": 2}, {"ends": "vocab_parallel", "accumulate_unsharded": False}, microbatches=2),
        "fsdp_vocab_ends_tied": lambda: compare({"dp_shard": 2}, {"ends": "vocab_parallel"}, tie_embeddings=True),
        "vocab_ends_mean": vocab_ends_mean,
        "vocab_ends_mean_tied": lambda: vocab_ends_mean(tie_embeddings=True),
        "chunked_reduce_scatter": chunked_reduce_scatter,
        "fsdp_no_prefetch_accum2_sharded": lambda: compare(
            {"dp_shard": 2}, {"prefetch": False, "accumulate_unsharded": False}, microbatches=2),
        "vocab_ends_from_meta": vocab_ends_from_meta,
        "fsdp_chunked_rs": lambda: compare({"dp_shard": 2}, {"reduce_scatter": "chunked"}),
        "fsdp_chunked_rs_accum2_sharded": lambda: compare(
            {"dp_shard": 2}, {"reduce_scatter": "chunked", "accumulate_unsharded": False}, microbatches=2),
        "fsdp_vocab_ends_chunked_rs_accum2": lambda: compare(
            {"dp_shard": 2}, {"ends": "vocab_parallel", "reduce_scatter": "chunked"}, microbatches=2),
        "counts_fsdp_vocab_ends": lambda: comm_counts({"dp_shard": 2}, {"ends": "vocab_parallel"}),
        "counts_fsdp": lambda: comm_counts({"dp_shard": 2}),
        "counts_fsdp_accum2": lambda: comm_counts({"dp_shard": 2}, microbatches=2),
        "counts_fsdp_accum2_sharded": lambda: comm_counts({"dp_shard": 2}, {"accumulate_unsharded": False},
                                                          microbatches=2),
        "counts_ddp_accum2": lambda: comm_counts({"dp_replicate": 2}, microbatches=2),
        "control_mean_of_means": control_mean_of_means,
        "mixed_precision": mixed_precision,
        "fsdp_ac_selective": lambda: compare({"dp_shard": 2}, {"reshard_after_forward": False}, blocks={
            "activation_checkpointing": {"mode": "selective", "ops": ["aten.mm.default"]}}),
        "counts_fsdp_vocab_ends_accum2": lambda: comm_counts({"dp_shard": 2}, {"ends": "vocab_parallel"},
                                                             microbatches=2),
        "counts_fsdp_vocab_ends_accum2_sharded": lambda: comm_counts(
            {"dp_shard": 2}, {"ends": "vocab_parallel", "accumulate_unsharded": False}, microbatches=2),
    },
}

def launch_cases():
    """This launch's cases and the context they run in (``tests/dist/suite_worker.py`` runs several workers' in one
    launch)."""
    return CASES_BY_WORLD[WORLD], keep_float64


if __name__ == "__main__":
    dist.init_process_group("gloo")
    with keep_float64():
        run_cases(launch_cases()[0])
