"""Real torchrun/gloo launches that lose a rank (SIGSTOP, SIGKILL) or race at exit.

A stopped or killed rank: every other rank ends with one RankFailure naming it and the mesh axis it waited on,
sooner than the plan's timeout (4 s) + 30 s after the signal, and that line is all it writes to stderr (no chained
traceback; it exits with examples/train.py's status 3, or 143 when torchrun's SIGTERM came first). Repeated 10
times per signal: ``python benchmarks/faults.py lines --repeat 10``. The exit race (an unwaited async collective holding
Python objects at interpreter exit): a run inside ``with meshplan.init(...)`` exits 0.
"""

import re

import pytest

from _launch import launch

pytestmark = pytest.mark.dist

WORLD = 4
VICTIM = 2
TIMEOUT_S = 4.0


def _dumps(results, reports):
    """faults.dump_dir: each survivor's flight-recorder trace (torch's pickle) and its report."""
    import pickle
    from pathlib import Path
    out = Path(results["_meta"]["out"]) / "dumps"
    for rank, report in reports.items():
        text = (out / f"meshplan_report_rank{rank}.txt").read_text()
        assert text == report["message"].removeprefix("meshplan: ") + "\n"
        trace = pickle.loads((out / f"meshplan_fr_rank{rank}").read_bytes())
        assert trace["entries"] and {"process_group", "profiling_name", "frames"} <= set(trace["entries"][-1])


def survivor_lines(results, rank):
    """The non-empty lines rank ``rank`` wrote to stderr."""
    return [line for line in results["_meta"]["rank_stderr"].get(rank, "").splitlines() if line.strip()]


def _survivors(results):
    meta = results["_meta"]
    assert "victim" in results and VICTIM in results["victim"], meta["stderr"]
    sent = results["victim"][VICTIM]["value"]["t"]
    reports = {r: v["value"] for r, v in results.get("fault", {}).items()}
    assert sorted(reports) == [r for r in range(WORLD) if r != VICTIM], (sorted(reports), meta["stderr"])
    return sent, reports


@pytest.mark.parametrize("signal_name, verb, kind, where", [
    ("sigstop", "stopped answering", "tp", "step"),      # tp × FSDP: every collective times out
    ("sigstop", "stopped answering", "pp", "forward"),   # 1F1B × FSDP, inside the schedule: sends and receives too
    ("sigkill", "died", "tp", "step"),
])
def test_lost_rank_is_named_on_every_other_rank(signal_name, verb, kind, where):
    # a killed rank: torchrun's agent stops the others once it sees the death (every 0.1 s by default); under
    # load that came before rank 1's own collective failed (a fresh-clone CI run, 2026-11-27), and the case is
    # about what each survivor's collective reports: the agent looks every 5 s here
    monitor = ("--monitor-interval", "5") if signal_name == "sigkill" else ()
    results = launch("tests/dist/faults_worker.py", WORLD, signal_name, str(VICTIM), kind, where, timeout=300,
                     rank_stderr=True, torchrun_args=monitor)
    sent, reports = _survivors(results)
    for rank, report in reports.items():  # the line alone: no chained traceback, nothing else (examples/train.py)
        assert survivor_lines(results, rank) == [report["message"]], results["_meta"]["rank_stderr"].get(rank)
    for rank, report in reports.items():
        msg = report["message"]
        assert msg.startswith(f"meshplan: rank {VICTIM} {verb} ("), msg
        if signal_name == "sigstop":
            assert "its process is stopped (SIGSTOP?)" in msg, msg
        else:
            assert re.search(r"its process (is gone|exited)", msg), msg
        # what this rank waited in, on which mesh axis, and why it gave up
        assert re.search(rf"rank {rank} was waiting in (\w+ #\d+|a pipeline (send|recv)) over mesh axis "
                         rf"(tp|dp_shard|pp) \(ranks [\d, -]+\)( for [\d.]+ s)?", msg), msg
        if signal_name == "sigstop" and "timed out" in msg:
            assert "(faults.timeout_s = 4 s, the plan)" in msg, msg
        assert "\n" not in msg
        assert report["t"] - sent < TIMEOUT_S + 30, (rank, report["t"] - sent)
    _dumps(results, reports)
    if kind == "pp":  # rank 0 is rank 2's pipeline peer: gloo records no send or receive, meshplan names them
        assert "was waiting in a pipeline send" in reports[0]["message"] or "pipeline recv" in reports[0]["message"]


@pytest.mark.parametrize("mode", ["exit_race", "exit_race_close"])
def test_finished_run_exits_0_despite_the_gloo_exit_race(mode):
    results = launch("tests/dist/faults_worker.py", 2, mode, timeout=120)
    assert sorted(results.get("exit", {})) == [0, 1], results["_meta"]["stderr"]
    assert results["_meta"]["returncode"] == 0, results["_meta"]["stderr"]
    assert "terminate called" not in results["_meta"]["stderr"]
