"""The engine in a process of its own (``runmap serve --engine-process on``, the default on CUDA).

Why: in one process the engine thread shares the interpreter lock with the HTTP event loop, which writes one
server-sent-event chunk per token per client (~8,000 a second at 32 streaming clients on the H200). The engine
thread then waits for the lock after every blocking CUDA call and every switch interval, and a served decode step
took 3.8 ms of engine-thread time against the offline 3.5 ms, while joins and snapshots lost as much again
(results/serve/load/README.md). Here the engine, its scheduler (runmap.serve.scheduler, unchanged) and the
batch runner run in a child process whose only other thread reads commands; the HTTP process keeps the event
loop, the tokenizer for prompts, the metrics and the page.

The two processes talk over one ``multiprocessing`` pipe:

* HTTP -> engine: ``("submit", id, prompt_ids, SamplingParams, endpoint, t_arrival)``, ``("cancel", id)``,
  ``("call", call_id, name, kwargs)`` (a function of ``scheduler.ENGINE_CALLS`` run on the engine thread),
  ``("stop",)``.
* engine -> HTTP: ``("loaded", info)`` or ``("load_failed", message)`` once; then ``("batch", events, metrics,
  state)`` after every pass of the scheduler's loop that produced something (one message per decode step, not
  one per token), ``("result", call_id, ok, value)``, and ``("stopped",)`` last.

Events are the in-process ones (``("token", text)``, then ``("done", Finished)`` or ``("error", ApiError)``);
a finished request crosses as ``Finished`` (its text, token ids and finish reason), not as the engine's
``Sequence``. The scheduler's metric updates (time to first token and inter-token latency, as the engine thread
saw them; tokens; finished requests) cross as aggregated operations applied to the HTTP process's Prometheus
registry, so /metrics reads the same in both modes. ``perf_counter`` is CLOCK_MONOTONIC on Linux, one clock for
both processes, so a request's arrival time stamped here is the engine's too.

If the engine process dies, every request in flight gets a 500 error event and /health says failed.
"""
from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import multiprocessing
import os
import signal
import threading
import time
from typing import Callable

from runmap.serve.protocol import ApiError
from runmap.serve.scheduler import Scheduler, Ticket, check_fits

log = logging.getLogger("runmap.serve")
STATE_EVERY_S = 0.02  # the scheduler's counters go to the HTTP process at most this often while busy
COMMAND_POLL_S = 0.1  # the engine process's command loop wakes at least this often to report a failed engine thread


@dataclasses.dataclass
class Finished:
    """A finished request, as its ``("done", ...)`` event carries it across the process boundary (the fields of
    runmap.serve.batching.Sequence that the HTTP side reads)."""

    finish_reason: str | None
    token_ids: list
    text: str
    t_first: float | None
    t_last: float | None


def _error_fields(e: ApiError) -> tuple:
    return (e.status, e.message, e.type, e.param, e.code)


def _error_from(fields: tuple) -> ApiError:
    status, message, type_, param, code = fields
    return ApiError(status, message, type=type_, param=param, code=code)


# ---- the engine process ------------------------------------------------------------------------------------

class _MetricsRelay:
    """Stands in for runmap.serve.metrics.ServeMetrics inside the engine process: each update the scheduler makes
    is queued (deque appends are atomic) and sent with the next batch, aggregated (counters summed, observations
    listed, gauges last value)."""

    class _Metric:
        def __init__(self, relay, name, labels=()):
            self.relay, self.name, self.labels_ = relay, name, labels

        def labels(self, *labels):
            return _MetricsRelay._Metric(self.relay, self.name, tuple(str(v) for v in labels))

        def inc(self, amount=1.0):
            self.relay.ops.append(("inc", self.name, self.labels_, amount))

        def observe(self, value):
            self.relay.ops.append(("observe", self.name, self.labels_, value))

        def set(self, value):
            self.relay.ops.append(("set", self.name, self.labels_, value))

    NAMES = ("requests", "errors", "prompt_tokens", "generation_tokens", "ttft", "itl", "e2e", "running", "waiting")

    def __init__(self):
        self.ops: collections.deque = collections.deque()
        for name in self.NAMES:
            setattr(self, name, _MetricsRelay._Metric(self, name))

    def drain(self) -> dict:
        out: dict = {}
        while self.ops:
            kind, name, labels, value = self.ops.popleft()
            key = (kind, name, labels)
            if kind == "inc":
                out[key] = out.get(key, 0.0) + value
            elif kind == "observe":
                out.setdefault(key, []).append(value)
            else:
                out[key] = value
        return out


