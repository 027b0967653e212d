"""Plan files: the three formats, safe loading, errors naming file and key, the committed schema."""

import json

import pytest

import meshplan
from meshplan import PlanError, load_plan
from meshplan.plan_file.json_schema import SCHEMA_PATH, plan_schema
from meshplan.plan_file.reading import MAX_PLAN_NODES

pytestmark = pytest.mark.fast


@pytest.mark.parametrize("name, text", [
    ("p.yaml", "version: 1\nlayout:\n  tp: 4\n  order: tp-cp-ep-dp-pp\n"),
    ("p.json", '{"version": 1, "layout": {"tp": 4, "order": "tp-cp-ep-dp-pp"}}'),
    ("p.toml", 'version = 1\n[layout]\ntp = 4\norder = "tp-cp-ep-dp-pp"\n'),
])
def test_formats(tmp_path, name, text):
    f = tmp_path / name
    f.write_text(text)
    plan = load_plan(f)
    assert plan.layout.tp == 4 and plan.version == 1 and plan.source == str(f)


def test_empty_and_defaults(tmp_path):
    f = tmp_path / "e.yaml"
    f.write_text("")
    plan = load_plan(f)
    assert plan.version == 1 and plan.layout is None


@pytest.mark.parametrize("name, text, message", [
    ("d.yaml", "layout:\n  tp: 2\n  tp: 4\n", r"d\.yaml: line 3: duplicate key 'tp'"),
    ("d.json", '{"layout": {"tp": 2, "tp": 4}}', r"d\.json: duplicate key 'tp'"),
    ("d.toml", "[layout]\ntp = 2\ntp = 4\n", r"d\.toml: not valid TOML"),
    ("x.yaml", "layout: [1, 2\n", r"x\.yaml: not valid YAML"),
    ("x.json", "{", r"x\.json: not valid JSON"),
    ("x.txt", "a: 1", r"unknown plan format '\.txt'"),
    ("l.yaml", "- 1\n- 2\n", r"l\.yaml: the top level must be a mapping, got list"),
    ("u.yaml", "!!python/object/apply:os.system ['echo hi']\n", r"u\.yaml: not valid YAML"),
    ("k.yaml", "layout:\n  tp: 2\n  ordr: tp-dp\n", r"k\.yaml: layout\.ordr: Extra inputs are not permitted"),
    ("v.yaml", "version: 2\n", r"v\.yaml: version: Input should be 1 \(got 2\)"),
    ("t.yaml", "layout:\n  tp: two\n", r"t\.yaml: layout\.tp: Input should be a valid integer.*\(got 'two'\)"),
    ("s.yaml", "source: x\n", r"s\.yaml: source: is set by the loader"),
])
def test_loader_errors(tmp_path, name, text, message):
    f = tmp_path / name
    f.write_text(text)
    with pytest.raises(PlanError, match=message):
        load_plan(f)


def test_size_limits(tmp_path):
    big = tmp_path / "big.yaml"
    big.write_text("# " + "x" * (1 << 20) + "\n")
    with pytest.raises(PlanError, match=r"big\.yaml: \d+ bytes; plan files are limited"):
        load_plan(big)
    bomb = tmp_path / "bomb.yaml"
    lines = ["a: &a [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]"]
    for i, name in enumerate("bcdefg"):
        prev = "a" if i == 0 else "bcdefg"[i - 1]
        lines.append(f"{name}: &{name} [" + ", ".join([f"*{prev}"] * 10) + "]")
    bomb.write_text("\n".join(lines) + "\n")
    with pytest.raises(PlanError, match=f"more than {MAX_PLAN_NODES} values"):
        load_plan(bomb)
    with pytest.raises(PlanError, match="no such plan file"):
        load_plan(tmp_path / "missing.yaml")


