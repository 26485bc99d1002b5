"""``runmap serve``: the OpenAI-compatible server and the local page (runmap.serve)."""
from __future__ import annotations

import argparse

from runmap.cli.options import add_residency_arguments, int_at_least
from runmap.kernels.registry import EXECUTOR_NAMES, executor_help
from runmap.serve import JOIN_MODES

HELP = "serve a pack over an OpenAI-compatible HTTP API (streaming, batching, metrics) with a local page"
DESCRIPTION = """\
Load the engine from --packed once, warm it up (first prefill, a decode step for every batch size and,
on CUDA, every KV-length bucket: Triton compilation and CUDA-graph capture happen here, not in the first
request), and serve on http://HOST:PORT/ (HOST 127.0.0.1 unless --host says otherwise):

  GET  /health                503 while loading and warming up, then 200
  GET  /v1/models             the model (--model-name; default the pack directory's name)
  POST /v1/chat/completions   the pack's chat template; "stream": true gives server-sent events
  POST /v1/completions        a plain prompt (text or token ids)
  GET  /metrics               Prometheus text: requests, tokens, time to first token and inter-token
                              latency histograms, running / waiting requests, expert-cache hits, misses,
                              host->device bytes, the cache contract observations with their status
  GET  /                      the page: chat, what is loaded, live telemetry, IFEval, campaign reports

Concurrent requests share the engine: between decode steps the waiting requests join the running batch
together, prefilled in one pass (up to --max-batch rows and --max-join-tokens prompt tokens) that runs
between the running rows' decode steps (--join-mode); a client that disconnects frees its row at the next
step. Bad requests get an
OpenAI error object with a 4xx status. Nothing is written to the pack; IFEval runs started from the page
write under --ifeval-dir (default results/serve/ifeval, created on the first run).

Examples:
  runmap serve --packed /data/olmoe-pack
  runmap serve --packed /data/olmoe-pack --resident 32 --max-batch 16 --port 8080
  runmap serve --packed /data/olmoe-pack --gpu-budget 6GiB
Stop with Ctrl-C (or SIGTERM): running requests end, a running IFEval run is interrupted (resumable).
Exit status: 0 stopped, 1 bad input (a missing pack, a port in use, an engine that cannot load: one line),
2 usage."""

DEFAULT_IFEVAL_DIR = "results/serve/ifeval"
ENGINE_PROCESS_MODES = ("auto", "on", "off")
DEFAULT_CAMPAIGNS = "results/campaigns"


def _port(text: str) -> int:
    try:
        p = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 0 <= p <= 65535:
        raise argparse.ArgumentTypeError(f"port must be in [0, 65535] (0: any free port), got {p}")
    return p


_positive = int_at_least(1)
_non_negative = int_at_least(0)


