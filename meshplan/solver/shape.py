"""The model as the cost model sees it: sizes only, torch-free.

A :class:`ModelShape` holds what the layout rules and the cost formulas read: layers, hidden size, heads, KV
heads, FFN width, vocabulary, the MLP kind, and for mixture-of-experts models the experts, top-k and expert
width. :func:`shape_from_config` reads it from a config in meshplan's own keys, the example models'
``ModelArgs`` keys or a transformers ``config.json``; :func:`meshplan.checks.model_shape.shape_of_model` reads
it from a built ``nn.Module``.

Example::

    >>> s = shape_from_config({"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
    ...                        "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256})
    >>> round(s.parameters() / 1e9, 2)
    8.03
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Mapping

from meshplan.errors import PlanError
from meshplan.solver.config_keys import moe_layer_range, nested, text_experts, windows
from meshplan.solver.routing import check_loads

__all__ = ["ModelShape", "shape_from_config"]


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer's sizes.

    Attributes:
        layers: transformer blocks. hidden: model width. heads / kv_heads: query and key-value heads.
        ffn: hidden width of the dense MLP. vocab: vocabulary (embedding and output rows).
        head_dim: per-head width (0: ``hidden // heads``).
        mlp: ``swiglu`` (gate, up, down: 3 matrices) or ``gelu`` (2 matrices).
        norm: ``rmsnorm`` (a weight) or ``layernorm`` (weight and bias).
        bias: every linear has a bias (GPT-2). qkv_bias: q, k, v have biases (Qwen2).
        tied_embeddings: the output projection is the embedding.
        experts / top_k / moe_ffn: routed experts per MoE layer, experts per token, each expert's width.
        shared_ffn: width of the shared expert(s) of an MoE layer (0: none).
        dense_layers: the first blocks with a dense MLP instead of experts.
        gqa_repeat: K and V are repeated to every query head before attention (torchtitan, the examples) rather
            than kept at ``kv_heads`` (fused grouped attention).
        window / window_layers: the sliding window in tokens (0: none) and how many layers slide (0 with a
            window: every layer; transformers' ``layer_types`` counted): a sharded sequence's
            attention work follows them.
        kernels: ``eager`` (norms, RoPE and activations written as PyTorch ops, as in the examples, transformers
            and torchtitan without compile) or ``fused`` (fused kernels: Megatron with Transformer Engine, or
            ``torch.compile``): what a norm keeps for backward (:attr:`norm_saved`) and how much element-wise
            memory traffic a block costs.
        name: shown in reports.
        expert_loop: the routed experts run in a Python loop over slices of stacked weights (the examples,
            transformers' eager experts): each MoE block pays :mod:`meshplan.solver.moe_costs` per microbatch on a
            cluster that measured it; False for grouped GEMMs (Megatron, torchtitan's ``grouped_mm``).
        expert_loads: tokens routed to each expert, a row per MoE layer and sample batch (the routers' counts,
            or a run's ``tokens_per_expert`` log); an expert-parallel layout is
            priced on its busiest rank (:func:`meshplan.solver.moe_costs.expert_imbalance`). Empty: balanced.
    """

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    head_dim: int = 0
    mlp: str = "swiglu"
    norm: str = "rmsnorm"
    bias: bool = False
    qkv_bias: bool = False
    tied_embeddings: bool = False
    experts: int = 0
    top_k: int = 0
    moe_ffn: int = 0
    shared_ffn: int = 0
    dense_layers: int = 0
    gqa_repeat: bool = True
    window: int = 0
    window_layers: int = 0
    kernels: str = "eager"
    name: str = "model"
    expert_loop: bool = True
    expert_loads: tuple = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "expert_loads", check_loads(self.expert_loads, self.experts))
        for f in ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab"):
            v = getattr(self, f)
            if type(v) is not int or v < 1:
                raise PlanError(f"model shape: {f} must be a positive integer, got {v!r}")
        if self.mlp not in ("swiglu", "gelu") or self.norm not in ("rmsnorm", "layernorm") or \
                self.kernels not in ("eager", "fused"):
            raise PlanError(f"model shape: mlp is swiglu or gelu, norm rmsnorm or layernorm, kernels eager or fused; "
                            f"got mlp {self.mlp!r}, norm {self.norm!r}, kernels {self.kernels!r}")
        if self.experts and not 1 <= self.top_k <= self.experts:
            raise PlanError(f"model shape: top_k({self.top_k}) must be in 1..experts({self.experts})")
        if self.window < 0 or not 0 <= self.window_layers <= self.layers:
            raise PlanError(f"model shape: window({self.window}) must be >= 0 and window_layers"
                            f"({self.window_layers}) in 0..layers({self.layers})")
        if not 0 <= self.dense_layers <= self.layers:
            raise PlanError(f"model shape: dense_layers({self.dense_layers}) must be in 0..layers({self.layers})")

    # -- sizes ------------------------------------------------------------------------------------------------
    @property
    def norm_saved(self) -> int:
        """``hidden``-wide tensors a norm and the projection after it keep besides the norm's input: an eager
        RMSNorm keeps its normalised input and its output (2), a fused one its output (1)."""
        return 2 if self.kernels == "eager" else 1

    @property
    def head_size(self) -> int:
        return self.head_dim or self.hidden // self.heads

    @property
    def q_width(self) -> int:
        """Width of the query projection's output (heads · head_dim)."""
        return self.heads * self.head_size

    @property
    def kv_width(self) -> int:
        """Width of the key (or value) projection's output."""
        return self.kv_heads * self.head_size

    @property
    def moe_layers(self) -> int:
        return self.layers - self.dense_layers if self.experts else 0

    @property
    def expert_width(self) -> int:
        return self.moe_ffn or self.ffn

    @property
    def mlp_matrices(self) -> int:
        return 3 if self.mlp == "swiglu" else 2

    # -- parameter counts -------------------------------------------------------------------------------------
    def attention_params(self) -> int:
        """q, k, v, o weights and biases of one layer."""
        h, q, kv = self.hidden, self.q_width, self.kv_width
        bias = (q + 2 * kv + h) if self.bias else (q + 2 * kv) if self.qkv_bias else 0
        return h * q + 2 * h * kv + q * h + bias

    def mlp_params(self, width: int) -> int:
        """One MLP of hidden width ``width``."""
        bias = (width * (self.mlp_matrices - 1) + self.hidden) if self.bias else 0
        return self.mlp_matrices * self.hidden * width + bias

    def norm_params(self) -> int:
        return self.hidden * (2 if self.norm == "layernorm" else 1)

    def expert_params(self) -> int:
        """All routed experts of one MoE layer (stacked ``[E, …]`` weights)."""
        return self.experts * self.mlp_matrices * self.hidden * self.expert_width

    def moe_dense_params(self) -> int:
        """The parts of an MoE layer's FFN that are not routed experts: router and shared expert."""
        return self.hidden * self.experts + (self.mlp_params(self.shared_ffn) if self.shared_ffn else 0)

    def layer_params(self, moe: bool) -> int:
        ffn = self.expert_params() + self.moe_dense_params() if moe else self.mlp_params(self.ffn)
        return self.attention_params() + ffn + 2 * self.norm_params()

    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    def head_params(self) -> int:
        """Final norm and output projection (none when tied)."""
        return self.norm_params() + (0 if self.tied_embeddings else self.vocab * self.hidden)

    def parameters(self) -> int:
        """Every parameter of the model (tied weights once)."""
        blocks = (self.layers - self.moe_layers) * self.layer_params(False) + self.moe_layers * self.layer_params(True)
        return self.embedding_params() + blocks + self.head_params()

    def active_parameters(self) -> int:
        """Parameters one token meets (top_k of the experts)."""
        if not self.experts:
            return self.parameters()
        unused = self.moe_layers * (self.experts - self.top_k) * self.mlp_matrices * self.hidden * self.expert_width
        return self.parameters() - unused

    def describe(self) -> str:
        moe = (f", {self.experts} experts top-{self.top_k} (width {self.expert_width}, {self.dense_layers} dense "
               f"layers)" if self.experts else "")
        n = self.parameters()
        count = f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M" if n >= 1e6 else f"{n:,}"
        return (f"{self.name}: {count} parameters, {self.layers} layers, hidden {self.hidden}, "
                f"{self.heads} heads / {self.kv_heads} KV, ffn {self.ffn} ({self.mlp}), vocab {self.vocab}{moe}")


