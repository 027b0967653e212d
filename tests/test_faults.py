"""Faults without real ranks: the plan section, the flight-recorder reading, the report's wording from heartbeats
and process states, the agreement diffs, SIGTERM while reporting, the exit wait. The real launches (SIGSTOP,
SIGKILL, mismatches on one rank, the exit race) are in ``test_dist_faults.py`` and ``test_dist_topology.py``."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from meshplan import Plan, PlanError, RankFailure
from meshplan.faults import agree, flight, heartbeat, report, shutdown, terminate, watch
from meshplan.plan_file.faults import STALE_BEATS, Faults

pytestmark = pytest.mark.fast


# ---------------------------------------------------------------- the plan section


def test_section_defaults_and_schema():
    f = Plan.from_data({"faults": {}}).faults
    assert (f.init_timeout_s, f.timeout_s, f.heartbeat_s, f.flight_recorder, f.dump_dir) == (600.0, 300.0, 2.0, 2000,
                                                                                            None)
    assert Plan.from_data({"faults": {"timeout_s": 20}}).faults.timeout_s == 20.0  # an int is a number of seconds
    from meshplan.plan_file.json_schema import plan_schema
    props = plan_schema()["$defs"]["Faults"]["properties"]
    assert set(props) == {"init_timeout_s", "timeout_s", "heartbeat_s", "flight_recorder", "dump_dir"}
    assert all(p.get("description") for p in props.values())


@pytest.mark.parametrize("faults, message", [
    ({"timeout_s": 0}, "faults.timeout_s: Input should be greater than 0"),
    ({"timeout_s": float("nan")}, "faults.timeout_s: Input should be a finite number"),
    ({"init_timeout_s": float("inf")}, "faults.init_timeout_s: Input should be a finite number"),
    ({"timeout_s": "20"}, "faults.timeout_s: Input should be a valid number"),
    ({"timeout_s": 86401}, "less than or equal to 86400"),
    ({"flight_recorder": -1}, "faults.flight_recorder: Input should be greater than or equal to 0"),
    ({"dump_dir": ""}, "faults.dump_dir: String should have at least 1 character"),
    ({"timeot_s": 1}, "faults.timeot_s: Extra inputs are not permitted"),
    ({"timeout_s": 5, "heartbeat_s": 2}, "heartbeat_s (2) × 3 must not exceed the shortest timeout (5 s): a silent "
                                         "rank would not be recognised before the timeout fires; lower heartbeat_s "
                                         "to at most 1.66667"),
])
def test_section_refuses_with_the_key_and_the_values(faults, message):
    with pytest.raises(PlanError, match=re.escape(message)):
        Plan.from_data({"faults": faults}, source="plans/x.yaml")


def test_init_timeout_argument_sets_both_timeouts_and_names_itself():
    from meshplan.mesh.runtime import _fault_settings
    plan = Plan.from_data({"faults": {"timeout_s": 60, "flight_recorder": 7}}, source="plans/x.yaml")
    settings, origin = _fault_settings(plan, 3)
    assert (settings.init_timeout_s, settings.timeout_s, settings.heartbeat_s, settings.flight_recorder) == (
        3.0, 3.0, 1.0, 7)  # heartbeat lowered so that 3 beats fit in the timeout
    assert origin == "meshplan.init(timeout_s=3)"
    assert _fault_settings(plan, None) == (plan.faults, "plans/x.yaml")
    assert _fault_settings(None, None)[1] == "the default; set it in a faults section of the plan"
    with pytest.raises(PlanError, match="meshplan.init: timeout_s: .*greater than 0"):
        _fault_settings(plan, 0)



class _Watch:
    """What a Job asks of its FaultWatch, recorded."""

    def __init__(self):
        self.calls = []

    def adopt(self, group, axis):
        self.calls.append(("adopt", group, axis))

    def ending(self, exc):
        self.calls.append(("ending", exc))

    def close(self):
        self.calls.append(("close",))


def test_the_job_owns_the_watch_and_the_topology_knows_no_faults():
    """meshplan.init's Job holds the fault watch; a Topology holds its job only to end it (issue 26)."""
    from meshplan.mesh.runtime import Job, watch_of
    from meshplan.mesh.topology import Topology
    w = _Watch()
    topo = Topology.__new__(Topology)  # the meshes do not matter here: a topology without them
    topo.job, topo._tokens = Job(w, owns_process_group=False), []
    assert watch_of(topo) is w and topo.faults is w  # topology.faults: the public alias of job.watch
    topo.adopt_group("group", "pp_embedding")
    assert w.calls == [("adopt", "group", "pp_embedding")]
    topo.close()  # ends the job once: the watch stops; no process group to shut down (init did not make it)
    topo.close()
    assert w.calls[1:] == [("ending", None), ("close",)]
    assert topo.job is None and watch_of(topo) is None and topo.faults is None
    assert watch_of(object()) is None  # a bare DeviceMesh, say