def apply_metrics(metrics, ops: dict) -> None:
    """Apply a drained _MetricsRelay to a ServeMetrics."""
    for (kind, name, labels), value in ops.items():
        m = getattr(metrics, name)
        if labels:
            m = m.labels(*labels)
        if kind == "inc":
            m.inc(value)
        elif kind == "observe":
            for v in value:
                m.observe(v)
        else:
            m.set(value)


class _Outbox:
    """The engine process's side of the pipe: events and metric updates gathered from any thread, sent as one
    message by ``flush`` (from the engine thread after each pass of its loop, and from the command thread)."""

    def __init__(self, conn, relay: _MetricsRelay):
        self.conn, self.relay = conn, relay
        self.events: collections.deque = collections.deque()
        self.lock = threading.Lock()  # Connection.send is not thread-safe
        self.sched: Scheduler | None = None
        self._state_t = 0.0
        self._last_state: dict | None = None
        self._stats = None
        self._waits_sent = 0
        self.broken = False

    def send(self, msg) -> None:
        with self.lock:
            self._send(msg)

    def _send(self, msg) -> None:
        if self.broken:
            return
        try:
            self.conn.send(msg)
        except (BrokenPipeError, EOFError, OSError):  # the HTTP process has gone: nobody is listening any more
            self.broken = True

    def event(self, tid: int, ev) -> None:
        kind, payload = ev
        if kind == "done":
            payload = Finished(payload.finish_reason, payload.token_ids, payload.text, payload.t_first,
                               payload.t_last)
        elif kind == "error":
            payload = _error_fields(payload)
        self.events.append((tid, kind, payload))

    def state(self, force: bool) -> dict | None:
        """The scheduler's figures, when STATE_EVERY_S has passed (or ``force``) and something changed."""
        s = self.sched
        now = time.perf_counter()
        if s is None or (not force and now - self._state_t < STATE_EVERY_S):
            return None
        try:
            return self._state(s, now)
        except RuntimeError:  # a deque or dict the engine thread changed while it was copied here: the next flush
            return None

    def _state(self, s: Scheduler, now: float) -> dict | None:
        self._state_t = now
        state = {"ready": s.ready, "failed": s.failed, "warmup_s": s.warmup_s, "totals": dict(s.totals),
                 "running": s.running, "waiting": s.waiting, "max_rows_seen": s.max_rows_seen,
                 "batch_counters": dict(s.batch_counters), "time_in": dict(s.time_in), "counters": s.counters(),
                 "tok_s": s.tok_per_s(), "compiles_after_ready": s.compiles_after_ready()}
        new = min(s.queue_waits_total - self._waits_sent, len(s.queue_waits))  # the newest entries, not yet sent
        waits = list(itertools.islice(reversed(s.queue_waits), new))[::-1] if new > 0 else []
        self._waits_sent = s.queue_waits_total
        if state == self._last_state and not waits and s.stats is self._stats:
            return None
        self._last_state = state
        out = dict(state, queue_waits=waits)
        if s.stats is not self._stats:
            self._stats = s.stats
            out["stats"] = s.stats
            out["memory"] = _device_memory(s.eng)
        return out

    def flush(self, force_state: bool = False) -> None:
        with self.lock:
            events = []
            while self.events:
                events.append(self.events.popleft())
            ops = self.relay.drain()
            state = self.state(force_state or any(k != "token" for _, k, _ in events))
            if events or ops or state is not None:
                self._send(("batch", events, ops, state))


