"""The engine thread: it owns the engine and the running batch; HTTP handlers and the IFEval job only
submit requests and receive events.

* ``submit`` queues a request (FIFO) and returns its ``Ticket``; between decode steps the thread admits
  waiting requests into the running batch (runmap.serve.batching) while a row is free and the KV cache
  has room, so a request joins a batch that is already decoding (continuous batching, up to max_batch).
* ``Ticket.cancel()`` (a client that went away) takes its row out at the next step, or drops it from the
  queue if it never started.
* Events go to the ticket's ``sink`` from this thread: ``("token", text_delta)``, then exactly one of
  ``("done", Sequence)`` or ``("error", ApiError)``. The HTTP side turns them into SSE chunks.
* The thread loads nothing: it is handed a built engine, warms it up (the first prefill and a decode step
  for every batch size, and on CUDA every KV-length bucket, so Triton compilation and CUDA-graph capture
  happen before ``ready``), then serves.
* Engine figures for /metrics and the page (``stats``: an ``EngineStats``) are snapshotted here, between
  steps, at most every ``STATS_EVERY_S`` while busy and once when the batch drains.
"""
from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import functools
import gc
import logging
import sys
import threading
import time
from typing import Callable

import torch

from runmap.serve.batching import JOIN_TOKENS, BatchRunner, SamplingParams, Sequence, prefill_warmup_shapes
from runmap.serve.protocol import ApiError

log = logging.getLogger("runmap.serve")
STATS_EVERY_S = 0.5
# host time a pending join's prefill may take between two decode steps (runmap.serve.batching.BatchRunner.advance_join;
# --join-mode interleaved): with the step pipelined one ahead, the device keeps decoding as long as this plus the
# step's own host work stays under a decode step (~2 ms at 8 rows, ~3.5 ms at 32 for OLMoE on the H200). At least one
# piece runs per call: a layer of an eager prefill took ~1 ms of host time in a probe, ~1.8 ms in a loaded server.
JOIN_SLICE_S = 0.001
GIL_SWITCH_INTERVAL_S = 0.0005  # sys.setswitchinterval for a serving process (Scheduler.start says why)
RATE_WINDOW_S = 5.0


def _telemetry(eng) -> dict:
    return eng.telemetry()


def _offline_runs(eng, *, rows: list, max_new_tokens: int, chat: bool, warmup: int, repeats: int) -> list[dict]:
    """The engine's own batched generation of ``rows`` (every row to max_new_tokens), ``warmup`` untimed runs then
    ``repeats`` timed ones, as the engine times them (benchmarks/serve_load.py's offline reference)."""
    from runmap.bench.campaign import _timing_values

    for _ in range(warmup):
        eng.run(rows, max_new_tokens=max_new_tokens, chat=chat, ignore_eos=True)
    out = []
    for _ in range(repeats):
        run = eng.run(rows, max_new_tokens=max_new_tokens, chat=chat, ignore_eos=True)
        pf, dc, tt, pt, nt = _timing_values(run, f"offline batch {len(rows)}")
        out.append({"decode_tok_s": dc, "ttft_s": tt, "new_tokens": nt, "prompt_tokens": pt,
                    "e2e_tok_s": nt / (run.prefill_s + run.decode_s)})
    return out


# what other threads (and the HTTP process) may run on the engine thread by name: (engine, **kwargs) -> picklable
ENGINE_CALLS: dict[str, Callable] = {"telemetry": _telemetry, "offline_runs": _offline_runs}


def check_fits(msl: int, prompt_len: int, max_new_tokens: int) -> None:
    """ApiError (400) unless a prompt of ``prompt_len`` tokens and ``max_new_tokens`` fit a context of ``msl``."""
    if prompt_len < 1:
        raise ApiError(400, "the prompt is empty (no token to condition on)", param="prompt")
    if prompt_len > msl:
        raise ApiError(400, f"This model's maximum context length is {msl} tokens. However, your prompt has "
                       f"{prompt_len} tokens.", param="messages", code="context_length_exceeded")
    if prompt_len + max_new_tokens - 1 > msl:
        raise ApiError(400, f"This model's maximum context length is {msl} tokens. However, you requested "
                       f"{prompt_len + max_new_tokens} tokens ({prompt_len} in the prompt, {max_new_tokens} for "
                       f"the completion; the last token needs no KV slot). Reduce max_tokens to at most "
                       f"{msl - prompt_len + 1}.", param="max_tokens", code="context_length_exceeded")