# ---------------------------------------------------------------- the flight recorder


def _entry(record, pg, name, seq, op="all_reduce", retired=True, created=100.0, frames=None):
    return {"record_id": record, "pg_id": pg, "process_group": (name, "mesh_x"), "collective_seq_id": seq,
            "profiling_name": f"gloo:{op}", "time_created_ns": int(created * 1e9), "retired": retired,
            "state": "scheduled", "input_sizes": [[4, 8]], "frames": frames}


def test_flight_entries_waiting_and_failed():
    user = {"filename": os.path.abspath("examples/llama.py"), "line": 88, "name": "forward"}
    inner = {"filename": torch.distributed.__file__, "line": 1, "name": "all_reduce"}
    dump = {"entries": [_entry(0, 3, "9", 1, created=10.0), _entry(1, 5, "15", 7, "all_gather", retired=False,
                                                                  created=20.0, frames=[inner, user]),
                        _entry(2, 5, "15", 8, retired=False, created=29.5)],
            "pg_status": {"5": {"last_completed_collective": 7}}}
    entries = flight.collectives(dump)
    assert [(c.op, c.group, c.seq, c.waiting) for c in entries] == [("all_reduce", "9", 1, False),
                                                                      ("all_gather", "15", 7, False),
                                                                      ("all_reduce", "15", 8, True)]
    assert entries[1].caller == "examples/llama.py:88 (forward)" and entries[1].shape == (4, 8)
    assert flight.waiting(dump).seq == 8
    assert flight.failed_entry(dump, timeout_s=10.0, now=30.0).seq == 7  # issued at least 10 s (less 1 s) ago
    assert flight.failed_entry(dump, timeout_s=None, now=30.0).seq == 8  # a closed connection: the newest
    assert flight.failed_entry({}, 10.0) is None and flight.waiting({}) is None


# ---------------------------------------------------------------- heartbeats and process states


@pytest.fixture
def store():
    return dist.HashStore()


def test_heartbeat_publishes_process_and_beats(store):
    beat = heartbeat.Heartbeat(store, 3, 0.05, lambda: {"op": "all_reduce", "axis": "tp", "seq": 4, "issued": 1.0})
    beat.start()
    try:
        time.sleep(0.3)
    finally:
        beat.stop()
    proc = heartbeat.read_records(store, "proc", [3])[3]
    assert proc["host"] == socket.gethostname() and proc["pid"] == os.getpid()
    assert heartbeat.process_state(proc) == "running"
    hb = heartbeat.read_records(store, "hb", [0, 3])
    assert list(hb) == [3] and hb[3]["n"] >= 3 and hb[3]["wait"]["axis"] == "tp"
    n = hb[3]["n"]
    time.sleep(0.15)
    assert heartbeat.read_records(store, "hb", [3])[3]["n"] == n  # stopped


def test_process_states_of_local_peers():
    here = socket.gethostname()
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    done = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        record = {"host": here, "pid": sleeper.pid, "start": heartbeat._start_ticks(sleeper.pid)}
        assert heartbeat.process_state(record) == "running"
        os.kill(sleeper.pid, signal.SIGSTOP)
        for _ in range(100):
            if heartbeat.process_state(record) == "stopped":
                break
            time.sleep(0.02)
        assert heartbeat.process_state(record) == "stopped"
        assert heartbeat.process_state({**record, "start": record["start"] + 1}) == "gone"  # a reused pid
        for _ in range(200):  # exited, not reaped yet
            if heartbeat.process_state({"host": here, "pid": done.pid}) == "zombie":
                break
            time.sleep(0.02)
        assert heartbeat.process_state({"host": here, "pid": done.pid}) == "zombie"
        done.wait()
        assert heartbeat.process_state({"host": here, "pid": done.pid}) == "gone"
        assert heartbeat.process_state({"host": "elsewhere", "pid": 1}) is None
    finally:
        sleeper.kill()
        sleeper.wait()


# ---------------------------------------------------------------- the report


