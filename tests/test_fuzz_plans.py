"""Fuzz: any plan file ends in a ``Plan`` or one ``PlanError``; any ``meshplan`` argv (every subcommand, called
in-process) exits 0 or 2 with one line, in bounded time and memory; any checkpoint manifest is listed or refused
in one line; a crafted checkpoint never runs code.

Inputs: random plan-shaped data and mutated copies of ``plans/*.yaml`` written as YAML, JSON and TOML; byte-level
mutations of real plan files; random bytes; deep nesting; integers past Python's 4,300-digit limit; non-scalar YAML
keys and YAML tags. Hypothesis runs derandomized here (a few seconds); ``python benchmarks/fuzz.py`` runs the same
strategies with random seeds and thousands of inputs and prints the outcome counts.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import re
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshplan import Plan, PlanError, load_plan
from meshplan.plan_file.document import as_plan
from meshplan.plan_file.reading import MAX_PLAN_NODES
from meshplan.cli.main import main

pytestmark = pytest.mark.fast

ROOT = Path(__file__).resolve().parent.parent
REAL_PLANS = sorted((ROOT / "plans").glob("*.yaml"))
SUFFIXES = (".yaml", ".yml", ".json", ".toml")
KEYS = ("version", "layout", "tensor_parallel", "data_parallel", "tp", "cp", "ep", "etp", "pp", "vpp", "dp_replicate",
        "dp_shard", "order", "sequence_parallel", "loss_parallel", "dropout_rng", "adjust_head_counts", "rules",
        "style", "input_layouts", "output_layouts", "use_local_output", "packed", "mode", "blocks", "param_dtype",
        "reduce_dtype", "reshard_after_forward", "activation_checkpointing", "every", "ops", "compile", "source",
        "faults", "timeout_s", "init_timeout_s", "heartbeat_s", "flight_recorder", "dump_dir",
        "layers.*.wq", "output", "", "x" * 40)
WORDS = ("colwise", "rowwise", "norm", "embedding", "lm_head", "replicate", "shard(1)", "shard(-1)", "partial",
         "batch", "tp-cp-ep-dp-pp", "DPT", "cluster", "fsdp", "selective", "aten.mm.default", "bfloat16", "yes",
         "true", "2", "2.0", "layers.*", "colwise_rep", "embedding_rowwise")
HUGE = 10 ** 4400  # past Python's int-to-str limit

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 10), st.integers(-2 ** 70, 2 ** 70),
    st.sampled_from([2 ** 20, 2 ** 20 + 1, 10 ** 8]), st.sampled_from([1, -1]).map(lambda sign: sign * HUGE),
    st.floats(allow_nan=True), st.sampled_from(WORDS),
    st.text(max_size=12))
keys = st.one_of(st.sampled_from(KEYS), st.text(max_size=8))
data = st.recursive(scalars, lambda ch: st.lists(ch, max_size=4) | st.dictionaries(keys, ch, max_size=5),
                    max_leaves=25)


def _real_plans() -> list[dict]:
    return [yaml.safe_load(p.read_text()) for p in REAL_PLANS]


@st.composite
def mutated_plans(draw) -> dict:
    """A real plan with 1-4 random edits: a value replaced, a key dropped or added, a section wrapped in a list."""
    plan = json.loads(json.dumps(draw(st.sampled_from(_real_plans()))))
    for _ in range(draw(st.integers(1, 4))):
        node = plan
        while isinstance(node, dict) and node and draw(st.booleans()):
            child = node[draw(st.sampled_from(sorted(node)))]
            if not isinstance(child, dict):
                break
            node = child
        if not isinstance(node, dict) or not node:
            continue
        key = draw(st.sampled_from(sorted(node)))
        op = draw(st.sampled_from(("set", "drop", "add", "wrap")))
        if op == "set":
            node[key] = draw(data)
        elif op == "drop":
            del node[key]
        elif op == "add":
            node[draw(keys)] = draw(data)
        else:
            node[key] = [node[key]]
    return plan


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return hex(v) if v > 10 ** 4000 else (str(v) if abs(v) < 10 ** 4000 else "-0")
    if isinstance(v, float):
        return "nan" if math.isnan(v) else ("inf" if v == math.inf else "-inf" if v == -math.inf else repr(v))
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v if x is not None) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{json.dumps(str(k))} = {_toml_value(x)}" for k, x in v.items() if x is not None) + "}"
    return '"null"'  # TOML has no null


class _Dumper(yaml.SafeDumper):
    """Writes an int past 4300 digits in hex (``str`` refuses it; YAML reads ``0x…`` back)."""

    def represent_int(self, data):
        return self.represent_scalar("tag:yaml.org,2002:int", hex(data) if abs(data) > 10 ** 4000 else str(data))


_Dumper.add_representer(int, _Dumper.represent_int)


def serialize(obj, suffix: str) -> bytes:
    """``obj`` as a ``suffix`` file (YAML, JSON, or inline-table TOML); huge ints survive only where they can."""
    if suffix in (".yaml", ".yml"):
        return yaml.dump(obj, Dumper=_Dumper, allow_unicode=True).encode("utf-8", "surrogatepass")
    if suffix == ".json":
        return json.dumps(obj, default=str).encode("utf-8", "surrogatepass") if _small(obj) else b'{"tp": 1}'
    body = obj if isinstance(obj, dict) else {"top": obj}
    return "\n".join(f"{json.dumps(str(k))} = {_toml_value(v)}" for k, v in body.items()
                     if v is not None).encode("utf-8", "surrogatepass")


def _small(obj) -> bool:
    """json.dumps cannot write an int past 4300 digits either."""
    if isinstance(obj, int) and not isinstance(obj, bool):
        return abs(obj) < 10 ** 4000
    if isinstance(obj, dict):
        return all(_small(v) for v in obj.values())
    if isinstance(obj, list):
        return all(_small(v) for v in obj)
    return True


def _nesting(suffix: str, n: int, kind: str) -> bytes:
    if suffix == ".json":
        inner = "[" * n + "]" * n if kind == "list" else '{"a": ' * n + "1" + "}" * n
        return f'{{"layout": {inner}}}'.encode()
    if suffix == ".toml":
        return (f"a = {'[' * n}{']' * n}" if kind == "list" else "a = " + "{b = " * n + "1" + "}" * n).encode()
    if kind == "block":
        return "".join("  " * i + "a:\n" for i in range(min(n, 400))).encode()
    return (f"layout: {'[' * n}{']' * n}" if kind == "list" else "layout: " + "{a: " * n + "1" + "}" * n).encode()


HUGE_TEXT = {
    ".yaml": ["layout:\n  tp: {d}\n", "layout:\n  tp: 0x{h}\n", "tensor_parallel:\n  rules:\n    a: {{style: 0x{h}}}\n",
              "layout: {{tp: 0b{b}}}\n", "{d}: 1\n", "0x{h}: 1\n",
              "tensor_parallel:\n  rules:\n    0x{h}: colwise\n", "version: 0x{h}\n"],
    ".json": ['{{"layout": {{"tp": {d}}}}}', '{{"version": {d}}}', '{{"layout": {{"tp": {d}.5}}}}'],
    ".toml": ["[layout]\ntp = {d}\n", "[layout]\ntp = 0x{h}\n", "version = 0o{o}\n"],
}
YAML_ODDITIES = [
    "? [1, 2]\n: x\n", "{[1]: 2}\n", "? {a: 1}\n: x\n", "layout:\n  ? [tp]\n  : 2\n", "!!set {a, b}\n",
    "layout: !!set {? [1]}\n", "a: &x {tp: 2}\nlayout:\n  <<: *x\n", "layout:\n  <<: 1\n", "layout: !!binary AAAA\n",
    "layout: !!timestamp 2020-13-45\n", "!!omap [a: 1, a: 2]\n", "layout: !!python/name:os.system\n",
    "layout: !!float x\n", "layout: !!int x\n", "layout:\n  tp: 1:2:3\n", "layout: *nope\n", "%YAML 9.9\n---\n",
    "--- 1\n--- 2\n", "layout: {tp: .inf}\n", "version: !!bool yes\n", "null: 1\n", "1.5: x\n", "2020-01-01: x\n",
    # alias bombs (a billion laughs: 9 levels of 9 references), a self-referential alias, merge-key fan-out
    "".join(f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9) if i else 'lol'}]\n" for i in range(10)),
    "layout: &a [*a]\n", "a: &a {tp: 2}\nb: &b {<<: [*a, *a, *a]}\nlayout: {<<: [*b, *b, *b, *b]}\n",
    "layout: !custom {tp: 2}\n", "!<tag:yaml.org,2002:python/none> x: 1\n", "layout: {tp: !!python/tuple [1, 2]}\n",
]


#: YAML tags that construct Python objects or call functions under an unsafe loader; ``{path}`` is a file each one
#: would create (``yaml.unsafe_load`` does: ``test_code_execution_payloads_are_real``), so its absence after
#: ``load_plan`` proves the loader ran nothing
CODE_TAGS = [
    "!!python/object/apply:os.system ['touch {path}']",
    "!!python/object/apply:subprocess.check_call [[touch, '{path}']]",
    "!!python/object/apply:builtins.open ['{path}', w]",
    "!!python/object/apply:builtins.exec [\"open('{path}', 'w')\"]",
    "!!python/object/apply:io.open ['{path}', w]",
    "!!python/object/new:builtins.eval [\"open('{path}', 'w')\"]",
]
#: tags that construct Python objects without touching a file (unsafe loaders build them)
OBJECT_TAGS = ["!!python/object/new:pathlib.PosixPath ['{path}']", "!!python/name:os.system", "!!python/module:os",
               "!!python/object:argparse.Namespace {{a: 1}}", "!!python/tuple [1, 2]", "!!python/bytes AAAA"]
#: where a tag goes in a plan
TAG_SPOTS = ["{tag}\n", "layout: {tag}\n", "layout:\n  tp: {tag}\n", "tensor_parallel:\n  rules:\n    wq: {tag}\n",
             "faults: {{timeout_s: {tag} }}\n", "? {tag}\n: 1\n", "- {tag}\n", "a: &x {tag}\nlayout: *x\n"]


#: the kinds of plan file :func:`plan_files` draws
FILE_KINDS = ("data", "mutated", "bytes_mutated", "random_bytes", "nesting", "huge", "yaml_odd", "code_tag",
              "duplicate_key", "non_finite")


@st.composite
def plan_files(draw, kinds: tuple[str, ...] = FILE_KINDS) -> tuple[str, bytes]:
    """``(suffix, content)`` of a plan file of one of ``kinds``, valid or not."""
    kind = draw(st.sampled_from(kinds))
    suffix = draw(st.sampled_from(SUFFIXES))
    if kind == "data":
        return suffix, serialize(draw(st.dictionaries(keys, data, max_size=5) | data), suffix)
    if kind == "mutated":
        return suffix, serialize(draw(mutated_plans()), suffix)
    if kind == "bytes_mutated":
        raw = bytearray(serialize(draw(st.sampled_from(_real_plans())), suffix))
        for _ in range(draw(st.integers(1, 8))):
            i = draw(st.integers(0, len(raw)))
            op = draw(st.sampled_from(("replace", "insert", "delete", "repeat")))
            if op == "replace" and i < len(raw):
                raw[i] = draw(st.integers(0, 255))
            elif op == "insert":
                raw[i:i] = draw(st.binary(min_size=1, max_size=4))
            elif op == "delete":
                del raw[i:i + draw(st.integers(1, 20))]
            else:
                raw[i:i] = raw[i:i + draw(st.integers(1, 40))] * draw(st.integers(1, 50))
        return suffix, bytes(raw)
    if kind == "random_bytes":
        return suffix, draw(st.binary(max_size=300))
    if kind == "nesting":
        n = draw(st.sampled_from((5, 31, 32, 33, 100, 999, 1000, 5000, 100_000)))
        return suffix, _nesting(suffix, n, draw(st.sampled_from(("list", "map", "block"))))
    if kind == "huge":
        suffix = ".yaml" if suffix == ".yml" else suffix
        k = draw(st.sampled_from((4299, 4301, 5000, 20_000)))
        text = draw(st.sampled_from(HUGE_TEXT[suffix]))
        return suffix, text.format(d="9" * k, h="f" * k, b="1" * k, o="7" * k).encode()
    if kind == "code_tag":
        tag = draw(st.sampled_from(CODE_TAGS + OBJECT_TAGS)).format(path=CANARY)
        return ".yaml", draw(st.sampled_from(TAG_SPOTS)).format(tag=tag).encode()
    if kind == "duplicate_key":
        return draw(duplicated_keys())
    if kind == "non_finite":
        suffix = draw(st.sampled_from((".yaml", ".json", ".toml")))
        return suffix, draw(st.sampled_from(NON_FINITE[suffix])).format(v=draw(st.sampled_from(
            NON_FINITE_VALUES[suffix]))).encode()
    return ".yaml", draw(st.sampled_from(YAML_ODDITIES)).encode()


#: a file no input may create (``CODE_TAGS``); checked after every load
CANARY = Path(tempfile.gettempdir()) / f"meshplan-fuzz-canary-{os.getpid()}"
#: a float plan field set to NaN, ±inf or a huge value, in each format (``{v}``: the value as that format spells it)
NON_FINITE = {".yaml": ["faults: {{timeout_s: {v}}}\n", "faults: {{heartbeat_s: {v}, timeout_s: {v}}}\n",
                        "layout: {{tp: {v}}}\n", "faults: {{flight_recorder: {v}}}\n"],
              ".json": ['{{"faults": {{"timeout_s": {v}}}}}', '{{"faults": {{"init_timeout_s": {v}}}}}',
                        '{{"layout": {{"tp": {v}}}}}'],
              ".toml": ["[faults]\ntimeout_s = {v}\n", "[faults]\nheartbeat_s = {v}\n", "[layout]\ntp = {v}\n"]}
NON_FINITE_VALUES = {".yaml": [".nan", ".NaN", ".inf", "-.inf", "+.inf", "1e308", "1e309", "-0.0", "0x7fffffffffffffff"],
                     ".json": ["NaN", "Infinity", "-Infinity", "1e308", "1e309", "-0.0", "9" * 400],
                     ".toml": ["nan", "+nan", "inf", "-inf", "1e308", "1e309", "-0.0", "0x7fffffffffffffff"]}


@st.composite
def duplicated_keys(draw) -> tuple[str, bytes]:
    """A real plan with one key written twice at the same level, as YAML, JSON or TOML text."""
    suffix = draw(st.sampled_from((".yaml", ".json", ".toml")))
    plan = draw(st.sampled_from(_real_plans()))
    key = draw(st.sampled_from(sorted(plan)))
    text = serialize(plan, suffix).decode("utf-8", "surrogatepass")
    if suffix == ".json":
        return suffix, text.replace("{", f"{{{json.dumps(key)}: 1, ", 1).encode()
    if suffix == ".toml":
        return suffix, (text + f"\n{json.dumps(key)} = 1\n").encode()
    return suffix, (text + f"{key}: 1\n").encode()


#: no input may take longer to load (a hang, an alias bomb expanded); generous: the machine is shared
MAX_LOAD_S = 10.0


def load_outcome(path: Path) -> str:
    """``"plan"`` or ``"error"`` (one line, nothing printed, in under :data:`MAX_LOAD_S`, no file created by a YAML
    tag); anything else escapes (and fails the caller)."""
    err = io.StringIO()
    t = time.perf_counter()
    try:
        with contextlib.redirect_stderr(err):  # e.g. pydantic-core's "Exception ignored" for an unprintable int
            plan = load_plan(path)
    except PlanError as e:
        assert "\n" not in str(e) and err.getvalue() == "", (str(e), err.getvalue())
        outcome = "error"
    else:
        assert isinstance(plan, Plan) and err.getvalue() == "", err.getvalue()
        outcome = "plan"
    assert time.perf_counter() - t < MAX_LOAD_S, (path.read_bytes()[:200], time.perf_counter() - t)
    assert not CANARY.exists(), f"a plan file ran code: {path.read_bytes()[:300]!r}"
    return outcome


@settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(plan_files())
def test_plan_files_end_in_plan_or_plan_error(tmp_path_factory, case):
    suffix, content = case
    path = tmp_path_factory.getbasetemp() / f"fuzz{suffix}"
    path.write_bytes(content)
    load_outcome(path)


# ---- the CLI ----------------------------------------------------------------------------------------------------

LLAMA_CFG = json.dumps({"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 128, "ffn_dim": 128})
NUMBERS = st.one_of(st.integers(-2, 2048).map(str), st.sampled_from(
    ["0", "1", "2", "4", "8", "65537", "1048577", "100000000", "1" * 31, "9" * 5000, "x", "", "1e3", " 8 ", "0x10",
     "-0", "٣"]))
FACTORIES = '''import sys
def exit0(**kw): sys.exit(0)
def exit3(**kw): sys.exit(3)
def exit_str(**kw): sys.exit("bye\\nnow")
def multiline(**kw): raise ValueError("line one\\nline two")
def printer(**kw):
    print("noise on stdout"); print("noise on stderr", file=sys.stderr)
    import warnings; warnings.warn("a warning")
    raise RuntimeError("printed first")
def not_a_module(**kw): return 42
def recursion(**kw): return recursion()
'''


def make_pool(root: Path) -> dict[str, list[str]]:
    """Files the CLI fuzz points at: plans (good and bad), configs, factory modules, output paths."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "meshplan_fuzz_exit_at_import.py").write_text("import sys\nsys.exit(0)\n")
    (root / "meshplan_fuzz_factories.py").write_text(FACTORIES)
    files = {"bin.yaml": b"\xff\xfe\x00bad", "deep.json": b"[" * 5000 + b"]" * 5000,
             "huge.toml": b"tp = " + b"9" * 5000,
             "ok.json": b'{"layout": {"tp": 2}}', "coerced.yaml": b"layout: {tp: '2'}\n",
             "hugetag.yaml": b"tensor_parallel: {rules: {a: {style: 0x" + b"f" * 5000 + b"}}}",
             "cfg_dict.json": b'{"model_type": "llama", "num_attention_heads": {"a": 1}}',
             "cfg_list.json": b"[1]", "cfg_type.json": b'{"model_type": ["llama"]}', "cfg_none.json": b"{}",
             "cfg_bin.json": b"\xff",
             "cfg_deep.json": b'{"model_type": "llama", "x": ' + b"[" * 5000 + b"]" * 5000 + b"}",
             "llama_cfg.json": LLAMA_CFG.encode()}
    for name, content in files.items():
        (root / name).write_bytes(content)
    (root / "dir.yaml").mkdir(exist_ok=True)
    plans = [str(p.relative_to(ROOT)) for p in REAL_PLANS] + [
        str(root / n) for n in ("bin.yaml", "deep.json", "huge.toml", "ok.json", "hugetag.yaml", "coerced.yaml",
                                "dir.yaml", "missing.yaml")] + ["", "-"]
    configs = [LLAMA_CFG, '{"num_hidden_layers": 1}', '{"nonexistent_key": 1}', '{"num_hiden_layers": 1}',
               '{"vocab_size": -1}', '{"hidden_size": "x"}', "{bad", "[1]", '{"a": ' + "9" * 5000 + "}",
               "{" + '"a": [' * 3000 + "]" * 3000 + "}", str(root / "llama_cfg.json"), str(root / "cfg_bin.json"),
               str(root / "dir.yaml"), "@" + str(root / "missing.json"), ""]
    models = ["llama:build", "examples.llama:build", "examples.hf_models:llama", "examples.hf_models:gpt2",
              "transformers:LlamaForCausalLM", "nope_module:x", "examples.hf_models", "examples.hf_models:FACTORIES",
              ":", "a:b:c", "..x:y", "meshplan_fuzz_exit_at_import:f", "os:getcwd"] + [
        f"meshplan_fuzz_factories:{f}" for f in ("exit0", "exit3", "exit_str", "multiline", "printer",
                                                 "not_a_module", "recursion")]
    sources = ["llama", "gpt2", "qwen2", "falcon_x", "", "bert", str(root / "cfg_dict.json"),
               str(root / "cfg_list.json"), str(root / "cfg_type.json"), str(root / "cfg_none.json"),
               str(root / "cfg_bin.json"), str(root / "cfg_deep.json"), str(root / "missing" / "config.json"),
               str(root / "dir.yaml"), *plans[:2]]
    outputs = [str(root / "out.yaml"), str(root), str(root / "missing" / "x.yaml"), str(root / "bin.yaml" / "x")]
    clusters = [str(root / n) for n in ("cfg_list.json", "cfg_bin.json", "cfg_deep.json", "ok.json")] + ["/dev/zero"]
    return {"plans": plans, "configs": configs, "models": models, "sources": sources, "outputs": outputs,
            "path": [str(root)], "clusters": clusters, "checkpoints": [str(root / "missing"), str(root / "dir.yaml")],
            "export_outputs": [str(root / "export"), str(root / "bin.yaml"), str(root / "missing" / "x" / "y")]}