def _device_memory(eng) -> dict | None:
    if eng.device.type != "cuda":
        return None
    import torch

    return {"cuda_allocated_bytes": torch.cuda.memory_allocated(eng.device),
            "cuda_reserved_bytes": torch.cuda.memory_reserved(eng.device)}


def engine_process_main(conn, load_engine: Callable, model_id: str, scheduler_kwargs: dict) -> None:
    """The child's entry point: load, warm up and serve until told to stop (or the HTTP process goes away)."""
    from runmap.serve.app import describe

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C reaches the whole group: the parent decides
    relay = _MetricsRelay()
    out = _Outbox(conn, relay)
    # Loaded on a thread that then ends, as in one process (Server._load): torch's CPU ops ran ~3x slower on the
    # engine thread of a process whose main thread had run them first (the main thread's OpenMP team competes for
    # the cores; measured on the 2-core development VM)
    loaded: dict = {}

    def load() -> None:
        try:
            loaded["engine"] = load_engine()
        except Exception as e:  # noqa: BLE001 - bad pack, missing device, ...: one line in the HTTP process
            loaded["error"] = f"{type(e).__name__}: {e}"
    loader = threading.Thread(target=load, name="runmap-load")
    loader.start()
    loader.join()
    if "engine" not in loaded:
        out.send(("load_failed", loaded.get("error", "the engine did not load")))
        return
    eng = loaded["engine"]
    tok = eng.tokenizer
    out.send(("loaded", {"info": describe(eng, model_id), "tokenizer_dir": str(tok.directory),
                         "eos_token_id": eng.cfg.eos_token_id, "vocab_size": eng.cfg.vocab_size, "pid": os.getpid()}))
    sched = Scheduler(eng, metrics=relay, decode=tok.decode, after_iteration=out.flush, **scheduler_kwargs)
    out.sched = sched
    sched.start()
    tickets: dict[int, Ticket] = {}
    reported = (False, None)
    try:
        while True:
            if (sched.ready, sched.failed) != reported:  # warm, or the engine thread stopped
                reported = (sched.ready, sched.failed)
                out.flush(force_state=True)
            if out.broken:
                break
            if not conn.poll(COMMAND_POLL_S):
                continue
            try:
                msg = conn.recv()
            except (EOFError, OSError):  # the HTTP process has gone
                break
            if msg[0] == "stop":
                break
            try:
                _command(msg, sched, out, tickets)
            except Exception:  # noqa: BLE001 - one bad command never takes the engine down with it
                log.exception("engine process: command %r failed", msg[0])
    finally:
        sched.stop()
        out.flush(force_state=True)
        if not sched.alive:  # not under a step still running (the process is ending anyway)
            eng.close()
        out.send(("stopped",))


def _command(msg, sched: Scheduler, out: _Outbox, tickets: dict) -> None:
    """One command of the HTTP process (engine_process_main's loop): submit, cancel or call."""
    kind = msg[0]
    if kind == "submit":
        _, tid, prompt_ids, params, endpoint, t_arrival = msg

        def sink(ev, tid=tid):
            if ev[0] != "token":
                tickets.pop(tid, None)
            out.event(tid, ev)
        t = Ticket(prompt_ids, params, sink, endpoint=endpoint, t_arrival=t_arrival)
        tickets[tid] = t
        try:
            sched.submit(t)
        except ApiError as e:
            sink(("error", e))
            out.flush()
    elif kind == "cancel":
        # forgotten here at once: a request cancelled while it waits gets no further event (the HTTP side has
        # stopped listening; it forgets the ticket too), one that runs leaves at the next step
        t = tickets.pop(msg[1], None)
        if t is not None:
            sched.cancel(t)
    elif kind == "call":
        _, cid, name, kwargs, timeout = msg
        threading.Thread(target=_run_call, args=(out, sched, cid, name, kwargs, timeout),
                         name=f"runmap-call-{name}", daemon=True).start()
    else:
        raise ValueError(f"unknown command {kind!r}")


