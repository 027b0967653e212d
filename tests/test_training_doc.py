"""docs/training.md lists every setting of the ``training`` section and the demo's plan is a valid training plan.

``python tests/test_training_doc.py`` prints the settings table, generated from the pydantic models, to paste
into docs/training.md when a setting is added or changed."""

import re
from pathlib import Path

import pytest
from pydantic_core import PydanticUndefined

from meshplan.plan_file.document import load_plan
from meshplan.plan_file.training import Training
from meshplan.trainer.settings import _submodel, setting_names

pytestmark = pytest.mark.fast

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "training.md"


def _rows(model: type = Training, prefix: str = "") -> list[str]:
    rows = []
    for name, field in model.model_fields.items():
        sub = _submodel(field.annotation)
        if sub is not None:
            rows.extend(_rows(sub, f"{prefix}{name}."))
            continue
        default = "required" if field.default is PydanticUndefined else f"`{field.default!r}`"
        kind = re.sub(r"typing\.|<class '|'>", "", str(field.annotation)).replace("|", "or")
        rows.append(f"| `{prefix}{name}` | {kind} | {default} | {field.description} |")
    return rows


def settings_table() -> str:
    """The markdown table of every setting: dotted name, type, default, description (from the models)."""
    return "\n".join(["| setting | type | default | what it does |", "|---|---|---|---|", *_rows()])


def test_doc_lists_every_setting():
    text = DOC.read_text()
    missing = [n for n in setting_names() if f"| `{n}` |" not in text]
    assert not missing, f"docs/training.md misses settings {missing}: paste `python tests/test_training_doc.py`"


def test_demo_plan_is_a_training_plan():
    plan = load_plan(ROOT / "plans" / "train.yaml")
    tr = plan.training
    assert (tr.model.path, tr.data.path, plan.layout.tp) == ("runs/tiny-llama", "docs", 2)
    assert tr.eval.every and tr.checkpoint.folder.startswith("runs/") and tr.export.startswith("runs/")
    assert "plans/train.yaml" in (ROOT / "scripts" / "demo.sh").read_text()


if __name__ == "__main__":
    print(settings_table())
