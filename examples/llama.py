"""A plain Llama-style decoder-only transformer.

No parallelism lives here: this is the ordinary ``nn.Module`` that meshplan plan
files parallelize. Module names follow torchtitan so a plan can address them by
path: ``tok_embeddings``, ``layers.<i>.attention_norm``,
``layers.<i>.attention.{wq,wk,wv,wo,resid_dropout}``, ``layers.<i>.ffn_norm``,
``layers.<i>.feed_forward.{w1,w2,w3,dropout}``, ``norm``, ``output``.

Notes for parallelizers:

* ``head_reshape="infer"`` reshapes projections with ``view(b, s, -1, head_dim)``
  and works on local (plain tensor) shards with ``n_heads / tp`` heads.
  ``head_reshape="stored"`` uses the stored ``n_heads`` / ``n_kv_heads`` like many
  real models; it only works on plain local shards if the parallelizer divides
  those counts by the TP degree (on DTensors, whose shapes are global, it works).
* RoPE positions come from ``h.shape[1]`` of the hidden states, so a model that
  receives sequence-sharded *local* activations computes wrong positions unless
  the parallelizer restores the full sequence first.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class ModelArgs:
    """Model configuration.

    ``n_kv_heads`` < ``n_heads`` gives grouped-query attention; ``dropout`` is
    used inside SDPA (training only) and by the ``resid_dropout`` / ``dropout``
    modules; ``tie_embeddings`` makes ``output.weight`` the embedding weight.
    """

    dim: int = 256
    n_layers: int = 4
    n_heads: int = 8
    n_kv_heads: int | None = None  # GQA; None means n_heads
    vocab_size: int = 1024
    ffn_dim: int = 768  # hidden size of the SwiGLU feed-forward
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_seq_len: int = 256
    dropout: float = 0.0
    head_reshape: str = "infer"  # "infer" or "stored", see module docstring
    tie_embeddings: bool = False

    def __post_init__(self) -> None:
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        if self.dim % self.n_heads or self.n_heads % self.n_kv_heads:
            raise ValueError("need dim % n_heads == 0 and n_heads % n_kv_heads == 0")
        if (self.dim // self.n_heads) % 2:
            raise ValueError("RoPE needs an even head_dim")
        if self.head_reshape not in ("infer", "stored"):
            raise ValueError(f"head_reshape must be 'infer' or 'stored', got {self.head_reshape!r}")


def precompute_freqs_cis(head_dim: int, end: int, theta: float) -> torch.Tensor:
    """Real RoPE table of shape ``(end, head_dim // 2, 2)`` holding ``(cos, sin)``."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(end, dtype=torch.float32), freqs)
    return torch.stack((angles.cos(), angles.sin()), dim=-1)


def apply_rotary_emb(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent pairs of ``x`` (``(b, s, heads, head_dim)``) by the RoPE angles."""
    xf = x.to(torch.promote_types(x.dtype, torch.float32)).unflatten(-1, (-1, 2))  # (b, s, h, hd/2, 2)
    x0, x1 = xf[..., 0], xf[..., 1]
    cos, sin = freqs_cis[None, :, None, :, 0], freqs_cis[None, :, None, :, 1]
    out = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)
    return out.flatten(-2).type_as(x)


class RMSNorm(nn.Module):
    """Root-mean-square layer norm over the last dimension.

    Args:
        dim (int): size of the normalized (last) dimension.
        eps (float): added to the mean square for stability. Default: ``1e-5``.

    Shape:
        - Input: :math:`(*, dim)`; Output: same shape as the input.
    """

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.to(torch.promote_types(x.dtype, torch.float32))  # at least float32: a float64 model stays float64
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.type_as(x) * self.weight

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


class Attention(nn.Module):
    """Causal multi-head attention with grouped-query heads and RoPE.

    Shape:
        - Input: :math:`(b, s, dim)` and ``freqs_cis`` of shape :math:`(s, hd/2, 2)`.
        - Output: :math:`(b, s, dim)`.
    """

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads = args.n_heads, args.n_kv_heads
        self.n_rep = args.n_heads // args.n_kv_heads
        self.head_dim = args.dim // args.n_heads
        self.head_reshape = args.head_reshape
        self.dropout = args.dropout
        self.wq = nn.Linear(args.dim, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(self.n_heads * self.head_dim, args.dim, bias=False)
        self.resid_dropout = nn.Dropout(args.dropout)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        stored = self.head_reshape == "stored"
        heads = (self.n_heads, self.n_kv_heads, self.n_kv_heads) if stored else (-1, -1, -1)
        q, k, v = (
            proj(x).view(bsz, seqlen, h, self.head_dim)
            for proj, h in zip((self.wq, self.wk, self.wv), heads)
        )
        q, k = apply_rotary_emb(q, freqs_cis), apply_rotary_emb(k, freqs_cis)
        if self.n_rep > 1:  # kv head j serves q heads j*n_rep .. (j+1)*n_rep - 1
            k = k.repeat_interleave(self.n_rep, dim=2)
            v = v.repeat_interleave(self.n_rep, dim=2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (b, heads, s, hd)
        dropout_p = self.dropout if self.training else 0.0
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout_p)
        out = out.transpose(1, 2).contiguous()
        out = out.view(bsz, seqlen, self.n_heads * self.head_dim if stored else -1)
        return self.resid_dropout(self.wo(out))


class FeedForward(nn.Module):
    """SwiGLU feed-forward: ``dropout(w2(silu(w1(x)) * w3(x)))``."""

    def __init__(self, dim: int, hidden_dim: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.w2(F.silu(self.w1(x)) * self.w3(x)))


class TransformerBlock(nn.Module):
    """Pre-norm block: ``h = x + attention(attention_norm(x)); h + feed_forward(ffn_norm(h))``."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = FeedForward(args.dim, args.ffn_dim, args.dropout)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), freqs_cis)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """Llama decoder: token ids to next-token logits.

    Constructing the model consumes no global RNG state: parameters come only
    from :meth:`init_weights`, so ``torch.manual_seed(s); Transformer(args)`` on
    CPU equals a meta-device build followed by ``to_empty`` and
    ``torch.manual_seed(s); init_weights()``.

    Args:
        args (ModelArgs): model configuration.

    Shape:
        - Input: :math:`(b, s)` integer token ids, :math:`s \\le` ``max_seq_len``.
        - Output: :math:`(b, s, vocab\\_size)` logits.
    """

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        # The default nn.Linear/nn.Embedding inits are overwritten below; draw
        # them from a forked RNG so they do not advance the global one.
        with torch.random.fork_rng(devices=[]):
            self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
            self.layers = nn.ModuleList(self._block(args, i) for i in range(args.n_layers))
            self.norm = RMSNorm(args.dim, args.norm_eps)
            self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.register_buffer("freqs_cis", self._freqs_cis(), persistent=False)
        self.init_weights()  # a no-op on the meta device

    def _block(self, args: ModelArgs, index: int) -> nn.Module:
        """Layer ``index`` (a subclass builds other blocks)."""
        return TransformerBlock(args)

    def _freqs_cis(self) -> torch.Tensor:
        a = self.args
        return precompute_freqs_cis(a.dim // a.n_heads, a.max_seq_len, a.rope_theta)

    @torch.no_grad()
    def init_weights(self, buffer_device: torch.device | str | None = None) -> None:
        """(Re)initialize all parameters from the global RNG and rebuild ``freqs_cis``.

        Linear and embedding weights are drawn from N(0, 0.02²); the residual
        projections ``wo`` and ``w2`` use std ``0.02 / sqrt(2 * n_layers)``
        (GPT-2 depth scaling); norm weights are set to one. Works after
        ``to_empty`` on a model built on the meta device.

        Args:
            buffer_device: device for the recomputed ``freqs_cis`` buffer.
                Default: the device the buffer is on now.
        """
        device = buffer_device if buffer_device is not None else self.freqs_cis.device
        with torch.device(device):
            self.freqs_cis = self._freqs_cis()
        std, depth_std = 0.02, 0.02 / math.sqrt(2 * self.args.n_layers)
        nn.init.normal_(self.tok_embeddings.weight, std=std)
        for layer in self.layers:
            self._init_block(layer, std, depth_std)
        self.norm.reset_parameters()
        if not self.args.tie_embeddings:
            nn.init.normal_(self.output.weight, std=std)

    def _init_block(self, layer: nn.Module, std: float, depth_std: float) -> None:
        """Draw one block's parameters (in a fixed order: the result depends only on the seed)."""
        attn, ffn = layer.attention, layer.feed_forward
        for lin in (attn.wq, attn.wk, attn.wv, ffn.w1, ffn.w3):
            nn.init.normal_(lin.weight, std=std)
        for lin in (attn.wo, ffn.w2):
            nn.init.normal_(lin.weight, std=depth_std)
        layer.attention_norm.reset_parameters()
        layer.ffn_norm.reset_parameters()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        seqlen = h.shape[1]  # positions follow the hidden states, not a stored length
        if seqlen > self.args.max_seq_len:
            raise ValueError(f"sequence length {seqlen} > max_seq_len {self.args.max_seq_len}")
        freqs_cis = self.freqs_cis[:seqlen]
        for layer in self.layers:
            h = layer(h, freqs_cis)
        return self.output(self.norm(h))


def tiny_args(**overrides) -> ModelArgs:
    """A small config for tests: dim 64, 2 layers, 4 heads, 2 kv heads, vocab 128."""
    base = ModelArgs(
        dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128, ffn_dim=128, max_seq_len=64
    )
    return replace(base, **overrides)


def build(args: ModelArgs) -> Transformer:
    """Build a :class:`Transformer` on the current default device."""
    return Transformer(args)