FLOATS = st.sampled_from(["80", "0", "-5", "nan", "inf", "-inf", "1e400", "1e-300", "0x10", "", "x", "1048577"])
SMALL_GPUS = st.sampled_from(["1", "2", "3", "8", "16", "0", "-1", "x"])
LISTS = st.sampled_from([",", "", " , ", "tp-cp-ep-dp-pp", "tp-xx", "DPT", "1f1b,x", "1,2", "0,-1", "1,,2", "a",
                         "none,selective", "bogus"])


@st.composite
def _hostile_run_flags(draw, pool) -> list[str]:
    """None (half the time) or 1-3 flags of estimate/solve with hostile values (NaN memory, a cluster file that is
    /dev/zero, …)."""
    argv: list[str] = []
    if draw(st.booleans()):
        return argv
    for flag in draw(st.lists(st.sampled_from(("--memory-gib", "--cluster", "--seq", "--global-batch", "--format",
                                               "--preset", "--config", "--gpus-per-node")), max_size=3)):
        value = {"--memory-gib": FLOATS, "--cluster": st.sampled_from(["h100-80g", "a100-80g", "nope",
                                                                        *pool["clusters"]]),
                 "--seq": SMALL_GPUS, "--global-batch": SMALL_GPUS, "--format": st.sampled_from(("json", "x")),
                 "--preset": st.sampled_from(("gpt-1.7b", "nope", "")), "--gpus-per-node": SMALL_GPUS,
                 "--config": st.sampled_from(pool["configs"] + pool["sources"][6:12])}[flag]
        argv += [flag, draw(value)]
    return argv


