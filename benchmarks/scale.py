"""O(shard) memory and time from the meta device to the first steps, per rank (issue 27; ``docs/scale.md``).

Run from the repo root::

    python benchmarks/scale.py --size dev                       # ~0.9 GB fp32 Llama / MoE, 4 gloo processes
    python benchmarks/scale.py --size full                      # ~2 GB fp32 (hidden 2048, 8 layers, vocab 32000)
    python benchmarks/scale.py --size tiny --layouts tp4 --json out.json     # the smoke test's size

A transformers ``LlamaForCausalLM`` (and for ``ep`` a ``MixtralForCausalLM`` of the same size) under each layout
on ``--nproc`` CPU processes (torchrun, gloo): ``tp4`` (tp 4), ``pp2tp2`` (pp 2 × tp 2), ``pp2fsdp2`` (pp 2 × FSDP2
over dp_shard 2), ``ep`` (``plans/hf_mixtral_ep.yaml``: attention tp 2, experts over ep 2), ``cp2tp2``
(``plans/hf_llama_cp.yaml``). For each layout and each start — ``init`` (meta → parallelize → ``materialize``,
seed 0, ``--init-mode``), ``safetensors`` (→ ``load_safetensors`` of the ``save_pretrained`` checkpoint),
``dcp`` (→ ``meshplan.load`` of a ``meshplan.save`` checkpoint) — then ``--steps`` AdamW steps (batch
``--batch`` × seq ``--seq`` per data rank), each rank reports its peak RSS (VmHWM, reset before each phase), its
parameter + gradient + AdamW bytes from its local tensors, ``meshplan estimate --rank R``'s bytes, and the
ratio peak / (p + g + opt + the measured empty-process baseline: VmHWM after importing torch, meshplan and
transformers and initializing the process group). One launch writes the checkpoints (one process, CPU-built
seeded model) and times the one-process starts; one launch per layout runs its three starts
(``--launch-per all``: every phase in one launch, as the smoke test does; ``phase``: a fresh process each).
``--mmap-threshold N`` launches the ranks with glibc's ``MALLOC_MMAP_THRESHOLD_=N`` (docs/scale.md: without it,
freed gathered parameters of 4-32 MiB stay in the heap's RSS); ``SCALE_PROBE=1`` writes each rank's per-action
VmRSS / VmHWM (``benchmarks/_scale_probe.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
STARTS = ("init", "safetensors", "dcp")
_DENSE = dict(num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=256, attention_dropout=0.0,
              tie_word_embeddings=False, hidden_act="silu", rms_norm_eps=1e-5)
#: (hidden, layers, vocab, FFN, heads, KV heads); the MoE: 4 experts top 2 of FFN / 4 (the dense FFN's bytes)
SIZES = {"tiny": (64, 2, 128, 128, 4, 4), "dev": (2048, 2, 32000, 5632, 16, 4), "full": (2048, 8, 32000, 5632, 16, 4)}


def model_specs(size: str, ckpt: Path) -> dict:
    """The two transformers models of ``size`` and where their checkpoints go."""
    hidden, layers, vocab, ffn, heads, kv = SIZES[size]
    base = {**_DENSE, "hidden_size": hidden, "num_hidden_layers": layers, "vocab_size": vocab,
            "num_attention_heads": heads, "num_key_value_heads": kv}
    moe = {**base, "intermediate_size": ffn // 4, "num_local_experts": 4, "num_experts_per_tok": 2,
           "router_jitter_noise": 0.0, "sliding_window": None}
    models = {"llama": ("LlamaConfig", "LlamaForCausalLM", {**base, "intermediate_size": ffn}),
              "moe": ("MixtralConfig", "MixtralForCausalLM", moe)}
    return {k: {"config_class": c, "model_class": m, "config": cfg, "hf_dir": str(ckpt / f"{k}-hf"),
                "dcp_dir": str(ckpt / f"{k}-dcp")} for k, (c, m, cfg) in models.items()}


def layout_plans(microbatches: int = 2, dp: dict | None = None) -> dict:
    """``{layout name: {"model": ..., "plan": plan data}}`` from the repo's transformers plans (``dp``: more keys of
    ``pp2fsdp2``'s and ``pp2fsdp2v``'s ``data_parallel`` section: ``accumulate_unsharded``, ``reduce_scatter``,
    ``prefetch``)."""
    def read(name: str) -> dict:
        return yaml.safe_load((ROOT / "plans" / name).read_text())
    llama, pipe = read("hf_llama.yaml"), {"schedule": "1f1b", "microbatches": microbatches}
    fsdp = {"version": 1, "layout": {"pp": 2, "dp_shard": 2}, "blocks": llama["blocks"], "pipeline": pipe}
    return {
        "tp4": {"model": "llama", "plan": {**llama, "layout": {"tp": 4}}},
        "pp2tp2": {"model": "llama", "plan": {**llama, "layout": {"pp": 2, "tp": 2}, "pipeline": pipe,
                                              "tensor_parallel": {**llama["tensor_parallel"], "loss_parallel": False}}},
        "pp2fsdp2": {"model": "llama", "plan": {**fsdp, "data_parallel": {"mode": "fsdp", **(dp or {})}}},
        # the same with the embedding and head sharded by rows over the 2 data ranks instead of FSDP2 units
        "pp2fsdp2v": {"model": "llama", "plan": {**fsdp, "data_parallel": {"mode": "fsdp", "ends": "vocab_parallel",
                                                                           **(dp or {})}}},
        "ep": {"model": "moe", "plan": read("hf_mixtral_ep.yaml")},
        "cp2tp2": {"model": "llama", "plan": read("hf_llama_cp.yaml")},
    }


def launch(spec: dict, nproc: int, work: Path, name: str, timeout: float = 3600) -> dict:
    """One torchrun launch of ``_scale_worker.py``; ``{rank: result}``."""
    out = work / name
    out.mkdir(parents=True, exist_ok=True)
    (out / "spec.json").write_text(json.dumps({**spec, "out": str(out)}))
    env = {**os.environ, "OMP_NUM_THREADS": "1", **spec.get("env", {}),
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           str(ROOT / "benchmarks" / "_scale_worker.py"), str(out / "spec.json")]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    got = {int(f.stem[4:]): json.loads(f.read_text()) for f in out.glob("rank*.json")}
    if len(got) != nproc:
        raise RuntimeError(f"{name}: {len(got)} of {nproc} ranks reported (torchrun rc {proc.returncode}):\n"
                           f"{proc.stderr[-4000:]}")
    return got


def estimate(plan: dict, config: dict, model_class: str, world: int, rank: int, seq: int, batch: int,
             work: Path) -> dict | None:
    """``meshplan estimate PLAN --config CONFIG --rank R``'s parameter, gradient and optimizer bytes (None: refused)."""
    from meshplan.cli.main import main
    (work / "plan.yaml").write_text(yaml.safe_dump(plan))
    (work / "config.json").write_text(json.dumps({**config, "architectures": [model_class]}))
    data_world = world // (plan["layout"].get("tp", 1) * plan["layout"].get("pp", 1) * plan["layout"].get("cp", 1))
    argv = ["estimate", str(work / "plan.yaml"), "--config", str(work / "config.json"), "--world-size", str(world),
            "--seq", str(seq), "--global-batch", str(batch * data_world), "--rank", str(rank), "--format", "json"]
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(io.StringIO()):
        try:
            rc = main(argv)
        except SystemExit as e:
            rc = e.code
    if rc != 0:
        return None
    got = json.loads(buf.getvalue())["rank"]
    return {k: got[k] for k in ("params", "grads", "optimizer")}


