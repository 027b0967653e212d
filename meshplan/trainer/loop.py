"""``meshplan train``'s run: meta model → parallelize → weights → the loop (data, schedule, clipping, evaluation,
checkpoints, metrics) → export. Every rank runs it under torchrun; rank 0 prints.
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import meshplan
from meshplan.data import PackedTokens, TokenFile, corpus_files, tokenize_corpus
from meshplan.data.order import step_seed
from meshplan.errors import PlanError
from meshplan.plan_file.document import Plan
from meshplan.plan_file.training import Training
from meshplan.trainer.checks import check_shapes
from meshplan.trainer.defaults import fill_plan
from meshplan.trainer.metrics import MetricsLog, StepRecord, memory_bytes
from meshplan.trainer.model import ModelSource, load_tokenizer, meta_model, model_vocab
from meshplan.trainer.schedule import lr_factor

__all__ = ["train", "lm_loss", "step_seed", "prepare"]


def lm_loss(out: Any, targets: torch.Tensor) -> torch.Tensor:
    """The summed next-token cross-entropy of a causal LM's output (``.logits`` or the logits themselves),
    vocab-parallel when the logits are sharded (``meshplan.cross_entropy``)."""
    logits = getattr(out, "logits", out)
    return meshplan.cross_entropy(logits, targets, reduction="sum")


class _NoStep(torch.optim.Optimizer):
    """An optimizer that changes nothing: evaluation runs ``train_step`` (every layout's forward, pipelines
    included) and discards the gradients."""

    def __init__(self, params: Any) -> None:
        super().__init__(params, {})

    def step(self, closure: Any = None) -> None:
        return None


def prepare(plan: Plan, world: int) -> tuple[Plan, ModelSource, Any, int, list[str]]:
    """What can be checked before any process group exists: the model builds on meta, the plan's missing sections
    are filled (:func:`~meshplan.trainer.defaults.fill_plan`), the layout splits the batch and the sequence on
    ``world`` processes, the data is there and the tokenizer's vocabulary fits the model's.

    Returns:
        ``(plan, source, tokenizer or None, vocab, lines saying what was filled)``.

    Raises:
        PlanError: no training section, a missing model/data path, a shape the layout cannot split, a tokenizer
            larger than the model's vocabulary.
    """
    tr = plan.training
    if tr is None:
        raise PlanError(f"{plan.source or '<plan>'}: no training section (give --model.path and --data.path)")
    source = meta_model(tr.model)
    plan, said = fill_plan(plan, source.model, tr.model.path or tr.model.config)
    check_shapes(plan, world)
    vocab = model_vocab(source)
    if tr.data.path.endswith(".bin"):
        tokens = TokenFile.open(tr.data.path)
        if tokens.vocab_size > vocab:
            raise PlanError(f"training.data.path: {tr.data.path} was tokenized for a vocabulary of "
                            f"{tokens.vocab_size:,}; the model's has {vocab:,}")
        return plan, source, None, vocab, said
    try:
        corpus_files(tr.data.path)
    except ValueError as e:
        raise PlanError(f"training.data.path: {e}") from None
    tok = load_tokenizer(tr.model)
    if len(tok) > vocab:
        raise PlanError(f"training.model.tokenizer: the tokenizer has {len(tok):,} ids but the model's vocabulary "
                        f"has {vocab:,} (a tokenizer of another model?)")
    return plan, source, tok, vocab, said


def open_data(tr: Training, tok: Any, vocab: int, data_world: int) -> PackedTokens:
    """The packed corpus: tokenized with ``tok`` and cached (or the token file itself), checked to hold one global
    batch. Needs no process group: the launcher calls it once before torchrun starts, so the ranks find the cache.

    Raises:
        PlanError: a corpus shorter than one global batch, a bad JSONL line, an id outside the vocabulary.
    """
    try:
        if tok is None:
            tokens = TokenFile.open(tr.data.path)
        else:
            tokens = tokenize_corpus(tr.data.path, lambda t: tok.encode(t, add_special_tokens=False),
                                     vocab_size=vocab, eos_id=tok.eos_token_id,
                                     tokenizer_id=f"{tok.name_or_path}:{len(tok)}", text_key=tr.data.text_key)
        data = PackedTokens(tokens, tr.seq_len, tr.seed, tr.data.eval_fraction)
        data.batch(0, tr.global_batch, 0, data_world)  # a corpus shorter than one batch fails here
        if tr.eval.every:
            data.batch(0, tr.global_batch, 0, data_world, split="eval")
    except ValueError as e:
        raise PlanError(f"training.data: {e}") from None
    return data


def _corpus(tr: Training, tok: Any, vocab: int, topo: Any) -> PackedTokens:
    """Rank 0 tokenizes (or finds the cache), the others wait, then map the same token file."""
    data = open_data(tr, tok, vocab, topo.data_world_size) if topo.rank == 0 else None
    dist.barrier()
    return data if data is not None else open_data(tr, tok, vocab, topo.data_world_size)


def _batch(data: PackedTokens, step: int, tr: Training, topo: Any, split: str = "train") -> tuple[Any, torch.Tensor]:
    """``(inputs, targets)`` of this rank's share of step ``step`` (0-based) on the mesh's device: the token ids,
    or with ``data.documents`` a dict with the restarting position ids (no cache: transformers ignores packing when
    it builds one)."""
    b = data.batch(step, tr.global_batch, topo.data_rank, topo.data_world_size, split=split)
    dev = topo.dense.device_type
    b = {k: v.to(dev) for k, v in b.items()}
    if not tr.data.documents:
        return b["input_ids"], b["labels"]
    return {"input_ids": b["input_ids"], "position_ids": b["position_ids"], "use_cache": False}, b["labels"]


def _weights(model: torch.nn.Module, source: ModelSource, tr: Training, resuming: bool) -> None:
    """The starting weights: none when a checkpoint will fill the meta shards, else the folder's or the seed's."""
    if resuming:
        return
    if source.weights is not None:
        meshplan.load_safetensors(model, source.weights)
    else:
        meshplan.materialize(model, seed=tr.seed)


def _evaluate(model: torch.nn.Module, data: PackedTokens, tr: Training, topo: Any) -> float:
    """The mean loss over ``eval.batches`` held-out global batches (the same ones every time)."""
    total = tokens = 0.0
    noop = _NoStep(model.parameters())
    model.eval()
    try:
        for k in range(tr.eval.batches):
            res = meshplan.train_step(model, _batch(data, k, tr, topo, "eval"), lm_loss, noop, topology=topo)
            total, tokens = total + res.loss * res.num_tokens, tokens + res.num_tokens
    finally:
        model.train()
    return total / max(tokens, 1.0)


def _flops_per_token(model: torch.nn.Module, seq: int) -> float | None:
    try:
        from meshplan.checks.model_shape import shape_of_model
        from meshplan.solver.compute import model_flops_per_token
        return model_flops_per_token(shape_of_model(model)[0], seq)
    except (PlanError, ValueError, AttributeError, TypeError):
        return None


def train(plan: Plan) -> dict[str, Any]:
    """Train as ``plan.training`` says, on the layout ``plan.layout`` says (every rank calls it under torchrun).

    Returns:
        The summary (rank 0 prints it): steps, first/last loss, tokens/s, the last evaluation.

    Raises:
        PlanError: a bad setting, path, tokenizer or corpus (before training starts).
    """
    plan, source, tok, vocab, said = prepare(plan, int(os.environ.get("WORLD_SIZE", "1")))
    tr = plan.training
    start = time.perf_counter()
    with meshplan.init(plan) as topo:
        if topo.rank == 0:
            for line in said:
                print(line, flush=True)
        data = _corpus(tr, tok, vocab, topo)
        flops = _flops_per_token(source.model, tr.seq_len)
        model = meshplan.parallelize(source.model, plan, topo)
        ck = tr.checkpoint
        ckpt = meshplan.CheckpointManager(ck.folder, every=ck.every, keep=ck.keep or None,
                                          async_save=ck.async_save) if ck.folder else None
        resuming = ckpt is not None and ck.resume and ckpt.latest() is not None
        _weights(model, source, tr, resuming)  # a resumed run loads its checkpoint straight into the meta shards
        opt = torch.optim.AdamW(model.parameters(), lr=tr.optimizer.lr, betas=tr.optimizer.betas,
                                eps=tr.optimizer.eps, weight_decay=tr.optimizer.weight_decay, fused=True)
        # fused: one kernel per parameter group, no per-parameter temporaries (torch's CPU default, single-tensor,
        # allocates 2 x the largest local shard in each step); the same update up to rounding (docs/training.md)
        position, done = meshplan.DataState(tr.global_batch, tr.seed), 0
        if resuming:
            saved = ckpt.load_latest(model, opt, data=position)
            if saved is not None:
                done, position = saved.step, saved.data
                if topo.rank == 0:
                    print(f"resumed from {saved.path} (step {done})", flush=True)
        log = MetricsLog(tr.log.every, tr.steps, tr.log.jsonl, active=topo.rank == 0)
        _loop(model, opt, data, tr, topo, log, ckpt, done, position, flops)
        if ckpt is not None:
            ckpt.close()
        if tr.export:
            meshplan.export_safetensors(model, tr.export)
            if topo.rank == 0:
                if tok is not None:
                    tok.save_pretrained(tr.export)
                print(f"wrote {tr.export}", flush=True)
        return log.summary(dist.get_world_size(), time.perf_counter() - start)


def _loop(model, opt, data, tr, topo, log, ckpt, done, position, flops) -> None:
    tokens_per_step = tr.global_batch * tr.seq_len
    clip = tr.max_grad_norm if tr.max_grad_norm is not None else math.inf  # inf: the norm, no clipping
    micro = 1 if topo.layout.pp > 1 else tr.microbatches
    for step in range(done + 1, tr.steps + 1):
        lr = tr.optimizer.lr * lr_factor(tr.schedule, step, tr.steps)
        for group in opt.param_groups:
            group["lr"] = lr
        torch.manual_seed(step_seed(tr.seed, step))
        batch = _batch(data, step - 1, tr, topo)
        t0 = time.perf_counter()
        res = meshplan.train_step(model, batch, lm_loss, opt, topology=topo,
                                  microbatches=micro, max_grad_norm=clip)
        dt = time.perf_counter() - t0
        position = position.advanced()
        mfu = (flops * tokens_per_step / dt / dist.get_world_size() / (tr.log.peak_tflops * 1e12)
               if flops and tr.log.peak_tflops else None)
        log.add(StepRecord(step, res.loss, grad_norm=res.grad_norm, lr=lr, tokens_per_s=tokens_per_step / dt,
                           mfu=mfu, memory_gib=memory_bytes() / 2 ** 30, seconds=dt))
        if tr.eval.every and (step % tr.eval.every == 0 or step == tr.steps):
            log.add(StepRecord(step, _evaluate(model, data, tr, topo), kind="eval"))
        if ckpt is not None:
            ckpt.save(step, model, opt, data=position, force=step == tr.steps)
