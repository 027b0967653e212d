"""Real gloo processes: expert-parallel token dispatch and combine (all-to-all with uneven splits).

Each rank routes its tokens (uniform, or skewed: one expert takes most) and checks that (1) the rows it sends each
rank are the router's assignment (counts per destination), (2) each rank receives exactly the rows routed to its
experts, from every source, expert by expert, (3) combine brings each expert's output back to the row it came
from, and (4) the backward (the reverse all-to-all) gives every row its expert's gradient.
"""

import contextlib
import os

import torch
import torch.distributed as dist

from _launch import run_cases
from meshplan.expert_parallel.dispatch import combine, dispatch, plan_routes

WORLD = int(os.environ["WORLD_SIZE"])
TOKENS, TOP_K, DIM = 24, 2, 3


def route(rank, experts, skewed):
    """Top-k expert ids per token: uniform random, or expert 0 in nearly every token's top-k."""
    g = torch.Generator().manual_seed(100 + rank)
    scores = torch.rand(TOKENS, experts, generator=g)
    if skewed:
        scores[:, 0] += 1.0
    return scores.topk(TOP_K, dim=-1).indices  # (TOKENS, TOP_K)


def case(experts, skewed):
    rank, ep = dist.get_rank(), WORLD
    local = experts // ep
    idx = route(rank, experts, skewed).reshape(-1)
    order = torch.argsort(idx, stable=True)
    expert = idx[order]
    token = torch.arange(TOKENS).repeat_interleave(TOP_K)[order]
    x = torch.stack([torch.full_like(token, rank), token, expert], 1).double().requires_grad_()  # rows say who
    counts = torch.bincount(idx, minlength=experts)
    routes = plan_routes(counts, dist.group.WORLD, ep)
    want_send = [int(((idx // local) == d).sum()) for d in range(ep)]
    assert routes.send == want_send, (routes.send, want_send)
    got = dispatch(x, routes, dist.group.WORLD)
    everyone = [None] * ep
    dist.all_gather_object(everyone, route(rank, experts, skewed).tolist())  # every rank's assignment
    mine = sorted((src, t, e) for src, table in enumerate(everyone) for t, row in enumerate(table) for e in row
                  if e // local == rank)
    rows = [tuple(int(v) for v in r) for r in got.detach().tolist()]
    assert sorted(rows) == mine, "received rows differ from the router's assignment"
    assert [r[2] for r in rows] == sorted(r[2] for r in rows), "not expert-major"
    assert routes.local_counts.tolist() == [sum(1 for r in rows if r[2] == rank * local + e) for e in range(local)]
    y = combine(got * (got[:, 2:3] + 1), routes, dist.group.WORLD)  # the expert: scale by (its id + 1)
    assert torch.equal(y.detach(), x.detach() * (expert[:, None].double() + 1)), "combine misplaced rows"
    w = torch.randn(y.shape, generator=torch.Generator().manual_seed(rank), dtype=torch.float64)
    (y * w).sum().backward()
    want = w * (expert[:, None].double() + 1)  # columns 0-1; column 2 (the id the expert read) has a term more
    assert torch.allclose(x.grad[:, :2], want[:, :2]), "backward did not return each row its expert's gradient"
    return {"sent": routes.send, "received": routes.recv, "local_counts": routes.local_counts.tolist()}


def moe_layer(n_experts, shared=False):
    """The example MoE layer with its experts over ep (ExpertParallel) vs one device on every rank's tokens: each
    rank's outputs, its experts' gradients (all ranks' tokens reach them), and the router's (summed over ep)."""
    from moe import MoE, tiny_args
    from torch.distributed.tensor.parallel import parallelize_module
    from meshplan.expert_parallel.experts import ExpertParallel
    from torch.distributed.device_mesh import init_device_mesh
    rank, ep = dist.get_rank(), WORLD
    args = tiny_args(n_experts=n_experts, shared_expert=shared)
    torch.manual_seed(0)
    ref = MoE(args)
    for p in ref.parameters():
        torch.nn.init.normal_(p, std=0.1)
    model = MoE(args)
    model.load_state_dict(ref.state_dict())
    mesh = init_device_mesh("cpu", (ep,), mesh_dim_names=("ep",))
    parallelize_module(model.experts, mesh, ExpertParallel())
    xs = [torch.randn(3, 8, args.dim, generator=torch.Generator().manual_seed(10 + r)) for r in range(ep)]
    ws = [torch.randn(3, 8, args.dim, generator=torch.Generator().manual_seed(20 + r)) for r in range(ep)]
    out = model(xs[rank])
    (out * ws[rank]).sum().backward()
    want = ref(torch.cat(xs))
    (want * torch.cat(ws)).sum().backward()
    assert torch.allclose(out, want[3 * rank:3 * (rank + 1)], atol=1e-6), "outputs differ"
    local = n_experts // ep
    for name in ("w1", "w2", "w3"):
        got = getattr(model.experts, name).grad.to_local()
        assert torch.allclose(got, getattr(ref.experts, name).grad[rank * local:(rank + 1) * local], atol=1e-6), name
    for name, p in model.named_parameters():
        if not name.startswith("experts."):
            grad = p.grad.clone()
            dist.all_reduce(grad)  # dense parameters: data parallel over the ep ranks
            want_grad = dict(ref.named_parameters())[name].grad
            rel = float((grad - want_grad).norm() / want_grad.norm())  # fp32 sums in another order
            assert rel <= 1e-5, (name, rel)
    return {"tokens_per_expert": model.tokens_per_expert.tolist()}


CASES = {
    "uniform": lambda: case(2 * WORLD, False),
    "skewed": lambda: case(2 * WORLD, True),
    "one_expert_each": lambda: case(WORLD, True),
    "moe_layer": lambda: moe_layer(2 * WORLD),
    "moe_layer_shared": lambda: moe_layer(WORLD, shared=True),
}

def launch_cases():
    """This launch's cases and the context they run in (``tests/dist/suite_worker.py`` runs several workers' in one
    launch)."""
    return CASES, contextlib.nullcontext


if __name__ == "__main__":
    dist.init_process_group("gloo")
    run_cases(launch_cases()[0])