def _mib(n: float, kib: bool = False) -> str:
    return f"{n / (1024 if kib else 1024 ** 2):,.1f}"


def _speed(ph: dict, one: dict | None, key: str) -> str:
    """``"2.10 (1.3×)"``: the phase's seconds of ``key`` and the one-process start's over them."""
    t1 = (one or {}).get(key) if one is not None and "error" not in one else None
    return f"{ph[key]:.2f} ({t1 / ph[key]:.1f}×)" if t1 and ph[key] else f"{ph[key]:.2f}"


def _row(ph: dict, rank: int, base: int, one: dict | None, est: dict | None) -> str:
    head = f"| {ph['layout']} | {ph['start']} | {rank} |"
    if "error" in ph:
        return f"{head} {ph['error']} |" + " |" * 11
    pgo = ph["params"] + ph["grads"] + ph["optimizer"]
    ratio = ph["hwm_kib"] * 1024 / (pgo + base * 1024)
    same = "n/a" if est is None else ("yes" if all(est[k] == ph[k] for k in est) else
                                      "no: " + "/".join(_mib(est[k]) for k in ("params", "grads", "optimizer")))
    speed = " / ".join(_speed(ph, one, k) for k in ("start_s", "start_cpu_s") if k in ph)
    return (f"{head} {_mib(ph['params'])} | {_mib(ph['grads'])} | {_mib(ph['optimizer'])} | {same} | "
            f"{_mib(base, True)} | {_mib(ph['hwm_start_kib'], True)} | {_mib(ph['hwm_kib'], True)} | "
            f"{_mib(ph.get('anon_kib', 0), True)} / {_mib(ph.get('file_kib', 0), True)} | "
            f"**{ratio:.2f}** | {ph['parallelize_s']:.2f} | {speed} | {ph.get('note') or ''} |")


