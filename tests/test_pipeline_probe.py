"""The eager split runs the model's code outside the blocks on the end stages as the model does, and the probe
compares the chained stages' output with the whole model's (never silently wrong).

What a later stage would get wrong before (issue 24): Cohere's ``lm_head(h) * logit_scale`` and Granite's
``/ logits_scaling`` and Gemma2's soft-capping ran on a middle stage's hidden state (the head a pass-through),
Granite's ``× embedding_multiplier`` and Gemma's ``× √hidden`` on a later stage's received one, Gemma2/3's
per-layer masks were chosen by a restarted index. Now these pass with chained stages equal to the model, in
output and gradients; a forward that depends on its input's values, or fails on a hidden state, is refused, and
the refusal suggests ``split: trace`` only where the probe traced the same copy and got the model's output.
"""

import functools
import warnings

import pytest
import torch
import torch.nn as nn

from meshplan.errors import PlanError
from meshplan.hf.tiny_models import tiny_model
from meshplan.pipeline import probe
from meshplan.pipeline.probe import probe_split
from meshplan.pipeline.split import plan_split, stage_view
from meshplan.plan_file.pipeline import Pipeline

pytestmark = pytest.mark.fast
SECTION = Pipeline(microbatches=2)
#: non-trivial settings of the code outside the blocks (the transformers defaults are 1.0 for Granite)
OUTSIDE = {"granite": {"embedding_multiplier": 12.0, "logits_scaling": 8.0, "residual_multiplier": 0.5},
           "cohere": {"logit_scale": 0.25}, "gemma2": {"final_logit_softcapping": 0.5}}


def _model(arch: str, layers: int = 4):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, why = tiny_model(arch, layers=layers, **OUTSIDE.get(arch, {}))
    assert model is not None, why
    return model.double()


def _probe(arch: str, container: str = "model.layers", stages: int = 2):
    model = _model(arch)
    container = "transformer.h" if arch == "falcon" else container
    split = plan_split(model, SECTION, container + ".*", stages)
    probe_split(model, split)
    return model, split


def _chain(model, split, x):
    h = x
    for s in range(split.num_stages):
        out = stage_view(model, split, s)(h)
        h = getattr(out, "logits", out)
    return h


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen3", "phi3"])
def test_llama_style_models_pass(arch):
    assert _probe(arch)[1].last == ("model.norm", "lm_head")


@pytest.mark.parametrize("arch", ["cohere", "granite", "gemma2", "gemma3_text", "cohere2", "olmo", "falcon"])
@pytest.mark.parametrize("stages", [2, 4])
def test_code_outside_the_blocks_runs_on_the_end_stages(arch, stages):
    """Logit scales, soft-capping, embedding multipliers, per-layer masks, OLMo's parameter-less final norm,
    Falcon's blocks returning tuples: the chained stages equal the model exactly, forward and backward (float64,
    train mode)."""
    model, split = _probe(arch, stages=stages)
    x = torch.randint(0, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    model.train()
    ref = model(x).logits
    ref.square().sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    out = _chain(model, split, x)
    out.square().sum().backward()
    assert torch.equal(out, ref)
    assert all(torch.equal(p.grad, grads[n]) for n, p in model.named_parameters())
    assert torch.equal(model(x).logits, ref)  # the model called directly after its views ran: unaffected


def test_a_middle_stage_sends_the_block_output_not_the_scaled_logits():
    """Cohere multiplies the head's output by ``logit_scale``: the first stage sends what block 2 gets."""
    model = _model("cohere")
    split = plan_split(model, SECTION, "model.layers.*", 2)
    x = torch.randint(0, model.config.vocab_size, (2, 24))
    seen = []
    model.model.layers[2].register_forward_pre_hook(lambda _m, args, kw: seen.append(args[0] if args else
                                                                                      next(iter(kw.values()))),
                                                    with_kwargs=True)
    with torch.no_grad():
        model(x)
        sent = stage_view(model, split, 0)(x)
    assert torch.equal(getattr(sent, "logits", sent), seen[0])


class ValueMasked(nn.Module):
    """Each block's output is masked where the token id is 0: computed from the input's *values*, which a later
    stage (fed a hidden state) does not have."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))
        self.head = nn.Linear(8, 16)

    def forward(self, ids):
        keep = (ids != 0).unsqueeze(-1) if ids.dtype == torch.long else (ids[..., :1] > 0)
        h = self.embed(ids)
        for layer in self.layers:
            h = layer(h) * keep
        return self.head(h)


class BadShape(ValueMasked):
    """Takes the sequence length from its input's last dimension (as GPT-2's ``input_ids.view(-1, input_shape[-1])``
    does): a later stage's input ends in the hidden size."""

    def forward(self, ids):
        n = ids.shape[-1]
        mix = torch.ones(n, n).tril() / n
        h = self.embed(ids)
        for layer in self.layers:
            h = layer(mix @ h)
        return self.head(h)