def _watch(store, world=4, rank=0, heartbeat_s=0.1):
    groups = {"15": ("tp", (0, 1)), "9": ("dp_shard", (0, 2)), "7": ("pp", (0, 2))}
    return SimpleNamespace(store=store, world=world, rank=rank,
                           settings=Faults(init_timeout_s=60.0, timeout_s=4.0, heartbeat_s=min(heartbeat_s, 1.3)),
                           timeout_s=4.0, timeout_key="faults.timeout_s", origin="plans/x.yaml", steady_state=True,
                           axis_of=lambda name: groups.get(name, ("?", ())), p2p_group="7")


def _dump(monkeypatch, *entries):
    monkeypatch.setattr("meshplan._torch.flight_recorder_dump", lambda stack_traces=False, only_active=False: {
        "entries": list(entries), "pg_status": {}})


def _beat(store, rank, age, wait=None, now=None):
    store.set(f"hb/{rank}", json.dumps({"t": (time.time() if now is None else now) - age, "n": 1, "wait": wait}))


class _Clock:
    """A clock that moves only when the code under test sleeps: the report's ages are exact on a loaded machine
    (with the real clock, 'for 4.0 s' read 'for 6.5 s' at load 400)."""

    def __init__(self, now=1_000_000.0):
        self.now = now

    def time(self):
        return self.now

    def sleep(self, seconds):
        self.now += seconds


@pytest.fixture
def clock(monkeypatch):
    c = _Clock()
    for module in (report, flight):
        monkeypatch.setattr(module, "time", SimpleNamespace(time=c.time, sleep=c.sleep))
    return c


def test_report_names_the_silent_rank_and_the_axis(store, monkeypatch, clock):
    _dump(monkeypatch, _entry(0, 5, "15", 41, created=clock.now - 4.0))
    for r in range(4):
        _beat(store, r, 0.0, now=clock.now)
    _beat(store, 1, 20.0, {"op": "all_gather", "axis": "dp_shard", "seq": 7, "issued": clock.now - 30}, now=clock.now)
    failure = report.diagnose(_watch(store), RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out "
                                                          "waiting 4000ms for recv operation to complete"))
    msg = str(failure)
    assert msg.startswith("rank 1 stopped answering (last heartbeat 20.0 s ago, then waiting in all_gather #7 over "
                          "dp_shard for 10 s); rank 0 was waiting in all_reduce #41 over mesh axis tp (ranks 0, 1) "
                          "for 4.0 s; timed out after 4 s (faults.timeout_s = 4 s, plans/x.yaml)"), msg
    assert isinstance(failure, RuntimeError) and not isinstance(failure, PlanError)
    assert (failure.silent, failure.axis, failure.group_ranks, failure.op) == ((1,), "tp", (0, 1), "all_reduce")
    assert 3.9 < failure.waited_s < 5


def test_report_blames_the_cause_not_the_victims(store, monkeypatch, clock):
    """Rank 2 failed on its own collective (a victim), rank 3 ended with an error (the cause)."""
    _dump(monkeypatch, _entry(0, 3, "9", 5, "all_gather", created=clock.now - 0.2))
    for r in range(4):
        _beat(store, r, 0.0, now=clock.now)
    store.set("fail/2", json.dumps({"t": 0, "kind": "fault", "text": "RuntimeError: Connection closed by peer"}))
    store.set("fail/3", json.dumps({"t": 0, "kind": "error", "text": "ValueError: bad batch"}))
    msg = str(report.diagnose(_watch(store), RuntimeError("[pair.cc:534] Connection closed by peer [1.2.3.4]:5. "
                                                          "This is typically caused by a crash")))
    assert msg.startswith("rank 3 ended with an error: ValueError: bad batch (last heartbeat 0.0 s ago); rank 0 was "
                          "waiting in all_gather #5 over mesh axis dp_shard (ranks 0, 2) for 0.2 s; the collective "
                          "failed: RuntimeError: Connection closed by peer [1.2.3.4]:5"), msg


#: the watch's heartbeat where live heartbeat threads (every 0.02 s) must never look silent: a rank is silent after
#: 3 of them (1.5 s), far beyond a thread's wait for a core on a loaded 2-core box (0.3 s left little room)
LIVE_S = 0.5


