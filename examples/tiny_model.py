"""Make a tiny transformers model folder to train with ``meshplan train``: a byte-level BPE tokenizer trained on
a local corpus, a small config of any causal-LM architecture, and its randomly initialised weights (safetensors).

Nothing here imports meshplan: the folder is what ``save_pretrained`` writes, as a downloaded checkpoint is.

    python examples/tiny_model.py runs/tiny --corpus docs --arch starcoder2

The corpus default is this repository's ``docs/`` and ``README.md`` (Markdown text that ships with the repo).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

#: per-architecture config overrides of the shared tiny sizes
_ARCH = {
    "llama": {},
    "starcoder2": {"norm_epsilon": 1e-5, "use_bias": True},
    "mistral": {"sliding_window": None},
    "qwen2": {},
    "granite": {},
}


def corpus_texts(paths: list[Path]) -> list[str]:
    """The text of every ``.md``/``.txt`` file under ``paths`` (sorted), one document each."""
    files = []
    for p in paths:
        files += sorted(q for q in p.rglob("*") if q.suffix in (".md", ".txt")) if p.is_dir() else [p]
    return [f.read_text(encoding="utf-8") for f in files]


def make_tokenizer(texts: list[str], vocab: int):
    """A byte-level BPE tokenizer of ``vocab`` ids trained on ``texts`` (deterministic), with ``<|endoftext|>``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<|endoftext|>")


def make_model(arch: str, vocab: int, eos: int, hidden: int = 64, layers: int = 2, seed: int = 0):
    """A ``arch`` causal LM of the given sizes, initialised from ``seed``."""
    from transformers import AutoConfig, AutoModelForCausalLM
    cfg = AutoConfig.for_model(arch, vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                               num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                               max_position_embeddings=2048, bos_token_id=eos, eos_token_id=eos,
                               tie_word_embeddings=False, **_ARCH.get(arch, {}))
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--corpus", type=Path, nargs="*", default=None, help="default: docs/ and README.md")
    ap.add_argument("--arch", default="llama", help="a transformers model type (llama, starcoder2, mistral, …)")
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    args = ap.parse_args()
    root = Path(__file__).resolve().parent.parent
    texts = corpus_texts(args.corpus or [root / "docs", root / "README.md"])
    tok = make_tokenizer(texts, args.vocab)
    model = make_model(args.arch, len(tok), tok.eos_token_id, args.hidden, args.layers)
    args.out.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(args.out)
    model.save_pretrained(args.out)
    print(f"wrote {args.out}: {args.arch}, {sum(p.numel() for p in model.parameters()):,} parameters, "
          f"vocab {len(tok)}")


if __name__ == "__main__":
    main()