@st.composite
def _estimate(draw, pool) -> list[str]:
    """A valid estimate (a real plan, a preset model, 8 ranks) with hostile flags added."""
    return ([draw(st.sampled_from(pool["plans"][:6] + pool["plans"][-6:])), "--preset", "llama3-8b",
             "--world-size", draw(st.sampled_from(["8", "4", "3", "0"])), "--seq", "512", "--global-batch", "8"]
            + draw(_hostile_run_flags(pool)))


@st.composite
def _solve(draw, pool) -> list[str]:
    """A valid solve (a small preset on a few devices) with pinned degrees, search lists and hostile flags."""
    argv = ["--preset", "gpt-1.7b", "--gpus", draw(st.sampled_from(["1", "2", "4", "3"])), "--seq", "512",
            "--global-batch", "8"] + draw(_hostile_run_flags(pool))
    for flag in draw(st.lists(st.sampled_from(("--tp", "--pp", "--cp", "--ep", "--vpp", "--dp-replicate")),
                              max_size=2)):
        argv += [flag, draw(SMALL_GPUS)]
    for flag in draw(st.lists(st.sampled_from(("--orders", "--schedules", "--vpps", "--micro-batches", "--ac")),
                              max_size=2)):
        argv += [flag, draw(LISTS)]
    if draw(st.integers(0, 3)) == 0:
        argv += ["--write", draw(st.sampled_from(pool["outputs"]))]
        if draw(st.booleans()):
            argv += ["--plan", draw(st.sampled_from(pool["plans"]))]
    return argv