@pytest.mark.parametrize("text, message", [
    ("a: " + "[" * 2000 + "]" * 2000 + "\n", r"nested deeper than 32 levels"),   # the 4 KB file
    ("{a: " * 2000 + "1" + "}" * 2000 + "\n", r"a(\.a){31}: nested deeper than 32 levels"),
    ("a:\n  " + "- " * 2000 + "x\n", r"a(\.0){31}: nested deeper than 32 levels"),
    ("a: &a " + "[" * 30 + "1" + "]" * 30 + "\nb: [[[*a]]]\n", r"b\.0\.0\.0: nested deeper than 32 levels \(through the alias \*a\)"),
    ("a:\n" + "- 1\n" * 60_000, r"more than 5000 values"),                       # 240 KB, under the byte limit
    ("".join(f"k{i}: &k{i} [*k{i - 1}, *k{i - 1}]\n" if i else "k0: &k0 [1, 2]\n" for i in range(14)),
     r"more than 5000 values"),
])
def test_depth_and_count_refused_before_the_document_is_built(tmp_path, monkeypatch, text, message):
    """Refused from the parser's events: the document is never composed (it took 0.5-9 s to build, then refuse)."""
    import yaml
    from meshplan.plan_file import reading

    def never(*a, **k):
        raise AssertionError("the document was built")
    monkeypatch.setattr(reading.yaml, "load", never)
    f = tmp_path / "p.yaml"
    f.write_text(text)
    with pytest.raises(PlanError, match=message):
        load_plan(f)
    assert yaml.load is never


def test_committed_schema_is_fresh():
    committed = json.loads(SCHEMA_PATH.read_text())
    assert committed == plan_schema(), "plans/plan.schema.json is stale: run `meshplan schema > plans/plan.schema.json`"


def test_every_field_has_a_description():
    def walk(schema, path):
        for name, prop in schema.get("properties", {}).items():
            assert prop.get("description"), f"{path}.{name} has no description"
        for name, sub in schema.get("$defs", {}).items():
            walk(sub, name)
    walk(plan_schema(), "Plan")


def test_plan_is_frozen():
    plan = meshplan.Plan.from_data({"layout": {"tp": 2}})
    with pytest.raises(ValueError):
        plan.version = 1


@pytest.mark.parametrize("data, message", [
    ({"layout": {"tp": "2"}}, r"layout\.tp: Input should be a valid integer \(got '2'\)"),
    ({"layout": {"tp": 2.0}}, r"layout\.tp: Input should be a valid integer \(got 2\.0\)"),
    ({"layout": {"tp": True}}, r"layout\.tp: Input should be a valid integer \(got True\)"),
    ({"tensor_parallel": {"loss_parallel": "yes"}}, r"loss_parallel: Input should be a valid boolean \(got 'yes'\)"),
    ({"tensor_parallel": {"sequence_parallel": 1}}, r"sequence_parallel\.bool: Input should be a valid boolean"),
    ({"version": True}, r"version: Input should be the integer 1 \(got True\)"),
    ({"version": 1.0}, r"version: Input should be the integer 1 \(got 1\.0\)"),
    ({"layout": {"tp": 2 ** 20 + 1}}, r"layout\.tp: Input should be less than or equal to 1048576"),
])
def test_strict_types_no_coercion(data, message):
    with pytest.raises(PlanError, match=message):
        meshplan.Plan.from_data(data)


def test_strict_keeps_file_shapes():
    """Lists for tuple fields, style shorthands, literals and the discriminated rules still load."""
    plan = meshplan.Plan.from_data({
        "version": 1, "layout": {"tp": 2, "order": "DPT"},
        "tensor_parallel": {"sequence_parallel": "batch", "rules": {
            "a": "colwise", "b": {"style": "rowwise", "input_layouts": ["shard(-1)", None]}}},
        "blocks": {"activation_checkpointing": {"mode": "selective", "ops": ["aten.mm.default"]}},
        "data_parallel": {"reshard_after_forward": 2}})
    assert plan.blocks.activation_checkpointing.ops == ("aten.mm.default",)
    assert plan.tensor_parallel.rules["a"].style == "colwise" and plan.tensor_parallel.sequence_parallel == "batch"
    for path in sorted(SCHEMA_PATH.parent.glob("*.yaml")):
        assert load_plan(path).layout is not None, path


OLD_SPELLING = """\
data_parallel:
  blocks: h.*
  param_dtype: bfloat16
  activation_checkpointing: {mode: selective, every: 2}
  compile: true
"""
NEW_SPELLING = """\
blocks: {pattern: h.*, activation_checkpointing: {mode: selective, every: 2}, compile: true}
data_parallel:
  param_dtype: bfloat16
"""


