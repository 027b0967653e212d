"""``meshplan estimate``, ``meshplan solve`` and ``meshplan profile`` from the command line: torch-free where they
should be, one-line errors with exit 2, JSON output, and ``--write`` plans that ``meshplan check`` accepts."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import meshplan
from meshplan.cli.main import main

EXAMPLE = '{"dim": 64, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 128, "ffn_dim": 128, ' \
          '"max_seq_len": 64}'


def _run(argv, capsys) -> tuple[int, str, str]:
    rc = main(argv)
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.mark.fast
def test_solve_and_estimate_never_import_torch(tmp_path):
    shape = tmp_path / "shape.yaml"
    shape.write_text("hidden_size: 4096\nnum_hidden_layers: 32\nnum_attention_heads: 32\nnum_key_value_heads: 8\n"
                     "intermediate_size: 14336\nvocab_size: 128256\n")
    code = ("import sys\nfrom meshplan.cli.main import main\n"
            "a = main(['solve', '--preset', 'llama3-8b', '--gpus', '64', '--seq', '8192', '--global-batch', '128'])\n"
            f"b = main(['estimate', 'plans/llama.yaml', '--config', {str(shape)!r}, '--world-size', '16', "
            "'--seq', '8192', '--global-batch', '32'])\n"
            "assert 'torch' not in sys.modules, 'torch imported'\nsys.exit(a or b)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "tokens/s/dev" in out.stdout and "collectives per step" in out.stdout


@pytest.mark.fast
def test_estimate_json(capsys):
    rc, out, _ = _run(["estimate", "plans/llama_3d.yaml", "--preset", "llama3-70b", "--world-size", "8", "--seq",
                       "4096", "--global-batch", "8", "--format", "json"], capsys)
    doc = json.loads(out)
    assert rc == 0 and doc["layout"]["pp"] == 2 and doc["memory"]["total"] > 0
    assert {c["axis"] for c in doc["collectives"]} >= {"tp", "pp", "dp", "step"}


@pytest.mark.fast
@pytest.mark.parametrize("argv, needle", [
    (["solve", "--preset", "nope", "--gpus", "8", "--seq", "64", "--global-batch", "8"], "--preset 'nope': unknown"),
    (["solve", "--preset", "llama3-8b", "--model", "x:y", "--gpus", "8", "--seq", "64", "--global-batch", "8"],
     "give the model as one of"),
    (["solve", "--config", '{"hidden": 64}', "--gpus", "8", "--seq", "64", "--global-batch", "8"], "no layers found"),
    (["solve", "--preset", "llama3-8b", "--gpus", "8", "--seq", "64", "--global-batch", "8", "--schedules", "2f2b"],
     "are not schedules"),
    (["solve", "--preset", "llama3-8b", "--gpus", "0", "--seq", "64", "--global-batch", "8"], "expected an integer"),
    (["solve", "--preset", "llama3-8b", "--gpus", "8", "--seq", "64", "--global-batch", "8", "--cluster", "tpu"],
     "not a preset"),
    (["estimate", "plans/llama.yaml", "--preset", "llama3-8b", "--world-size", "3", "--seq", "64",
      "--global-batch", "8"], "does not divide world_size(3)"),
    (["estimate", "plans/llama.yaml", "--config", '{"hidden": 64, "layers": 2, "heads": 4, "kv_heads": 1, "ffn": 128, '
      '"vocab": 128}', "--world-size", "4", "--seq", "64", "--global-batch", "8"],
     "tp(2) does not divide num_key_value_heads(1); valid tp: 1"),
])
def test_one_line_errors(capsys, argv, needle):
    rc, _, err = _run(argv, capsys)
    assert rc == 2 and err.count("\n") == 1 and err.startswith("meshplan: error: ") and needle in err, err


@pytest.mark.fast
def test_write_a_plan_that_check_accepts(tmp_path, capsys):
    import llama
    out = tmp_path / "chosen.yaml"
    rc, text, _ = _run(["solve", "--model", "examples.llama:build", "--config", EXAMPLE, "--gpus", "4", "--seq", "64",
                        "--global-batch", "8", "--plan", "plans/llama.yaml", "--tp", "2", "--write", str(out)], capsys)
    assert rc == 0 and out.is_file() and "Written by `meshplan solve`" in out.read_text()
    plan = meshplan.load_plan(out)
    assert plan.layout.tp == 2
    report = meshplan.check(llama.build(llama.tiny_args(n_layers=4)), plan, world_size=4)
    assert report.ok, report.errors


@pytest.mark.dist
def test_profile_writes_a_cluster_solve_reads(tmp_path, capsys):
    from meshplan.solver.cluster import load_cluster_file
    path = tmp_path / "cluster.json"
    rc, _, _ = _run(["profile", "--nproc", "2", "-o", str(path)], capsys)
    cl = load_cluster_file(path)
    assert rc == 0 and cl.device == "cpu" and cl.gpus_per_node == 2 and cl.overlap == 0.0
    assert all(f.bandwidth > 0 and f.latency >= 0 for kind in cl.collectives.values() for f in kind.values())
    assert set(cl.collectives) >= {"all_gather", "reduce_scatter", "all_reduce", "all_to_all", "send", "all_to_all_v"}
    # what the counts leave out (meshplan/profile/overheads.py): measured, finite, non-negative
    assert set(cl.dtensor_overheads) == {"mm", "view", "pointwise", "redistribute"} and cl.oversubscription >= 1.0
    assert 0 < cl.attention_efficiency <= 1.5  # measured: causal SDPA over the matmul peak
    assert min(cl.fsdp_unit_overhead, cl.pipeline_action_overhead, cl.repeat_spread, *cl.dtensor_overheads.values()) >= 0
    assert cl.touch_rate >= 0 and cl.block_op_overhead >= 0  # the reference block (0: noise left no per-token part)
    assert 0.5 < cl.block_scale < 3  # that block timed whole over its price: measured (not the default 1)
    assert cl.block_scale != 1.0
    assert [g for g, _, _ in cl.sync_loss] == [2, 2, 2] and min(x for p in cl.sync_loss for x in p) >= 0
    rc, text, _ = _run(["solve", "--model", "examples.llama:build", "--config", EXAMPLE, "--gpus", "2", "--seq", "64",
                        "--global-batch", "8", "--dtype", "float32", "--cluster", str(path)], capsys)
    assert rc == 0 and "profiled-" in text


@pytest.mark.fast
def test_solve_folds_loop_schedule_twins_and_explains_the_label(capsys):
    """interleaved_1f1b and looped_bfs priced alike were two rows of the top 10: now one row ``A|B`` (JSON keeps
    both), and a legend says what ``dp1×16 mb1×16`` means."""
    argv = ["solve", "--preset", "llama3-405b", "--gpus", "512", "--tp", "8", "--pp", "4", "--seq", "8192",
            "--global-batch", "256", "--show-rejected", "0", "--top", "3", "--schedules", "interleaved_1f1b,looped_bfs"]
    rc, out, _ = _run(argv + ["--format", "json"], capsys)
    labels = [x["label"] for x in json.loads(out)["layouts"]]
    assert rc == 0 and labels[1].replace("interleaved_1f1b", "looped_bfs") == labels[2]
    rc, out, _ = _run(argv, capsys)
    rows = [line for line in out.splitlines() if line[:3] in ("1  ", "2  ", "3  ")]
    # (a pipeline keeping FSDP2 units unsharded across microbatches holds them all: reshard-each-microbatch rows)
    assert rc == 0 and len(rows) == 3 and "interleaved_1f1b|looped_bfs dp2×8(hsdp) mb2×8" in rows[1]
    assert len({r.split("  ")[1] for r in rows}) == 3
    assert "R data-parallel replicas × S shards" in out and "B sequences per micro-batch × M micro-batches" in out
    assert "A|B: schedules with the same estimated step time" in out


@pytest.mark.fast
def test_tables_wrap_their_last_column_to_a_width():
    from meshplan.solver.report import table
    rows = [("1", "tp8 pp4", "compute 23.2, bubble 1.27, tp 3.89, pp 0.0119, dp 0.0366, optimizer 0.00991")]
    lines = table(("#", "layout", "where the time goes (s)"), rows, width=40)
    assert all(len(x) <= 40 for x in lines) and lines[1].startswith("1  tp8 pp4  compute 23.2,")
    assert all(x.startswith(" " * 11) for x in lines[2:]) and len(lines) > 2
    assert table(("#", "layout"), [("1", "tp8")]) == ["#  layout", "1  tp8"]


@pytest.mark.fast
def test_profile_failure_names_the_workers_exception():
    """A failed measuring job reports the worker's exception, not the last line of torchrun's summary ('=====')."""
    from meshplan.profile.run import _error_line
    stderr = ("[rank0]: Traceback (most recent call last):\n[rank0]:   File \"w.py\", line 46, in _timed\n"
              "[rank0]: RuntimeError: No backend type associated with device type cpu\n"
              "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n"
              "============================================================\nmeshplan.profile.worker FAILED\n"
              "============================================================\n")
    assert _error_line(stderr) == "RuntimeError: No backend type associated with device type cpu"
    assert _error_line("======\n") == "no output"