@st.composite
def _checkpoints(draw, pool) -> list[str]:
    return [draw(st.sampled_from(pool["checkpoints"] + pool["outputs"]))]


@st.composite
def _export(draw, pool) -> list[str]:
    argv = [draw(st.sampled_from(pool["checkpoints"])), draw(st.sampled_from(pool["export_outputs"]))]
    if draw(st.booleans()):
        argv += ["--max-shard-bytes", draw(NUMBERS)]
    return argv


@st.composite
def _profile(draw, pool) -> list[str]:  # only argument errors: a valid profile would launch torchrun
    return draw(st.sampled_from([["--nproc", "0"], ["--nproc", "x"], ["--backend", "mpi"], ["--nproc", "1025"]]))


OTHER_COMMANDS = {"estimate": _estimate, "solve": _solve, "checkpoints": _checkpoints, "export": _export,
                  "profile": _profile}


@st.composite
def argvs(draw, pool: dict[str, list[str]]) -> list[str]:
    """A random ``meshplan`` command line: a subcommand, its flags with random values, sometimes junk."""
    cmd = draw(st.sampled_from(("ranks", "ranks", "check", "check", "convert", "convert", "schema", "nope", "",
                                "estimate", "solve", "checkpoints", "export", "profile")))
    argv = [cmd] if cmd else []
    if cmd in ("estimate", "solve", "checkpoints", "export", "profile"):
        argv += draw(OTHER_COMMANDS[cmd](pool))
    layout_flags = ["--world-size", "--tp", "--pp", "--cp", "--ep", "--etp", "--vpp", "--dp-replicate", "--dp-shard"]
    if cmd == "check":
        argv += [draw(st.sampled_from(pool["plans"])), "--model", draw(st.sampled_from(pool["models"]))]
        if draw(st.booleans()):
            argv += ["--config", draw(st.sampled_from(pool["configs"]))]
        if draw(st.booleans()):
            argv += ["--path", pool["path"][0]]
    if cmd == "convert":
        argv.append(draw(st.sampled_from(pool["sources"])))
        for flag, choices in (("--from", ("hf", "meshplan", "torch", "deepspeed", "accelerate", "x")),
                              ("--to", ("meshplan", "hf", "torch", "deepspeed", "accelerate", "x"))):
            if draw(st.booleans()):
                argv += [flag, draw(st.sampled_from(choices))]
        if draw(st.booleans()):
            argv += ["-o", draw(st.sampled_from(pool["outputs"]))]
        argv += draw(st.lists(st.sampled_from(("--no-sequence-parallel", "--no-loss-parallel")), max_size=2))
    if cmd in ("ranks", "check"):
        for flag in draw(st.lists(st.sampled_from(layout_flags), max_size=4)):
            argv += [flag, draw(NUMBERS)]
        if draw(st.booleans()):
            argv += ["--order", draw(st.sampled_from(("tp-dp", "DPT", "spread", "tp-xx", "pp-tp-dp", "")))]
        if draw(st.booleans()):
            argv += ["--format", draw(st.sampled_from(("table", "json", "svg", "png")))]
    if draw(st.integers(0, 9)) == 0:
        argv.insert(draw(st.integers(0, len(argv))), draw(st.sampled_from(("--bogus", "-x", "--", "x", "\x00"))))
    return argv


