"""Text and JSON of estimates and searches (what ``meshplan estimate`` and ``meshplan solve`` print). Torch-free."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import asdict
from typing import Any

from meshplan.solver.cluster import Cluster
from meshplan.solver.search import SearchResult
from meshplan.solver.shape import ModelShape
from meshplan.solver.step import Estimate

__all__ = ["estimate_text", "estimate_json", "search_text", "search_json", "fmt_bytes"]

GiB = float(1 << 30)


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


def _parts(e: Estimate) -> str:
    return ", ".join(f"{k} {v:.3g}" for k, v in e.parts.items() if v > 0)


def estimate_text(e: Estimate, s: ModelShape, cl: Cluster, source: str) -> str:
    """The ``meshplan estimate`` report: memory per rank, collectives per step by axis, step time."""
    m, c = e.memory, e.candidate
    usable = cl.memory * cl.usable_memory
    lines = [f"meshplan estimate: {source}  {s.describe()}",
             f"layout: {c.label()} on {c.world} ranks (order {c.order})", "",
             f"memory per rank (pipeline rank {e.memory_rank}, the most loaded): {fmt_bytes(m.total)} of "
             f"{fmt_bytes(usable)} usable on {cl.name}" + ("" if m.total <= usable else
                                                          " — DOES NOT FIT (meshplan solve rejects it: memory)"),
             f"  parameters {fmt_bytes(m.params)} ({m.numel:,} elements in {m.tensors} tensors), gradients "
             f"{fmt_bytes(m.grads)}, optimizer {fmt_bytes(m.optimizer)}",
             f"  activations {fmt_bytes(m.activations)} (microbatches in flight), FSDP gathered parameters "
             f"{fmt_bytes(m.gathered)}, transient {fmt_bytes(m.transient)}"
             + (f"; on the host (cpu_offload) {fmt_bytes(m.host)}" if m.host else ""), "",
             "collectives per step (pipeline rank 0; every rank of a stage issues the same):"]
    head = ("axis", "kind", "group", "calls", "bytes/call", "what")
    rows = [(x.axis, x.kind, f"{x.group.size} on {x.group.nodes} node{'s' if x.group.nodes > 1 else ''}",
             str(x.count), fmt_bytes(x.nbytes), x.what) for x in e.collectives]
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(head)]
    lines += ["  " + "  ".join(v.ljust(w) for v, w in zip(head, widths)).rstrip()]
    lines += ["  " + "  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows]
    by_axis: dict[str, float] = defaultdict(float)
    for x in e.collectives:
        by_axis[x.axis] += x.count * x.nbytes
    lines += ["  bytes per step by axis: " + ", ".join(f"{a} {fmt_bytes(v)}" for a, v in by_axis.items()), "",
              f"step time on {cl.name}: {e.step_time:.4g} s ({_parts(e)}) -> {e.tokens_per_s:,.0f} tokens/s, "
              f"{e.tokens_per_s_device:,.1f} per device, {e.tflops_device:.1f} model TFLOP/s per device, "
              f"MFU {100 * e.mfu:.1f}%"]
    return "\n".join(lines)


def _candidate_json(e: Estimate) -> dict[str, Any]:
    return {"layout": e.candidate.layout_dict(), "candidate": asdict(e.candidate), "label": e.candidate.label(),
            "step_time": e.step_time, "tokens_per_s": e.tokens_per_s, "tokens_per_s_device": e.tokens_per_s_device,
            "mfu": e.mfu, "tflops_device": e.tflops_device, "memory": {**asdict(e.memory), "total": e.memory.total},
            "memory_rank": e.memory_rank, "parts": e.parts}


def estimate_json(e: Estimate) -> dict[str, Any]:
    out = _candidate_json(e)
    out["collectives"] = [{"axis": x.axis, "kind": x.kind, "group": x.group.size, "nodes": x.group.nodes,
                           "count": x.count, "bytes": x.nbytes, "what": x.what} for x in e.collectives]
    return out


def search_text(res: SearchResult, s: ModelShape, cl: Cluster, gpus: int, top: int, rejected: int) -> str:
    """The ``meshplan solve`` report: the fastest valid layouts, then the rejections by rule."""
    lines = [f"meshplan solve: {s.describe()}",
             f"{gpus} devices of {cl.name} ({cl.gpus_per_node} per node): {res.enumerated:,} candidates enumerated, "
             f"{len(res.valid):,} valid, {len(res.rejected):,} rejected, in {res.seconds:.2f} s", ""]
    head = ("#", "layout", "step s", "tokens/s/dev", "MFU", "memory GiB", "where the time goes (s)")
    rows = [(str(i + 1), e.candidate.label(), f"{e.step_time:.4g}", f"{e.tokens_per_s_device:,.1f}",
             f"{100 * e.mfu:.1f}%", f"{e.memory.total / GiB:.1f}", _parts(e)) for i, e in enumerate(res.valid[:top])]
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(head)]
    lines += ["  ".join(v.ljust(w) for v, w in zip(head, widths)).rstrip()]
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows]
    if not res.valid:
        lines.append("no valid layout: see the rejections below")
    counts = res.reasons()
    lines += ["", "rejected, by rule: " + (", ".join(f"{k} {v:,}" for k, v in counts.most_common()) or "none")]
    shown: dict[str, int] = defaultdict(int)
    for r in res.rejected:
        if shown[r.reason] < rejected:
            shown[r.reason] += 1
            lines.append(f"  {r.label}: {r.message}")
    return "\n".join(lines)


def search_json(res: SearchResult, top: int | None) -> dict[str, Any]:
    return {"enumerated": res.enumerated, "valid": len(res.valid), "rejected": len(res.rejected),
            "seconds": res.seconds, "reasons": dict(res.reasons()),
            "layouts": [_candidate_json(e) for e in (res.valid if top is None else res.valid[:top])],
            "rejections": [asdict(r) for r in res.rejected]}
