"""Base models (no head: the output is a ``ModelOutput`` with ``last_hidden_state``, no ``logits``) under a
pipeline: the last stage gives its last hidden state, the loss function the model's own output class.

Issue 24: the last stage handed transformers' ``BaseModelOutputWithPast`` to torch's stage, which sends and
checks tensors only: at pp 2 the ranks waited on each other until gloo's timeout; in the 3-D layout torch raised
``PipeliningMetadataError: Stage args must be a tensor … got BaseModelOutputWithPast``.
"""

import warnings

import pytest
import torch
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from meshplan.errors import PlanError
from meshplan.hf.tiny_models import tiny_model
from meshplan.pipeline.probe import probe_split
from meshplan.pipeline.split import plan_split, stage_view
from meshplan.pipeline.stages import StepLoss, boundary_hooks, output_field
from meshplan.plan_file.pipeline import Pipeline

pytestmark = pytest.mark.fast


def _model(arch: str, layers: int = 4):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, why = tiny_model(arch, layers=layers)
    assert model is not None, why
    return model.double()


def test_output_field_is_the_logits_else_the_last_hidden_state():
    h = torch.zeros(1, 2, 3)
    assert output_field(CausalLMOutputWithPast(logits=h)) == "logits"
    assert output_field(BaseModelOutputWithPast(last_hidden_state=h)) == "last_hidden_state"
    assert output_field(h) is None and output_field((h,)) is None


@pytest.mark.parametrize("arch", ["qwen3_vl_text", "eurobert"])
def test_a_base_models_stages_give_tensors_and_the_loss_gets_its_output_class(arch):
    """Chained stage views with the boundary hooks parallelize installs: each gives a tensor (what torch's
    stages send), the last one the model's last hidden state exactly; the loss function is handed the model's
    own output class holding it (float64, forward and backward)."""
    model = _model(arch)
    split = plan_split(model, Pipeline(microbatches=2), "layers.*", 2)
    probe_split(model, split)  # what `meshplan check` and parallelize run: passes
    x = torch.randint(0, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    ref = model(x).last_hidden_state
    loss, seen = StepLoss(), []
    loss.fn = lambda out, y: (seen.append(type(out)), out.last_hidden_state.square().sum())[1]
    h = x
    for s in range(2):
        view = stage_view(model, split, s)
        boundary_hooks(view, None, False, first=s == 0, last=s == 1, loss=loss)
        h = view(h)
        assert isinstance(h, torch.Tensor)
    assert torch.equal(h, ref)
    loss(h, None).backward()
    assert seen == [type(model(x))]
    grad = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    model(x).last_hidden_state.square().sum().backward()
    assert all(torch.equal(p.grad, grad[n]) for n, p in model.named_parameters() if p.grad is not None)


class DictOut(torch.nn.Module):
    """Blocks in ``layers``; its forward returns a plain dict (neither a tensor nor a ``ModelOutput``)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(16, 8)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(2))

    def forward(self, x):
        h = self.emb(x) if not x.is_floating_point() else x
        for layer in self.layers:
            h = layer(h)
        return {"hidden": h}


def test_an_output_torchs_stages_cannot_send_is_refused_in_one_line():
    """Not a hang at run time: the probe ``check`` and ``parallelize`` run refuses it, saying what to return."""
    model = DictOut()
    with pytest.raises(PlanError, match=r"^pipeline: DictOut returns a dict; expected a tensor, a tuple of tensors "
                                        r"or a transformers ModelOutput with logits or last_hidden_state .*pp 1$"):
        probe_split(model, plan_split(model, Pipeline(microbatches=2), "layers.*", 2))
