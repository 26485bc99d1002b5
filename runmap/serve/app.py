"""The HTTP application (FastAPI on uvicorn): the OpenAI endpoints, health, metrics, and the local page.

``Server`` owns what the application serves: it loads the engine on a thread of its own (so /health can
answer 503 while the pack loads and the engine warms up), then hands the engine to the scheduler's
engine thread. ``create_app(server)`` builds the FastAPI application over it.

Endpoints::

    GET  /health                 200 {"status": "ok"} once warm; 503 {"status": "loading"|"warming"|"failed"}
    GET  /metrics                Prometheus text format (runmap.serve.metrics)
    GET  /v1/models              the one model (--model-name, default the pack directory's name)
    POST /v1/chat/completions    chat template of the pack; stream: true -> server-sent events
    POST /v1/completions         plain prompt (text or token ids); stream: true -> server-sent events
    GET  /                       the page (runmap/serve/static/); its JSON API is under /api/

Bodies are parsed here rather than by FastAPI's body binding so that every bad request, malformed JSON
included, gets an OpenAI error object with status 400 (404 for an unknown model, 503 before the engine is
warm) instead of FastAPI's 422 shape; errors never end a process or a stream without a message.
"""
from __future__ import annotations

import asyncio
import collections
import json
import threading
import time
from pathlib import Path
from typing import Callable

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from runmap.serve import JOIN_MODES
from runmap.serve import protocol as P
from runmap.serve.batching import JOIN_TOKENS, SamplingParams
from runmap.serve.campaigns import Campaigns
from runmap.serve.engine_process import EngineProcess
from runmap.serve.ifeval_job import IFEvalRuns
from runmap.serve.metrics import CONTENT_TYPE, ServeMetrics
from runmap.serve.scheduler import Scheduler, Ticket

STATIC_DIR = Path(__file__).resolve().parent / "static"
DISCONNECT_POLL_S = 0.5


class _Outbox:
    """Events from the engine thread to the event loop's per-request queues, with one loop wake-up per batch.

    Why: a decode step of B rows makes B token events; a ``call_soon_threadsafe`` each wakes the loop B times (a
    write to its self-pipe each) while the engine thread wants the GIL back for the next step. Here the engine
    thread appends to a shared deque and schedules a drain only when none is pending; the drain clears the flag
    before it empties the deque, so an event appended at any moment is either taken by a running drain or
    schedules the next one (deque appends and pops are atomic)."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.items: collections.deque = collections.deque()
        self.pending = False

    def put(self, q: asyncio.Queue, ev) -> None:
        self.items.append((q, ev))
        if not self.pending:
            self.pending = True
            try:
                self.loop.call_soon_threadsafe(self._drain)
            except RuntimeError:  # the event loop is closed (shutdown): nobody is listening any more
                self.pending = False
                self.items.clear()

    def _drain(self) -> None:
        self.pending = False
        while self.items:
            q, ev = self.items.popleft()
            q.put_nowait(ev)


def describe(eng, model_id: str) -> dict:
    """What is loaded, for the page and the metrics' info labels."""
    st = eng.stats()
    cfg = eng.cfg
    return {
        "model": model_id, "arch": cfg.arch, "pack": str(eng.pack_dir), "pack_identity": eng.pack_identity,
        "executor": eng.executor, "expert_format": eng.expert_format, "regime": eng.regime,
        "resident": eng.resident, "num_experts": cfg.num_experts, "top_k": cfg.top_k, "num_layers": cfg.num_layers,
        "resident_per_layer": [eng.resident] * cfg.num_layers, "device": str(eng.device),
        "cuda_graphs": eng.use_graphs, "fused": sorted(eng.model.fused), "policy": st.policy,
        "max_batch": eng.max_batch, "max_seq_len": eng.max_seq_len, "load_s": eng.load_s,
        "memory": {"nonrouted_bytes": st.nonrouted_bytes, "kv_cache_bytes": st.kv_cache_bytes,
                   "resident_bytes": st.resident_bytes, "spare_bytes": st.spare_bytes,
                   "staging_bytes": st.staging_bytes},
    }


