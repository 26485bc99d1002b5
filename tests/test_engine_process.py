"""The engine in a child process (runmap.serve.engine_process): what crosses the pipe, and what happens when the
child cannot load or dies. The served path itself (the openai client, streaming, concurrency, bad input, the page)
runs through an engine process in tests/test_serve.py."""
from __future__ import annotations

import functools
import os
import pickle
import queue
import signal
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from runmap.engine.engine import Engine
from runmap.serve.app import Server
from runmap.serve.batching import SamplingParams
from runmap.serve.engine_process import EngineProcess, _MetricsRelay, apply_metrics
from runmap.serve.metrics import ServeMetrics
from runmap.serve.scheduler import Ticket
from test_model_support import build_packs

MAX_SEQ_LEN = 64


@pytest.fixture(scope="module")
def pack(tmp_path_factory):
    return build_packs(tmp_path_factory)["tiny-olmoe"]


def _server(pack, tmp_path, **load_kw) -> Server:
    load = functools.partial(Engine.from_pack, pack, **{"executor": "reference", "device": "cpu", "max_batch": 2,
                                                        "max_seq_len": MAX_SEQ_LEN, **load_kw})
    return Server(load, model_id="tiny", pack_dir=pack, ifeval_dir=tmp_path / "ifeval", engine_process=True)


def _ready_server(pack, tmp_path, **load_kw) -> Server:
    server = _server(pack, tmp_path, **load_kw)
    server.start()
    try:
        assert _wait_phase(server, ("ready", "failed")) == "ready"
    except BaseException:
        server.shutdown()
        raise
    return server


def _wait_phase(server: Server, phases, timeout=120.0) -> str:
    t0 = time.monotonic()
    while server.phase not in phases:
        assert time.monotonic() - t0 < timeout, f"phase still {server.phase}"
        time.sleep(0.05)
    return server.phase


def _events(q: queue.Queue, timeout=60.0) -> list:
    out = []
    while True:
        ev = q.get(timeout=timeout)
        out.append(ev)
        if ev[0] != "token":
            return out


def test_a_request_runs_in_the_child_and_its_figures_reach_the_http_process(pack, tmp_path):
    server = _ready_server(pack, tmp_path)
    try:
        sched = server.scheduler
        assert isinstance(sched, EngineProcess) and sched.proc.pid != os.getpid()
        ref = Engine.from_pack(pack, executor="reference", device="cpu", max_batch=1, max_seq_len=MAX_SEQ_LEN)
        ids = server.encode_prompt("Hello there", True)
        want = ref.generate([ids], max_new_tokens=6)[0]
        ref.close()
        q: queue.Queue = queue.Queue()
        sched.submit(Ticket(ids, SamplingParams(max_new_tokens=6), q.put))
        evs = _events(q)
        kind, done = evs[-1]
        assert kind == "done" and done.token_ids == want.token_ids and done.finish_reason == "length"
        assert "".join(t for k, t in evs[:-1]) == done.text == want.text
        t0 = time.monotonic()  # the scheduler's figures follow within a state period
        while sched.totals["generated_tokens"] < 6 and time.monotonic() - t0 < 5:
            time.sleep(0.02)
        assert sched.totals["requests"] == 1 and sched.totals["generated_tokens"] == 6
        assert sched.counters()["steps"] >= 5 and sched.stats is not None and sched.stats.hits > 0
        text = server.metrics.render().decode()
        got = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
        assert got["runmap_generation_tokens_total"] == 6 and got["runmap_time_to_first_token_seconds_count"] == 1
        assert got["runmap_inter_token_latency_seconds_count"] == 5
        doc = server.telemetry_doc()  # a named call run on the child's engine thread
        assert doc["arch"] == server.info["arch"] and doc["hits"] == sched.stats.hits
        # a request the context cannot hold is refused here, before it crosses
        with pytest.raises(Exception, match="maximum context length"):
            sched.submit(Ticket(ids, SamplingParams(max_new_tokens=MAX_SEQ_LEN), q.put))
    finally:
        server.shutdown()
    assert not server.scheduler.alive and server.phase == "stopping"