def cli_outcome(argv: list[str]) -> tuple[int, str, str]:
    """``(exit code, stdout, stderr)`` of ``meshplan argv`` in this process; asserts the CLI contract."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as e:  # argparse's --help/--version only
            code = e.code
    text = err.getvalue()
    assert code in (0, 2), (argv, code, text)
    if code == 2:  # one error line (or none: `check` printed its failing report on stdout)
        assert text == "" or (text.count("\n") == 1 and text.endswith("\n")
                              and re.match(r"meshplan: error: \S", text)), (argv, text)
    else:  # nothing, or the documented notes of a success (convert's dropped/assumed lines, solve's wrote/warning)
        assert all(NOTE.match(line) for line in text.splitlines()), (argv, text)
    return code, out.getvalue(), text


#: the stderr lines a successful command may print: ``meshplan convert: dropped …`` / ``assumed …`` (docs/conversion.md),
#: ``meshplan: wrote FILE`` and ``meshplan: warning: …`` (solve, estimate)
NOTE = re.compile(r"meshplan convert: (dropped|assumed) \S|meshplan: (wrote|warning:) \S")


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    saved = list(sys.path)  # --path and the cwd's examples/ land on sys.path: leave it as it was
    files = make_pool(tmp_path_factory.mktemp("cli_pool"))
    files["checkpoints"] += add_checkpoints(tmp_path_factory.mktemp("cli_ckpts"))
    yield files
    sys.path[:] = saved


class _Payload:
    """Unpickling it creates :data:`CANARY` (``open(CANARY, "w")``)."""

    def __reduce__(self):
        return (open, (str(CANARY), "w"))


def add_checkpoints(root: Path) -> list[str]:
    """A real checkpoint of the tiny Llama and broken copies of it (crafted ``.metadata`` that would create
    :data:`CANARY`, garbage metadata, hand-edited manifests); returns the folders and their parents."""
    import shutil
    import warnings

    import llama
    import meshplan
    import torch
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    from conftest import drop_fake_process_group
    drop_fake_process_group()  # one process: no rank of a leftover fake group may be planned to write
    torch.manual_seed(0)
    model = llama.build(llama.tiny_args())
    good = root / "good" / "step-00000001"
    meshplan.save(good, model, None, step=1)
    broken = {"payload": (".metadata", pickle_bytes(_Payload())), "garbage": (".metadata", b"\x80\x05garbage"),
              "yesterday": ("meshplan.json", b'{"step": 1, "saved_at": "yesterday"}'),
              "huge_time": ("meshplan.json", b'{"step": 1, "saved_at": 1e300}'),
              "list": ("meshplan.json", b'{"step": 1, "data": [1, 2]}'), "not_json": ("meshplan.json", b"{")}
    out = [str(good), str(good.parent)]
    for name, (file, content) in broken.items():
        folder = root / name / "step-00000001"
        shutil.copytree(good, folder)
        (folder / file).write_bytes(content)
        out += [str(folder), str(folder.parent)]
    return out


def pickle_bytes(obj) -> bytes:
    import pickle
    return pickle.dumps(obj)


#: no CLI run may take longer (a hang, a search or a read without bound); generous: the machine is shared
MAX_CLI_S = 60.0


@settings(max_examples=100, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(st.data())
def test_cli_exits_0_or_2_with_one_line(pool, data):
    """Every subcommand, random and hostile arguments: exit 0 or exit 2 with one line, in bounded time and memory,
    and no file created by a crafted checkpoint or plan."""
    import resource
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t = time.perf_counter()
    argv = data.draw(argvs(pool))
    code, out, _ = cli_outcome(argv)
    assert time.perf_counter() - t < MAX_CLI_S, (argv, time.perf_counter() - t)
    if code == 0 and argv[:1] in (["estimate"], ["solve"]):  # a right answer: finite numbers only (argv may be [])
        assert not re.search(r"\b(nan|inf|NaN|Infinity)\b", out), (argv, out)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss < 2 << 20, argv  # KiB: under 2 GiB more
    assert not CANARY.exists(), f"a crafted input ran code: {argv}"


MANIFEST_VALUES = st.one_of(data, st.sampled_from(["yesterday", 1e300, float("nan"), float("inf"), -1, 2 ** 64, True,
                                                   [], {}, None, "saved", 10 ** 4400]))


@st.composite
def manifests(draw) -> bytes:
    """A real manifest with fields replaced, dropped or added, or random bytes."""
    base = {"data": {"global_batch": 8, "samples_seen": 8, "seed": 0}, "extra": {}, "format": 1, "layout": None,
            "meshplan": "0.1.0", "optimizer": "none", "plan": None, "rng": True, "saved_at": 1.7e9, "step": 1,
            "torch": "2.13.0", "world_size": 1}
    kind = draw(st.sampled_from(("edit", "edit", "bytes", "top")))
    if kind == "bytes":
        return draw(st.binary(max_size=200))
    if kind == "top":
        value = draw(data)
        return json.dumps(value, default=str).encode() if _small(value) else b"1"
    for _ in range(draw(st.integers(1, 3))):
        key = draw(st.sampled_from(sorted(base) + ["surprise"]))
        if draw(st.integers(0, 4)) == 0:
            base.pop(key, None)
        else:
            base[key] = draw(MANIFEST_VALUES)
    if key == "data" and isinstance(base.get("data"), dict) and draw(st.booleans()):
        base["data"]["seed"] = draw(MANIFEST_VALUES)
    try:
        return json.dumps(base, default=str).encode()
    except ValueError:  # an int past 4,300 digits
        return b'{"step": 1, "saved_at": ' + b"9" * 5000 + b"}"


@settings(max_examples=80, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(manifests())
def test_checkpoint_manifests_end_in_a_listing_or_one_line(pool, content):
    """``meshplan checkpoints`` over a folder whose manifest is anything: exit 0 listing it (a valid manifest) or
    skipping it (not this step's), or exit 2 with one line naming ``meshplan.json``."""
    from meshplan.checkpoint.manifest import read_manifest_file
    folder = Path(pool["checkpoints"][0]).parent.parent / "fuzzed" / "step-00000001"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / ".metadata").write_bytes(b"never read by the listing")
    (folder / "meshplan.json").write_bytes(content)
    code, out, err = cli_outcome(["checkpoints", str(folder.parent)])
    assert code == 0 or "meshplan.json: " in err, err
    try:
        read_manifest_file(folder / "meshplan.json")
    except PlanError as e:
        assert "\n" not in str(e) and str(e).startswith(str(folder / "meshplan.json")), str(e)