class Server:
    """The state behind the application. ``load_engine()`` builds the engine (on the loader thread)."""

    def __init__(self, load_engine: Callable, *, model_id: str, pack_dir, ifeval_dir, campaign_roots=(),
                 command: str = "runmap serve", pipelined=None, on_failure: Callable[[str], None] | None = None,
                 join_tokens: int = JOIN_TOKENS, join_mode: str = JOIN_MODES[0], engine_process: bool = False):
        if join_mode not in JOIN_MODES:
            raise ValueError(f"join_mode must be one of {JOIN_MODES}, got {join_mode!r}")
        self.join_mode = join_mode
        self.load_engine, self.model_id, self.pack_dir = load_engine, model_id, Path(pack_dir)
        self.command, self.pipelined, self.on_failure = command, pipelined, on_failure
        self.join_tokens = join_tokens
        # the engine and its scheduler in a child process (runmap.serve.engine_process; load_engine must then
        # pickle, e.g. a functools.partial of Engine.from_pack); self.engine is then an EngineView
        self.engine_process = engine_process
        self.metrics = ServeMetrics()
        self.tok_lock = threading.Lock()  # one tokenizer, used by the HTTP threads and the engine thread
        self.engine = None
        self.scheduler: Scheduler | EngineProcess | None = None
        self.load_error: str | None = None
        self.info: dict = {}
        self.started = time.time()
        self.ifeval = IFEvalRuns(Path(ifeval_dir), pack_dir=self.pack_dir, model_name=model_id,
                                 scheduler=lambda: self.scheduler, encode=self.encode_prompt,
                                 telemetry=self.telemetry_doc, info=lambda: self.info, command=command)
        self.campaigns = Campaigns(campaign_roots)
        self._loader: threading.Thread | None = None
        self._shutdown_lock = threading.Lock()
        self._down = False

    # ---- lifecycle -------------------------------------------------------------------------------------
    def start(self) -> None:
        self._loader = threading.Thread(target=self._load, name="runmap-load", daemon=True)
        self._loader.start()

    def _load(self) -> None:
        if self.engine_process:
            return self._load_process()
        try:
            eng = self.load_engine()
        except Exception as e:  # noqa: BLE001 - bad pack, missing device, ...: one line, the server exits
            return self._load_failed(f"{type(e).__name__}: {e}")
        with self._shutdown_lock:
            if self._down:  # stopped while the pack was loading
                eng.close()
                return
            self.engine = eng
        self.info = describe(eng, self.model_id)
        sched = Scheduler(eng, metrics=self.metrics, info=self.info, decode=self._decode, **self._scheduler_kwargs())
        self.metrics.source = sched
        self.scheduler = sched
        sched.start()

    def _scheduler_kwargs(self) -> dict:
        return {"pipelined": self.pipelined, "join_tokens": self.join_tokens,
                "interleave_joins": self.join_mode == "interleaved",
                "concurrent_joins": self.join_mode == "concurrent",
                "mixed_joins": self.join_mode == "mixed"}

    def _load_failed(self, message: str) -> None:
        self.load_error = message
        if self.on_failure is not None:
            self.on_failure(message)

    def _load_process(self) -> None:
        proc = EngineProcess(self.load_engine, model_id=self.model_id, metrics=self.metrics,
                             scheduler_kwargs=self._scheduler_kwargs())
        try:
            view = proc.start()
        except RuntimeError as e:  # the child's one line (bad pack, missing device, ...): the server exits
            return self._load_failed(str(e))
        with self._shutdown_lock:
            if self._down:  # stopped while the pack was loading
                proc.stop()
                return
            self.engine = view
            self.info = view.info
            self.metrics.source = proc
            self.scheduler = proc

    def wait_loaded(self, timeout: float | None = None) -> None:
        if self._loader is not None:
            self._loader.join(timeout)

    def shutdown(self) -> None:
        """Interrupt an IFEval run, end every request (an error event: the server is shutting down), close
        the engine. Idempotent; safe from any thread."""
        with self._shutdown_lock:
            if self._down:
                return
            self._down = True
            self.ifeval.stop()
            self.ifeval.join(30)
            if self.scheduler is not None:
                self.scheduler.stop()
            if self.engine is not None and not (self.scheduler is not None and self.scheduler.alive):
                self.engine.close()  # not under a step still running (the process is ending anyway)
            self.campaigns.close()

    @property
    def phase(self) -> str:
        if self._down:
            return "stopping"
        if self.load_error is not None or (self.scheduler is not None and self.scheduler.failed):
            return "failed"
        if self.scheduler is None:
            return "loading"
        return "ready" if self.scheduler.ready else "warming"

    # ---- tokenizer (under one lock: HF tokenizers may refuse concurrent use) ----------------------------
    def _decode(self, ids) -> str:
        with self.tok_lock:
            return self.engine.tokenizer.decode(ids)

    def encode_prompt(self, prompt, chat: bool) -> list[int]:
        """Text (chat=True: one user message, or a list of {role, content}) or token ids -> ids; ApiError 400."""
        from runmap.engine.generation import GenerationError
        from runmap.engine.tokenization import TokenizerError

        eng = self.engine
        try:
            with self.tok_lock:
                if chat:
                    return eng.tokenizer.encode_chat(prompt)
                return eng.encode(prompt)
        except (TokenizerError, GenerationError) as e:
            raise P.ApiError(400, str(e), param="messages" if chat else "prompt") from None
        except Exception as e:  # noqa: BLE001 - the chat template (Jinja) rejecting the messages
            raise P.ApiError(400, f"the model's chat template rejected the messages: {type(e).__name__}: {e}",
                             param="messages") from None

    def telemetry_doc(self) -> dict | None:
        """The engine's telemetry document (schemas/telemetry.schema.json), built on the engine thread."""
        sched = self.scheduler
        return None if sched is None else sched.telemetry()

    def live(self) -> dict:
        """The page's live telemetry."""
        sched = self.scheduler
        out = {"phase": self.phase, "error": self.load_error or (sched.failed if sched else None)}
        if sched is None:
            return out
        st = sched.stats
        out.update(tok_s=round(sched.tok_per_s(), 2), running=sched.running, waiting=sched.waiting,
                   max_rows_seen=sched.max_rows_seen, totals=dict(sched.totals), batch=dict(sched.batch_counters),
                   warmup_s=sched.warmup_s)
        if st is not None:
            out.update(_stats_dict(st))
        if isinstance(sched, EngineProcess):
            out.update(sched.memory or {})
        elif self.engine is not None and self.engine.device.type == "cuda":
            import torch

            out["cuda_allocated_bytes"] = torch.cuda.memory_allocated(self.engine.device)
            out["cuda_reserved_bytes"] = torch.cuda.memory_reserved(self.engine.device)
        return out