HEADER = ("| layout | start | rank | params MiB | grads MiB | AdamW MiB | = estimate | baseline MiB | peak RSS after "
          "start MiB | peak RSS MiB | peak anon / file MiB | peak / (p+g+opt+base) | parallelize s | "
          "start s / CPU s (one process ÷ this) | note |\n"
          + "|" + "---|" * 15)


def table(results: dict, layouts: dict) -> str:
    """The markdown table of every phase of every rank (``results``: what :func:`run` returns)."""
    one = {(ph["layout"], ph["start"]): ph for ph in results["one"][0]["phases"]}
    rows = []
    for rank, res in results["world"].items():
        for ph in res["phases"]:
            ref = one.get(("one-" + layouts[ph["layout"]]["model"], ph["start"]))
            key = (list(layouts).index(ph["layout"]), STARTS.index(ph["start"]), int(rank))
            est = results["est"].get(f"{ph['layout']}:{rank}")
            rows.append((key, _row(ph, int(rank), res["baseline_kib"], ref, est)))
    lines = [HEADER] + [r for _, r in sorted(rows)]
    ref_rows = [f"| {k[0]} | {k[1]} | 0 | " + (ph.get("error") or f"peak RSS {_mib(ph['hwm_kib'], True)} MiB, "
                f"params {_mib(ph['params'])} MiB, start {ph['start_s']:.2f} s, CPU "
                f"{ph.get('start_cpu_s', float('nan')):.2f} s") + " |" for k, ph in one.items()]
    return ("\n".join(lines) + "\n\none process (no parallelize, no steps):\n\n| model | start | rank | |\n"
            "|---|---|---|---|\n" + "\n".join(ref_rows))


def summary(results: dict, layouts: dict) -> str:
    """One line per (layout, start): the worst rank's ratio, its peak and p+g+opt, the slowest rank's start."""
    one = {(ph["layout"], ph["start"]): ph for ph in results["one"][0]["phases"]}
    lines = ["| layout | start | worst peak / (p+g+opt+base) | its peak MiB | its p+g+opt MiB | baseline MiB | "
             "its RSS at the phase's start MiB | its peak anon / file MiB | worst peak after the start / (p+base) "
             "| slowest start s | one process start s | note |", "|" + "---|" * 12]
    for name in layouts:
        for start in STARTS:
            phs = [(r, ph) for r, res in results["world"].items() for ph in res["phases"]
                   if (ph["layout"], ph["start"]) == (name, start)]
            if not phs:
                continue
            bad = [ph["error"] for _, ph in phs if "error" in ph]
            if bad:
                lines.append(f"| {name} | {start} | {bad[0]} |" + " |" * 9)
                continue
            base = {r: results["world"][r]["baseline_kib"] * 1024 for r, _ in phs}
            ratio = {r: ph["hwm_kib"] * 1024 / (ph["params"] + ph["grads"] + ph["optimizer"] + base[r])
                     for r, ph in phs}
            r, ph = max(phs, key=lambda rp: ratio[rp[0]])
            loaded = max(p["hwm_start_kib"] * 1024 / (p["params"] + base[q]) for q, p in phs)
            ref = one.get(("one-" + layouts[name]["model"], start), {})
            lines.append(f"| {name} | {start} | **{ratio[r]:.2f}** (rank {r}) | {_mib(ph['hwm_kib'], True)} | "
                         f"{_mib(ph['params'] + ph['grads'] + ph['optimizer'])} | {_mib(base[r])} | "
                         f"{_mib(ph['rss_start_kib'], True)} | {_mib(ph.get('anon_kib', 0), True)} / "
                         f"{_mib(ph.get('file_kib', 0), True)} | {loaded:.2f} | "
                         f"{max(p['start_s'] for _, p in phs):.2f} | {ref.get('start_s', float('nan')):.2f} | "
                         f"{ph.get('note') or ''} |")
    return "\n".join(lines)