@pytest.mark.parametrize("argv, message", [
    (["ranks", "--world-size", "100000000", "--tp", "8"], "argument --world-size: expected an integer in [1, 65536]"),
    (["ranks", "--world-size", "1" * 31, "--tp", "8"], "expected an integer in [1, 65536] (2**16"),
    (["ranks", "--world-size", "8", "--tp", "100000000"], "argument --tp: expected an integer in [1, 1048576] (2**20)"),
    (["check", "plans/llama.yaml", "--model", "llama:build", "--world-size", "0"],
     "argument --world-size: expected an integer in [1, 1048576] (2**20), got 0"),
    (["check", "plans/llama.yaml", "--model", "meshplan_fuzz_exit_at_import:f"], "called sys.exit(0)"),
    (["check", "plans/llama.yaml", "--model", "meshplan_fuzz_factories:exit0"],
     "the factory failed: called sys.exit(0)"),
    (["check", "plans/llama.yaml", "--model", "meshplan_fuzz_factories:exit3"],
     "the factory failed: called sys.exit(3)"),
    (["check", "plans/llama.yaml", "--model", "meshplan_fuzz_factories:multiline"], "ValueError: line one line two"),
    (["check", "plans/llama.yaml", "--model", "meshplan_fuzz_factories:printer"], "RuntimeError: printed first"),
    (["check", "plans/hf_llama.yaml", "--model", "transformers:LlamaForCausalLM", "--config",
      '{"nonexistent_key": 1}'], "--config key(s) 'nonexistent_key' are not attributes of LlamaConfig"),
    (["check", "plans/hf_llama.yaml", "--model", "examples.hf_models:llama", "--config", '{"num_hiden_layers": 1}'],
     "'num_hiden_layers' (did you mean num_hidden_layers"),
    (["convert", "{root}/cfg_dict.json"], "transformers cannot use this config: StrictDataclassFieldValidationError"),
    (["convert", "{root}/cfg_list.json"], "cfg_list.json: expected a JSON object (a transformers config), got list"),
    (["convert", "llama", "-o", "{root}"], "is a directory, expected a file path"),
    (["convert", "llama", "-o", "{root}/missing/x.yaml"], "cannot write: No such file or directory"),
    (["check", "{root}/bin.yaml", "--model", "x:y"], "bin.yaml: not UTF-8 text: byte 0xff at offset 0"),
    (["check", "{root}/dir.yaml", "--model", "x:y"], "dir.yaml: is a directory, expected a plan file"),
    (["check", "{root}/coerced.yaml", "--model", "x:y"], "layout.tp: Input should be a valid integer (got '2')"),
    (["check", "{root}/hugetag.yaml", "--model", "x:y"],
     "hugetag.yaml: tensor_parallel.rules.a.style: an integer of 20000 bits; plan integers have at most 13000 bits"),
])
def test_issue_inputs_one_line_exit_2(tmp_path, argv, message):
    pool = make_pool(tmp_path)
    saved = list(sys.path)
    try:
        code, out, err = cli_outcome([a.replace("{root}", str(tmp_path)) for a in argv] + (
            ["--path", pool["path"][0]] if argv[0] == "check" else []))
    finally:
        sys.path[:] = saved
    assert code == 2 and out == "" and message in err, err


