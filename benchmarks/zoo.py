"""The transformers zoo: every config class with a ``base_model_tp_plan``, tiny, at tp=2, meshplan vs transformers.

For each model type (``CONFIG_MAPPING`` entries whose default config has a non-empty ``base_model_tp_plan``):

1. build it tiny (``meshplan.hf.tiny_models.tiny_model``: every layer kind kept, every sharded size divisible by tp);
2. convert transformers' tp_plan with ``meshplan.hf.convert.from_hf`` (sequence and loss parallel on, the default),
   ``meshplan.check`` it at world size 2, and when it passes run ``check_numerics`` (tp=2 simulated ranks in one
   process, one forward + backward vs one device, every gradient on every rank within 1e-5 relative). When the
   SP + loss-parallel plan is refused but the plain one is not, the plain one is run and that is recorded. A
   float32 difference is run again in float64 with the same tolerance (``float64_numerics``): equal there means
   float32 reduction-order noise on a gradient that cancels, recorded as ``equal`` with ``precision: float64``;
3. apply transformers' own tp_plan (``apply_tensor_parallelism``, as ``from_pretrained(tp_plan=…)`` does) to a
   copy of the same tiny model in the same simulation, and compare the same way.

meshplan's result is exactly one of ``equal``, ``refused`` (check or convert said no, with its reason),
``not buildable tiny`` (why), ``WRONG`` (check ok, numerics differ) or ``crash`` (check ok, the run raised).
transformers' is ``equal``, ``wrong`` or ``crash``. Each model runs in a worker process with a time limit.

    python benchmarks/zoo.py                      # all, writes docs/transformers-zoo.md and /tmp/meshplan-zoo.json
    python benchmarks/zoo.py --only llama,gemma2 --jobs 1 --no-doc
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

TP = 2
CLASSES = ("equal", "refused", "not buildable tiny", "WRONG", "crash")
HF_CLASSES = ("equal", "wrong", "crash", "no plan", "-")


def _quiet() -> None:
    warnings.filterwarnings("ignore")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from transformers.utils import logging
    logging.set_verbosity_error()


def _short(e: BaseException | str, n: int = 400) -> str:
    text = e if isinstance(e, str) else f"{type(e).__name__}: {e}"
    return " ".join(text.split())[:n]


def zoo_types() -> dict[str, str]:
    """``{model type: config class name}`` for every config class whose default has a non-empty tp plan (a
    default that cannot be instantiated is read from the class attribute)."""
    _quiet()
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    out = {}
    for model_type in CONFIG_MAPPING.keys():
        cls = CONFIG_MAPPING[model_type]
        try:
            plan = cls().base_model_tp_plan
        except Exception:  # noqa: BLE001 - fall back to the class attribute
            plan = getattr(cls, "base_model_tp_plan", None)
        if plan:
            out[model_type] = cls.__name__
    return out


def _plan(model, model_type: str, sp: bool, lp: bool) -> dict:
    """meshplan's conversion of the tiny model's tp_plan (its config.json, so the built class is converted)."""
    from meshplan.hf.convert import from_hf
    with tempfile.TemporaryDirectory() as d:
        data = model.config.to_dict()
        data.update(model_type=model.config.model_type, architectures=[type(model).__name__])
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(data, f, default=str)
        plan = from_hf(d, sequence_parallel=sp, loss_parallel=lp)
    plan.pop("_origin", None)
    return {"layout": {"tp": TP}, **plan}


def _check(model, model_type: str, sp: bool, lp: bool) -> tuple[dict | None, list[str]]:
    """(plan, errors): convert + check; errors empty when the plan passed."""
    import meshplan
    from meshplan.errors import PlanError
    try:
        plan = _plan(model, model_type, sp, lp)
    except PlanError as e:
        return None, [f"convert: {_short(str(e), 600)}"]
    report = meshplan.check(model, plan, world_size=TP)
    return plan, [_short(str(e), 600) for e in report.errors]


def loss_fn(model):
    """The loss both sides use: None (check_numerics' default: the model's own causal-LM loss) for a model with
    an output embedding, else the mean square of the last hidden state times a fixed pattern (base models)."""
    try:
        head = model.get_output_embeddings()
    except Exception:  # noqa: BLE001 - some base models raise NotImplementedError
        head = None
    if head is not None:
        return None

    def hidden(m, batch):  # a fixed projection: a norm's output has a constant mean square (zero gradients)
        import torch
        out = m(input_ids=batch["input_ids"])
        h = getattr(out, "last_hidden_state", None)
        h = (h if h is not None else out[0]).float()
        h = h.full_tensor() if hasattr(h, "full_tensor") else h
        return (h * torch.arange(h.numel(), dtype=h.dtype).reshape(h.shape).mul(0.7).sin()).square().mean()
    return hidden


def smoke(model) -> str | None:
    """Why the tiny model does not run one forward + backward on token ids on one device, else None."""
    from meshplan.checks.numerics import _loss, _vocab, default_batch
    try:
        batch = default_batch(model, TP)
        fn = loss_fn(model) or (lambda m, b: _loss(m, b, _vocab(m)))
        fn(model, batch).backward()
    except Exception as e:  # noqa: BLE001
        return f"the tiny {type(model).__name__} does not run on token ids (one device): {_short(e, 300)}"
    finally:
        model.zero_grad(set_to_none=True)
    return None


def meshplan_side(model, model_type: str) -> dict:
    """meshplan's class for a built tiny model: equal / refused / WRONG / crash, with reason and detail."""
    from meshplan import Plan
    from meshplan.checks.numerics import check_numerics
    out = {"mode": "sp+lp"}
    try:
        plan, errors = _check(model, model_type, True, True)
        if errors:
            plain, plain_errors = _check(model, model_type, False, False)
            if plain_errors:
                return {**out, "class": "refused", "reason": "; ".join(plain_errors[:2]),
                        "errors": plain_errors, "sp_errors": errors}
            plan, out = plain, {"mode": "plain", "sp_refused": errors[0]}
    except Exception as e:  # noqa: BLE001 - a crash of convert/check is a finding
        return {**out, "class": "crash", "reason": f"convert/check raised {_short(e)}"}
    rep = check_numerics(model, Plan.from_data(plan), tp=TP, loss_fn=loss_fn(model))
    out.update(worst=max(rep.errors.values(), default=None), loss_error=rep.loss_error)
    if rep.crash is not None:
        return {**out, "class": "crash", "reason": rep.crash}
    if not rep.ok:
        again = float64_numerics(model, plan)  # float32 noise on a gradient that cancels, or a real difference?
        if again is not None and again.ok:
            return {**out, "class": "equal", "precision": "float64",
                    "reason": f"float64 {again.summary()}; float32: {rep.summary()}"}
        return {**out, "class": "WRONG", "reason": rep.summary(), "failed": rep.failed[:10]}
    return {**out, "class": "equal", "reason": rep.summary()}


