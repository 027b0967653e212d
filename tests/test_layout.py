"""Layout validation: every rule with its message."""

import pytest

from meshplan import Layout, PlanError

pytestmark = pytest.mark.fast


def test_defaults_and_inference():
    r = Layout().resolve(8)
    assert (r.tp, r.dp, r.dp_shard, r.dp_replicate, r.etp, r.edp) == (1, 8, 8, 1, 1, 8)
    assert r.order == ("tp", "cp", "ep", "dp", "pp")
    r = Layout(tp=2, dp_replicate=2).resolve(16)
    assert (r.dp, r.dp_replicate, r.dp_shard) == (8, 2, 4)
    assert Layout(tp=2, etp=1, ep=2).resolve(8).edp == 4


def test_size_one_axes_appended():
    assert Layout(tp=2, order="tp-dp").resolve(4).order == ("tp", "dp", "cp", "ep", "pp")


@pytest.mark.parametrize("kwargs, world, message", [
    ({"tp": 3}, 16, r"^tp\(3\) does not divide world_size\(16\); valid tp: 1, 2, 4, 8, 16$"),
    ({"tp": 4, "pp": 3}, 16, r"tp\(4\)·cp\(1\)·pp\(3\) = 12 does not divide world_size\(16\); valid tp: none; valid pp: 1, 2, 4$"),
    ({"ep": 3}, 16, r"etp\(1\)·ep\(3\)·pp\(1\) = 3 does not divide world_size\(16\); valid ep: 1, 2, 4, 8, 16"),
    ({"dp_replicate": 3}, 16, r"dp_replicate\(3\) does not divide dp\(16\).*valid dp_replicate: 1, 2, 4, 8, 16"),
    ({"dp_replicate": 2, "dp_shard": 2}, 16, r"dp_replicate\(2\)·dp_shard\(2\) = 4 != dp\(16\)"),
    ({"tp": 2, "order": "dp-pp"}, 8, r"order 'dp-pp' lacks 'tp' but tp\(2\) > 1"),
    ({"ep": 2, "order": "tp-dp-pp"}, 8, r"lacks 'ep' but ep\(2\) > 1"),
    ({"vpp": 2}, 8, r"vpp\(2\) needs pp > 1, got pp\(1\)"),
    ({"tp": 2, "pp": 2, "ep": 2, "etp": 1, "order": "tp-pp-ep-dp-cp"}, 16,
     r"must end with pp when pp\(2\) > 1 and edp\(4\) != dp\(4\)|dense and expert pipeline groups differ"),
])
def test_rules(kwargs, world, message):
    with pytest.raises(PlanError, match=message):
        Layout(**kwargs).resolve(world)


def test_order_ends_with_pp_rule():
    # pp not last and edp != dp: Megatron's rule rejects it
    with pytest.raises(PlanError, match=r"must end with pp when pp\(2\) > 1 and edp\(2\) != dp\(4\)"):
        Layout(pp=2, ep=2, order="tp-cp-ep-pp-dp").resolve(8)
    # pp not last but edp == dp: allowed when the pipeline groups agree
    r = Layout(pp=2, tp=2, order="tp-pp-dp").resolve(8)
    assert r.groups("pp") == r.expert_grid.groups("pp")


@pytest.mark.parametrize("order, message", [
    ("tp-xp", r"unknown token\(s\) \['xp'\]"),
    ("tp-tp-dp", r"repeats \['tp'\]"),
    ("tp-cpdp", r"unknown token\(s\) \['cpdp'\]"),  # a whole-token check, not a substring test
    ("DPX", r"unknown token"),
])
def test_order_tokens(order, message):
    with pytest.raises(ValueError, match=message):
        Layout(order=order)


def test_strict_and_frozen():
    with pytest.raises(ValueError, match="Extra inputs are not permitted"):
        Layout(tpp=2)
    with pytest.raises(ValueError, match="greater than or equal to 1"):
        Layout(tp=0)
    with pytest.raises(ValueError, match="dp_shard must be -1"):
        Layout(dp_shard=0)
    lay = Layout(tp=2)
    with pytest.raises(ValueError):
        lay.tp = 4


def test_plan_error_is_value_error():
    assert issubclass(PlanError, ValueError)


def test_degrees_and_world_size_are_bounded():
    Layout(tp=2 ** 20, dp_shard=2 ** 20)  # the bound itself is allowed
    for field in ("tp", "cp", "ep", "etp", "pp", "vpp", "dp_replicate", "dp_shard"):
        with pytest.raises(ValueError, match=rf"{field}\n.*less than or equal to 1048576"):
            Layout(**{field: 2 ** 20 + 1})
    for world in (0, 2 ** 20 + 1, 10 ** 30, True):
        with pytest.raises(PlanError, match=r"world_size must be an integer in \[1, 1048576\] \(2\*\*20\), got"):
            Layout().resolve(world)