def _stats_dict(st) -> dict:
    return {"hits": st.hits, "misses": st.misses, "hit_rate": st.hit_rate, "evictions": st.evictions,
            "bytes_h2d": st.bytes_h2d, "h2d_seconds": st.h2d_seconds, "observations": dict(st.observations)}


# ---- the application ------------------------------------------------------------------------------------

def _sse(obj) -> bytes:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n".encode()


_CONTENT_MARK = "\u0000runmap-content\u0000"  # never a model's text: a NUL on each side


def _content_sse(make: Callable[[str], dict]) -> Callable[[str], bytes]:
    """text -> the SSE bytes of ``_sse(make(text))``, with ``make`` called once: its output serialized around a
    sentinel text, then each chunk is the two halves around the JSON-encoded text (same bytes, no model per chunk)."""
    whole = _sse(make(_CONTENT_MARK)).decode()
    head, tail = whole.split(json.dumps(_CONTENT_MARK, ensure_ascii=False), 1)
    head_b, tail_b = head.encode(), tail.encode()

    def content(text: str) -> bytes:
        return head_b + json.dumps(text, ensure_ascii=False).encode() + tail_b
    return content


async def _json_body(request: Request) -> dict:
    raw = await request.body()
    try:
        obj = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise P.ApiError(400, f"We could not parse the JSON body of your request ({e}). The body must be one JSON "
                              "object.", code="invalid_json") from None
    if not isinstance(obj, dict):
        raise P.ApiError(400, f"the request body must be a JSON object, got {type(obj).__name__}", code="invalid_json")
    return obj