# ---- attacks, one by one: code execution, duplicate keys, non-finite numbers, unicode, alias bombs --------------


@pytest.mark.parametrize("tag", CODE_TAGS)
def test_code_execution_payloads_are_real(tmp_path, tag):
    """The payloads work: an unsafe loader creates the file (so the canary's absence below means something)."""
    target = tmp_path / "ran"
    yaml.unsafe_load(f"x: {tag.format(path=target)}\n")  # noqa: S506 - the positive control
    assert target.exists()


@pytest.mark.parametrize("spot", TAG_SPOTS)
@pytest.mark.parametrize("tag", CODE_TAGS + OBJECT_TAGS)
def test_python_tags_run_nothing(tmp_path, tag, spot):
    path = tmp_path / "plan.yaml"
    path.write_text(spot.format(tag=tag.format(path=CANARY)))
    with pytest.raises(PlanError, match=r"plan\.yaml: .*(constructor for the tag|tag:yaml\.org,2002:python)"):
        load_plan(path)
    assert not CANARY.exists()


@pytest.mark.parametrize("suffix, text", [
    (".yaml", "layout: {tp: 2}\nlayout: {tp: 4}\n"), (".yaml", "layout:\n  tp: 2\n  tp: 4\n"),
    (".yaml", "tensor_parallel:\n  rules:\n    wq: colwise\n    wq: rowwise\n"), (".yaml", "{a: 1, a: 2}\n"),
    (".json", '{"layout": {"tp": 2}, "layout": {"tp": 4}}'), (".json", '{"layout": {"tp": 2, "tp": 4}}'),
    (".toml", "[layout]\ntp = 2\ntp = 4\n"), (".toml", "[layout]\ntp = 2\n[layout]\ncp = 1\n"),
    (".toml", "layout = {tp = 2}\n[layout]\ncp = 1\n"),
])
def test_duplicate_keys_refused_in_every_format(tmp_path, suffix, text):
    path = tmp_path / f"plan{suffix}"
    path.write_text(text)
    with pytest.raises(PlanError, match=r"(?i)duplicate|defined|overwrite|already exists|Cannot declare"):
        load_plan(path)


