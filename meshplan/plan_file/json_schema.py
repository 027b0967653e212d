"""The JSON Schema of plan files, generated from the Pydantic models."""

from __future__ import annotations

from pathlib import Path

__all__ = ["plan_schema", "SCHEMA_PATH"]

#: where the committed copy lives (a test fails when it is stale)
SCHEMA_PATH = Path(__file__).resolve().parents[2] / "plans" / "plan.schema.json"


def plan_schema() -> dict:
    """JSON Schema (draft 2020-12) of a plan file."""
    from meshplan.plan_file.document import Plan
    schema = Plan.model_json_schema(mode="validation")
    schema.get("properties", {}).pop("source", None)
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "meshplan plan"
    return schema