def run(args) -> dict:
    """The launches; ``{"one": {rank: result}, "world": {rank: result}, "est": {"layout:rank": bytes}}``."""
    work = Path(args.work or tempfile.mkdtemp(prefix="meshplan-scale-"))
    models = model_specs(args.size, work / "ckpt")
    dp = {"accumulate_unsharded": args.accumulate_unsharded == "true", "reduce_scatter": args.reduce_scatter,
          "prefetch": args.prefetch == "true"}
    layouts = {k: v for k, v in layout_plans(dp=dp).items() if k in args.layouts}
    used = sorted({v["model"] for v in layouts.values()})
    base = {"models": {k: models[k] for k in used}, "init_mode": args.init_mode, "adamw": args.adamw,
            "batch": args.batch, "seq": args.seq,
            "env": {"MALLOC_MMAP_THRESHOLD_": str(args.mmap_threshold)} if args.mmap_threshold else {}}
    one_layouts = {f"one-{m}": {"model": m, "plan": None} for m in used}
    one = launch({**base, "prepare": True, "steps": 0, "layouts": one_layouts,
                  "phases": [(k, s) for k in one_layouts for s in args.starts]}, 1, work, "one")
    phases = [(k, s) for k in layouts for s in args.starts]
    spec = {**base, "steps": args.steps, "layouts": layouts}
    groups = {"all": [phases], "phase": [[ph] for ph in phases],
              "layout": [[ph for ph in phases if ph[0] == k] for k in layouts]}[args.launch_per]
    world: dict = {}
    for i, group in enumerate(groups):
        for r, res in launch({**spec, "phases": group}, args.nproc, work, f"world-{i}").items():
            world.setdefault(r, {**res, "phases": []})["phases"] += res["phases"]
    est = {}
    for name, lay in layouts.items():
        m = models[lay["model"]]
        for r in range(args.nproc):
            est[f"{name}:{r}"] = estimate(lay["plan"], m["config"], m["model_class"], args.nproc, r, args.seq,
                                          args.batch, work)
    return {"one": one, "world": world, "est": est, "layouts": layouts, "work": str(work)}


def parse_args(argv=None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="dev")
    ap.add_argument("--layouts", nargs="+", choices=list(layout_plans()), default=list(layout_plans()))
    ap.add_argument("--starts", nargs="+", choices=STARTS, default=list(STARTS))
    ap.add_argument("--init-mode", choices=("exact", "sharded"), default="exact")
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--accumulate-unsharded", choices=("true", "false"), default="true",
                    help="pp2fsdp2's and pp2fsdp2v's data_parallel.accumulate_unsharded (false: reduce-scatter "
                         "every microbatch)")
    ap.add_argument("--reduce-scatter", choices=("collective", "chunked"), default="collective",
                    help="pp2fsdp2's and pp2fsdp2v's data_parallel.reduce_scatter (chunked: gloo without "
                         "input-sized buffers)")
    ap.add_argument("--prefetch", choices=("true", "false"), default="true",
                    help="pp2fsdp2's and pp2fsdp2v's data_parallel.prefetch (false: one unit gathered at "
                         "a time)")
    ap.add_argument("--adamw", choices=("fused", "default"), default="fused",
                    help="torch.optim.AdamW(fused=True) (no per-parameter temporaries on CPU) or torch's default "
                         "(CPU: single-tensor, 2 x the largest local shard of temporaries in its step)")
    ap.add_argument("--batch", type=int, default=2, help="sequences per data rank (pp: ≥ its 2 microbatches)")
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--launch-per", choices=("all", "layout", "phase"), default="layout",
                    help="one torchrun launch for all phases, per layout (default) or per phase: a phase's peak "
                         "starts from what the launch's earlier phases left (a pipeline phase: ~140 MiB)")
    ap.add_argument("--mmap-threshold", type=int, default=0,
                    help="glibc MALLOC_MMAP_THRESHOLD_ for the ranks (bytes; 0: glibc's dynamic default). 1048576: "
                         "every freed buffer of >= 1 MiB goes back to the OS (docs/scale.md)")
    ap.add_argument("--work", help="folder for checkpoints and rank files (default: a new temporary one)")
    ap.add_argument("--json", help="also write the raw results here")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    res = run(args)
    print(summary(res, res["layouts"]) + "\n\n" + table(res, res["layouts"]))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
