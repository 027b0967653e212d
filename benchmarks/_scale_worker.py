"""The torchrun side of ``benchmarks/scale.py``: one launch runs many (layout, start) phases in turn.

Run by ``scale.py`` as ``torchrun --nproc-per-node N benchmarks/_scale_worker.py SPEC.json``. SPEC names the
models (transformers configs), the checkpoints, the phases and where each rank writes ``rank<R>.json``.

Each phase: ``gc`` + ``malloc_trim(0)``, the peak RSS reset (``/proc/self/clear_refs`` ← 5: VmHWM := VmRSS), then
meta model → ``meshplan.parallelize`` → the start (``materialize`` | ``load_safetensors`` | ``meshplan.load``) →
``steps`` AdamW steps of ``train_step``; the rank reports its VmHWM after the start and after the steps, and its
parameter / gradient / AdamW bytes measured from its local tensors. A phase that raises is recorded as
``not supported yet: <error>`` and the next phase runs (the refusals meshplan makes happen on every rank alike).
"""

from __future__ import annotations

import ctypes
import datetime
import gc
import json
import os
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
import transformers

import meshplan

_LIBC = ctypes.CDLL("libc.so.6")


def status_kib(key: str) -> int:
    """A ``/proc/self/status`` line in KiB (``VmRSS``, ``VmHWM``)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def reset_peak() -> int:
    """Free what Python and glibc hold, reset VmHWM to VmRSS; returns VmRSS in KiB."""
    gc.collect()
    if os.environ.get("SCALE_NO_TRIM") != "1":
        _LIBC.malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")
    return status_kib("VmRSS")


class Sampler:
    """The peaks of ``RssAnon`` and ``RssFile`` (KiB), sampled every 5 ms in a thread: VmHWM is their sum's peak;
    file-backed pages (a mapped checkpoint) are page cache, anonymous ones the process's own."""

    def __init__(self):
        self.peak = {"RssAnon": 0, "RssFile": 0}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            for k in self.peak:
                self.peak[k] = max(self.peak[k], status_kib(k))

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join()
        return {"anon_kib": self.peak["RssAnon"], "file_kib": self.peak["RssFile"]}


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _nbytes(tensors) -> int:
    seen, n = set(), 0
    for t in tensors:  # alive for the whole loop: their ids are unique (a to_local() view's id is not)
        loc = _local(t)
        if id(t) not in seen and not loc.is_meta:
            seen.add(id(t))
            n += loc.numel() * loc.element_size()
    return n


def _loss(out, y):
    logits = getattr(out, "logits", out)
    if hasattr(logits, "placements"):  # vocab-sharded (loss_parallel) or replicated: meshplan's loss
        return meshplan.cross_entropy(logits, y, reduction="sum")
    return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), reduction="sum")


def _build(spec: dict, which: str):
    cfg = spec["models"][which]
    config = getattr(transformers, cfg["config_class"])(**cfg["config"])
    with torch.device("meta"):
        return getattr(transformers, cfg["model_class"])(config)


def _start(model, start: str, spec: dict, which: str) -> str:
    """Fill the meta model's shards; returns a note ('' when the start ran as asked)."""
    if start == "init":
        if spec["init_mode"] == "exact":
            meshplan.materialize(model, seed=0)
        else:
            try:
                meshplan.materialize(model, seed=0, mode=spec["init_mode"])
            except TypeError as e:
                raise NotImplementedError(f"materialize(mode={spec['init_mode']!r}): {e}") from e
        return ""
    if start == "safetensors":
        meshplan.load_safetensors(model, spec["models"][which]["hf_dir"])
        return ""
    try:
        meshplan.load(spec["models"][which]["dcp_dir"], model)
        return ""
    except meshplan.PlanError as e:
        if "meta device" not in str(e):
            raise
    meshplan.materialize(model, seed=0)  # today's way: allocate (and initialize) first, then load
    meshplan.load(spec["models"][which]["dcp_dir"], model)
    return "load into meta shards not supported yet: materialize(seed) then load"


