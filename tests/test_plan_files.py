"""Plan files: the three formats, safe loading, errors naming file and key, the committed schema."""

import json

import pytest

import meshplan
from meshplan import PlanError, load_plan
from meshplan.schema import SCHEMA_PATH, plan_schema

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
    with pytest.raises(PlanError, match="more than 100000 values"):
        load_plan(bomb)
    with pytest.raises(PlanError, match="no such plan file"):
        load_plan(tmp_path / "missing.yaml")


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