#: config keys read for each field, first found wins (meshplan, the examples' ModelArgs, transformers, Megatron)
_ALIASES: dict[str, tuple[str, ...]] = {
    "layers": ("layers", "n_layers", "num_hidden_layers", "n_layer", "num_layers"),
    "hidden": ("hidden", "dim", "hidden_size", "n_embd", "d_model"),
    "heads": ("heads", "n_heads", "num_attention_heads", "n_head"),
    "kv_heads": ("kv_heads", "n_kv_heads", "num_key_value_heads", "num_kv_heads", "num_query_groups", "kv_n_heads"),
    "ffn": ("ffn", "ffn_dim", "intermediate_size", "n_inner", "ffn_hidden_size"),
    "vocab": ("vocab", "vocab_size", "padded_vocab_size"),
    "head_dim": ("head_dim", "kv_channels"),
    "experts": ("experts", "n_experts", "num_local_experts", "num_experts", "n_routed_experts", "num_moe_experts",
                "moe_num_experts"),
    "top_k": ("top_k", "num_experts_per_tok", "moe_router_topk", "moe_k", "moe_top_k"),
    "moe_ffn": ("moe_ffn", "moe_hidden", "moe_intermediate_size", "moe_ffn_hidden_size"),
    "shared_ffn": ("shared_ffn", "shared_expert_intermediate_size"),
    "dense_layers": ("dense_layers", "n_dense_layers", "first_k_dense_replace"),
    "tied_embeddings": ("tied_embeddings", "tie_embeddings", "tie_word_embeddings"),
    "qkv_bias": ("qkv_bias",),
    "bias": ("bias",),
    "mlp": ("mlp",),
    "norm": ("norm",),
    "gqa_repeat": ("gqa_repeat",),
    "window": ("window", "sliding_window"),
    "window_layers": ("window_layers",),
    "kernels": ("kernels",),
    "name": ("name", "model_type"),
    "expert_loop": ("expert_loop",),
    "expert_loads": ("expert_loads",),
}
_GPT2_LIKE = ("gpt2", "gpt_neox", "gptj", "opt", "gpt_bigcode", "bloom", "falcon", "phi")