def test_report_without_a_silent_rank_says_who_waits_where(store, monkeypatch):
    _dump(monkeypatch)
    issued = time.time() - 5
    beats = [heartbeat.Heartbeat(store, r, 0.02, lambda r=r: {"op": "all_gather", "axis": "pp", "seq": 3,
                                                               "issued": issued} if r == 2 else None)
             for r in range(4)]
    for b in beats:
        b.start()
    try:
        t = time.time()
        msg = str(report.diagnose(_watch(store, heartbeat_s=LIVE_S), RuntimeError("Timed out waiting 4000ms for recv")))
    finally:
        for b in beats:
            b.stop()
    assert time.time() - t >= STALE_BEATS * LIVE_S  # it looked for a silent rank for 3 heartbeats first
    assert msg.startswith("no rank missed its heartbeat (every rank is alive: the ranks issued different "
                          "collectives, e.g. a rank-dependent branch or a rank that skipped a step; waiting now: "
                          "rank 2 in all_gather #3 over pp); rank 0's collective failed (the flight recorder is off"), msg


def test_a_rank_stopped_by_torchrun_still_names_the_silent_peer(store):
    """SIGTERM outside a failed collective (torchrun stops the group after a worker died): the silent rank is named;
    a peer SIGTERMed too is not; nobody silent: None (the job was stopped for another reason)."""
    beats = {r: heartbeat.Heartbeat(store, r, 0.02, lambda: None) for r in range(4)}
    for b in beats.values():
        b.start()
    try:
        store.set("fail/1", json.dumps({"t": 0, "kind": "terminated", "text": "stopped by SIGTERM"}))
        t = time.time()
        assert report.diagnose_terminated(_watch(store, heartbeat_s=LIVE_S)) is None
        assert time.time() - t >= STALE_BEATS * LIVE_S  # it looked for 3 heartbeats first
        beats[2].stop()
        failure = report.diagnose_terminated(_watch(store, rank=3, heartbeat_s=LIVE_S))
    finally:
        for b in beats.values():
            b.stop()
    assert re.fullmatch(r"rank 2 stopped answering \(last heartbeat [\d.]+ s ago\); rank 3 was stopped by torchrun "
                        r"\(SIGTERM\) before a collective of its own failed", str(failure)), str(failure)
    assert failure.silent == (2,)


def test_report_sees_a_stopped_local_peer_at_once(store, monkeypatch):
    _dump(monkeypatch, _entry(0, 5, "15", 2, created=time.time() - 1))
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        os.kill(sleeper.pid, signal.SIGSTOP)
        time.sleep(0.2)
        for r in range(4):
            _beat(store, r, 0.0)
        store.set("proc/1", json.dumps({"host": socket.gethostname(), "pid": sleeper.pid, "start": None}))
        msg = str(report.diagnose(_watch(store, heartbeat_s=100.0), RuntimeError("Connection reset by peer")))
        assert msg.startswith("rank 1 stopped answering (its process is stopped (SIGSTOP?); last heartbeat"), msg
    finally:
        sleeper.kill()
        sleeper.wait()


def _wait_batch_p2p():  # the name torch's pipeline schedules wait on their sends and receives under
    raise RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:129] Timed out waiting 60000ms for send operation to "
                       "complete")


def test_report_names_a_pipeline_send_and_the_timeout_that_fired(store, monkeypatch, clock):
    """gloo records no send or receive in the flight recorder: a schedule's point-to-point wait is named from the
    traceback, over the pp group; the timeout that fired (60 s) is init_timeout_s's value, whatever the phase.
    The clock is the test's own: with the real one, CI's loaded box read 'last heartbeat 61.3 s ago'."""
    _dump(monkeypatch, _entry(0, 5, "15", 41, created=clock.now - 70))  # an older collective, not the one
    for r in range(4):
        _beat(store, r, 0.0 if r != 2 else 61.0, now=clock.now)
    try:
        _wait_batch_p2p()
    except RuntimeError as e:
        msg = str(report.diagnose(_watch(store, heartbeat_s=10.0), e))
    assert msg.startswith("rank 2 stopped answering (last heartbeat 61.0 s ago); rank 0 was waiting in a pipeline "
                          "send over mesh axis pp (ranks 0, 2) for 60.0 s; timed out after 60 s "
                          "(faults.init_timeout_s = 60 s, plans/x.yaml)"), msg


def test_ranks_text():
    assert [report.ranks_text(r) for r in ([0, 1, 2, 3], [0, 2], [3, 1], list(range(0, 64, 8)), [])] == [
        "0-3", "0, 2", "1, 3", "0, 8, 16, … 56 (8 ranks)", "?"]


