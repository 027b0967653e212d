"""Real gloo processes: what one pipelined ``meshplan.train_step`` communicates and stores, per rank, for
``tests/test_dist_solver.py`` to hold against ``meshplan estimate`` (the schedule's first step infers shapes
point to point, so pipelines cannot run on a fake group). World 4.

Each case parallelizes the example Llama with its plan, runs one step (the schedule's shape inference, the
optimizer's state), then records a second step op by op: collectives by kind and group size, and the parameter,
gradient and optimizer bytes the rank holds.
"""

import contextlib
import os

import torch
import yaml

import meshplan
from _launch import run_cases
from benchmarks._comm import CommLog
from llama import ModelArgs, build

WORLD = int(os.environ.get("WORLD_SIZE", 4))
SEQ, BATCH = 32, 8
TP = yaml.safe_load(open("plans/llama.yaml"))["tensor_parallel"]
BLOCKS = {"pattern": "layers.*"}

#: name → plan; every case runs on all WORLD ranks, BATCH sequences per data-parallel rank
PLANS = {
    "pp2_fsdp2": {"layout": {"pp": 2}, "blocks": BLOCKS, "pipeline": {"schedule": "1f1b", "microbatches": 4}},
    "pp2_ddp2": {"layout": {"pp": 2, "dp_replicate": 2}, "blocks": BLOCKS,
                 "pipeline": {"schedule": "gpipe", "microbatches": 2}},
    "pp2_tp2": {"layout": {"pp": 2, "tp": 2}, "blocks": BLOCKS, "tensor_parallel": TP,
                "pipeline": {"schedule": "1f1b", "microbatches": 2}},
    "pp4": {"layout": {"pp": 4}, "blocks": BLOCKS, "pipeline": {"schedule": "1f1b", "microbatches": 4}},
    "pp2_interleaved_v2": {"layout": {"pp": 2, "vpp": 2}, "blocks": BLOCKS,
                           "pipeline": {"schedule": "interleaved_1f1b", "microbatches": 4}},
    "pp2_looped_bfs_tp2": {"layout": {"pp": 2, "vpp": 2, "tp": 2}, "blocks": BLOCKS, "tensor_parallel": TP,
                           "pipeline": {"schedule": "looped_bfs", "microbatches": 2}},
    "pp2_fsdp2_vocab_ends": {"layout": {"pp": 2}, "blocks": BLOCKS, "data_parallel": {"ends": "vocab_parallel"},
                             "pipeline": {"schedule": "1f1b", "microbatches": 4}},
}


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _bytes(tensors) -> int:
    return sum(_local(t).numel() * _local(t).element_size() for t in tensors)


def _case(name: str):
    def run():
        plan = meshplan.Plan.from_data(PLANS[name], source=name)
        torch.manual_seed(0)
        model = build(ModelArgs(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=128, ffn_dim=128,
                                max_seq_len=SEQ))
        topo = meshplan.build_mesh(PLANS[name]["layout"])
        meshplan.parallelize(model, plan, topo)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        x = torch.randint(0, 128, (BATCH, SEQ), generator=torch.Generator().manual_seed(topo.data_rank))
        meshplan.train_step(model, (x, x), meshplan.cross_entropy, opt, topology=topo, max_grad_norm=1.0)
        with CommLog() as log:
            meshplan.train_step(model, (x, x), meshplan.cross_entropy, opt, topology=topo, max_grad_norm=1.0)
        states = [v for st in opt.state.values() for v in st.values() if torch.is_tensor(v)]
        return {"pp_rank": topo.pp_rank, "counts": dict(log.by_group()),
                "params": _bytes(model.parameters()), "optimizer": _bytes(states)}
    return run


CASES = {name: _case(name) for name in PLANS}

def launch_cases():
    """This launch's cases and the context they run in (``tests/dist/suite_worker.py`` runs several workers' in one
    launch)."""
    return CASES, contextlib.nullcontext


if __name__ == "__main__":
    import torch.distributed as dist
    dist.init_process_group("gloo")
    run_cases(launch_cases()[0])