@pytest.mark.parametrize("suffix", [".yaml", ".json", ".toml"])
def test_non_finite_and_huge_numbers_refused(tmp_path, suffix):
    for template in NON_FINITE[suffix]:
        for value in NON_FINITE_VALUES[suffix]:
            path = tmp_path / f"plan{suffix}"
            path.write_bytes(template.format(v=value).encode())
            assert load_outcome(path) == "error", (template, value)


@pytest.mark.parametrize("text", [
    "l\u0430yout: {tp: 2}\n",                      # a Cyrillic а: not the key 'layout'
    "layout: {tp: 2}\ntensor_parallel:\n  rules:\n    \"layers.*.wq\\u200b\": colwise\n",  # zero-width space
    "\ufefflayout: {tp: 2}\n",                       # a byte-order mark
    "layout: {tp: 2}  # \u202e\u2066 right-to-left override\n",
    "tensor_parallel:\n  rules:\n    \"\U0001F600.*\": colwise\n",
    "layout: \"\\0\"\n", "layout: \x00\n", "layout: \x85\n", "layout: {tp: 2}\n\u2028\u2029",
])
def test_unicode_ends_in_a_plan_or_one_plan_error(tmp_path, text):
    for suffix, body in ((".yaml", text), (".json", json.dumps({"k": text})), (".toml", f"k = {json.dumps(text)}")):
        path = tmp_path / f"plan{suffix}"
        path.write_bytes(body.encode("utf-8"))
        load_outcome(path)


def test_alias_bomb_refused_fast(tmp_path):
    path = tmp_path / "bomb.yaml"
    path.write_text(YAML_ODDITIES[-6])  # 9**9 leaves if expanded
    t = time.perf_counter()
    with pytest.raises(PlanError, match=f"more than {MAX_PLAN_NODES} values"):
        load_plan(path)
    assert time.perf_counter() - t < MAX_LOAD_S


python_data = st.recursive(
    st.one_of(scalars, st.binary(max_size=4), st.just(object()), st.complex_numbers(), st.just(Ellipsis)),
    lambda ch: (st.lists(ch, max_size=3) | st.tuples(ch, ch) | st.frozensets(st.integers(), max_size=3)
                | st.dictionaries(st.one_of(keys, st.integers(), st.none(), st.tuples(st.integers())), ch,
                                  max_size=4)),
    max_leaves=15)


@settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(st.one_of(st.dictionaries(keys, python_data, max_size=5), mutated_plans()))
def test_python_data_ends_in_plan_or_plan_error(data):
    """A dict built in Python (``meshplan.parallelize(model, {...})``) with any objects in it: a Plan or one
    PlanError, as for a file."""
    try:
        assert isinstance(as_plan(data), Plan)
    except PlanError as e:
        assert "\n" not in str(e)


def test_legacy_spelling_in_an_invalid_plan_prints_nothing(tmp_path):
    """Found by the long fuzz (seed 15): a deprecated ``data_parallel.blocks`` in a plan that does not validate
    printed a FutureWarning besides the PlanError; the warning now comes only with a Plan."""
    path = tmp_path / "plan.yml"
    path.write_text("data_parallel:\n  blocks: -6.9e+16\n  etp: 1\n")
    assert load_outcome(path) == "error"