def _train(model, spec: dict, layout: str, vocab: int) -> tuple[list[float], int, int, int]:
    fused = {"fused": True, "default": None}[spec.get("adamw", "fused")]  # docs/scale.md: the step's temporaries
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused)
    step, before = opt.step, []

    def timed_step(*a, **k):  # the peak of forward + backward, before AdamW's step runs
        before.append(status_kib("VmHWM"))
        return step(*a, **k)
    opt.step = timed_step
    state = meshplan.parallel_state(model)
    topo = state.topology if state is not None else None
    data_world = topo.data_world_size if topo is not None else 1
    g = torch.Generator().manual_seed(7)
    losses = []
    for _ in range(spec["steps"]):
        x = torch.randint(0, vocab, (spec["batch"] * data_world, spec["seq"]), generator=g)
        rank = topo.data_rank if data_world > 1 else 0
        x = x[rank * spec["batch"]:(rank + 1) * spec["batch"]]
        inputs = x if spec["layouts"][layout]["plan"]["layout"].get("pp", 1) > 1 else {"input_ids": x}
        losses.append(meshplan.train_step(model, (inputs, x), _loss, opt).loss)
    moments = [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    return losses, _nbytes(moments), len(opt.state), max(before, default=0)


def run_phase(spec: dict, layout: str, start: str) -> dict:
    """One (layout, start) on this rank: times, peaks and bytes (see the module docstring)."""
    out: dict = {"layout": layout, "start": start, "rss_start_kib": reset_peak()}
    sampler = Sampler()
    try:
        _phase(spec, layout, start, out)
    finally:
        out.update(sampler.stop())
    return out


def _phase(spec: dict, layout: str, start: str, out: dict) -> None:
    which = spec["layouts"][layout]["model"]
    t = time.perf_counter()
    model = _build(spec, which)
    plan = spec["layouts"][layout]["plan"]
    if plan is not None:
        model = meshplan.parallelize(model, plan, meshplan.build_mesh(plan["layout"]))
    out["parallelize_s"] = time.perf_counter() - t
    t, cpu = time.perf_counter(), time.process_time()
    try:
        out["note"] = _start(model, start, spec, which)
    except (meshplan.PlanError, NotImplementedError, TypeError, RuntimeError) as e:
        out["error"] = f"not supported yet: {type(e).__name__}: {str(e).splitlines()[0][:300]}"
        return
    finally:  # wall and CPU seconds (the CPU ones: this rank's work, whatever the other ranks' share of the cores)
        out["start_s"], out["start_cpu_s"] = time.perf_counter() - t, time.process_time() - cpu
    out["hwm_start_kib"] = status_kib("VmHWM")
    params = [p for p in model.parameters() if p.requires_grad]
    out["params"] = _nbytes(model.parameters())
    out["grads"] = _nbytes(params)  # what backward leaves: one gradient shaped like each local shard
    t = time.perf_counter()
    out["loss"], out["optimizer"], out["states"], out["hwm_backward_kib"] = (
        _train(model, spec, layout, model.config.vocab_size) if spec["steps"] else ([], 0, 0, 0))
    out["steps_s"] = time.perf_counter() - t
    out["hwm_kib"] = status_kib("VmHWM")


def prepare(spec: dict) -> dict:
    """Write each model's checkpoints once (one process): save_pretrained (safetensors) and meshplan.save (DCP)."""
    made = {}
    for which, cfg in spec["models"].items():
        if Path(cfg["dcp_dir"]).is_dir():
            continue
        config = getattr(transformers, cfg["config_class"])(**cfg["config"])
        t = time.perf_counter()
        torch.manual_seed(0)
        model = getattr(transformers, cfg["model_class"])(config)
        made[which] = {"cpu_build_s": time.perf_counter() - t,
                       "params": sum(p.numel() * p.element_size() for p in model.parameters())}
        model.save_pretrained(cfg["hf_dir"])
        meshplan.save(cfg["dcp_dir"], model, step=0)
        del model
    return made


def imports(spec: dict) -> None:
    """What the empty process imports: meshplan's lazily loaded names, the torch.distributed parts they use and
    the transformers model classes (code, not data: the baseline holds it, the phases do not re-count it)."""
    import torch.distributed.checkpoint  # noqa: F401
    import torch.distributed.fsdp  # noqa: F401
    import torch.distributed.pipelining  # noqa: F401
    import torch.distributed.tensor  # noqa: F401
    for name in ("parallelize", "materialize", "load_safetensors", "load", "save", "train_step", "cross_entropy",
                 "build_mesh", "parallel_state"):
        getattr(meshplan, name)
    for cfg in spec["models"].values():
        getattr(transformers, cfg["model_class"]), getattr(transformers, cfg["config_class"])


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    imports(spec)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=spec.get("timeout_s", 900)))
    rank = dist.get_rank()
    if os.environ.get("SCALE_PROBE") == "1":  # per-action VmRSS / VmHWM (benchmarks/_scale_probe.py)
        sys.path.insert(0, str(Path(__file__).parent))
        from _scale_probe import install
        install(str(Path(spec["out"], f"probe{rank}.txt")))
    result: dict = {"baseline_kib": status_kib("VmHWM"), "rss_kib": status_kib("VmRSS"), "phases": []}
    if spec.get("prepare"):
        result["prepared"] = prepare(spec)
    log = Path(spec["out"], f"progress{rank}.txt")
    for layout, start in spec["phases"]:
        with log.open("a") as f:
            f.write(f"{time.strftime('%H:%M:%S')} {layout} {start}\n")
        try:
            result["phases"].append(run_phase(spec, layout, start))
        except Exception as e:  # noqa: BLE001 - a phase that fails is reported, the table goes on
            result["phases"].append({"layout": layout, "start": start,
                                     "error": f"failed: {type(e).__name__}: {str(e).splitlines()[0][:300]}"})
        dist.barrier()
    Path(spec["out"], f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # the gloo exit race of tests/_launch.py: results are written, leave without finalizing


if __name__ == "__main__":
    main()
