"""The eager split refuses models whose forward a later stage would compute differently (never silently wrong):
per-layer masks chosen by index (Gemma2), an embedding not fed the input (GPT-2), a parameter-less final norm
left on every stage (OLMo); Llama-style models pass. Chained stage views equal the full model where it passes
(``tests/test_pipeline.py``)."""

import warnings

import pytest
import torch

from meshplan.errors import PlanError
from meshplan.hf.tiny_models import tiny_model
from meshplan.pipeline.probe import probe_split
from meshplan.pipeline.split import plan_split
from meshplan.plan_file.pipeline import Pipeline

pytestmark = pytest.mark.fast
SECTION = Pipeline(microbatches=2)


def _probe(arch: str, container: str):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = tiny_model(arch)[0]
        split = plan_split(model, SECTION, container + ".*", 2)
        probe_split(model, split)
    return split


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen3", "phi3"])
def test_llama_style_models_pass(arch):
    assert _probe(arch, "model.layers").last == ("model.norm", "lm_head")


@pytest.mark.parametrize("arch,container,why", [
    ("gemma2", "model.layers", "other extra inputs"),             # layer_types: a mask per layer index
    ("gpt2", "transformer.h", "not fed the model's input"),      # input_ids reshaped; wpe on position ids
    ("olmo", "model.layers", "runs after the last block"),       # LayerNorm without parameters
])
def test_unsafe_models_are_refused_with_the_reason(arch, container, why):
    with pytest.raises(PlanError, match=why):
        _probe(arch, container)


def test_examples_llama_passes_on_the_meta_device():
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    import llama
    with torch.device("meta"):
        model = llama.build(llama.tiny_args(n_layers=4))
    split = plan_split(model, SECTION, "layers.*", 2)
    probe_split(model, split)
    assert split.first == ("tok_embeddings",) and split.last == ("norm", "output")


def test_olmo_passes_once_its_norm_is_named_a_last_stage_module():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = tiny_model("olmo")[0]
    section = Pipeline(microbatches=2, last_stage_modules=["model.norm", "lm_head"])
    probe_split(model, plan_split(model, section, "model.layers.*", 2))