def float64_numerics(model, plan: dict):
    """:func:`check_numerics` of ``plan`` on a float64 copy of ``model`` (experts on transformers' eager
    implementation: ``grouped_mm`` has no float64 kernel), with the same tolerance; None if the copy cannot run.

    A float32 gradient whose true value cancels to ~0 differs between ANY two reduction orders, one device
    included: deepseek_v4's hash-routed layer 0 sends both top-k copies of every token to expert 0 (its
    ``tid2eid`` table is zeros), so ``weights = s / (2 s)`` is constant and the gate's true gradient is 1e-18,
    while the float32 one-device gradient differs from the float64 one by 2.8e-5 of the floor (tp: 3.5e-5).
    In float64 both agree to 5e-14."""
    from meshplan import Plan
    from meshplan.checks.numerics import check_numerics
    try:
        work = copy.deepcopy(model).double()
        if hasattr(work, "set_experts_implementation") and getattr(work.config, "_experts_implementation", None):
            work.set_experts_implementation("eager")
    except Exception:  # noqa: BLE001 - no float64 opinion
        return None
    rep = check_numerics(work, Plan.from_data(plan), tp=TP, loss_fn=loss_fn(work))
    return None if rep.crash is not None else rep


def hf_numerics(model, tp: int = TP, tol: float = 1e-5):
    """transformers' own tp_plan on a copy of ``model`` (``apply_tensor_parallelism``) over ``tp`` simulated
    ranks, compared with ``model`` as :func:`meshplan.checks.numerics.check_numerics` compares (same batch, loss,
    floor and tolerance). Returns a :class:`~meshplan.checks.numerics.NumericsReport`, or None without a plan."""
    from torch.distributed.device_mesh import init_device_mesh
    from transformers.distributed.tensor_parallel import apply_tensor_parallelism

    from meshplan._torch import simulated_ranks
    from meshplan.checks.numerics import NumericsReport, _loss, _per_rank, _rel, _vocab, default_batch
    if not getattr(model, "tp_plan", None):
        return None
    batch, vocab = default_batch(model, tp), _vocab(model)
    fn = loss_fn(model) or (lambda m, b: _loss(m, b, vocab))
    report = NumericsReport(tp=tp, tol=tol)
    work = copy.deepcopy(model).eval()
    model.eval().zero_grad(set_to_none=True)
    ref_loss = fn(model, batch)
    ref_loss.backward()
    ref = {n: q.grad.detach().clone() for n, q in model.named_parameters() if q.grad is not None}
    model.zero_grad(set_to_none=True)
    norms = [float(g.double().norm()) for g in ref.values()]
    floor = 1e-3 * statistics.median(norms) if norms else 0.0
    try:
        with simulated_ranks(tp):
            mesh = init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",))
            apply_tensor_parallelism(work, mesh, _hf_plan(work))
            if getattr(work.config, "tie_word_embeddings", False):
                work.tie_weights()  # as from_pretrained does after sharding: the head shares the sharded embedding
            loss = fn(work, batch)
            loss.backward()
            want = ref_loss.detach().reshape(())
            losses = {r: v.reshape(()) for r, v in _per_rank(loss).items()}
            report.loss_error = max(_rel(v, want, 0.0) for v in losses.values())
            report.loss = (float(want), float(max(losses.values(), key=lambda v: _rel(v, want, 0.0))))
            for name, q in work.named_parameters():
                if name not in ref:
                    continue
                if q.grad is None:
                    report.errors[name], report.notes[name] = math.inf, "no gradient"
                    continue
                report.errors[name] = max(_rel(v, ref[name], floor) for v in _per_rank(q.grad).values())
    except Exception as e:  # noqa: BLE001 - reported
        report.crash = _short(e, 500)
        return report
    report.failed = sorted((n for n, e in report.errors.items() if not e <= tol or n in report.notes),
                           key=lambda n: -report.errors[n])
    return report