def _pick(cfg: Mapping[str, Any], field: str) -> Any:
    for key in _ALIASES[field]:
        if key in cfg and cfg[key] is not None:
            return cfg[key]
    return None


def _derived(cfg: Mapping[str, Any], out: dict) -> None:
    """Fields a config implies rather than states: the MLP kind, biases, norms, default FFN and KV heads."""
    text_experts(out)
    act = str(cfg.get("hidden_act") or cfg.get("activation_function") or cfg.get("activation") or "")
    kind = str(cfg.get("model_type", ""))
    gpt2 = kind in _GPT2_LIKE
    out.setdefault("mlp", "gelu" if gpt2 or act.startswith("gelu") else "swiglu")
    out.setdefault("norm", "layernorm" if gpt2 else "rmsnorm")
    out.setdefault("bias", gpt2)
    out.setdefault("qkv_bias", kind in ("qwen2", "qwen2_moe") or bool(cfg.get("attention_bias")))
    if "kv_heads" not in out and "heads" in out:
        out["kv_heads"] = out["heads"]
    if "ffn" not in out and "hidden" in out:
        out["ffn"] = 4 * out["hidden"]
    if cfg.get("shared_expert") is True and "shared_ffn" not in out:  # the examples' MoE: one shared expert
        out["shared_ffn"] = out.get("moe_ffn") or out.get("ffn", 0)
    shared = cfg.get("n_shared_experts", cfg.get("moe_num_shared_experts"))
    if isinstance(shared, int) and shared and "shared_ffn" not in out:
        out["shared_ffn"] = shared * (out.get("moe_ffn") or out.get("ffn", 0))
    moe_layer_range(cfg, out)
    windows(cfg, out)
    if not out.get("experts"):
        for k in ("experts", "top_k", "moe_ffn", "shared_ffn", "dense_layers", "expert_loads"):
            out.pop(k, None)


def shape_from_config(cfg: Mapping[str, Any], where: str = "--config") -> ModelShape:
    """A :class:`ModelShape` from a config mapping (meshplan keys, the examples' ``ModelArgs``, transformers'
    ``config.json`` or Megatron's argument names; a multimodal config's ``text_config`` is read, and so are DBRX's
    nested ``ffn_config`` and ``attn_config``: :mod:`meshplan.solver.config_keys`).

    Raises:
        PlanError: a size is missing (naming the keys looked for) or not a positive integer.
    """
    if isinstance(cfg.get("text_config"), Mapping):
        cfg = {**cfg["text_config"], "model_type": cfg["text_config"].get("model_type", cfg.get("model_type"))}
    cfg = nested(cfg)
    out: dict[str, Any] = {}
    for field in _ALIASES:
        v = _pick(cfg, field)
        if v is not None:
            out[field] = v
    _derived(cfg, out)
    for f in ("layers", "hidden", "heads", "vocab"):
        if f not in out:
            raise PlanError(f"{where}: no {f} found; expected one of the keys {', '.join(_ALIASES[f])}")
    known = {f.name for f in fields(ModelShape)}
    try:
        return ModelShape(**{k: v for k, v in out.items() if k in known})
    except TypeError as e:
        raise PlanError(f"{where}: {e}") from None