def _run_call(out: _Outbox, sched: Scheduler, cid: int, name: str, kwargs: dict, timeout) -> None:
    try:
        value = sched.call_named(name, timeout=timeout, **kwargs)
        out.send(("result", cid, True, value))
    except ApiError as e:
        out.send(("result", cid, False, ("api", _error_fields(e))))
    except TimeoutError as e:  # concurrent.futures.TimeoutError is this class: the caller gets the same one
        out.send(("result", cid, False, ("timeout", f"{name}: no result within {timeout} s ({e})")))
    except Exception as e:  # noqa: BLE001 - handed to the caller in the HTTP process
        out.send(("result", cid, False, ("other", f"{type(e).__name__}: {e}")))


# ---- the HTTP process's side -----------------------------------------------------------------------------

class EngineView:
    """What the HTTP process keeps of an engine that runs elsewhere: its tokenizer (prompts are tokenized where
    the requests arrive) and the figures of ``describe``."""

    def __init__(self, loaded: dict):
        from runmap.engine.tokenization import Tokenizer

        self.info = loaded["info"]
        self.tokenizer = Tokenizer(loaded["tokenizer_dir"], eos_token_id=loaded["eos_token_id"])
        self.vocab_size = int(loaded["vocab_size"])
        self.max_seq_len = int(self.info["max_seq_len"])
        self.max_batch = int(self.info["max_batch"])
        self.device_name = self.info["device"]

    def encode(self, prompt, chat: bool = False) -> list[int]:
        """As runmap.engine.engine.Engine.encode."""
        from runmap.engine.generation import encode_prompt

        return encode_prompt(self.tokenizer, prompt, chat, self.vocab_size)

    def close(self) -> None:  # the engine process closes the engine
        pass


