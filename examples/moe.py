"""A plain mixture-of-experts decoder: the Llama example with top-k routed SwiGLU experts.

No parallelism lives here: this is the ordinary ``nn.Module`` that meshplan plan
files parallelize (expert parallelism shards ``experts`` on dim 0). Attention,
norms and RoPE come from ``llama.py``. Module names follow torchtitan:
``tok_embeddings``, ``layers.<i>.attention_norm``,
``layers.<i>.attention.{wq,wk,wv,wo,resid_dropout}``, ``layers.<i>.ffn_norm``,
``layers.<i>.moe.router.gate``, ``layers.<i>.moe.experts`` (Parameters ``w1``,
``w2``, ``w3``), ``layers.<i>.moe.shared_expert.{w1,w2,w3}`` (optional),
``norm``, ``output``. The first ``n_dense_layers`` blocks have a dense
``layers.<i>.feed_forward.{w1,w2,w3}`` instead of ``moe``.

:class:`MoE` runs in separate steps, each overridable or wrappable on its own:

1. ``self.router(x)`` → ``(topk_scores, topk_idx, aux_loss)`` (module call).
2. ``self.dispatch(x, topk_idx)`` → ``(x_sorted, routing)``: token copies sorted
   by expert (stable, so token order within an expert), ``routing.counts``
   rows per expert after the capacity limit.
3. ``self.experts(x_sorted, routing.counts)`` → one output row per input row,
   same order (module call). :class:`GroupedExperts` takes its expert count
   from its own weights, so a parallelizer can keep experts ``[a, b)`` only and
   feed it the rows of those experts with their counts (e.g. around an
   all-to-all in forward hooks on ``experts``).
4. ``self.combine(y_sorted, topk_scores, routing)`` → scales rows by their gate
   value and scatter-adds them back to token order; dropped copies add zero.
5. ``+ self.shared_expert(x)`` when ``shared_expert=True``.

Each :class:`MoE` forward stores ``aux_loss`` (a 0-d tensor in the graph) and
``tokens_per_expert`` / ``kept_per_expert`` (detached counts) on the module;
:meth:`Transformer.aux_loss` sums ``aux_loss_coef * aux_loss`` over layers. Add
it to the task loss before ``backward``.

Notes for parallelizers:

* Routing statistics are per forward call: the aux loss and the capacity
  (``ceil(capacity_factor · tokens · top_k / n_experts)``) are computed over the
  tokens this module sees. Under data parallelism each rank's value covers its
  own tokens, so the mean of per-rank aux losses is not the global-batch aux
  loss, and with a ``capacity_factor`` which tokens are dropped depends on how
  the batch is split. ``capacity_factor=None`` drops nothing.
* The stored ``aux_loss`` is a non-leaf tensor: ``copy.deepcopy`` of a model
  after a forward fails until it is cleared (``moe.aux_loss = None``).
* ``GroupedExperts`` calls ``to_local()`` on DTensor weights, so dim-0-sharded
  DTensor parameters work if its inputs are already the local experts' rows.
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

if __package__:  # imported as examples.moe
    from . import llama
else:  # imported as `moe` (examples/ on sys.path) or loaded from its file
    try:
        import llama
    except ImportError:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import llama

# re-exported: the same classes as llama's (one module object, however this file was imported)
Attention, FeedForward, RMSNorm = llama.Attention, llama.FeedForward, llama.RMSNorm
precompute_freqs_cis = llama.precompute_freqs_cis

__all__ = [
    "ModelArgs", "Routing", "TopKRouter", "GroupedExperts", "MoE", "TransformerBlock", "Transformer",
    "load_balance_loss", "tiny_args", "build", "Attention", "FeedForward", "RMSNorm", "precompute_freqs_cis",
]


@dataclass
class ModelArgs(llama.ModelArgs):
    """Model configuration: :class:`llama.ModelArgs` plus the MoE fields.

    ``ffn_dim`` is the hidden size of the dense layers (the first
    ``n_dense_layers``); ``moe_hidden`` that of each routed expert and of the
    shared expert. ``gate`` turns router logits into scores with a softmax over
    experts or an independent sigmoid each; ``norm_topk`` rescales the ``top_k``
    chosen scores to sum to one. ``capacity_factor=None`` routes every token
    copy; otherwise each expert takes at most
    ``ceil(capacity_factor · tokens · top_k / n_experts)`` copies per forward, the
    first in token order, and the rest contribute zero.
    """

    moe_hidden: int = 256
    n_experts: int = 4
    top_k: int = 2
    gate: str = "softmax"  # "softmax" or "sigmoid"
    norm_topk: bool = True
    shared_expert: bool = False
    capacity_factor: float | None = None
    aux_loss_coef: float = 0.01
    n_dense_layers: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.gate not in ("softmax", "sigmoid"):
            raise ValueError(f"gate must be 'softmax' or 'sigmoid', got {self.gate!r}")
        if not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"need 1 <= top_k <= n_experts, got top_k={self.top_k}, n_experts={self.n_experts}")
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise ValueError(f"capacity_factor must be None or > 0, got {self.capacity_factor}")
        if not 0 <= self.n_dense_layers <= self.n_layers:
            raise ValueError(f"need 0 <= n_dense_layers <= n_layers, got {self.n_dense_layers}")


def load_balance_loss(probs: torch.Tensor, topk_idx: torch.Tensor) -> torch.Tensor:
    """Switch/GShard load-balancing loss ``E · Σ_e f_e · P_e``.

    ``f_e`` is the fraction of the ``T · k`` token copies routed to expert ``e``
    (no gradient), ``P_e`` the mean over tokens of the router probability of
    ``e``. Perfectly uniform routing gives 1.

    Args:
        probs: ``(T, E)`` router probabilities, each row summing to one.
        topk_idx: ``(T, k)`` chosen experts.
    """
    n_experts = probs.shape[-1]
    if topk_idx.numel() == 0:
        return probs.sum() * 0.0
    counts = torch.bincount(topk_idx.reshape(-1), minlength=n_experts)
    f = counts.to(probs.dtype) / topk_idx.numel()
    return n_experts * (f * probs.mean(0)).sum()


class TopKRouter(nn.Module):
    """Token-choice top-k router: ``gate`` (a bias-free ``dim → n_experts`` linear), scores, top-k.

    Shape:
        - Input: :math:`(T, dim)`.
        - Output: ``(topk_scores (T, k), topk_idx (T, k) int64, aux_loss ())``;
          ``topk_idx`` rows are in decreasing score order.
    """

    def __init__(self, dim: int, n_experts: int, top_k: int, gate: str = "softmax", norm_topk: bool = True):
        super().__init__()
        self.n_experts, self.top_k, self.score_func, self.norm_topk = n_experts, top_k, gate, norm_topk
        self.gate = nn.Linear(dim, n_experts, bias=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits = self.gate(x)
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # float64 stays float64
        scores = logits.softmax(-1) if self.score_func == "softmax" else logits.sigmoid()
        topk_scores, topk_idx = scores.topk(self.top_k, dim=-1)
        if self.norm_topk:
            topk_scores = topk_scores / topk_scores.sum(-1, keepdim=True)
        # the aux loss needs probabilities: sigmoid scores are normalised per token (DeepSeek-V3 style)
        probs = scores if self.score_func == "softmax" else scores / scores.sum(-1, keepdim=True)
        return topk_scores.type_as(x), topk_idx, load_balance_loss(probs, topk_idx)


class GroupedExperts(nn.Module):
    """``E`` SwiGLU experts stored as stacked weights, run on rows grouped by expert.

    Expert ``e`` computes ``(silu(x @ w1[e].T) * (x @ w3[e].T)) @ w2[e].T``, i.e. the
    :class:`llama.FeedForward` whose ``nn.Linear`` weights are ``w1[e], w2[e], w3[e]``.
    ``E`` is read from ``w1.shape[0]`` on every call, so a module holding a slice of
    the experts (dim 0 of all three weights) works on the rows of those experts.

    Args:
        dim (int): model dimension. hidden (int): expert hidden size.
        n_experts (int): number of experts held.

    Shape:
        - Input: ``x`` :math:`(N, dim)` sorted by expert, ``counts`` :math:`(E,)`
          integer rows per expert (summing to ``N``; zeros allowed).
        - Output: :math:`(N, dim)`, row ``i`` the output of the expert of input row ``i``.
    """

    def __init__(self, dim: int, hidden: int, n_experts: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n_experts, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(n_experts, hidden, dim))

    @property
    def num_experts(self) -> int:
        """Experts held here (local experts if dim 0 was sharded as plain tensors)."""
        return self.w1.shape[0]

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        w1, w2, w3 = (w.to_local() if hasattr(w, "to_local") else w for w in (self.w1, self.w2, self.w3))
        n_experts = w1.shape[0]
        sizes = [int(c) for c in counts.tolist()]
        if len(sizes) != n_experts:
            raise ValueError(f"GroupedExperts: counts has {len(sizes)} entries for {n_experts} experts")
        if sum(sizes) != x.shape[0] or min(sizes, default=0) < 0:
            raise ValueError(f"GroupedExperts: counts {sizes} do not split {x.shape[0]} rows")
        # every expert runs, even on zero rows, so every weight gets a (possibly zero) gradient
        outs = [
            (F.silu(rows @ w1[e].t()) * (rows @ w3[e].t())) @ w2[e].t()
            for e, rows in enumerate(torch.split(x, sizes, dim=0))
        ]
        return torch.cat(outs, dim=0) if outs else x.new_zeros(x.shape)

    @torch.no_grad()
    def init_weights(self, std: float, out_std: float) -> None:
        """``w1``, ``w3`` from N(0, std²), ``w2`` from N(0, out_std²), from the global RNG."""
        nn.init.normal_(self.w1, std=std)
        nn.init.normal_(self.w3, std=std)
        nn.init.normal_(self.w2, std=out_std)


class Routing(NamedTuple):
    """Where the expert-sorted rows came from (the output of :meth:`MoE.dispatch`).

    Attributes:
        counts: ``(E,)`` int64 rows per expert after the capacity limit (the ``experts`` input).
        copy_idx: ``(N,)`` index of each row into the flattened ``(T · k)`` token copies
            (copy ``j`` is token ``j // k``, choice ``j % k``), expert-major.
        token_idx: ``(N,)`` source token of each row (``copy_idx // k``).
        num_tokens: ``T``.
    """

    counts: torch.Tensor
    copy_idx: torch.Tensor
    token_idx: torch.Tensor
    num_tokens: int


class MoE(nn.Module):
    """Top-k routed SwiGLU experts plus an optional dense shared expert.

    Attributes set by each forward: ``aux_loss`` (0-d, in the graph, unweighted),
    ``tokens_per_expert`` (``(E,)`` routed copies before the capacity limit,
    detached) and ``kept_per_expert`` (copies the experts computed, detached).

    Shape:
        - Input: :math:`(*, dim)`; Output: same shape.
    """

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.dim, self.n_experts, self.top_k = args.dim, args.n_experts, args.top_k
        self.capacity_factor = args.capacity_factor
        self.router = TopKRouter(args.dim, args.n_experts, args.top_k, args.gate, args.norm_topk)
        self.experts = GroupedExperts(args.dim, args.moe_hidden, args.n_experts)
        self.shared_expert = FeedForward(args.dim, args.moe_hidden) if args.shared_expert else None
        self.aux_loss: torch.Tensor | None = None
        self.tokens_per_expert: torch.Tensor | None = None
        self.kept_per_expert: torch.Tensor | None = None

    def capacity(self, num_tokens: int) -> int | None:
        """Most token copies one expert takes in a forward over ``num_tokens`` tokens (None: no limit)."""
        if self.capacity_factor is None:
            return None
        return math.ceil(self.capacity_factor * num_tokens * self.top_k / self.n_experts)

    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor) -> tuple[torch.Tensor, Routing]:
        """Sort the token copies by expert (stable) and apply the capacity limit.

        Args:
            x: ``(T, dim)`` tokens. topk_idx: ``(T, k)`` chosen experts.

        Returns:
            ``x_sorted`` ``(N, dim)`` (``N = T · k`` minus dropped copies) and :class:`Routing`.
        """
        num_tokens, k = topk_idx.shape
        flat = topk_idx.reshape(-1)
        counts = torch.bincount(flat, minlength=self.n_experts)
        copy_idx = torch.argsort(flat, stable=True)
        self.tokens_per_expert = counts.detach()
        cap = self.capacity(num_tokens)
        if cap is not None:
            # rank of each sorted copy within its expert; copies past `cap` are dropped
            starts = torch.cumsum(counts, 0) - counts
            rank = torch.arange(flat.numel(), device=flat.device) - starts[flat[copy_idx]]
            copy_idx = copy_idx[rank < cap]
            counts = counts.clamp(max=cap)
        self.kept_per_expert = counts.detach()
        token_idx = torch.div(copy_idx, k, rounding_mode="floor")
        return x[token_idx], Routing(counts, copy_idx, token_idx, num_tokens)

    def combine(self, y_sorted: torch.Tensor, topk_scores: torch.Tensor, routing: Routing) -> torch.Tensor:
        """Weight each expert output row by its gate score and sum the rows back per token: ``(T, dim)``."""
        weights = topk_scores.reshape(-1)[routing.copy_idx].unsqueeze(-1)
        out = y_sorted.new_zeros(routing.num_tokens, y_sorted.shape[-1])
        return out.index_add(0, routing.token_idx, y_sorted * weights)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        topk_scores, topk_idx, aux_loss = self.router(x)
        self.aux_loss = aux_loss
        x_sorted, routing = self.dispatch(x, topk_idx)
        y_sorted = self.experts(x_sorted, routing.counts)
        out = self.combine(y_sorted, topk_scores, routing)
        if self.shared_expert is not None:
            out = out + self.shared_expert(x)
        return out.view(shape)

    @torch.no_grad()
    def init_weights(self, std: float, out_std: float) -> None:
        """Router gate from N(0, std²); experts and shared expert like a feed-forward (``w2``: ``out_std``)."""
        nn.init.normal_(self.router.gate.weight, std=std)
        self.experts.init_weights(std, out_std)
        if self.shared_expert is not None:
            nn.init.normal_(self.shared_expert.w1.weight, std=std)
            nn.init.normal_(self.shared_expert.w3.weight, std=std)
            nn.init.normal_(self.shared_expert.w2.weight, std=out_std)


class TransformerBlock(nn.Module):
    """Pre-norm block: ``h = x + attention(attention_norm(x)); h + moe(ffn_norm(h))``.

    With ``dense=True`` the block has a dense ``feed_forward`` (hidden ``ffn_dim``)
    instead of ``moe``; ``self.moe`` is then None.
    """

    def __init__(self, args: ModelArgs, dense: bool = False) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        if dense:
            self.feed_forward = FeedForward(args.dim, args.ffn_dim, args.dropout)
            self.moe = None
        else:
            self.moe = MoE(args)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), freqs_cis)
        ffn = self.moe if self.moe is not None else self.feed_forward
        return h + ffn(self.ffn_norm(h))


class Transformer(llama.Transformer):
    """MoE decoder: token ids to next-token logits; :meth:`aux_loss` after a forward.

    Like :class:`llama.Transformer`, construction consumes no global RNG state:
    ``torch.manual_seed(s); Transformer(args)`` on CPU equals a meta-device build
    followed by ``to_empty`` and ``torch.manual_seed(s); init_weights()``.

    Shape:
        - Input: :math:`(b, s)` integer token ids, :math:`s \\le` ``max_seq_len``.
        - Output: :math:`(b, s, vocab\\_size)` logits.
    """

    def _block(self, args: ModelArgs, index: int) -> nn.Module:
        return TransformerBlock(args, dense=index < args.n_dense_layers)

    def _init_block(self, layer: nn.Module, std: float, depth_std: float) -> None:
        """As :meth:`llama.Transformer._init_block`, the experts and the shared expert as ``w1/w3`` at ``std`` and
        ``w2`` at ``depth_std``, the router gate at ``std``."""
        attn = layer.attention
        for lin in (attn.wq, attn.wk, attn.wv):
            nn.init.normal_(lin.weight, std=std)
        nn.init.normal_(attn.wo.weight, std=depth_std)
        if layer.moe is not None:
            layer.moe.init_weights(std, depth_std)
        else:
            ffn = layer.feed_forward
            nn.init.normal_(ffn.w1.weight, std=std)
            nn.init.normal_(ffn.w3.weight, std=std)
            nn.init.normal_(ffn.w2.weight, std=depth_std)
        layer.attention_norm.reset_parameters()
        layer.ffn_norm.reset_parameters()

    def moe_layers(self) -> list[MoE]:
        """The :class:`MoE` modules, in layer order."""
        return [layer.moe for layer in self.layers if layer.moe is not None]

    def aux_loss(self) -> torch.Tensor:
        """``aux_loss_coef ·`` the sum of the MoE layers' aux losses from the last forward (0 if none)."""
        losses = [m.aux_loss for m in self.moe_layers() if m.aux_loss is not None]
        if not losses:
            return torch.zeros((), device=self.freqs_cis.device)
        return self.args.aux_loss_coef * torch.stack(losses).sum()


def tiny_args(**overrides) -> ModelArgs:
    """A small config for tests: dim 64, 2 layers, 4 heads, 2 kv heads, vocab 128, 4 experts (hidden 96), top-2."""
    base = ModelArgs(
        dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128, ffn_dim=128, max_seq_len=64,
        moe_hidden=96, n_experts=4, top_k=2,
    )
    return replace(base, **overrides)


def build(args: ModelArgs) -> Transformer:
    """Build a :class:`Transformer` on the current default device."""
    return Transformer(args)