def test_cancels_bad_commands_timeouts_and_stop_leave_nothing_behind(pack, tmp_path):
    """A cancelled request (running or still waiting) is forgotten on both sides; a malformed command is logged and
    the engine keeps serving; a named call past its timeout raises TimeoutError; stop() ends a request in flight
    with a 503 error event and the child reports no failure."""
    server = _ready_server(pack, tmp_path, max_batch=1)
    try:
        sched = server.scheduler
        ids = server.encode_prompt("Hello there", True)
        long = SamplingParams(max_new_tokens=MAX_SEQ_LEN - len(ids))
        q1, q2 = queue.Queue(), queue.Queue()
        t1 = sched.submit(Ticket(ids, long, q1.put))
        assert q1.get(timeout=60)[0] == "token"  # running: the one row
        t2 = sched.submit(Ticket(ids, long, q2.put))  # waits for the row
        sched.cancel(t2)
        sched.cancel(t1)
        assert sched._tickets == {} and sched._ticket_ids == {}
        sched._send(("cancel",))  # malformed: the child logs it and goes on
        q3: queue.Queue = queue.Queue()
        sched.submit(Ticket(ids, SamplingParams(max_new_tokens=3), q3.put))
        assert _events(q3)[-1][0] == "done" and server.phase == "ready"
        with pytest.raises(TimeoutError):
            sched.call_named("offline_runs", timeout=0.0, rows=["a"], max_new_tokens=2, chat=False, warmup=0,
                             repeats=1)  # (the engine thread still runs it, later)
        assert sched._calls == {}
        q4: queue.Queue = queue.Queue()
        sched.submit(Ticket(ids, long, q4.put))
        assert q4.get(timeout=60)[0] == "token"
    finally:
        server.shutdown()
    kind, err = _events(q4)[-1]
    assert kind == "error" and err.status == 503 and "shutting down" in err.message
    assert sched.failed is None and server.phase == "stopping" and sched._tickets == {}
    with pytest.raises(Exception, match="shutting down|loading and warming up"):
        sched.submit(Ticket(ids, SamplingParams(max_new_tokens=2), q4.put))


def test_an_engine_that_cannot_load_in_the_child_fails_the_server_in_one_line(pack, tmp_path):
    failures = []
    server = _server(pack, tmp_path, executor="no-such-executor")
    server.on_failure = failures.append
    server.start()
    try:
        assert _wait_phase(server, ("failed",)) == "failed"
        assert failures and "no-such-executor" in failures[0] and "\n" not in failures[0]
        assert server.load_error == failures[0]
    finally:
        server.shutdown()


def test_a_child_that_dies_ends_the_requests_in_flight_with_an_error(pack, tmp_path):
    server = _ready_server(pack, tmp_path)
    try:
        sched = server.scheduler
        q: queue.Queue = queue.Queue()
        ids = server.encode_prompt("Hello there", True)
        sched.submit(Ticket(ids, SamplingParams(max_new_tokens=MAX_SEQ_LEN - len(ids)), q.put))
        assert q.get(timeout=60)[0] == "token"  # running
        os.kill(sched.proc.pid, signal.SIGKILL)
        evs = _events(q)
        kind, err = evs[-1]
        assert kind == "error" and err.status == 500 and "exit code -9" in err.message
        assert _wait_phase(server, ("failed",)) == "failed" and "exit code -9" in sched.failed
        with pytest.raises(Exception, match="loading and warming up|not running"):
            sched.submit(Ticket(ids, SamplingParams(max_new_tokens=2), q.put))
    finally:
        server.shutdown()


def test_metric_updates_cross_aggregated_and_land_in_the_registry():
    relay = _MetricsRelay()
    relay.generation_tokens.inc()
    relay.generation_tokens.inc()
    relay.requests.labels("chat", "stop").inc()
    relay.itl.observe(0.002)
    relay.itl.observe(0.004)
    relay.waiting.set(3)
    relay.waiting.set(1)
    ops = pickle.loads(pickle.dumps(relay.drain()))
    assert ops[("inc", "generation_tokens", ())] == 2.0 and ops[("observe", "itl", ())] == [0.002, 0.004]
    assert ops[("set", "waiting", ())] == 1 and relay.drain() == {}
    metrics = ServeMetrics()
    apply_metrics(metrics, ops)
    got = {(s.name, tuple(sorted(s.labels.items()))): s.value
           for f in text_string_to_metric_families(metrics.render().decode()) for s in f.samples}
    assert got[("runmap_generation_tokens_total", ())] == 2
    assert got[("runmap_requests_total", (("endpoint", "chat"), ("finish_reason", "stop")))] == 1
    assert got[("runmap_inter_token_latency_seconds_count", ())] == 2
    assert got[("runmap_requests_waiting", ())] == 1


def test_an_engine_snapshot_pickles_with_its_mappings_read_only(pack):
    eng = Engine.from_pack(pack, executor="reference", device="cpu", max_batch=1, max_seq_len=MAX_SEQ_LEN)
    try:
        st = eng.stats()
        back = pickle.loads(pickle.dumps(st))
        assert back == st and type(back.observations) is type(st.observations)
        with pytest.raises(TypeError):
            back.observations["x"] = 1
    finally:
        eng.close()