class EngineProcess:
    """The scheduler's interface (what runmap.serve.app, the IFEval job and benchmarks/serve_load.py use) for
    an engine running in a child process. ``start()`` blocks until the engine is loaded (not yet warm) and
    returns the EngineView, or raises RuntimeError with the child's one-line reason."""

    def __init__(self, load_engine: Callable, *, model_id: str, metrics=None, scheduler_kwargs: dict | None = None,
                 start_method: str = "spawn"):
        self.load_engine, self.model_id, self.metrics = load_engine, model_id, metrics
        self.scheduler_kwargs = dict(scheduler_kwargs or {})
        self.ctx = multiprocessing.get_context(start_method)
        self.proc = None
        self.conn = None
        self._send_lock = threading.Lock()
        self._ids = itertools.count(1)
        self._tickets: dict[int, Ticket] = {}
        self._ticket_ids: dict[int, int] = {}  # id(ticket) -> its id
        self._calls: dict[int, tuple] = {}
        self._reader: threading.Thread | None = None
        self._stopped = threading.Event()
        # _closing: stop() was asked (a "stopped" from the child is then expected, and no state makes it ready again);
        # _closed: the reader has ended every open ticket and call (no new one may be added); both under _lock
        self._lock = threading.Lock()
        self._closing = False
        self._closed = False
        self.view: EngineView | None = None
        self.info: dict = {}
        # the scheduler's figures, as the engine process last sent them
        self.ready = False
        self.failed: str | None = None
        self.warmup_s: float | None = None
        self.stats = None
        self.memory: dict | None = None
        self.totals = {"requests": 0, "generated_tokens": 0, "prompt_tokens": 0, "cancelled": 0, "errors": 0}
        self.running = 0
        self.waiting = 0
        self.max_rows_seen = 0
        self.batch_counters: dict = {}
        self.time_in: dict = {"admit_s": 0.0, "step_s": 0.0, "stats_s": 0.0, "calls_s": 0.0}
        self._counters: dict = {}
        self._tok_s = 0.0
        self._compiles = None
        self.queue_waits: collections.deque = collections.deque(maxlen=100_000)

    # ---- lifecycle -------------------------------------------------------------------------------------------
    def start(self) -> EngineView:
        parent, child = self.ctx.Pipe()
        self.proc = self.ctx.Process(target=engine_process_main, name="runmap-engine",
                                     args=(child, self.load_engine, self.model_id, self.scheduler_kwargs), daemon=True)
        self.proc.start()
        child.close()
        self.conn = parent
        while True:
            try:
                msg = parent.recv()
            except (EOFError, OSError):
                self.proc.join(5)
                raise RuntimeError(f"the engine process exited while loading (exit code {self.proc.exitcode})") \
                    from None
            if msg[0] == "load_failed":
                self.proc.join(30)
                raise RuntimeError(msg[1])
            if msg[0] == "loaded":
                break
        self.view = EngineView(msg[1])
        self.info = self.view.info
        self._reader = threading.Thread(target=self._read, name="runmap-engine-reader", daemon=True)
        self._reader.start()
        return self.view

    def stop(self, timeout: float = 30.0) -> None:
        with self._lock:
            self._closing = True
            self.ready = False
        if self.proc is None:
            return
        self._send(("stop",))
        if not self._stopped.wait(timeout):
            log.error("the engine process did not stop within %.0f s: terminating it", timeout)
            self.proc.terminate()
        self.proc.join(timeout)
        if self._reader is not None:
            self._reader.join(5)

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.is_alive()

    # ---- the scheduler's interface ------------------------------------------------------------------------------
    @property
    def max_batch(self) -> int:
        return self.view.max_batch

    @property
    def max_seq_len(self) -> int:
        return self.view.max_seq_len

    def check(self, prompt_len: int, max_new_tokens: int) -> None:
        check_fits(self.max_seq_len, prompt_len, max_new_tokens)

    def submit(self, ticket: Ticket) -> Ticket:
        if not self.ready:
            raise ApiError(503, "the engine is still loading and warming up; retry when /health says ok",
                           type="server_error", code="not_ready")
        self.check(len(ticket.prompt_ids), ticket.params.max_new_tokens)
        tid = next(self._ids)
        with self._lock:
            if self._closing or self._closed:
                raise ApiError(503, "the server is shutting down", type="server_error")
            self._tickets[tid] = ticket
            self._ticket_ids[id(ticket)] = tid
        if not self._send(("submit", tid, list(ticket.prompt_ids), ticket.params, ticket.endpoint,
                           ticket.t_arrival)):
            self._tickets.pop(tid, None)
            self._ticket_ids.pop(id(ticket), None)
            raise ApiError(503, "the engine process is not running", type="server_error")
        self.waiting += 1  # until the engine process's next figures
        return ticket

    def cancel(self, ticket: Ticket) -> None:
        """The caller has stopped listening: the ticket is forgotten here and in the engine process (a request that
        runs leaves its row at the next step; one still waiting leaves the queue)."""
        ticket.cancelled = True
        tid = self._ticket_ids.pop(id(ticket), None)
        if tid is not None:
            self._tickets.pop(tid, None)
            self._send(("cancel", tid))

    def call_named(self, name: str, timeout: float | None = 60.0, **kwargs):
        import concurrent.futures

        fut: concurrent.futures.Future = concurrent.futures.Future()
        cid = next(self._ids)
        with self._lock:
            if self._closed:
                raise ApiError(503, "the engine process is not running", type="server_error")
            self._calls[cid] = fut
        if self.failed or not self._send(("call", cid, name, kwargs, timeout)):
            self._calls.pop(cid, None)
            raise ApiError(503, "the engine process is not running", type="server_error")
        try:  # the engine thread's own timeout comes back as TimeoutError; this one covers a child that went silent
            return fut.result(None if timeout is None else timeout + 5.0)
        except TimeoutError:
            self._calls.pop(cid, None)
            raise

    def telemetry(self) -> dict:
        return self.call_named("telemetry")

    def counters(self) -> dict:
        return dict(self._counters)

    def tok_per_s(self) -> float:
        return self._tok_s

    def compiles_after_ready(self) -> dict | None:
        return self._compiles

    # ---- the pipe -----------------------------------------------------------------------------------------------
    def _send(self, msg) -> bool:
        with self._send_lock:
            try:
                self.conn.send(msg)
                return True
            except (BrokenPipeError, EOFError, OSError):
                return False

    def _read(self) -> None:
        clean = False  # the engine process said it stopped (else it died, or the pipe broke)
        try:
            while True:
                try:
                    msg = self.conn.recv()
                except (EOFError, OSError):
                    break
                kind = msg[0]
                if kind == "batch":
                    self._on_batch(*msg[1:])
                elif kind == "result":
                    _, cid, ok, value = msg
                    fut = self._calls.pop(cid, None)
                    if fut is not None:
                        if ok:
                            fut.set_result(value)
                        elif value[0] == "api":
                            fut.set_exception(_error_from(value[1]))
                        elif value[0] == "timeout":
                            fut.set_exception(TimeoutError(value[1]))
                        else:
                            fut.set_exception(RuntimeError(value[1]))
                elif kind == "stopped":
                    clean = True
                    break
        finally:
            with self._lock:
                self._closed = True
                self.ready = False
                asked = self._closing
            self._stopped.set()
            if self.proc is not None:
                self.proc.join(5)
            gone = not (clean and asked)  # died, the pipe broke, or stopped without being asked
            if gone and self.failed is None:
                code = self.proc.exitcode if self.proc is not None else None
                self.failed = (f"the engine process exited (exit code {code})" if not clean
                               else "the engine process stopped without being asked to")
                log.error("%s", self.failed)
            err = ApiError(500 if gone else 503, f"engine failure: {self.failed}" if gone
                           else "the server is shutting down", type="server_error")
            for tid, t in list(self._tickets.items()):
                if not t.done:
                    t.done = True
                    t.sink(("error", err))
            self._tickets.clear()
            for fut in self._calls.values():
                fut.set_exception(ApiError(503, "the engine process is not running", type="server_error"))
            self._calls.clear()

    def _on_batch(self, events: list, ops: dict, state: dict | None) -> None:
        if state is not None:
            self._on_state(state)
        if ops and self.metrics is not None:
            apply_metrics(self.metrics, ops)
        for tid, kind, payload in events:
            t = self._tickets.get(tid)
            if t is None:
                continue
            if kind == "token":
                t.sink(("token", payload))
                continue
            del self._tickets[tid]
            self._ticket_ids.pop(id(t), None)
            t.done = True
            if kind == "done":
                t.sink(("done", payload))
            else:
                err = _error_from(payload)
                t.error = err
                t.sink(("error", err))

    def _on_state(self, state: dict) -> None:
        self.failed = state["failed"] or self.failed
        self.warmup_s = state["warmup_s"]
        self.totals = state["totals"]
        self.running, self.waiting = state["running"], state["waiting"]
        self.max_rows_seen = state["max_rows_seen"]
        self.batch_counters = state["batch_counters"]
        self.time_in = state["time_in"]
        self._counters = state["counters"]
        self._tok_s = state["tok_s"]
        self._compiles = state["compiles_after_ready"]
        self.queue_waits.extend(state["queue_waits"])
        if "stats" in state:
            self.stats = state["stats"]
            self.memory = state["memory"]
        with self._lock:  # a state already in the pipe when stop() was asked does not make the server ready again
            self.ready = bool(state["ready"]) and not self.failed and not self._closing and not self._closed

