"""The style table (meshplan.tensor_parallel.style_table): one entry per style name of the plan file, and the
plan file's data torch-free."""

import subprocess
import sys

import pytest

from meshplan.plan_file.tensor_parallel import STYLE_NAMES, Rule
from meshplan.tensor_parallel.layouts import Stream, StyleArgs, residual_stream
from meshplan.tensor_parallel.style_table import STYLES

pytestmark = pytest.mark.fast


def test_one_entry_per_style_name():
    assert set(STYLES) == set(STYLE_NAMES)
    assert all(spec.name == name for name, spec in STYLES.items())


def test_style_names_come_from_the_rule_union():
    from typing import get_args
    classes = get_args(get_args(Rule)[0])
    assert len(STYLE_NAMES) == len(classes) == len(set(STYLE_NAMES))
    assert STYLE_NAMES[:3] == ("colwise", "rowwise", "norm")


def test_plan_file_is_torch_free():
    code = "import meshplan.plan_file.document, sys; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_table_is_read_only():
    with pytest.raises(TypeError):
        STYLES["colwise"] = STYLES["rowwise"]  # type: ignore[index]


REQUIRED = {"prepare_output": {"output_layouts": "partial", "desired_output_layouts": "replicate"}}


@pytest.mark.parametrize("sp", [True, False, "batch"])
@pytest.mark.parametrize("name", STYLE_NAMES)
def test_every_style_builds_fresh_and_has_costs(name, sp):
    spec, stream, o = STYLES[name], Stream(sp, True), REQUIRED.get(name, {})
    layouts = spec.layouts(o, stream)
    a, b = spec.build(StyleArgs(layouts, stream, o)), spec.build(StyleArgs(layouts, stream, o))
    assert a is None or a is not b
    fwd, bwd = spec.collectives(o, stream)
    assert isinstance(fwd, list) and isinstance(bwd, list)


def test_residual_stream():
    assert [residual_stream(sp) for sp in (True, False, "batch")] == ["shard(1)", "replicate", "shard(0)"]
