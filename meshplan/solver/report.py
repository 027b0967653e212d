"""Text and JSON of estimates and searches (what ``meshplan estimate`` and ``meshplan solve`` print). Torch-free."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import asdict, replace
from typing import Any

from meshplan.solver.cluster import Cluster
from meshplan.solver.search import SearchResult
from meshplan.solver.shape import ModelShape
from meshplan.solver.step import Estimate

__all__ = ["estimate_text", "estimate_json", "uncertainty", "band_text", "search_text", "search_json", "fmt_bytes", "table", "LEGEND"]

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
             f"layout: {c.label()} on {c.world} ranks (order {c.order})", LEGEND, "",
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
              f"MFU {100 * e.mfu:.1f}%", band_text(cl)]
    return "\n".join(lines)


def uncertainty(cl: Cluster) -> dict[str, Any]:
    """The estimate's relative ± band: the profile's repeat spread and the calibration's mean error, added in
    quadrature (each 0 when unknown)."""
    band = (cl.repeat_spread ** 2 + cl.calibration_error ** 2) ** 0.5
    return {"band": band, "repeat_spread": cl.repeat_spread, "calibration_error": cl.calibration_error,
            "calibration_source": cl.calibration_source}


def band_text(cl: Cluster) -> str:
    """One line: the ± band and where it comes from."""
    u = uncertainty(cl)
    calibration = (f"the calibration's mean error {100 * u['calibration_error']:.0f}% ({u['calibration_source']})"
                   if u["calibration_error"] else "no calibration for this cluster (benchmarks/calibrate.py "
                   "--save-clusters writes one)")
    return (f"uncertainty: ±{100 * u['band']:.0f}% of the step time, from the profile's repeat spread "
            f"{100 * u['repeat_spread']:.0f}% and {calibration}")


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


#: what the layout column's words mean (``meshplan solve`` prints it under its table, ``estimate`` under its layout)
LEGEND = ("layout: tpT cpC epE ppP×vV SCHEDULE dpR×S(MODE) mbB×M ac=AC [ORDER]: tensor, context, expert, "
          "pipeline degrees (V stages per pp rank), R data-parallel replicas × S shards (fsdp/hsdp/ddp), B sequences "
          "per micro-batch × M micro-batches per step, activation checkpointing; the Megatron order when not "
          "tp-cp-ep-dp-pp")

#: the loop schedules the cost model prices alike (the same bubble (p−1)/(v·m+p−1) and sends)
_LOOPS = ("interleaved_1f1b", "looped_bfs")


def _distinct(valid: list[Estimate]) -> list[tuple[Estimate, list[str]]]:
    """``valid`` with each loop-schedule twin folded into the first of its tie: ``(estimate, twin schedules)``."""
    rows: list[tuple[Estimate, list[str]]] = []
    seen: dict[Any, list[str]] = {}
    for e in valid:
        c = e.candidate
        key = (replace(c, schedule=None), f"{e.step_time:.9g}") if c.schedule in _LOOPS else None
        if key is not None and key in seen:
            seen[key].append(c.schedule)
            continue
        rows.append((e, []))
        if key is not None:
            seen[key] = rows[-1][1]
    return rows


def _label(e: Estimate, twins: list[str]) -> str:
    c = e.candidate
    return c.label().replace(f" {c.schedule} ", f" {'|'.join([c.schedule, *twins])} ", 1) if twins else c.label()


def search_text(res: SearchResult, s: ModelShape, cl: Cluster, gpus: int, top: int, rejected: int,
                width: int | None = None) -> str:
    """The ``meshplan solve`` report: the fastest valid layouts (loop-schedule twins of equal step time on one row,
    ``interleaved_1f1b|looped_bfs``), then the rejections by rule; ``width``: wrap the last column to fit."""
    lines = [f"meshplan solve: {s.describe()}",
             f"{gpus} devices of {cl.name} ({cl.gpus_per_node} per node): {res.enumerated:,} candidates enumerated, "
             f"{len(res.valid):,} valid, {len(res.rejected):,} rejected, in {res.seconds:.2f} s", ""]
    head = ("#", "layout", "step s", "tokens/s/dev", "MFU", "memory GiB", "where the time goes (s)")
    shown = _distinct(res.valid)[:top]
    rows = [(str(i + 1), _label(e, twins), f"{e.step_time:.4g}", f"{e.tokens_per_s_device:,.1f}",
             f"{100 * e.mfu:.1f}%", f"{e.memory.total / GiB:.1f}", _parts(e)) for i, (e, twins) in enumerate(shown)]
    lines += table(head, rows, width)
    if not res.valid:
        lines.append("no valid layout: see the rejections below")
    else:
        lines.append(LEGEND if width is None else "\n".join(_wrap(LEGEND, width, 0)))
        if any(twins for _, twins in shown):
            lines.append("A|B: schedules with the same estimated step time, on one row (the first needs the least "
                         "memory)")
    counts = res.reasons()
    lines += ["", "rejected, by rule: " + (", ".join(f"{k} {v:,}" for k, v in counts.most_common()) or "none")]
    per_rule: dict[str, int] = defaultdict(int)
    for r in res.rejected:
        if per_rule[r.reason] < rejected:
            per_rule[r.reason] += 1
            lines.append(f"  {r.label}: {r.message}")
    return "\n".join(lines)


def _wrap(text: str, width: int, indent: int) -> list[str]:
    """``text`` in lines of at most ``width`` characters (at spaces), every line but the first indented."""
    import textwrap
    return textwrap.wrap(text, max(width, indent + 20), subsequent_indent=" " * indent, break_on_hyphens=False) or [""]


def table(head: tuple[str, ...], rows: list[tuple[str, ...]], width: int | None = None) -> list[str]:
    """Columns padded to their widest cell; with ``width`` (a terminal's), the last column wraps under itself."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(head)]
    start = sum(w + 2 for w in widths[:-1])
    out = []
    for r in [head, *rows]:
        line = "  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip()
        if width is None or len(line) <= width:
            out.append(line)
        else:
            import textwrap
            chunks = textwrap.wrap(r[-1], max(width - start, 20), break_on_hyphens=False) or [""]
            out += [line[:start] + chunks[0], *(" " * start + c for c in chunks[1:])]
    return out


def search_json(res: SearchResult, top: int | None) -> dict[str, Any]:
    return {"enumerated": res.enumerated, "valid": len(res.valid), "rejected": len(res.rejected),
            "seconds": res.seconds, "reasons": dict(res.reasons()),
            "layouts": [_candidate_json(e) for e in (res.valid if top is None else res.valid[:top])],
            "rejections": [asdict(r) for r in res.rejected]}