def test_a_forward_that_reads_its_inputs_values_is_refused_with_the_numbers():
    model = ValueMasked()
    with pytest.raises(PlanError, match=r"compute another output than the model \(max \|difference\| .* use "
                                        r"pipeline.split: trace with split_points \['layers.2'\] \(traced and "
                                        r"checked"):
        probe_split(model, plan_split(model, SECTION, "layers.*", 2))


def test_a_forward_that_fails_on_a_hidden_state_is_refused_and_trace_is_suggested_only_if_it_works():
    model = BadShape()
    with pytest.raises(PlanError, match=r"fails where the model runs: stage 1 of 2 raised RuntimeError.*use "
                                        r"pipeline.split: trace with split_points \['layers.2'\] \(traced"):
        probe_split(model, plan_split(model, SECTION, "layers.*", 2))
    gpt2 = _model("gpt2")  # tied embeddings: torch's traced split refuses a parameter on two stages
    with pytest.raises(PlanError, match=r"stage 1 of 2 raised .*split: trace with split_points "
                                        r"\['transformer.h.2'\] does not run it either .* use pp 1"):
        probe_split(gpt2, plan_split(gpt2, SECTION, "transformer.h.*", 2))


def test_trace_is_suggested_only_if_its_stages_run_with_autograd_on():
    """GLM-MoE-DSA's stages, traced under no_grad, ran; traced with autograd on, as train_step traces, stage 0
    fails (a placeholder torch.export leaves unfed): the probe used to suggest the trace, which then crashed."""
    model = _model("glm_moe_dsa", layers=2)
    with pytest.raises(PlanError, match=r"split_points \['model.layers.1'\] does not run it either .* use pp 1"):
        probe_split(model, plan_split(model, SECTION, "model.layers.*", 2))


class Twice(ValueMasked):
    def forward(self, ids):
        h = self.embed(ids)
        for layer in [self.layers[0], *self.layers]:
            h = layer(h)
        return self.head(h)


def test_a_block_run_twice_is_refused():
    model = Twice()
    with pytest.raises(PlanError, match=r"block 'layers.0' ran 2 times in one forward; expected once .*; .*split: trace"):
        probe_split(model, plan_split(model, SECTION, "layers.*", 2))