def test_old_blocks_spelling_loads_with_a_warning(tmp_path):
    """data_parallel.{blocks, activation_checkpointing, compile} (before the blocks section) = the new spelling."""
    old, new = tmp_path / "old.yaml", tmp_path / "new.yaml"
    old.write_text(OLD_SPELLING)
    new.write_text(NEW_SPELLING)
    with pytest.warns(FutureWarning) as record:
        plan = load_plan(old)
    msg = str(record[0].message)
    assert msg == (f"{old}: data_parallel.blocks, data_parallel.activation_checkpointing, data_parallel.compile: "
                   f"deprecated, these configure the model's blocks and moved to the top-level blocks section; write "
                   f"`blocks: {{pattern: h.*, activation_checkpointing: {{mode: selective, every: 2}}, "
                   f"compile: true}}` at the top level of the plan and remove blocks, activation_checkpointing, compile from "
                   f"data_parallel")
    assert plan.model_copy(update={"source": None}) == load_plan(new).model_copy(update={"source": None})
    assert plan.blocks.pattern == "h.*" and plan.blocks.compile and plan.data_parallel.param_dtype == "bfloat16"
    with pytest.warns(FutureWarning, match=r"<plan>: data_parallel.compile: deprecated.*`blocks: \{compile: true\}`"):
        only = meshplan.Plan.from_data({"data_parallel": {"compile": True}})
    assert only.blocks.compile and only.data_parallel == meshplan.Plan.from_data({"data_parallel": {}}).data_parallel


def test_both_blocks_spellings_are_an_error(tmp_path):
    f = tmp_path / "both.yaml"
    f.write_text("blocks: {pattern: layers.*}\ndata_parallel: {compile: true}\n")
    with pytest.raises(PlanError, match=r"both\.yaml: data_parallel\.compile and the blocks section are both given; "
                                        r"expected one: move compile into blocks"):
        load_plan(f)


@pytest.mark.parametrize("name, content, message", [
    ("b.yaml", b"\xff\xfe", r"b\.yaml: not UTF-8 text: byte 0xff at offset 0"),
    ("d.json", b"[" * 5000 + b"]" * 5000, r"d\.json: nested deeper than 32 levels"),
    ("d.toml", b"a = " + b"[" * 5000 + b"]" * 5000, r"d\.toml: nested deeper than 32 levels"),
    ("d.yaml", b"a: " + b"[" * 40 + b"]" * 40, r"d\.yaml: a\.0\.0(\.0)*: nested deeper than 32 levels"),
    ("h.yaml", b"layout: {tp: " + b"9" * 5000 + b"}", r"h\.yaml: not valid YAML: an integer of more than 4300 digits"),
    ("h.json", b'{"layout": {"tp": ' + b"9" * 5000 + b"}}", r"h\.json: not valid JSON: an integer of more than 4300"),
    ("h.toml", b"tp = " + b"9" * 5000, r"h\.toml: not valid TOML: an integer of more than 4300 digits"),
    ("x.yaml", b"tensor_parallel: {rules: {a: {style: 0x" + b"f" * 5000 + b"}}}",
     r"x\.yaml: tensor_parallel\.rules\.a\.style: an integer of 20000 bits; plan integers have at most 13000 bits"),
    ("k.yaml", b"? [1, 2]\n: x\n", r"k\.yaml: line 1: a mapping key must be a scalar \(a name\), got a list"),
    ("k2.yaml", b"layout:\n  {[1]: 2}\n", r"k2\.yaml: line 2: a mapping key must be a scalar"),
])
def test_hostile_files_one_plan_error(tmp_path, name, content, message):
    f = tmp_path / name
    f.write_bytes(content)
    with pytest.raises(PlanError, match=message) as info:
        load_plan(f)
    assert "\n" not in str(info.value)


def test_unreadable_files(tmp_path, monkeypatch):
    (tmp_path / "dir.yaml").mkdir()
    with pytest.raises(PlanError, match=r"dir\.yaml: is a directory, expected a plan file"):
        load_plan(tmp_path / "dir.yaml")
    f = tmp_path / "p.yaml"
    f.write_text("layout: {tp: 2}\n")

    def denied(*args, **kwargs):
        raise PermissionError(13, "Permission denied")
    monkeypatch.setattr(type(f), "open", denied)
    with pytest.raises(PlanError, match=r"p\.yaml: cannot read the plan file: Permission denied"):
        load_plan(f)