@dataclasses.dataclass(eq=False)
class Ticket:
    """A submitted request. ``endpoint`` labels its metrics."""

    prompt_ids: list
    params: SamplingParams
    sink: Callable
    endpoint: str = "chat"
    t_arrival: float = dataclasses.field(default_factory=time.perf_counter)
    seq: Sequence | None = None
    cancelled: bool = False
    done: bool = False
    error: ApiError | None = None  # set when the engine failed under this request

    def cancel(self) -> None:
        self.cancelled = True
        seq = self.seq  # read once: the engine thread may clear it meanwhile (a join that failed)
        if seq is not None:
            seq.cancel()


class Scheduler:
    def __init__(self, engine, *, metrics=None, info: dict | None = None, decode=None, pipelined=None,
                 join_tokens: int = JOIN_TOKENS, interleave_joins: bool = False, concurrent_joins: bool = False,
                 mixed_joins: bool = False, after_iteration: Callable[[], None] | None = None):
        self.eng, self.metrics = engine, metrics
        # called by the engine thread after each pass of its loop (and while it waits idle, every STATS_EVERY_S):
        # the engine process (runmap.serve.engine_process) sends the pass's events to the HTTP process from there
        self.after_iteration = after_iteration
        self.join_tokens = join_tokens
        self.interleave_joins = interleave_joins
        self.concurrent_joins = concurrent_joins
        self.mixed_joins = mixed_joins
        self.info = dict(info or {})
        self.max_batch = engine.max_batch
        self.decode_text = decode
        self.pipelined = pipelined
        self.runner: BatchRunner | None = None
        self._cv = threading.Condition()
        self._waiting: collections.deque[Ticket] = collections.deque()
        self._running: dict[int, Ticket] = {}
        self._joining: list[Ticket] = []  # the requests of the join in progress (neither waiting nor running)
        self._join_began = 0.0  # perf_counter when that join began (its requests' queue wait ends there)
        self._stop = False
        self._thread: threading.Thread | None = None
        self.ready = False
        self.failed: str | None = None
        self.warmup_s: float | None = None
        self.stats = None  # EngineStats, refreshed by the engine thread
        self.batch_counters: dict = {}
        self._stats_t = 0.0
        self._stats_steps = -1  # decode steps at the last snapshot: an idle engine is not re-read
        self._rate: collections.deque = collections.deque()  # (time, tokens) per step, last RATE_WINDOW_S
        self.totals = {"requests": 0, "generated_tokens": 0, "prompt_tokens": 0, "cancelled": 0, "errors": 0}
        self.max_rows_seen = 0
        self._calls: collections.deque = collections.deque()  # (fn, Future) to run on the engine thread
        # Triton kernel variants compiled by this process (runmap.kernels.common.CompileLog; CUDA only), marked when
        # the server reports ready: a variant compiled later stalled a request
        self.compiles = None
        self._switch_interval: float | None = None  # the process's own, restored at stop()
        self._froze = False  # gc.freeze() done after warm-up (undone at stop())
        # where the engine thread's time goes once serving (seconds, cumulative): admitting waiting requests (their
        # joint prefills), decode steps (with the rows' token handling), gauges and the stats snapshot, functions run
        # for other threads (Scheduler.call); the rest of the wall time it waited for work. A phase that fails keeps
        # the time it took. Read by the load benchmark per window.
        self.time_in = {"admit_s": 0.0, "step_s": 0.0, "stats_s": 0.0, "calls_s": 0.0}
        # (admission time, seconds the request waited in the queue before its join began) of recent admissions
        self.queue_waits: collections.deque = collections.deque(maxlen=100_000)
        self.queue_waits_total = 0  # entries ever appended to queue_waits (the deque keeps the last 100,000)

    # ---- the HTTP side --------------------------------------------------------------------------------
    def start(self) -> None:
        # The engine thread shares the GIL with the event loop's (HTTP, one SSE chunk per token per client). Under
        # load the loop thread runs Python for long stretches, and a thread asking for the GIL waits up to the
        # switch interval (5 ms by default: more than a decode step) before the holder is made to drop it; a
        # shorter interval bounds the engine's wait at the cost of more frequent switches.
        self._switch_interval = sys.getswitchinterval()
        sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
        self._thread = threading.Thread(target=self._main, name="runmap-engine", daemon=True)
        self._thread.start()

    def check(self, prompt_len: int, max_new_tokens: int) -> None:
        """ApiError (400) unless the request fits the context."""
        check_fits(self.eng.max_seq_len, prompt_len, max_new_tokens)

    def submit(self, ticket: Ticket) -> Ticket:
        if not self.ready:
            raise ApiError(503, "the engine is still loading and warming up; retry when /health says ok",
                           type="server_error", code="not_ready")
        self.check(len(ticket.prompt_ids), ticket.params.max_new_tokens)
        with self._cv:
            if self._stop:
                raise ApiError(503, "the server is shutting down", type="server_error")
            self._waiting.append(ticket)
            if self.metrics is not None:
                self.metrics.waiting.set(len(self._waiting))
            self._cv.notify()
        return ticket

    def cancel(self, ticket: Ticket) -> None:
        ticket.cancel()
        with self._cv:
            self._cv.notify()

    def call(self, fn, timeout: float | None = 60.0):
        """Run ``fn()`` on the engine thread between two steps and return its result (for reads of engine
        state that must not race the step, e.g. ``Engine.telemetry``)."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._cv:
            if self._stop or self.failed:
                raise ApiError(503, "the engine thread is not running", type="server_error")
            self._calls.append((fn, fut))
            self._cv.notify()
        return fut.result(timeout)

    def stop(self, timeout: float = 30.0) -> None:
        with self._cv:
            self._stop = True
            self.ready = False
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout)
        # what start() and the warm-up changed for the whole process: a process that goes on (tests, benchmarks that
        # start several servers) gets its switch interval back and its frozen objects collectable again
        if self._switch_interval is not None:
            sys.setswitchinterval(self._switch_interval)
            self._switch_interval = None
        if self._froze:
            gc.unfreeze()
            self._froze = False

    def compiles_after_ready(self) -> dict | None:
        """{"count", "variants"}: Triton kernel variants compiled since ready (None: not observed, e.g. on the CPU,
        where the interpreter compiles nothing, or before ready)."""
        if self.compiles is None or self.compiles.marked_at is None:
            return None
        return {"count": self.compiles.count - self.compiles.marked_at, "variants": list(self.compiles.since_mark)}

    @property
    def max_seq_len(self) -> int:
        return self.eng.max_seq_len

    def counters(self) -> dict:
        """The batch runner's counters (steps, joins, admitted, ...); empty before the engine thread made it."""
        return dict(self.runner.counters) if self.runner is not None else {}

    def call_named(self, name: str, timeout: float | None = 60.0, **kwargs):
        """``ENGINE_CALLS[name](engine, **kwargs)`` on the engine thread (the same call crosses to an engine
        process: runmap.serve.engine_process.EngineProcess.call_named)."""
        return self.call(functools.partial(ENGINE_CALLS[name], self.eng, **kwargs), timeout=timeout)

    def telemetry(self) -> dict:
        return self.call_named("telemetry")

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def running(self) -> int:
        return len(self._running)

    def tok_per_s(self) -> float:
        """Generated tokens per second over the last RATE_WINDOW_S (0 when idle)."""
        now = time.perf_counter()
        pts = [(t, n) for t, n in list(self._rate) if now - t <= RATE_WINDOW_S]
        if not pts:
            return 0.0
        span = max(now - pts[0][0], 1e-3) if len(pts) > 1 else RATE_WINDOW_S
        return sum(n for _, n in pts) / min(span, RATE_WINDOW_S)

    # ---- the engine thread ----------------------------------------------------------------------------
    def _main(self) -> None:
        try:
            with torch.inference_mode():
                self.runner = BatchRunner(self.eng, decode=self.decode_text, pipelined=self.pipelined,
                                          join_tokens=self.join_tokens, interleave=self.interleave_joins,
                                          concurrent=self.concurrent_joins, mixed=self.mixed_joins)
                t0 = time.perf_counter()
                if self.eng.device.type == "cuda":  # the interpreter (CPU) compiles nothing
                    from runmap.kernels.common import compile_log

                    self.compiles = compile_log()
                self._warmup()
                self.warmup_s = time.perf_counter() - t0
                if self.compiles is not None:
                    self.compiles.mark()
                # Everything loaded so far (torch, transformers, the engine: millions of objects) lives as long as
                # the process; frozen, the collector's full passes stop re-scanning it, so a serving process does not
                # stall every running row for a full collection from time to time (a long-lived server's usual step)
                gc.collect()
                gc.freeze()
                self._froze = True
                self._refresh_stats(force=True)
                self.ready = True
                log.info("engine warm in %.1f s", self.warmup_s)
                self._serve()
        except BaseException as e:  # noqa: BLE001 - reported on /health and in the log, never silently
            self.failed = f"{type(e).__name__}: {e}"
            log.error("engine thread stopped: %s", self.failed)
            self._fail_all(ApiError(500, f"engine failure: {self.failed}", type="server_error"))
            self.ready = False

    def _warmup(self) -> None:
        """One prefill, then a decode step at every batch size (and on CUDA at every KV-length bucket the
        decode step attends, the key of its CUDA graphs), so no request pays for compilation or capture. Under partial
        residency the eviction policy forgets these pad-token routes after (``Engine.policy_kept``)."""
        with self.eng.policy_kept():
            self._warm_shapes()

    def _warm_shapes(self) -> None:
        eng = self.eng
        dev = eng.device
        ids = eng.tokenizer.encode("Hello") or [0]
        ids = ids[: max(1, eng.max_seq_len // 2)]
        eng.experts.begin()
        try:
            zero1 = torch.zeros(1, dtype=torch.long, device=dev)
            eng.prefill(torch.tensor([ids], dtype=torch.long, device=dev), zero1)
            if dev.type == "cuda":  # every size class of prefill pass, so no request compiles a kernel variant
                self._warm_prefills()
                # the captured passes whole joins replay (one per rows x length bucket; none under partial residency
                # or a GPU budget): a join then costs the host a few copies and one launch instead of an eager pass
                n = eng.prepare_join_passes(concurrent=self.concurrent_joins)
                if n:
                    where = " (in a pool of their own: they replay beside decode steps)" if self.concurrent_joins else ""
                    log.info("captured %d join prefill passes%s", n, where)
                if self.mixed_joins:  # every rows x prompt x KV-length bucket of a mixed step (runmap.engine.mixed_step)
                    n = eng.prepare_mixed_steps()
                    log.info("captured %d mixed steps (a joining prompt computed inside a decode step)", n)
            slots = [len(ids)]
            if dev.type == "cuda":
                slots = [n - 1 for n in eng.kv_buckets()]
            for B in range(1, eng.max_batch + 1):
                tok = torch.zeros(B, dtype=torch.long, device=dev)
                pad = torch.zeros(B, dtype=torch.long, device=dev)
                for mode in eng.warm_step_modes(B):  # auto with both sites: both steps, its chooser not asked
                    with eng.forced_step(mode):
                        for s in slots:
                            eng.decode(tok, s, pad)
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
        finally:
            eng.experts.end()
        # the first real request also goes through the batching path (prefill into a running batch included)
        # (a request alone, then two of different lengths joining it together: the padded joint prefill)
        r = self.runner
        longer = (ids * 2)[: len(ids) + 1] if len(ids) < eng.max_seq_len else ids

        def warm(prompt):
            return Sequence(prompt, SamplingParams(max_new_tokens=max(1, min(3, eng.max_seq_len - len(prompt) + 1)),
                                                   temperature=0.0))
        r.admit(warm(ids))
        r.step()
        r.admit_many([warm(ids), warm(longer)][: eng.max_batch - r.rows])  # two lengths: a padded joint prefill
        while r.rows:
            r.step()
        if (self.interleave_joins or self.concurrent_joins or self.mixed_joins) and eng.max_batch > 1:
            # a join whose prefill runs between (interleaved) or beside (concurrent) the running rows' decode steps, or
            # inside one (mixed: once the shared slot is past the prompt's smallest length bucket)
            steps = 1
            if self.mixed_joins:  # until the shared slot reaches the end of the prompt's bucket: a mixed step can take it
                from runmap.engine.mixed_step import mixed_bucket

                steps = max(1, (mixed_bucket(len(ids)) or 0) - len(ids))
            r.admit(Sequence(ids, SamplingParams(max_new_tokens=max(1, min(steps + 8, eng.max_seq_len - len(ids) + 1)),
                                                 temperature=0.0, ignore_eos=True)))
            for _ in range(steps):
                if r.rows:
                    r.step()
            if r.rows and r.begin_join([warm(ids)], interleave=r.can_interleave()):
                while r.joining:
                    r.advance_join(JOIN_SLICE_S)
                    r.finish_join()
                    if r.rows:
                        r.step()
            while r.rows:
                r.step()

    def _warm_prefills(self) -> None:
        """One prefill per shape of ``prefill_warmup_shapes`` into the engine's first KV rows (the batch is empty);
        the tokens are the pad id: only the shapes matter."""
        eng, dev = self.eng, self.eng.device
        for lens in prefill_warmup_shapes(max_seq_len=eng.max_seq_len, prefill_chunk=eng.prefill_chunk,
                                          max_batch=eng.max_batch, join_tokens=self.join_tokens, top_k=eng.cfg.top_k):
            P = max(lens)
            tokens = torch.full((len(lens), P), int(eng.pad_id), dtype=torch.long, device=dev)
            pads = [P - n for n in lens]
            eng.prefill(tokens, torch.tensor(pads, dtype=torch.long, device=dev), kv=eng.kv.rows(0, len(lens)),
                        pad_host=pads)

    def _serve(self) -> None:
        r = self.runner
        while True:
            if self.after_iteration is not None:
                self.after_iteration()
            with self._cv:
                while not self._stop and not self._waiting and not r.rows and not r.joining and not self._calls:
                    self._drop_cancelled_waiting()
                    if not self._cv.wait(timeout=STATS_EVERY_S) and self._stats_steps != r.counters["steps"]:
                        self._refresh_stats(force=True)
                    if self.after_iteration is not None and not self._waiting and not self._calls:
                        self.after_iteration()
                if self._stop:
                    break
                self._drop_cancelled_waiting()
                calls, self._calls = list(self._calls), collections.deque()
            t0 = time.perf_counter()
            for fn, fut in calls:
                try:
                    fut.set_result(fn())
                except BaseException as e:  # noqa: BLE001 - handed to the caller
                    fut.set_exception(e)
            t = time.perf_counter()
            self.time_in["calls_s"] += t - t0
            phase = "admit_s"  # the phase an exception below interrupts keeps its time
            try:
                self._admit()
                t0, t = t, time.perf_counter()
                self.time_in["admit_s"] += t - t0
                if r.rows:
                    phase = "step_s"
                    self.max_rows_seen = max(self.max_rows_seen, r.rows)
                    n0 = self.totals["generated_tokens"]
                    r.step()
                    self._rate.append((t, self.totals["generated_tokens"] - n0))
                    while self._rate and t - self._rate[0][0] > RATE_WINDOW_S:
                        self._rate.popleft()
                    self.time_in["step_s"] += time.perf_counter() - t
            except Exception as e:  # noqa: BLE001 - an engine failure fails the batch, not the server
                self.time_in[phase] += time.perf_counter() - t
                log.exception("engine step failed")
                self._fail_batch(ApiError(500, f"engine failure: {type(e).__name__}: {e}", type="server_error"))
            t0 = time.perf_counter()
            self._update_gauges()
            self._refresh_stats(force=not r.rows)
            self.time_in["stats_s"] += time.perf_counter() - t0
        down = ApiError(503, "the server is shutting down", type="server_error")
        self._fail_batch(down)
        self._fail_all(down)

    def _fail_batch(self, err: ApiError) -> None:
        """Every running row gets ``err``; the KV rows are dropped (the engine stays up for new requests)."""
        with self._cv:
            tickets = list(self._running.values()) + self._joining
            self._running.clear()
            self._joining = []
        for t in tickets:
            t.error = err
        self.totals["errors"] += len(tickets)
        try:
            self.runner.abort_all("error")
        finally:  # a ticket whose row was not told (the runner failed before it could be) still gets its error
            for t in tickets:
                if not t.done:
                    t.done = True
                    t.sink(("error", err))

    def _drop_cancelled_waiting(self) -> None:
        keep = collections.deque()
        for t in self._waiting:
            if t.cancelled:
                self._finish_cancelled_waiting(t)
            else:
                keep.append(t)
        self._waiting = keep

    def _finish_cancelled_waiting(self, t: Ticket) -> None:
        t.done = True
        self.totals["requests"] += 1
        self.totals["cancelled"] += 1
        if self.metrics is not None:
            self.metrics.requests.labels(t.endpoint, "cancelled").inc()

    def _admit(self) -> None:
        """Every waiting request that fits joins, together (one joint prefill: runmap.serve.batching). With
        --join-mode whole the prefill runs now while the running rows wait; with interleaved, while rows are running,
        it is spread over the next decode steps (a slice of JOIN_SLICE_S of host time per step); with concurrent, while
        rows are running, its captured pass runs on a stream of its own beside the next decode steps and the rows join
        at the first step boundary after it is done; with mixed, while rows are running, the first waiting request's
        prompt is computed inside the next decode step (BatchRunner.mixed_fits; otherwise the join is whole). One join
        is in progress at a time."""
        r = self.runner
        if r.joining:
            self._advance_join()
            if r.joining:
                return
        while r.rows < self.max_batch:
            with self._cv:
                self._drop_cancelled_waiting()
                tickets = list(self._waiting)[: self.max_batch - r.rows]
            # a request cancelled since then ends the group (it is dropped from the queue at the next pass)
            tickets = tickets[:next((i for i, t in enumerate(tickets) if t.cancelled), len(tickets))]
            if not tickets:
                break
            seqs = []
            t_join = time.perf_counter()
            for t in tickets:
                t.seq = Sequence(t.prompt_ids, t.params, on_token=self._on_token(t), on_finish=self._on_finish(t))
                seqs.append(t.seq)
            interleave = r.can_interleave()
            try:
                n = r.begin_join(seqs, interleave=interleave)
            except Exception as e:
                self._join_failed(tickets, e)
                raise
            for t in tickets[n:]:
                t.seq = None
            with self._cv:
                for t in tickets[:n]:
                    self._waiting.remove(t)  # FIFO: the first n of the queue
                self._joining = tickets[:n]
            self._join_began = t_join
            if n:
                self._advance_join(whole=not interleave)
                if r.joining:
                    break  # the rest of the join runs between the next decode steps
            if n < len(tickets):  # no room for the next one until running rows finish: the queue keeps its order
                break
        self._update_gauges()

    def _advance_join(self, whole: bool = False) -> None:
        """Run the pending join's next slice (all of it when ``whole`` or when no row is running) and, once it is
        complete, make its requests running ones."""
        r = self.runner
        try:
            r.advance_join(None if whole or not r.rows else JOIN_SLICE_S)
            joined = r.finish_join()
        except Exception as e:
            r.drop_join()  # its requests are the scheduler's again: failed or waiting, never finished by the runner
            tickets, self._joining = self._joining, []
            self._join_failed(tickets, e)
            raise
        if joined:  # counted now: a join that fails sends its requests back to the queue (or answers one with an error)
            with self._cv:
                for t in self._joining:
                    self._running[id(t)] = t
            self.queue_waits.extend((self._join_began, self._join_began - t.t_arrival) for t in self._joining)
            self.queue_waits_total += len(self._joining)
            for t in self._joining:
                if self.metrics is not None:
                    self.metrics.prompt_tokens.inc(len(t.prompt_ids))
                self.totals["prompt_tokens"] += len(t.prompt_ids)
            self._joining = []

    def _join_failed(self, tickets: list[Ticket], e: Exception) -> None:
        """A join failed: the head of its group gets the error and leaves the queue; the others wait again at the
        front in their order. So a join that keeps failing (a prompt the engine cannot prefill, or a group too large
        for memory) shrinks by one request per failure instead of being retried for ever; the caller then fails the
        running rows as after any engine error."""
        head = tickets[0]
        for t in tickets:
            t.seq = None
        with self._cv:
            if head in self._waiting:
                self._waiting.remove(head)
            queued = set(map(id, self._waiting))
            for t in reversed(tickets[1:]):
                if id(t) not in queued:
                    self._waiting.appendleft(t)
        head.error = ApiError(500, f"engine failure while prefilling this request: {type(e).__name__}: {e}",
                              type="server_error")
        self.totals["errors"] += 1
        self._on_finish(head)(None)  # delivers the error as for a running row (metrics, sink)

    def _on_token(self, t: Ticket):
        def on_token(tid, delta):
            now = time.perf_counter()
            seq = t.seq
            if tid is not None:
                if seq.t_first is None:  # this is the first token (t_first is set after this call returns)
                    if self.metrics is not None:
                        self.metrics.ttft.observe(now - t.t_arrival)
                elif self.metrics is not None and seq.t_last is not None:
                    self.metrics.itl.observe(now - seq.t_last)
                if self.metrics is not None:
                    self.metrics.generation_tokens.inc()
                self.totals["generated_tokens"] += 1
            if delta:
                t.sink(("token", delta))
        return on_token

    def _on_finish(self, t: Ticket):
        def on_finish(seq: Sequence):
            with self._cv:
                self._running.pop(id(t), None)
            if t.done:
                return
            t.done = True
            if t.error is not None:
                if self.metrics is not None:
                    self.metrics.requests.labels(t.endpoint, "error").inc()
                t.sink(("error", t.error))
                return
            self.totals["requests"] += 1
            if seq.finish_reason == "cancelled":
                self.totals["cancelled"] += 1
            if self.metrics is not None:
                self.metrics.requests.labels(t.endpoint, seq.finish_reason).inc()
                if seq.t_last is not None:
                    self.metrics.e2e.observe(seq.t_last - t.t_arrival)
            t.sink(("done", seq))
        return on_finish

    def _fail_all(self, err: ApiError) -> None:
        with self._cv:
            tickets = list(self._waiting) + list(self._running.values()) + self._joining
            self._waiting.clear()
            self._running.clear()
            self._joining = []
        for t in tickets:
            if not t.done:
                t.done = True
                t.sink(("error", err))

    def _update_gauges(self) -> None:
        if self.metrics is not None:
            # a joining request counts as running (its prefill is under way), not as waiting; once a mixed join's step
            # ran, its request is one of the runner's rows already
            r = self.runner
            joining = 0 if r is not None and r.join_running else len(self._joining)
            self.metrics.running.set((r.rows if r is not None else 0) + joining)
            self.metrics.waiting.set(len(self._waiting))

    def _refresh_stats(self, force: bool = False) -> None:
        now = time.perf_counter()
        if not force and now - self._stats_t < STATS_EVERY_S:
            return
        self._stats_t = now
        self.stats = self.eng.stats()
        if self.runner is not None:
            self.batch_counters = dict(self.runner.counters)
            self._stats_steps = self.runner.counters["steps"]
