"""Expert parallelism without processes: the source-major → expert-major order of dispatched rows."""

import pytest
import torch

from meshplan import PlanError
from meshplan.expert_parallel.dispatch import expert_major_order, plan_routes

pytestmark = pytest.mark.fast


@pytest.mark.parametrize("sources", [1, 2, 3, 8])
@pytest.mark.parametrize("experts", [1, 2, 5])
def test_expert_major_order(sources, experts):
    g = torch.Generator().manual_seed(sources * 10 + experts)
    counts = torch.randint(0, 4, (sources, experts), generator=g)
    counts[0, 0] = 0  # empty blocks included
    order = expert_major_order(counts)
    assert sorted(order.tolist()) == list(range(int(counts.sum())))  # a permutation
    block = torch.repeat_interleave(torch.arange(sources * experts), counts.reshape(-1))  # (source, expert) per row
    source, expert = block // experts, block % experts
    key = expert[order] * sources + source[order]
    assert torch.equal(key, key.sort().values)  # expert by expert, sources in order within each
    within = [r for r in order.tolist()]
    for b in range(sources * experts):  # rows of one block keep their order
        rows = [r for r in within if block[r] == b]
        assert rows == sorted(rows)


def test_worked_example():
    # received: src 0: e0 [0], e1 [1 2]; src 1: e0 [3 4 5]; src 2: e1 [6 7]
    assert expert_major_order(torch.tensor([[1, 2], [3, 0], [0, 2]])).tolist() == [0, 3, 4, 5, 1, 2, 6, 7]


def test_experts_must_divide_over_ep():
    with pytest.raises(PlanError, match=r"ep\(4\) does not divide the number of experts \(6\)"):
        plan_routes(torch.ones(6, dtype=torch.long), None, 4)


def test_dense_interface_counts_every_token_once_per_expert():
    """Llama 4's experts take ``forward(x)``, x = every token once per expert, expert-major: E equal blocks."""
    from meshplan.expert_parallel.experts import _sorted_inputs
    x = torch.arange(12.).reshape(6, 2)
    rows, counts, more = _sorted_inputs((x,), "dense", 3)
    assert rows is x and counts.tolist() == [2, 2, 2] and more == []
    with pytest.raises(PlanError, match=r"experts \(interface dense\): 6 input rows are not 4 \(the expert count\) "
                                        r"equal blocks"):
        _sorted_inputs((x,), "dense", 4)


def test_the_interface_is_read_from_the_forward():
    import torch.nn as nn

    from meshplan.expert_parallel.apply import _interface
    from meshplan.plan_file.expert_parallel import ExpertsRule

    class Dense(nn.Module):
        def forward(self, hidden_states):
            return hidden_states

    class Four(nn.Module):
        def forward(self, a, b, c, d):
            return a
    rule = ExpertsRule(style="experts")
    assert _interface(Dense(), rule, "r") == "dense"
    with pytest.raises(PlanError, match=r"r: Four.forward takes 4 positional inputs; expected 1 \(x, every token "
                                        r"once per expert: interface dense\), 2"):
        _interface(Four(), rule, "r")