def _hf_plan(model) -> dict[str, str]:
    """The model's expanded tp_plan, less the entries of tied duplicates (``lm_head.weight`` tied to the input
    embedding): ``apply_tensor_parallelism`` looks parameters up without duplicates and would raise KeyError;
    from_pretrained shards before tying, then ties, so the shared parameter is sharded once (by the embedding's
    rule) and :func:`hf_numerics` re-ties after applying."""
    plan = model._expand_parallel_plan(dict(model.tp_plan))
    unique = {n for n, _ in model.named_parameters()}
    modules = {n for n, _ in model.named_modules()}
    return {k: v for k, v in plan.items() if k in unique or k in modules}


def hf_side(model) -> dict:
    """transformers' own tp_plan on the same tiny model: equal / wrong / crash / no plan."""
    try:
        rep = hf_numerics(model)
    except Exception as e:  # noqa: BLE001
        return {"class": "crash", "reason": _short(e)}
    if rep is None:
        return {"class": "no plan", "reason": f"{type(model).__name__}.tp_plan is empty"}
    if rep.crash is not None:
        return {"class": "crash", "reason": rep.crash}
    return {"class": "equal" if rep.ok else "wrong", "reason": rep.summary(), "failed": rep.failed[:10]}


def classify(model_type: str, hf: bool = True) -> dict:
    """One zoo row: ``{type, model, class, reason, …, hf: {class, reason}}`` (see the module docstring)."""
    _quiet()
    from meshplan.hf.tiny_models import tiny_model
    t0 = time.perf_counter()
    model, why = tiny_model(model_type, tp=TP)
    row = {"type": model_type, "model": type(model).__name__ if model is not None else None}
    if model is None:
        return {**row, "class": "not buildable tiny", "reason": why, "hf": {"class": "-"}, "seconds": 0.0}
    why = smoke(model)
    if why is not None:
        return {**row, "class": "not buildable tiny", "reason": why, "hf": {"class": "-"}, "seconds": 0.0}
    row.update(meshplan_side(model, model_type))
    row["hf"] = hf_side(model) if hf else {"class": "-"}
    row["seconds"] = round(time.perf_counter() - t0, 1)
    return row