def test_examples_llama_passes_on_the_meta_device(monkeypatch):
    """A meta-device model gets fixed pseudo-random values in a CPU copy; past REAL_LIMIT only the meta run's
    shapes and block calls are checked."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    import llama
    with torch.device("meta"):
        model = llama.build(llama.tiny_args(n_layers=4))
    split = plan_split(model, SECTION, "layers.*", 2)
    probe_split(model, split)
    assert split.first == ("tok_embeddings",) and split.last == ("norm", "output")
    monkeypatch.setattr(probe, "REAL_LIMIT", 0)
    probe_split(model, split)
    assert all(p.is_meta for p in model.parameters())


def test_the_probe_leaves_the_random_stream_alone():
    model = _model("granite")
    split = plan_split(model, SECTION, "model.layers.*", 2)
    torch.manual_seed(5)
    want = torch.rand(3)
    torch.manual_seed(5)
    probe_split(model, split)
    assert torch.equal(torch.rand(3), want)


def test_a_model_with_use_cache_passes_and_traces():
    """transformers' configs default to ``use_cache=True``: the forward then returns a ``DynamicCache``, which
    torch.export cannot put in a graph's output; ``split: trace`` traces with the cache off (restored after)."""
    from meshplan.pipeline.trace import traced_stages
    model = _model("granite")
    model.config.use_cache = True
    split = plan_split(model, SECTION, "model.layers.*", 2)
    probe_split(model, split)
    x = torch.randint(0, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    traced = traced_stages(model, (x,), ["model.layers.2"], 2, [0, 1])
    h = traced.modules[0](x)
    out = traced.modules[1](*h) if isinstance(h, tuple) else traced.modules[1](h)
    assert torch.equal(out, model(x).logits) and model.config.use_cache is True


def test_meshplan_check_refuses_what_parallelize_refuses_and_its_suggestion_checks_ok():
    """``meshplan check`` runs the same probe; following its suggestion (``split: trace`` with the split points
    it names) gives a plan check accepts."""
    import meshplan
    plan = {"layout": {"pp": 2}, "blocks": {"pattern": "layers.*"},
            "pipeline": {"schedule": "1f1b", "microbatches": 2}}
    report = meshplan.check(ValueMasked(), plan)
    assert not report.ok and "compute another output than the model" in str(report.errors[0])
    assert "use pipeline.split: trace with split_points ['layers.2']" in str(report.errors[0])
    traced = {"layout": {"pp": 2}, "pipeline": {"schedule": "1f1b", "microbatches": 2, "split": "trace",
                                                "split_points": ["layers.2"]}}
    report = meshplan.check(ValueMasked(), traced)
    assert report.ok, report.errors


def test_the_probe_keeps_to_the_models_longest_input():
    """examples/llama.py refuses inputs longer than ``max_seq_len``: at 16 (under the probe's 24 tokens) the probe
    runs 16 tokens and the split passes (it was refused: 'sequence length 24 > max_seq_len 16')."""
    import llama
    import meshplan
    plan = {"layout": {"pp": 2}, "blocks": {"pattern": "layers.*"},
            "pipeline": {"schedule": "1f1b", "microbatches": 2}}
    report = meshplan.check(llama.build(llama.tiny_args(max_seq_len=16)), plan)
    assert report.ok, report.errors
    assert probe._max_len(llama.build(llama.tiny_args(max_seq_len=16))) == 16


def test_every_stage_gets_the_keyword_inputs_and_what_cannot_reach_a_stage_is_refused():
    """Position ids 0, 2, 4, … (an offset alone would not show: RoPE is relative) and packed documents (ids
    restarting per document: transformers masks each document) change the whole model's logits; the chained stages
    given the same keyword inputs (as the schedule gives every stage) reproduce them, and without them the last
    stage is off (what a pipelined train_step did before: silently wrong). Inputs no stage can take are refused."""
    from types import SimpleNamespace as NS
    from meshplan.pipeline.inputs import stage_inputs
    from meshplan.pipeline.step import pipeline_step
    model = _model("llama")
    split = plan_split(model, SECTION, "model.layers.*", 2)
    x = torch.arange(24).reshape(2, 12) % 50
    for pos in (torch.arange(0, 24, 2).reshape(1, 12), torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 0, 1, 2]])):
        first, side = stage_inputs(model, {"input_ids": x, "position_ids": pos, "use_cache": False})
        assert first is x and side["position_ids"].shape == (2, 12) and side["use_cache"] is False
        with torch.no_grad():
            want, plain = model(x, **side).logits, model(x, use_cache=False).logits
            hidden = stage_view(model, split, 0)(first, **side)
            chained = stage_view(model, split, 1)(hidden, **side).logits
            dropped = stage_view(model, split, 1)(hidden).logits
        assert (want - plain).abs().max() > 1e-3  # the positions matter
        assert torch.equal(chained, want)
        assert (dropped - want).abs().max() > 1e-3  # a later stage without them: the default positions
    step = functools.partial(pipeline_step, model, NS(topology=None, pipeline=NS()), loss_fn=lambda o, y: o,
                             optimizer=None, shard_batch=None, attach=None)
    with pytest.raises(PlanError, match=r"inputs are a tuple of 2.*inputs 2..2 cannot reach it.*a dict"):
        step(((x, torch.ones_like(x)), x))
    with pytest.raises(PlanError, match=r"without 'input_ids', LlamaForCausalLM.forward's first parameter"):
        step(({"tokens": x}, x))
    with pytest.raises(PlanError, match=r"inputs hold \['labels'\].*pass them as the targets"):
        step(({"input_ids": x, "labels": x}, x))
    with pytest.raises(PlanError, match=r"input 'cu_seqlens' has shape \(3,\).*dim 0 = the batch's 2 rows"):
        step(({"input_ids": x, "cu_seqlens": torch.tensor([0, 5, 12])}, x))