@pytest.mark.parametrize("text, failed", [
    ("[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 5000ms for recv", True),
    ("Application timeout caused pair closure", True), ("Connection closed by peer [127.0.0.1]:1", True),
    ("Read error [127.0.0.1]:3202: Connection reset by peer", True),
    ("Watchdog caught collective operation timeout: WorkNCCL(SeqNum=1, Timeout(ms)=600000)", True),
    ("mat1 and mat2 shapes cannot be multiplied (4x8 and 16x8)", False), ("CUDA out of memory", False),
])
def test_collective_failures_told_from_bugs(text, failed):
    assert watch.is_collective_failure(RuntimeError(text)) is failed
    assert watch.is_collective_failure(RankFailure(text)) is False  # translated once only
    assert watch.is_collective_failure(dist.DistBackendError("anything")) is True
    stopped = terminate.Terminated(143)
    stopped.__context__ = RuntimeError(text)
    assert (watch.collective_cause(stopped) is stopped.__context__) is failed
    assert watch.collective_cause(ValueError("x")) is None
    try:  # a pipeline stage re-raises a failed send with its own message
        try:
            raise RuntimeError(text)
        except RuntimeError as e:
            raise RuntimeError("Failed to run stage backward: Stage output: …") from e
    except RuntimeError as wrapped:
        assert (watch.collective_cause(wrapped) is wrapped.__cause__) is failed
        translated = RankFailure("rank 1 died …")
        translated.__cause__ = wrapped
        assert watch.collective_cause(translated) is None  # once only


# ---------------------------------------------------------------- agreement diffs (the launches check the exchange)


def test_agreement_texts():
    assert agree._texts("software", {"torch": "2.13.0", "python": "3.11.9"}, {"torch": "2.12.1", "python": "3.11.9"},
                        0, 3, "meshplan.init") == (
        'ranks disagree on the software: torch: rank 0 has "2.13.0", rank 3 has "2.12.1"; every rank must run the '
        'same torch, meshplan and Python (one image, one environment)')
    sig = agree.model_signature(torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.BatchNorm1d(3)))
    assert sig[:2] == [["0.weight", [3, 2], "float32"], ["0.bias", [3], "float32"]] and ["1.num_batches_tracked", [],
                                                                                          "int64"] in sig
    text = agree._texts("model", sig, sig[:1], 0, 1, "meshplan.parallelize")
    assert text.startswith("ranks disagree on the model given to meshplan.parallelize: 0.bias: rank 0 has [3] "
                           "float32, rank 1 has no such parameter or buffer;"), text
    assert text.endswith("1.num_batches_tracked: rank 0 has [] int64, rank 1 has no such parameter or buffer (6 of 7 "
                         "parameters and buffers differ); every rank must build the same model"), text
    assert agree._texts("plan", {"a": None, "b": {"x": 1}}, {"a": {"y": 2}, "b": {"x": 2}}, 0, 1, "meshplan.init") == (
        'ranks disagree on the plan given to meshplan.init: a: rank 0 has null, rank 1 has {"y": 2}; b.x: rank 0 has '
        '1, rank 1 has 2')


# ---------------------------------------------------------------- SIGTERM and the end of the job


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})


def test_sigterm_unwinds_and_is_held_while_reporting():
    done = _run("""
        import os, signal
        from meshplan.faults.terminate import TermGuard, Terminated
        guard = TermGuard(); guard.install()
        try:
            os.kill(os.getpid(), signal.SIGTERM)
        except Terminated as e:
            print("unwound", e.code, flush=True)
        with guard.hold():
            os.kill(os.getpid(), signal.SIGTERM)
            print("report out", flush=True)
        print("never", flush=True)
    """)
    assert done.stdout.split("\n")[:2] == ["unwound 143", "report out"] and "never" not in done.stdout
    assert done.returncode == -signal.SIGTERM, done


def test_a_handler_of_the_users_stays():
    done = _run("""
        import signal
        from meshplan.faults.terminate import TermGuard
        mine = lambda s, f: None
        signal.signal(signal.SIGTERM, mine)
        guard = TermGuard(); guard.install(); guard.uninstall()
        print(guard.installed, signal.getsignal(signal.SIGTERM) is mine)
    """)
    assert done.stdout.strip() == "False True", done


def test_gloo_idle_wait_returns_without_gloo_threads():
    t = time.perf_counter()
    assert shutdown.wait_gloo_idle(limit_s=60.0)
    assert time.perf_counter() - t < 60.0  # returned before its limit (a wall bound tighter than that can flake)
    assert shutdown._gloo_threads() == {}