def create_app(server: Server) -> FastAPI:
    app = FastAPI(title="runmap serve", docs_url=None, redoc_url=None, openapi_url=None)
    outboxes: dict = {}  # event loop -> its _Outbox (one loop in practice)

    @app.exception_handler(P.ApiError)
    async def _api_error(request: Request, e: P.ApiError):
        endpoint = request.url.path
        server.metrics.errors.labels(endpoint, str(e.status)).inc()
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        kind = "not_found" if e.status_code == 404 else None
        msg = f"no route {request.method} {request.url.path}" if e.status_code in (404, 405) else str(e.detail)
        return JSONResponse(P.ApiError(e.status_code, msg, code=kind).body(), status_code=e.status_code)

    def ready_scheduler() -> Scheduler:
        sched = server.scheduler
        if sched is None or not sched.ready:
            raise P.ApiError(503, f"the engine is {server.phase}; retry when /health says ok", type="server_error",
                             code="not_ready")
        return sched

    def check_model(name: str) -> None:
        if name != server.model_id:
            raise P.ApiError(404, f"The model '{name}' does not exist (this server serves '{server.model_id}').",
                             param="model", code="model_not_found")

    @app.get("/health")
    async def health():
        phase = server.phase
        body = {"status": "ok" if phase == "ready" else phase}
        if phase == "failed":
            body["error"] = server.load_error or server.scheduler.failed
        return JSONResponse(body, status_code=200 if phase == "ready" else 503)

    @app.get("/metrics")
    async def metrics():
        return Response(server.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models():
        card = P.ModelCard(id=server.model_id, created=int(server.started))
        return P.ModelList(data=[card]).model_dump()

    async def _submit(request: Request, endpoint: str, prompt_ids: list[int], req, max_tokens: int | None):
        sched = ready_scheduler()
        if max_tokens is None:  # the API's default: whatever the context leaves after the prompt
            max_tokens = max(sched.max_seq_len - len(prompt_ids) + 1, 1)
        temperature, top_p = req.sampling()
        params = SamplingParams(max_new_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=req.seed,
                                stop=req.stop_list())
        q: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        outbox = outboxes.get(loop) or outboxes.setdefault(loop, _Outbox(loop))

        def sink(ev):
            outbox.put(q, ev)

        ticket = sched.submit(Ticket(prompt_ids, params, sink, endpoint=endpoint))
        return sched, ticket, q

    async def _next(request: Request, q: asyncio.Queue):
        """The next event, or None when the client has gone away."""
        if not q.empty():  # already there: no timer (wait_for's cost per token adds up at thousands of tokens/s)
            return q.get_nowait()
        while True:
            try:
                return await asyncio.wait_for(q.get(), timeout=DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    return None

    async def _generate(request: Request, endpoint: str, prompt_ids: list[int], req, max_tokens, chat: bool):
        sched, ticket, q = await _submit(request, endpoint, prompt_ids, req, max_tokens)
        rid = P.new_id("chatcmpl" if chat else "cmpl")
        created = P.now()
        model = server.model_id
        n_prompt = len(prompt_ids)

        def usage(seq) -> dict:
            n = len(seq.token_ids)
            return P.Usage(prompt_tokens=n_prompt, completion_tokens=n, total_tokens=n_prompt + n).model_dump()

        def chunk(delta: dict | None = None, text: str | None = None, finish=None, use=None, empty=False) -> dict:
            if chat:
                choices = [] if empty else [P.ChatChunkChoice(delta=P.Delta(**(delta or {})), finish_reason=finish)]
                d = P.ChatCompletionChunk(id=rid, created=created, model=model, choices=choices).model_dump()
                for c in d["choices"]:
                    c["delta"] = {k: v for k, v in c["delta"].items() if v is not None}
            else:
                choices = [] if empty else [P.CompletionChoice(text=text or "", finish_reason=finish)]
                d = P.Completion(id=rid, created=created, model=model, choices=choices).model_dump()
            if req.include_usage:
                d["usage"] = use
            else:
                d.pop("usage", None)
            return d

        if req.stream:
            # Content chunks differ only in their text: the typed chunk is built and serialized once, with a
            # sentinel for the text, and each token's chunk is the two halves around its JSON-encoded text (a
            # pydantic model, a dump and a json.dumps per token were most of the event loop's time per chunk, and
            # that thread shares the GIL with the engine's)
            content = _content_sse(lambda text: chunk(delta={"content": text}) if chat else chunk(text=text))

            async def events():
                done = False
                try:
                    if chat:
                        yield _sse(chunk(delta={"role": "assistant", "content": ""}))
                    held = None  # an event taken from the queue while gathering tokens, handled next
                    while True:
                        ev, held = (held, None) if held is not None else (await _next(request, q), None)
                        if ev is None:
                            return
                        kind, payload = ev
                        if kind == "token":
                            # tokens that are already queued (the client or the loop fell behind the engine) go
                            # out as one content delta: fewer chunks to build and write, the same text
                            parts = [payload]
                            while not q.empty():
                                nxt = q.get_nowait()
                                if nxt[0] != "token":
                                    held = nxt
                                    break
                                parts.append(nxt[1])
                            yield content("".join(parts))
                        elif kind == "done":
                            done = True
                            yield _sse(chunk(delta={}, finish=P.finish_reason(payload.finish_reason)) if chat
                                       else chunk(text="", finish=P.finish_reason(payload.finish_reason)))
                            if req.include_usage:
                                yield _sse(chunk(empty=True, use=usage(payload)))
                            yield b"data: [DONE]\n\n"
                            return
                        else:
                            done = True
                            yield _sse(payload.body())
                            yield b"data: [DONE]\n\n"
                            return
                finally:
                    if not done:  # the client went away (or the response was torn down): free the row
                        sched.cancel(ticket)

            return StreamingResponse(events(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

        parts = []
        try:
            while True:
                ev = await _next(request, q)
                if ev is None:
                    sched.cancel(ticket)
                    return Response(status_code=499)
                kind, payload = ev
                if kind == "token":
                    parts.append(payload)
                elif kind == "error":
                    raise payload
                else:
                    seq = payload
                    break
        except asyncio.CancelledError:
            sched.cancel(ticket)
            raise
        fr = P.finish_reason(seq.finish_reason)
        text = "".join(parts)
        if chat:
            return P.ChatCompletion(id=rid, created=created, model=model, usage=P.Usage(**usage(seq)), choices=[
                P.ChatChoice(message=P.AssistantMessage(content=text), finish_reason=fr)]).model_dump()
        return P.Completion(id=rid, created=created, model=model, usage=P.Usage(**usage(seq)), choices=[
            P.CompletionChoice(text=text, finish_reason=fr)]).model_dump()

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        obj = await _json_body(request)
        try:
            req = P.ChatCompletionRequest.model_validate(obj)
        except ValidationError as e:
            raise P.validation_error(e) from None
        check_model(req.model)
        ready_scheduler()
        messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in req.messages]
        ids = await run_in_threadpool(server.encode_prompt, messages, True)
        max_tokens = req.requested_max_tokens()
        server.scheduler.check(len(ids), max_tokens if max_tokens is not None else 1)
        return await _generate(request, "chat", ids, req, max_tokens, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        obj = await _json_body(request)
        try:
            req = P.CompletionRequest.model_validate(obj)
        except ValidationError as e:
            raise P.validation_error(e) from None
        check_model(req.model)
        ready_scheduler()
        ids = await run_in_threadpool(server.encode_prompt, req.prompt_value(), False)
        server.scheduler.check(len(ids), req.max_tokens if req.max_tokens is not None else 1)
        return await _generate(request, "completion", ids, req, req.max_tokens, chat=False)

    # ---- the page's API ----------------------------------------------------------------------------------
    @app.get("/api/info")
    async def api_info():
        return {"phase": server.phase, "error": server.load_error, "command": server.command, **server.info,
                "warmup_s": server.scheduler.warmup_s if server.scheduler else None}

    @app.get("/api/telemetry")
    async def api_telemetry():
        return server.live()

    @app.get("/api/ifeval")
    async def ifeval_status():
        return {"job": server.ifeval.status(), "runs": server.ifeval.runs(), "dir": str(server.ifeval.root)}

    @app.post("/api/ifeval/start")
    async def ifeval_start(request: Request):
        obj = await _json_body(request)
        unknown = set(obj) - {"limit", "max_new_tokens", "batch_size", "name"}
        if unknown:
            raise P.ApiError(400, f"Unrecognized request argument supplied: {sorted(unknown)[0]}")
        try:
            limit = None if obj.get("limit") in (None, "") else int(obj["limit"])  # absent: all 541
            max_new = int(obj.get("max_new_tokens", 1280))
            batch = None if obj.get("batch_size") in (None, "") else int(obj["batch_size"])
        except (TypeError, ValueError):
            raise P.ApiError(400, "limit, max_new_tokens and batch_size must be integers") from None
        name = obj.get("name") or None
        return await run_in_threadpool(lambda: server.ifeval.start(limit=limit, max_new_tokens=max_new,
                                                                   batch_size=batch, name=name))

    @app.post("/api/ifeval/stop")
    async def ifeval_stop():
        return server.ifeval.stop()

    @app.get("/api/campaigns")
    async def campaigns():
        return {"roots": [str(r) for r in server.campaigns.roots], "campaigns": server.campaigns.list()}

    @app.get("/api/campaigns/{name}")
    async def campaign(name: str):
        return await run_in_threadpool(server.campaigns.report, name)

    @app.get("/api/campaigns/{name}/plots/{file}")
    async def campaign_plot(name: str, file: str):
        return FileResponse(server.campaigns.plot(name, file), media_type="image/png")

    @app.get("/")
    async def index():
        return FileResponse(STATIC_DIR / "index.html", media_type="text/html")

    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")
    return app