# --------------------------------------------------------------------------------------------- workers
def _worker(conn, hf: bool) -> None:
    _quiet()
    while True:
        model_type = conn.recv()
        if model_type is None:
            return
        try:
            row = classify(model_type, hf=hf)
        except BaseException as e:  # noqa: BLE001 - the sweep goes on
            row = {"type": model_type, "class": "crash", "reason": f"zoo worker: {_short(e)}", "hf": {"class": "-"}}
        conn.send(row)


class _Slot:
    def __init__(self, hf: bool):
        self.hf, self.proc, self.conn, self.job, self.started = hf, None, None, None, 0.0

    def start(self, model_type: str) -> None:
        if self.proc is None or not self.proc.is_alive():
            ctx = mp.get_context("spawn")
            self.conn, child = ctx.Pipe()
            self.proc = ctx.Process(target=_worker, args=(child, self.hf), daemon=True)
            self.proc.start()
        self.job, self.started = model_type, time.perf_counter()
        self.conn.send(model_type)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join()
        self.proc = None


def sweep(types: list[str], jobs: int = 1, timeout: float = 60.0, hf: bool = True, log=print) -> list[dict]:
    """Classify every type in worker processes; a type past ``timeout`` seconds (or killing its worker) is a
    ``crash`` row and its worker is restarted."""
    todo, rows, slots = list(types), [], [_Slot(hf) for _ in range(max(1, jobs))]
    while todo or any(s.job for s in slots):
        for s in slots:
            if s.job is None and todo:
                s.start(todo.pop(0))
        time.sleep(0.05)
        for s in slots:
            if s.job is None:
                continue
            row = None
            try:
                if s.conn.poll():
                    row = s.conn.recv()
            except EOFError:
                row = {"type": s.job, "class": "crash", "reason": f"worker died (exit {s.proc.exitcode})"}
                s.kill()
            if row is None and time.perf_counter() - s.started > timeout:
                row = {"type": s.job, "class": "crash", "reason": f"timed out after {timeout:.0f} s"}
                s.kill()
            if row is not None:
                row.setdefault("hf", {"class": "-"})
                rows.append(row)
                log(f"{row['type']:38s} {row['class']:19s} hf: {row['hf']['class']:8s} {_short(row['reason'], 110)}")
                s.job = None
    for s in slots:
        if s.proc is not None:
            s.conn.send(None)
            s.proc.join(5)
    return sorted(rows, key=lambda r: r["type"])


# --------------------------------------------------------------------------------------------- report
def _counts(rows: list[dict], key) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in rows:
        out[key(r)] = out.get(key(r), 0) + 1
    return out