def add_arguments(p) -> None:
    p.add_argument("--packed", required=True, metavar="DIR", help="pack directory (runmap pack)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=_port, default=8000, help="port (default 8000; 0: any free port, printed at start)")
    p.add_argument("--executor", default="grouped", choices=EXECUTOR_NAMES,
                   help="W4A16 executor (default grouped). " + executor_help())
    add_residency_arguments(p)
    p.add_argument("--max-batch", type=_positive, default=8, metavar="B", help="rows decoded together (default 8)")
    p.add_argument("--max-join-tokens", type=_non_negative, default=None, metavar="N",
                   help="prompt tokens (rows x longest prompt, padding included) one joint prefill of waiting "
                        "requests may take (default 4096); with --join-mode whole every running row waits for that "
                        "prefill. 0: each request joins alone, with exactly the prefill it gets alone")
    p.add_argument("--join-mode", choices=JOIN_MODES, default=JOIN_MODES[0],
                   help="how waiting requests join running rows: whole (default): the running rows wait for the "
                        "joint prefill at a step boundary; interleaved: the prefill runs a layer at a time between "
                        "the running rows' decode steps, on a CUDA stream of its own, where the decode step allows "
                        "it (full residency with CUDA graphs); concurrent: the prefill's captured pass runs at once "
                        "on a CUDA stream of its own beside the decode steps (same condition, and a pass short "
                        "enough to be captured); mixed: a waiting request's prompt (up to 512 tokens) is computed "
                        "inside the next decode step, one request per step, so the weights are read once for both "
                        "(full residency with CUDA graphs, no --gpu-budget; otherwise, and for a longer prompt, a "
                        "whole join). On the H200 interleaved served fewer tokens per second than whole "
                        "(the engine thread is host-bound), concurrent about as many (32 clients: 0.74 of the "
                        "offline batch against 0.72) and mixed about as many (32 clients: 0.73 against 0.72, 8 "
                        "clients 0.83 against 0.86, inter-token p99 8.6 against 14.6 ms; "
                        "results/serve/load/README.md)")
    p.add_argument("--max-seq-len", type=_positive, default=None, metavar="N",
                   help="context: prompt + completion tokens per request (default min(max_position_embeddings, 4096))")
    p.add_argument("--device", default=None, help="cuda | cpu (default: cuda when available)")
    p.add_argument("--model-name", default=None, metavar="NAME",
                   help="the model id clients send (default: the pack directory's name)")
    p.add_argument("--ifeval-dir", default=DEFAULT_IFEVAL_DIR, metavar="DIR",
                   help=f"where the page's IFEval runs write (default {DEFAULT_IFEVAL_DIR})")
    p.add_argument("--campaigns", action="append", default=None, metavar="DIR",
                   help=f"campaign roots the page lists (repeatable; default {DEFAULT_CAMPAIGNS})")
    p.add_argument("--access-log", action="store_true", help="log every HTTP request (uvicorn's access log)")
    p.add_argument("--engine-process", choices=ENGINE_PROCESS_MODES, default="auto",
                   help="run the engine and its scheduler in a child process, apart from the HTTP event loop: "
                        "auto (default): on when the engine runs on CUDA. In one process the engine thread waits "
                        "for the interpreter lock while the event loop writes a streamed chunk per token per client "
                        "(results/serve/load/README.md)")


def _command(pack, args) -> str:
    """The command line as recorded in IFEval sidecars (what a rerun needs)."""
    import shlex

    parts = ["runmap", "serve", "--packed", str(pack), "--executor", args.executor, "--max-batch", str(args.max_batch)]
    for flag, v in (("--resident", args.resident), ("--max-seq-len", args.max_seq_len), ("--device", args.device),
                    ("--model-name", args.model_name), ("--max-join-tokens", args.max_join_tokens),
                    ("--prefill-chunk", args.prefill_chunk), ("--host-read-spares", args.host_read_spares),
                    ("--two-site-min-batch", args.two_site_min_batch),
                    ("--cache-contract", None if args.cache_contract == "v1" else args.cache_contract),
                    ("--join-mode", None if args.join_mode == JOIN_MODES[0] else args.join_mode),
                    ("--engine-process", None if args.engine_process == "auto" else args.engine_process)):
        if v is not None:
            parts += [flag, str(v)]
    if args.gpu_budget is not None:
        parts += ["--gpu-budget", str(args.gpu_budget)]
    if args.expert_placement != "gpu":
        parts += ["--expert-placement", args.expert_placement]
    if args.cpu_executor != "cpu-native":
        parts += ["--cpu-executor", args.cpu_executor]
    if args.prefetch:
        parts.append("--prefetch")
    return " ".join(shlex.quote(p) for p in parts)


def engine_process_on(mode: str, device: str | None) -> bool:
    """--engine-process: auto is on when the engine will run on CUDA (asked for, or the default device)."""
    if mode != "auto":
        return mode == "on"
    if device is not None:
        return str(device).startswith("cuda")
    import torch

    return torch.cuda.is_available()  # asks the driver without creating a CUDA context in this process


def run(args) -> int:
    import functools
    import signal
    import socket
    import sys
    import threading
    from pathlib import Path

    def fail(msg: str) -> int:
        print(f"runmap serve: {msg}", file=sys.stderr)
        return 1

    from runmap.format.packfile import MANIFEST, PackError, PackReader, is_pack_dir

    pack = Path(args.packed)
    if not is_pack_dir(pack):
        if (pack / MANIFEST).is_file():  # a manifest that is not a pack's: the reader says what is wrong with it
            try:
                PackReader(pack, verify=False).close()
            except PackError as e:
                return fail(str(e))
        return fail(f"{pack}: not a runmap pack (no manifest.json of a pack; make one with `runmap pack`)")
    resident = args.resident
    if args.gpu_budget is not None:
        from runmap.engine.budget import BudgetError, plan_for_pack

        try:  # joining requests are prefilled into the free rows of the engine's own KV cache: no extra row
            plan = plan_for_pack(pack, args.gpu_budget, max_batch=args.max_batch, max_seq_len=args.max_seq_len,
                                 **({} if args.prefill_chunk is None else {"prefill_chunk": args.prefill_chunk}))
        except BudgetError as e:
            return fail(str(e))
        resident = plan.resident
        import torch

        where = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu")).type  # as from_pack
        print(f"runmap serve: {plan.describe(where)}", file=sys.stderr, flush=True)
    try:
        family = socket.getaddrinfo(args.host, args.port, type=socket.SOCK_STREAM)[0][0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((args.host, args.port))
    except OSError as e:
        return fail(f"cannot listen on {args.host}:{args.port}: {e.strerror or e}")
    host, port = sock.getsockname()[:2]

    import uvicorn

    from runmap.engine.engine import Engine
    from runmap.serve.app import Server, create_app

    # under --gpu-budget the engine plans again (the same plan as printed) and caps torch's allocator at it; a
    # partial, so that it pickles for --engine-process
    load = functools.partial(Engine.from_pack, pack, executor=args.executor, device=args.device,
                             max_batch=args.max_batch, max_seq_len=args.max_seq_len,
                             expert_placement=args.expert_placement, cpu_executor=args.cpu_executor,
                             host_read_spares=args.host_read_spares, two_site_min_batch=args.two_site_min_batch,
                             prefetch=args.prefetch, prefill_chunk=args.prefill_chunk,
                             cache_contract=args.cache_contract,
                             warm_up=False,  # the scheduler warms up every shape it serves
                             **({"gpu_budget": args.gpu_budget} if args.gpu_budget is not None
                                else {"resident": resident}))

    failure: list[str] = []
    uv: list = []

    def on_failure(msg: str) -> None:
        failure.append(msg)
        print(f"runmap serve: cannot load the engine: {msg}", file=sys.stderr, flush=True)
        if uv:
            uv[0].should_exit = True

    model_id = args.model_name or pack.resolve().name
    server = Server(load, model_id=model_id, pack_dir=pack, ifeval_dir=args.ifeval_dir,
                    campaign_roots=args.campaigns or [DEFAULT_CAMPAIGNS], command=_command(pack, args),
                    on_failure=on_failure, join_mode=args.join_mode,
                    engine_process=engine_process_on(args.engine_process, args.device),
                    **({} if args.max_join_tokens is None else {"join_tokens": args.max_join_tokens}))
    shown = f"[{host}]" if family == socket.AF_INET6 else host
    url = f"http://{shown}:{port}/"
    class _Uvicorn(uvicorn.Server):
        """uvicorn re-raises a captured SIGTERM after its shutdown, which would end the process before the
        engine is closed and before the exit status is returned: remember the signal instead, and start
        draining (requests end with an error event, an IFEval run is interrupted) at once."""

        stop_signal = None

        def handle_exit(self, sig, frame):
            if self.stop_signal is None:
                self.stop_signal = sig
                threading.Thread(target=server.shutdown, name="runmap-drain", daemon=True).start()
            if self.should_exit and sig == signal.SIGINT:
                self.force_exit = True
            self.should_exit = True

    config = uvicorn.Config(create_app(server), log_level="warning", access_log=args.access_log,
                            timeout_graceful_shutdown=5)
    uv.append(_Uvicorn(config))
    print(f"runmap serve: listening on {url} (loading {pack})", file=sys.stderr, flush=True)

    def announce():
        while server.phase in ("loading", "warming"):
            if uv[0].should_exit:
                return
            threading.Event().wait(0.1)
        if server.phase == "ready":
            i = server.info
            print(f"runmap serve: ready: {model_id} ({i['arch']}, {i['executor']}, {i['regime']} residency "
                  f"{i['resident']}/{i['num_experts']} experts per layer, {i['device']}, max batch {i['max_batch']}, "
                  f"context {i['max_seq_len']}); load {i['load_s']:.1f} s, warm-up {server.scheduler.warmup_s:.1f} s; "
                  f"{url}", file=sys.stderr, flush=True)
        elif server.scheduler is not None and server.scheduler.failed:
            on_failure(server.scheduler.failed)

    server.start()
    threading.Thread(target=announce, name="runmap-announce", daemon=True).start()
    try:
        uv[0].run(sockets=[sock])
    finally:
        server.shutdown()
    if failure:
        return 1
    print("runmap serve: stopped", file=sys.stderr)
    return 130 if uv[0].stop_signal == signal.SIGINT else 0
