"""One error per job: an uncaught meshplan error under torchrun is one line, printed once (issue 29)."""

import pytest

from _launch import launch

pytestmark = pytest.mark.dist


def test_wrong_world_size_prints_one_line_for_four_ranks():
    results = launch("tests/dist/one_error_worker.py", 4, timeout=120)
    meta = results["_meta"]
    text = meta["stderr"] + meta["stdout"]
    ours = [line for line in text.splitlines() if "does not divide" in line]
    assert ours == [ours[0]] and ours[0].startswith("meshplan: error (rank "), text
    assert ours[0].endswith("tp(3) does not divide world_size(4); valid tp: 1, 2, 4"), text
    # no rank printed a traceback: the one left is torchrun's own ChildFailedError summary (the launcher's)
    assert "one_error_worker.py\", line" not in text and "PlanError" not in text, text
    assert text.count("Traceback (most recent call last)") <= 1, text
    assert meta["returncode"] == 1, text