def markdown(rows: list[dict], config_classes: dict[str, str], seconds: float, jobs: int, timeout: float) -> str:
    """The text of ``docs/transformers-zoo.md``."""
    import torch
    import transformers

    from meshplan.hf.styles import HF_UNSUPPORTED as HF_UNSUPPORTED_STYLES
    mine = _counts(rows, lambda r: r["class"])
    theirs = _counts([r for r in rows if r["class"] != "not buildable tiny"], lambda r: r["hf"]["class"])
    decoders = [r for r in rows if r.get("model") and r["model"].endswith("ForCausalLM")
                and r["class"] != "not buildable tiny"]
    eq = sum(r["class"] == "equal" for r in decoders)
    hf_eq = sum(r["hf"]["class"] == "equal" for r in decoders)
    # transformers styles that are not tensor parallelism of modules: experts (expert parallelism), DeepSeek's MLA
    # split projection, bare parameters; meshplan refuses them by name (see meshplan.hf.styles.HF_UNSUPPORTED)
    beyond = [r for r in decoders if r["class"] == "refused" and any(
        f"style '{k}'" in r.get("reason", "") for k in HF_UNSUPPORTED_STYLES)]
    rest = len(decoders) - len(beyond)
    rest_eq = sum(r["class"] == "equal" for r in decoders if r not in beyond)
    esc = lambda s: " ".join(str(s).split()).replace("|", "\\|")  # noqa: E731
    lines = [
        "# transformers zoo: meshplan vs transformers' own tp_plan, tiny models, tp=2",
        "",
        f"Generated by `python benchmarks/zoo.py --jobs {jobs} --timeout {timeout:.0f}` on "
        f"{time.strftime('%Y-%m-%d %H:%M')} (transformers {transformers.__version__}, torch {torch.__version__}, "
        f"{seconds / 60:.1f} min on 2 shared CPU cores); do not edit.",
        "",
        "Every config class with a non-empty `base_model_tp_plan`, built tiny by `meshplan/hf_tiny.py` (every layer",
        "kind kept, sizes divisible by tp), one forward + backward at tp=2 (simulated ranks, `LocalTensorMode`) vs",
        "one device, every gradient on every rank within 1e-5 relative (`meshplan.checks.numerics`). meshplan runs",
        "`meshplan.hf.convert.from_hf` (sequence + loss parallel) after `meshplan.check`; *transformers* applies",
        "the model's own `tp_plan` with `apply_tensor_parallelism` to a copy of the same model (a tied `lm_head`",
        "re-tied after sharding, as `from_pretrained` does). Causal LMs are compared on their own loss, base models",
        "on the mean square of the last hidden state times a fixed pattern. `not buildable tiny` also covers models",
        "that do not run on token ids alone (vision towers, talkers). Each model: one worker process, time-limited.",
        "",
        "| meshplan | models |", "|---|---|",
        *[f"| {c} | {mine.get(c, 0)} |" for c in CLASSES],
        f"| **total** | {len(rows)} |",
        "",
        "| transformers' tp_plan (buildable models) | models |", "|---|---|",
        *[f"| {c} | {n} |" for c, n in sorted(theirs.items())],
        "",
        f"Buildable decoders (`*ForCausalLM`): {len(decoders)}; meshplan `equal` on {eq} "
        f"({100 * eq / max(len(decoders), 1):.0f} %), transformers' tp_plan `equal` on {hf_eq} "
        f"({100 * hf_eq / max(len(decoders), 1):.0f} %). {len(beyond)} of them are refused because transformers' "
        f"plan uses styles that are not tensor parallelism of modules (MoE experts, MLA, bare parameters: expert "
        f"parallelism is a separate issue); of the other {rest}, meshplan is `equal` on {rest_eq} "
        f"({100 * rest_eq / max(rest, 1):.0f} %) and refuses the rest with a reason.",
        "",
        "| model type | config class | model | meshplan | reason / worst error | transformers' tp_plan |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        hf = r["hf"]["class"] + (f": {esc(r['hf'].get('reason', ''))[:160]}" if r["hf"]["class"] in
                                 ("wrong", "crash") else "")
        mode = " (without SP/loss_parallel)" if r.get("mode") == "plain" else ""
        lines.append(f"| {r['type']} | {config_classes.get(r['type'], '')} | {r.get('model') or ''} | "
                     f"{r['class']}{mode} | {esc(r.get('reason', ''))[:300]} | {hf} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", help="comma-separated model types")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds per model")
    ap.add_argument("--no-hf", action="store_true", help="skip transformers' own tp_plan")
    ap.add_argument("--json", default="/tmp/meshplan-zoo.json", help="raw results (out of git)")
    ap.add_argument("--doc", default=os.path.join(ROOT, "docs", "transformers-zoo.md"))
    ap.add_argument("--no-doc", action="store_true")
    ap.add_argument("--render", action="store_true", help="only rewrite --doc from the --json of an earlier sweep")
    args = ap.parse_args(argv)
    configs = zoo_types()
    if args.render:
        with open(args.json) as f:
            data = json.load(f)
        rows, seconds = data["rows"], data["seconds"]
        args.jobs, args.timeout = data.get("jobs", args.jobs), data.get("timeout", args.timeout)
    else:
        types = args.only.split(",") if args.only else list(configs)
        t0 = time.perf_counter()
        rows = sweep(types, jobs=args.jobs, timeout=args.timeout, hf=not args.no_hf)
        seconds = time.perf_counter() - t0
        with open(args.json, "w") as f:
            json.dump({"seconds": seconds, "jobs": args.jobs, "timeout": args.timeout, "rows": rows}, f, indent=1,
                      default=str)
    print(f"\n{len(rows)} models in {seconds:.0f} s: " + ", ".join(f"{c} {n}" for c, n in
                                                            _counts(rows, lambda r: r["class"]).items()))
    if not args.no_doc and not args.only:
        with open(args.doc, "w") as f:
            f.write(markdown(rows, configs, seconds, args.jobs, args.timeout))
        print(f"wrote {args.doc}" + ("" if args.render else f", {args.json}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
