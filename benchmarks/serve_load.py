"""Load benchmark of `runmap serve` (issue 17, item 6): concurrent streaming clients against the real server,
compared in the same run with the engine's offline batch throughput at the same batch size.

Run from the repository root (PYTHONPATH=. where the package is not installed):

    PYTHONPATH=. python3 benchmarks/serve_load.py --packed PACK --out results/serve/load/NAME.json [--resident N]
        [--clients 1,8,32,64] [--duration-s 60] [--max-tokens 128] [--plot FILE.png]

See --help (DESCRIPTION below) for what is measured and how.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import time
from pathlib import Path

from runmap.cli.options import int_at_least
from runmap.cli.serve import ENGINE_PROCESS_MODES, engine_process_on
from runmap.serve import JOIN_MODES

REPO = Path(__file__).resolve().parent.parent

RECORD_VERSION = 1
DEFAULT_PROMPTS = REPO / "data" / "ifeval" / "input_data.jsonl"
TARGET_RATIO, TARGET_CLIENTS = 0.8, (8, 32)  # issue 17 item 6: >= 0.8 of offline at 8 and 32 clients
ERROR_SAMPLES = 5

DESCRIPTION = f"""\
Start `runmap serve`'s server in this process (FastAPI on uvicorn, 127.0.0.1, a free port) over --packed with
the given residency, wait until /health says ok (the engine is loaded and warm), send one request alone (its
time to first token and duration are recorded apart from the windows), then for each client count of --clients:

  1. run that many concurrent streaming clients (the official openai client, AsyncOpenAI, spread over
     --client-procs worker processes so that parsing the streams does not compete with the server for this
     process's GIL) for --duration-s seconds. Each client loops: one request with the next prompt of a fixed
     prompt set (the first --num-prompts prompts of --prompts, the IFEval prompts by default, in an order drawn
     with --seed, of at most --max-prompt-tokens tokens that fit --max-seq-len with --max-tokens; client c
     starts at prompt c), max_tokens --max-tokens, temperature 0, stream with include_usage. No request is
     started after the window; those running at its end finish (bounded by max_tokens).
  2. measure: generated tok/s over the window (the server's own token counter read at the window's start and
     end; the clients' count, from the usage chunks, is kept beside it), p50/p99 time to first token (request
     sent -> first content chunk), p50/p99 inter-token latency (between content chunks of a request), requests
     completed in the window, errors, mean running / waiting rows of the scheduler, each client's turnaround
     between two requests (its stream ended -> its next request sent: a closed-loop client holds no row then),
     and the CPU seconds of this process (the HTTP side), of the engine's child process and of the clients;
  3. once the server is idle, time the engine's own batched decode at batch min(clients, --max-batch) on the
     same engine, between scheduler steps: Engine.run on the first prompts of the set, max_new_tokens
     --max-tokens, EOS ignored (every row decodes), --offline-warmup untimed then --offline-repeats timed
     runs; decode tok/s as `runmap bench` reports it (GenerationRun.decode_tok_s, median of the repeats).
     ratio_to_offline = served tok/s / offline decode tok/s (target: >= {TARGET_RATIO} at {TARGET_CLIENTS[0]} and
     {TARGET_CLIENTS[1]} clients).

The record (schemas/serve-load.schema.json) names the machine, the software, the pack, the residency, the
workload and this command; it is written atomically to --out after every client count ("complete": false until
the last one, so a run stopped by a time limit keeps what it measured). At the end the first request is sent
again alone: the record says whether its greedy answer is unchanged after the offline runs on the served engine.
A short table is printed; --plot also writes a PNG of tok/s and latency against clients.

Bounds: every window lasts --duration-s (each client also stops after --max-requests requests), every request
has a timeout, the server must be ready within --ready-timeout-s, an offline measurement within
--offline-timeout-s. Exit status: 0 record written (even when a target is missed), 1 bad input or a failure
(one line), 2 usage, 130 interrupted (SIGINT; the record keeps the client counts measured).

Examples:
  PYTHONPATH=. python3 benchmarks/serve_load.py --packed /data/olmoe-pack --out results/serve/load/olmoe-full.json
  PYTHONPATH=. python3 benchmarks/serve_load.py --packed /data/olmoe-pack --resident 30 --clients 8 --duration-s 30 \\
      --out results/serve/load/olmoe-r30.json"""


class BenchFailure(Exception):
    """A failure the benchmark reports in one line (exit status 1)."""


# ---- arguments ---------------------------------------------------------------------------------------------

_positive_int, _nonneg_int = int_at_least(1), int_at_least(0)


def _seconds(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not math.isfinite(v) or v <= 0:
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds > 0, got {text!r}")
    return v


def _client_counts(text: str) -> list[int]:
    try:
        counts = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated client counts like 1,8,32, got {text!r}") from None
    if not counts or any(c < 1 for c in counts):
        raise argparse.ArgumentTypeError(f"client counts must be integers >= 1, got {text!r}")
    if len(set(counts)) != len(counts):
        raise argparse.ArgumentTypeError(f"client counts repeat: {text!r}")
    return counts


def build_parser() -> argparse.ArgumentParser:
    from runmap.cli.options import add_residency_arguments

    p = argparse.ArgumentParser(prog="serve_load.py", description=DESCRIPTION,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--packed", required=True, metavar="DIR", help="pack directory (runmap pack)")
    p.add_argument("--out", required=True, metavar="FILE", help="the JSON record to write (e.g. results/serve/load/X.json)")
    p.add_argument("--executor", default="grouped", help="W4A16 executor of the engine (default grouped)")
    add_residency_arguments(p)
    p.add_argument("--device", default=None, help="cuda | cpu (default: cuda when available)")
    p.add_argument("--join-mode", choices=JOIN_MODES, default=JOIN_MODES[0],
                   help=f"the server's --join-mode (default {JOIN_MODES[0]})")
    p.add_argument("--engine-process", choices=ENGINE_PROCESS_MODES, default="auto",
                   help="the server's --engine-process (default auto: the engine in a child process on CUDA)")
    p.add_argument("--clients", type=_client_counts, default=[1, 8, 32, 64], metavar="N,N,...",
                   help="concurrent client counts, one window each (default 1,8,32,64)")
    p.add_argument("--duration-s", type=_seconds, default=60.0, metavar="S", help="window per client count (default 60)")
    p.add_argument("--max-batch", type=_positive_int, default=None, metavar="B",
                   help="the server's --max-batch (default: the largest client count)")
    p.add_argument("--max-seq-len", type=_positive_int, default=1024, metavar="N",
                   help="the server's context (default 1024: an IFEval prompt and --max-tokens fit; fewer KV-length "
                        "buckets to capture at warm-up than the server's default)")
    p.add_argument("--max-tokens", type=_positive_int, default=128, metavar="N", help="max_tokens of every request (default 128)")
    p.add_argument("--endpoint", choices=["chat", "completions"], default="chat",
                   help="chat: /v1/chat/completions with the pack's chat template (default); completions: /v1/completions")
    p.add_argument("--prompts", default=str(DEFAULT_PROMPTS), metavar="JSONL",
                   help="prompt source: JSONL with a 'prompt' field per line (default: the IFEval prompts)")
    p.add_argument("--max-prompt-tokens", type=_positive_int, default=512, metavar="N",
                   help="leave out prompts longer than this (default 512): rows of a running batch share KV slots, so "
                        "a few very long prompts would make requests wait for room rather than measure the batch")
    p.add_argument("--num-prompts", type=_positive_int, default=64, metavar="N", help="prompts drawn from --prompts (default 64)")
    p.add_argument("--seed", type=_nonneg_int, default=0, help="seed of the prompt draw (default 0)")
    p.add_argument("--offline-warmup", type=_nonneg_int, default=1, metavar="N", help="untimed offline runs per batch (default 1)")
    p.add_argument("--offline-repeats", type=_positive_int, default=3, metavar="N", help="timed offline runs per batch (default 3)")
    p.add_argument("--client-procs", type=_positive_int, default=4, metavar="N",
                   help="worker processes the clients are spread over (default 4; at most one per client)")
    p.add_argument("--max-requests", type=_positive_int, default=100_000, metavar="N",
                   help="requests per client and window at most (default 100000: the window ends first)")
    p.add_argument("--request-timeout-s", type=_seconds, default=600.0, metavar="S", help="per request (default 600)")
    p.add_argument("--ready-timeout-s", type=_seconds, default=900.0, metavar="S",
                   help="loading + warm-up of the server at most (default 900)")
    p.add_argument("--offline-timeout-s", type=_seconds, default=600.0, metavar="S",
                   help="one offline measurement at most (default 600)")
    p.add_argument("--plot", default=None, metavar="PNG", help="also plot tok/s and latency against clients (matplotlib)")
    p.add_argument("--label", default=None, help="a free-text label stored in the record (e.g. the campaign name)")
    return p


# ---- prompts -----------------------------------------------------------------------------------------------

def load_prompts(path: Path, n: int, seed: int) -> list[str]:
    """Every prompt of a JSONL file of {"prompt": ...} lines in a seeded order (the set is its first prompts
    that fit the context, chosen once the tokenizer is loaded: select_prompts); at least n of them."""
    import random

    try:
        lines = [ln for ln in path.read_text(encoding="utf-8").splitlines() if ln.strip()]
    except OSError as e:
        raise BenchFailure(f"--prompts {path}: cannot read: {e.strerror or e}") from None
    prompts = []
    for i, ln in enumerate(lines, 1):
        try:
            doc = json.loads(ln)
        except json.JSONDecodeError as e:
            raise BenchFailure(f"--prompts {path}: line {i}: not JSON ({e.msg})") from None
        if not isinstance(doc, dict) or not isinstance(doc.get("prompt"), str) or not doc["prompt"]:
            raise BenchFailure(f"--prompts {path}: line {i}: no non-empty string field 'prompt'")
        prompts.append(doc["prompt"])
    if len(prompts) < n:
        raise BenchFailure(f"--num-prompts {n}: {path} has only {len(prompts)} prompts")
    random.Random(seed).shuffle(prompts)
    return prompts


def select_prompts(srv, ordered: list[str], n: int, *, chat: bool, max_tokens: int, max_seq_len: int,
                   max_prompt_tokens: int):
    """The first n prompts (in the seeded order) of at most max_prompt_tokens tokens whose tokens and max_tokens
    fit the context, as the server counts them (a longer one would be refused with a 400 every time a client
    sends it); their token counts; how many were passed over."""
    chosen, lengths, skipped = [], [], 0
    for p in ordered:
        k = len(srv.server.encode_prompt(p, chat))
        if k > max_prompt_tokens or k + max_tokens - 1 > max_seq_len:
            skipped += 1
            continue
        chosen.append(p)
        lengths.append(k)
        if len(chosen) == n:
            return chosen, lengths, skipped
    raise BenchFailure(f"only {len(chosen)} of the prompts have at most --max-prompt-tokens {max_prompt_tokens} tokens and "
                       f"fit --max-seq-len {max_seq_len} with --max-tokens {max_tokens}; --num-prompts asks for {n}")


# ---- the clients (worker processes) ------------------------------------------------------------------------

async def _one_client(client, cid: int, job: dict, out: list) -> None:
    prompts, t_end = job["prompts"], job["t_end"]
    k = 0
    while time.monotonic() < t_end and k < job["max_requests"]:
        idx = (cid + k * job["clients"]) % len(prompts)  # clients walk the set in interleaved, fixed order
        k += 1
        rec = {"client": cid, "prompt": idx, "t_send": time.monotonic(), "chunks": [], "tokens": None,
               "finish": None, "error": None}
        try:
            if job["endpoint"] == "chat":
                stream = await client.chat.completions.create(
                    model=job["model"], messages=[{"role": "user", "content": prompts[idx]}],
                    max_tokens=job["max_tokens"], temperature=0, stream=True, stream_options={"include_usage": True})
            else:
                stream = await client.completions.create(
                    model=job["model"], prompt=prompts[idx], max_tokens=job["max_tokens"], temperature=0,
                    stream=True, stream_options={"include_usage": True})
            async for ch in stream:
                now = time.monotonic()
                if ch.usage is not None:
                    rec["tokens"] = ch.usage.completion_tokens
                if ch.choices:
                    c = ch.choices[0]
                    text = c.delta.content if job["endpoint"] == "chat" else c.text
                    if text:
                        rec["chunks"].append(now)
                        if job.get("keep_text"):
                            rec["text"] = rec.get("text", "") + text
                    if c.finish_reason:
                        rec["finish"] = c.finish_reason
            if rec["tokens"] is None:
                rec["error"] = "the stream ended without a usage chunk"
        except Exception as e:  # noqa: BLE001 - counted and sampled in the record, the client goes on
            rec["error"] = f"{type(e).__name__}: {e}"[:300]
        rec["t_done"] = time.monotonic()
        out.append(rec)
        if rec["error"] is not None:
            await asyncio.sleep(0.05)  # a refused request must not turn into a busy loop


async def _run_clients(job: dict) -> list:
    from openai import AsyncOpenAI

    out: list = []
    # the client's own HTTP transport and connection pool, as a user's program has them (its default pool is far
    # above the clients of one worker); no retries: a refused request counts as an error
    async with AsyncOpenAI(base_url=job["url"] + "v1", api_key="none", max_retries=0, timeout=job["timeout_s"]) as client:
        delay = job["t_start"] - time.monotonic()
        if delay > 0:  # every worker starts its clients at the same instant (CLOCK_MONOTONIC is system-wide)
            await asyncio.sleep(delay)
        await asyncio.gather(*(_one_client(client, cid, job, out) for cid in job["client_ids"]))
    return out


def client_worker(job: dict) -> list:
    """Entry point of a worker process: run job['client_ids'] clients, return their request records."""
    # the server is on this machine: an http_proxy of the environment must not carry the requests
    for var in ("NO_PROXY", "no_proxy"):  # urllib's reading of the environment prefers the lowercase one
        os.environ[var] = ",".join(filter(None, [os.environ.get(var), "127.0.0.1", "localhost"]))
    return asyncio.run(_run_clients(job))


def _warm_worker() -> str:
    import openai  # noqa: F401 - imported before the first window so that it does not delay the start

    return openai.__version__


# ---- statistics --------------------------------------------------------------------------------------------

def _dist(values: list[float]) -> dict:
    """p50 / p99 / mean / max of seconds (linear interpolation between order statistics), n = sample count."""
    if not values:
        return {"n": 0, "p50": None, "p99": None, "mean": None, "max": None}
    v = sorted(values)

    def q(p):
        x = p * (len(v) - 1)
        lo = math.floor(x)
        hi = min(lo + 1, len(v) - 1)
        return v[lo] + (v[hi] - v[lo]) * (x - lo)

    return {"n": len(v), "p50": q(0.50), "p99": q(0.99), "mean": sum(v) / len(v), "max": v[-1]}


def summarize_window(records: list, *, clients: int, t_start: float, t_end: float, server_tokens: int,
                     samples: list) -> dict:
    """One client count's point: throughput over [t_start, t_end], latencies, requests and errors."""
    dur = t_end - t_start
    ok = [r for r in records if r["error"] is None]
    errors = [r for r in records if r["error"] is not None]
    done_in_window = [r for r in ok if r["t_done"] <= t_end]
    # the clients' count: a request's usage tokens, the share of its content chunks that arrived in the window
    client_tokens = 0.0
    for r in ok:
        n = len(r["chunks"])
        if n:
            client_tokens += r["tokens"] * sum(1 for t in r["chunks"] if t <= t_end) / n
    ttft = [r["chunks"][0] - r["t_send"] for r in ok if r["chunks"]]
    # each client's turnaround between two requests (a closed-loop client holds no row meanwhile)
    by_client: dict = {}
    for r in sorted(records, key=lambda r: r["t_send"]):
        by_client.setdefault(r["client"], []).append(r)
    gaps = [b["t_send"] - a["t_done"] for rs in by_client.values() for a, b in zip(rs, rs[1:])]
    itl = [b - a for r in ok for a, b in zip(r["chunks"], r["chunks"][1:])]
    msgs = []
    for r in errors:
        if r["error"] not in msgs and len(msgs) < ERROR_SAMPLES:
            msgs.append(r["error"])
    running = [s[0] for s in samples]
    waiting = [s[1] for s in samples]
    return {
        "clients": clients, "duration_s": dur,
        "generated_tokens": server_tokens, "tok_s": server_tokens / dur,
        "client_tokens": client_tokens, "client_tok_s": client_tokens / dur,
        "requests": len(done_in_window), "requests_started": len(records), "requests_ok": len(ok),
        "errors": len(errors), "error_samples": msgs,
        "finish_reasons": {k: sum(1 for r in ok if r["finish"] == k) for k in sorted({str(r["finish"]) for r in ok})},
        "completion_tokens_per_request": _dist([float(r["tokens"]) for r in ok]),
        "ttft_s": _dist(ttft), "itl_s": _dist(itl),
        "mean_running_rows": sum(running) / len(running) if running else None,
        "mean_waiting_requests": sum(waiting) / len(waiting) if waiting else None,
        "drain_s": max((r["t_done"] for r in records), default=t_end) - t_end,
        "client_gap_s": _dist([max(0.0, g) for g in gaps]),
    }


# ---- the server in this process ----------------------------------------------------------------------------

class InProcessServer:
    """`runmap serve`'s Server and FastAPI application on uvicorn, in a thread of this process, bound to
    127.0.0.1 on a free port: the offline measurement then runs on the very engine the server serves with, on
    the engine thread between scheduler steps (``call_named("offline_runs")``; with --engine-process, in the engine's
    child process)."""

    def __init__(self, pack: Path, *, executor: str, resident, device, max_batch: int, max_seq_len: int,
                 ifeval_dir: Path, command: str, gpu_budget: int | None = None, join_mode: str = JOIN_MODES[0],
                 engine_process: bool = False):
        import functools
        import socket
        import threading

        import uvicorn

        from runmap.engine.engine import Engine
        from runmap.serve.app import Server, create_app

        # as runmap serve: under a budget the engine plans again and caps torch's allocator at it (a partial: it
        # pickles, for an engine process)
        load = functools.partial(Engine.from_pack, pack, executor=executor, device=device, max_batch=max_batch,
                                 max_seq_len=max_seq_len, **({"gpu_budget": gpu_budget} if gpu_budget is not None
                                                             else {"resident": resident}))

        self.model_id = "bench"
        self.server = Server(load, model_id=self.model_id, pack_dir=pack, ifeval_dir=ifeval_dir, campaign_roots=[],
                             command=command, join_mode=join_mode, engine_process=engine_process)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/"
        cfg = uvicorn.Config(create_app(self.server), log_level="warning", access_log=False, timeout_graceful_shutdown=5)
        self.uv = uvicorn.Server(cfg)
        self.thread = threading.Thread(target=self.uv.run, kwargs={"sockets": [self.sock]}, name="bench-uvicorn",
                                       daemon=True)

    def start(self, timeout_s: float) -> float:
        """Start loading and serving; return the seconds until /health said ok."""
        import urllib.error
        import urllib.request

        direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never through an http_proxy
        t0 = time.monotonic()
        self.server.start()
        self.thread.start()
        while True:
            phase = self.server.phase
            if phase == "failed":
                why = self.server.load_error or (self.server.scheduler.failed if self.server.scheduler else "unknown")
                raise BenchFailure(f"the server could not start the engine: {why}")
            if not self.thread.is_alive():
                raise BenchFailure("uvicorn stopped before the server was ready")
            if time.monotonic() - t0 > timeout_s:
                raise BenchFailure(f"the server was not ready within --ready-timeout-s {timeout_s:g} (phase {phase})")
            try:  # the standard library: the server answers 503 (an HTTPError) until it is warm
                with direct.open(self.url + "health", timeout=5) as r:
                    if r.status == 200:
                        return time.monotonic() - t0
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.1)

    @property
    def scheduler(self):
        return self.server.scheduler

    @property
    def device(self):
        """The engine's device (in an engine process: from what it reported)."""
        import torch

        eng = self.server.engine
        return eng.device if hasattr(eng, "device") else torch.device(self.server.info["device"])

    def wait_idle(self, timeout_s: float = 120.0) -> None:
        """Until no request runs or waits (clients that went away are dropped at the next step)."""
        t0 = time.monotonic()
        while self.scheduler.running or self.scheduler.waiting:
            if time.monotonic() - t0 > timeout_s:
                raise BenchFailure(f"the server still had {self.scheduler.running} running and "
                                   f"{self.scheduler.waiting} waiting requests {timeout_s:g} s after the clients ended")
            time.sleep(0.05)

    def stop(self) -> None:
        self.uv.should_exit = True
        self.thread.join(30)
        self.server.shutdown()


def offline_throughput(srv: InProcessServer, prompts: list[str], *, batch: int, max_tokens: int, chat: bool,
                       warmup: int, repeats: int, timeout_s: float) -> dict:
    """The engine's own batched decode at `batch` rows, timed by the engine (as `runmap bench` reads it)."""
    import concurrent.futures

    from runmap.bench import metrics as bm

    rows = [prompts[i % len(prompts)] for i in range(batch)]
    srv.wait_idle()
    try:  # on the engine thread, between scheduler steps (runmap.serve.scheduler.ENGINE_CALLS)
        runs = srv.scheduler.call_named("offline_runs", timeout=timeout_s, rows=rows, max_new_tokens=max_tokens,
                                        chat=chat, warmup=warmup, repeats=repeats)
    except concurrent.futures.TimeoutError:
        raise BenchFailure(f"the offline measurement at batch {batch} took longer than --offline-timeout-s "
                           f"{timeout_s:g}") from None
    except Exception as e:  # noqa: BLE001 - an engine failure ends the benchmark in one line
        raise BenchFailure(f"the offline measurement at batch {batch} failed: {type(e).__name__}: {e}") from None
    dec = bm.repeat_stats([r["decode_tok_s"] for r in runs])
    return {"batch": batch, "warmup": warmup, "repeats": repeats, "max_new_tokens": max_tokens, "ignore_eos": True,
            "prompts": f"the first {batch} prompts of the set (cycled)", "decode_tok_s": dec,
            "e2e_tok_s": bm.repeat_stats([r["e2e_tok_s"] for r in runs]),
            "ttft_s": bm.repeat_stats([r["ttft_s"] for r in runs]),
            "new_tokens": runs[-1]["new_tokens"], "prompt_tokens": runs[-1]["prompt_tokens"]}


def _cpu_seconds(pid: int | None = None) -> float | None:
    """CPU seconds (user + system, every thread) a process has used: this one (pid None) from os.times(), another
    from /proc/PID/stat; None where that cannot be read (no /proc, a process that has gone)."""
    if pid is None:
        t = os.times()
        return t.user + t.system
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime
    except (OSError, ValueError, IndexError):
        return None


def _cpu_snapshot(srv: "InProcessServer") -> dict:
    """CPU seconds so far of this process, of the engine's child process and of the other children (the clients)."""
    import multiprocessing

    proc = getattr(srv.scheduler, "proc", None)  # runmap.serve.engine_process.EngineProcess (--engine-process on)
    engine_pid = proc.pid if proc is not None else None
    clients = [_cpu_seconds(p.pid) for p in multiprocessing.active_children() if p.pid != engine_pid]
    return {"bench_process": _cpu_seconds(), "engine_process": _cpu_seconds(engine_pid) if engine_pid else None,
            "client_processes": None if not clients or None in clients else sum(clients)}


def _cpu_delta(a: dict, b: dict) -> dict:
    return {k: None if a[k] is None or b[k] is None else max(0.0, b[k] - a[k]) for k in a}


def run_window(srv: InProcessServer, pool, *, clients: int, procs: int, job: dict, duration_s: float) -> dict:
    """One client count: start the clients on the workers, read the server's token counter at the window's
    start and end, sample the scheduler's rows, collect the request records once every client finished."""
    procs = min(procs, clients)
    t_start = time.monotonic() + 1.0  # time for the workers to receive their jobs before the common start
    t_end = t_start + duration_s
    futs = [pool.submit(client_worker, dict(job, clients=clients, client_ids=list(range(w, clients, procs)),
                                            t_start=t_start, t_end=t_end)) for w in range(procs)]
    sched = srv.scheduler
    while time.monotonic() < t_start:
        time.sleep(0.001)
    n0 = sched.totals["generated_tokens"]
    late0 = sched.compiles_after_ready()
    busy0, count0, pc0 = dict(sched.time_in), sched.counters(), time.perf_counter()
    cpu0 = _cpu_snapshot(srv)
    samples = []
    while (now := time.monotonic()) < t_end:
        samples.append((sched.running, sched.waiting))
        time.sleep(min(0.25, max(0.0, t_end - now)))
    n1 = sched.totals["generated_tokens"]
    late1 = sched.compiles_after_ready()
    busy1, count1, pc1 = dict(sched.time_in), sched.counters(), time.perf_counter()
    cpu1 = _cpu_snapshot(srv)
    records = []
    for f in futs:
        try:
            records += f.result(timeout=job["timeout_s"] + 120)
        except Exception as e:  # noqa: BLE001 - a worker that died or hung: one line, no partial point
            raise BenchFailure(f"a client worker failed at {clients} clients: {type(e).__name__}: {e}") from None
    point = summarize_window(records, clients=clients, t_start=t_start, t_end=t_end, server_tokens=n1 - n0,
                             samples=samples)
    # Triton kernel variants compiled inside the window (each one stalled every running row); None on the CPU
    point["cpu_s"] = _cpu_delta(cpu0, cpu1)  # where the host's time went: HTTP side, engine, clients
    point["kernel_compiles"] = None if late0 is None else {"count": late1["count"] - late0["count"],
                                                           "variants": late1["variants"][len(late0["variants"]):]}
    # the engine thread over the window: its time admitting (joint prefills), stepping, snapshotting and running
    # other threads' calls, the rest waiting for work; joins and steps run; how long admitted requests waited in the
    # queue before their join
    busy = {k: busy1[k] - busy0[k] for k in busy1}
    point["engine_thread"] = {
        **busy, "idle_s": max(0.0, (pc1 - pc0) - sum(busy.values())),
        "joins": count1["joins"] - count0["joins"], "steps": count1["steps"] - count0["steps"],
        "admitted": count1["admitted"] - count0["admitted"],
        # joins by how they ran beside the rows (the rest whole): counters a runner of that mode has
        **{k: count1.get(k, 0) - count0.get(k, 0) for k in ("interleaved_joins", "concurrent_joins", "mixed_joins")},
        "queue_wait_s": _dist([w for t, w in list(sched.queue_waits) if pc0 <= t <= pc1])}
    return point


# ---- record, table, plot ------------------------------------------------------------------------------------

def machine_info(device) -> dict:
    import platform

    from runmap.bench import metrics as bm

    return {"hostname": platform.node(), "platform": platform.platform(), "cpu_count": os.cpu_count(),
            "device": bm.device_info(device), "software": bm.software_info(), "git": bm.git_info()}


def print_table(rec: dict) -> None:
    def f(v, spec=".1f"):
        return "-" if v is None else format(v, spec)

    print(f"{rec['pack']['name']} {rec['residency']['regime']} residency "
          f"{rec['residency']['resident']}/{rec['residency']['num_experts']}, max batch {rec['server']['max_batch']}, "
          f"max_tokens {rec['workload']['max_tokens']}, {rec['workload']['duration_s']:g} s windows")
    print(f"{'clients':>7} {'tok/s':>9} {'offline':>9} {'ratio':>6} {'ttft p50':>9} {'ttft p99':>9} "
          f"{'itl p50':>8} {'itl p99':>8} {'reqs':>6} {'errors':>6} {'rows':>5} {'e2e-ratio':>9} {'compiles':>8}")
    for pt in rec["points"]:
        ms = lambda d, k: None if d[k] is None else d[k] * 1e3  # noqa: E731
        print(f"{pt['clients']:>7} {pt['tok_s']:>9.1f} {pt['offline']['decode_tok_s']['median']:>9.1f} "
              f"{pt['ratio_to_offline']:>6.2f} {f(ms(pt['ttft_s'], 'p50')):>7}ms {f(ms(pt['ttft_s'], 'p99')):>7}ms "
              f"{f(ms(pt['itl_s'], 'p50')):>6}ms {f(ms(pt['itl_s'], 'p99')):>6}ms {pt['requests']:>6} {pt['errors']:>6} "
              f"{f(pt['mean_running_rows']):>5} {f(pt.get('ratio_to_offline_e2e'), '.2f'):>9} "
              f"{f((pt.get('kernel_compiles') or {}).get('count'), 'd'):>8}")
    print(f"{'clients':>7} engine thread: {'admit':>6} {'steps':>6} {'stats':>6} {'idle':>6} (share of the window)"
          f" {'joins':>6} {'mixed':>6} {'admitted':>8} {'queue wait p50/p99':>19}")
    for pt in rec["points"]:
        e = pt.get("engine_thread")
        if e is None:
            continue
        wall = sum(e[k] for k in ("admit_s", "step_s", "stats_s", "calls_s", "idle_s")) or 1.0
        qw = e["queue_wait_s"]
        print(f"{pt['clients']:>7} {'':>14}" + "".join(f" {e[k] / wall:>6.2f}" for k in ("admit_s", "step_s", "stats_s", "idle_s"))
              + f" {'':>21} {e['joins']:>6} {e.get('mixed_joins', 0):>6} {e['admitted']:>8} "
              + f"{f(None if qw['p50'] is None else qw['p50'] * 1e3):>8}/{f(None if qw['p99'] is None else qw['p99'] * 1e3)} ms")
    print(f"{'clients':>7} host cores (CPU s / window s): {'bench':>6} {'engine':>7} {'clients':>8}   "
          f"client turnaround p50/p99")
    for pt in rec["points"]:
        cpu, gap = pt.get("cpu_s"), pt.get("client_gap_s")
        if cpu is None or gap is None:
            continue
        cores = [f(None if cpu[k] is None else cpu[k] / pt["duration_s"], ".2f")
                 for k in ("bench_process", "engine_process", "client_processes")]
        print(f"{pt['clients']:>7} {'':>29} {cores[0]:>6} {cores[1]:>7} {cores[2]:>8}   "
              f"{f(ms(gap, 'p50')):>8}/{f(ms(gap, 'p99'))} ms")
    for t in rec["targets"]["checks"]:
        print(f"target ratio >= {rec['targets']['ratio_to_offline_min']} at {t['clients']} clients: "
              f"{'met' if t['met'] else 'NOT met'} ({t['ratio']:.2f})")


def plot(rec: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = rec["points"]
    x = [p["clients"] for p in pts]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.plot(x, [p["tok_s"] for p in pts], "o-", label="served (streaming clients)")
    a.plot(x, [p["offline"]["decode_tok_s"]["median"] for p in pts], "s--", label="offline batch decode")
    a.set_xlabel("concurrent clients")
    a.set_ylabel("generated tok/s")
    a.set_xscale("log", base=2)
    a.set_xticks(x, [str(c) for c in x])
    a.legend()
    a.grid(alpha=0.3)
    for key, label, color in (("ttft_s", "time to first token", "tab:blue"), ("itl_s", "inter-token latency", "tab:red")):
        for q, ls in (("p50", "o-"), ("p99", "s:")):
            ys = [float("nan") if p[key][q] is None else p[key][q] * 1e3 for p in pts]
            b.plot(x, ys, ls, color=color, label=f"{label} {q}")
    b.set_xlabel("concurrent clients")
    b.set_ylabel("ms")
    b.set_xscale("log", base=2)
    b.set_xticks(x, [str(c) for c in x])
    b.set_yscale("log")
    b.legend(fontsize=8)
    b.grid(alpha=0.3)
    r = rec["residency"]
    fig.suptitle(f"runmap serve load: {rec['pack']['name']}, {r['regime']} residency {r['resident']}/{r['num_experts']}, "
                 f"max_tokens {rec['workload']['max_tokens']}")
    fig.tight_layout()
    from runmap.atomic import atomic_path

    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)


# ---- main ----------------------------------------------------------------------------------------------------

def run(args, argv: list[str]) -> int:
    import concurrent.futures
    import multiprocessing
    import shlex
    import tempfile

    from runmap.format.packfile import is_pack_dir

    pack = Path(args.packed)
    if not is_pack_dir(pack):
        raise BenchFailure(f"--packed {pack}: not a runmap pack (no manifest.json of a pack; make one with `runmap pack`)")
    out = Path(args.out)
    if out.is_dir():
        raise BenchFailure(f"--out {out}: is a directory (give the JSON file to write)")
    try:  # before the engine loads: an output that cannot be written fails now, not after the windows
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise BenchFailure(f"--out {out}: cannot create {out.parent}: {e.strerror or e}") from None
    if not os.access(out.parent, os.W_OK):
        raise BenchFailure(f"--out {out}: {out.parent} is not writable")
    max_batch = args.max_batch or max(args.clients)
    ordered = load_prompts(Path(args.prompts), args.num_prompts, args.seed)
    resident = args.resident
    if args.gpu_budget is not None:
        from runmap.engine.budget import BudgetError, plan_for_pack

        try:  # as runmap serve: joining requests are prefilled into free rows of the engine's KV cache
            plan = plan_for_pack(pack, args.gpu_budget, max_batch=max_batch, max_seq_len=args.max_seq_len)
        except BudgetError as e:
            raise BenchFailure(str(e)) from None
        resident = plan.resident
        print(f"serve_load: {plan.describe()}", flush=True)
    command = " ".join(shlex.quote(a) for a in ["python3", "benchmarks/serve_load.py", *argv])

    # spawn, not fork: this process holds CUDA (and torch's thread pools) once the engine is loaded
    workers = min(args.client_procs, max(args.clients))
    pool = concurrent.futures.ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn"))
    with tempfile.TemporaryDirectory(prefix="serve-load-") as scratch:
        srv = InProcessServer(pack, executor=args.executor, resident=resident, device=args.device, max_batch=max_batch,
                              max_seq_len=args.max_seq_len, ifeval_dir=Path(scratch) / "ifeval",
                              command=f"runmap serve (in {command})", gpu_budget=args.gpu_budget,
                              join_mode=args.join_mode,
                              engine_process=engine_process_on(args.engine_process, args.device))
        try:
            # the workers import the client while the engine loads
            warm = [pool.submit(_warm_worker) for _ in range(workers)]
            print(f"serve_load: starting the server on {srv.url} ({pack})", flush=True)
            ready_s = srv.start(args.ready_timeout_s)
            client_version = warm[0].result(timeout=120)
            for w in warm:
                w.result(timeout=120)
            info = dict(srv.server.info)
            sched = srv.scheduler
            prompts, prompt_tokens, skipped = select_prompts(srv, ordered, args.num_prompts, chat=args.endpoint == "chat",
                                                             max_tokens=args.max_tokens, max_seq_len=info["max_seq_len"],
                                                             max_prompt_tokens=args.max_prompt_tokens)
            print(f"serve_load: ready in {ready_s:.1f} s ({info['regime']} residency {info['resident']}/"
                  f"{info['num_experts']}, {info['executor']}, {info['device']}, max batch {info['max_batch']})",
                  flush=True)
            job = {"url": srv.url, "model": srv.model_id, "prompts": prompts, "endpoint": args.endpoint,
                   "max_tokens": args.max_tokens, "max_requests": args.max_requests, "timeout_s": args.request_timeout_s}
            machine = machine_info(srv.device)
            from runmap.atomic import write_json
            from runmap.provenance import utc_timestamp

            def record(points: list, first: dict, complete: bool) -> dict:
                stats = sched.stats
                checks = [{"clients": p["clients"], "ratio": p["ratio_to_offline"],
                           "met": p["ratio_to_offline"] >= TARGET_RATIO} for p in points if p["clients"] in TARGET_CLIENTS]
                return {
                    "record_version": RECORD_VERSION, "kind": "serve-load", "label": args.label,
                    "created_utc": utc_timestamp(), "complete": complete, "command": command, "machine": machine,
                    "pack": {"dir": str(pack), "name": pack.resolve().name, "identity": info["pack_identity"],
                             "arch": info["arch"], "num_layers": info["num_layers"], "num_experts": info["num_experts"],
                             "top_k": info["top_k"]},
                    "residency": {"regime": info["regime"], "resident": info["resident"], "num_experts": info["num_experts"],
                                  "asked": ("--gpu-budget " + str(args.gpu_budget)) if args.gpu_budget is not None else
                                  (f"--resident {args.resident}" if args.resident is not None else "full")},
                    "server": {"host": "127.0.0.1", "executor": info["executor"], "device": info["device"],
                               "cuda_graphs": info["cuda_graphs"], "max_batch": info["max_batch"],
                               "join_mode": args.join_mode,
                               "engine_process": srv.server.engine_process,
                               "max_seq_len": info["max_seq_len"], "load_s": info["load_s"], "warmup_s": sched.warmup_s,
                               "ready_s": ready_s, "first_request": first,
                               "expert_cache": {"hits": stats.hits, "misses": stats.misses, "bytes_h2d": stats.bytes_h2d}
                               if stats is not None else None,
                               "totals": dict(sched.totals),
                               "kernel_compiles_after_ready": sched.compiles_after_ready()},
                    "workload": {"endpoint": args.endpoint, "prompt_source": os.path.relpath(args.prompts, REPO)
                                 if Path(args.prompts).resolve().is_relative_to(REPO) else str(args.prompts),
                                 "num_prompts": len(prompts), "seed": args.seed,
                                 "prompt_tokens": {"min": min(prompt_tokens), "mean": sum(prompt_tokens) / len(prompt_tokens),
                                                   "max": max(prompt_tokens)},
                                 "prompts_skipped_too_long": skipped,
                                 "max_prompt_tokens": args.max_prompt_tokens, "max_tokens": args.max_tokens, "temperature": 0.0,
                                 "stream": True, "include_usage": True, "duration_s": args.duration_s,
                                 "clients": list(args.clients), "client": f"openai {client_version} AsyncOpenAI",
                                 "client_procs": args.client_procs, "max_requests_per_client": args.max_requests},
                    "points": points,
                    "targets": {"ratio_to_offline_min": TARGET_RATIO, "at_clients": list(TARGET_CLIENTS), "checks": checks},
                }

            # The first request after ready, alone and untimed by the windows: what a server's first user waits
            # (a cost left out of warm-up shows here instead of in the first window)
            def alone() -> dict:
                now = time.monotonic()
                return pool.submit(client_worker, dict(job, clients=1, client_ids=[0], max_requests=1, keep_text=True,
                                                       t_start=now, t_end=now + args.request_timeout_s)
                                   ).result(args.request_timeout_s + 60)[0]

            r = alone()
            first = {"ttft_s": r["chunks"][0] - r["t_send"] if r["chunks"] else None, "e2e_s": r["t_done"] - r["t_send"],
                     "completion_tokens": r["tokens"], "error": r["error"], "answer_unchanged_at_end": None}
            print(f"serve_load: first request: {first['e2e_s']:.2f} s"
                  + (f", first token after {first['ttft_s']:.3f} s" if first["ttft_s"] is not None else "")
                  + (f", error {first['error']}" if first["error"] else ""), flush=True)
            points = []
            for c in args.clients:
                srv.wait_idle()
                pt = run_window(srv, pool, clients=c, procs=args.client_procs, job=job, duration_s=args.duration_s)
                pt["offline"] = offline_throughput(srv, prompts, batch=min(c, max_batch), max_tokens=args.max_tokens,
                                                   chat=args.endpoint == "chat", warmup=args.offline_warmup,
                                                   repeats=args.offline_repeats, timeout_s=args.offline_timeout_s)
                pt["ratio_to_offline"] = pt["tok_s"] / pt["offline"]["decode_tok_s"]["median"]
                # beside it: against the offline batch's whole time, its prefill included (the served rate pays for
                # every request's prefill too); the target is read against the decode-only ratio above
                pt["ratio_to_offline_e2e"] = pt["tok_s"] / pt["offline"]["e2e_tok_s"]["median"]
                points.append(pt)
                print(f"serve_load: {c} clients: {pt['tok_s']:.1f} tok/s served, offline batch "
                      f"{pt['offline']['batch']} {pt['offline']['decode_tok_s']['median']:.1f} tok/s "
                      f"(ratio {pt['ratio_to_offline']:.2f}), {pt['requests']} requests, {pt['errors']} errors",
                      flush=True)
                # written after every client count: a run stopped by its time limit keeps the points it measured
                write_json(out, record(points, first, complete=False))  # complete once the final check is in
            # The offline runs used the served engine (its KV cache, its expert cache) between scheduler steps: the
            # first request, sent again alone and greedy, must get the same answer
            srv.wait_idle()
            again = alone()
            first["answer_unchanged_at_end"] = (r["error"] is None and again["error"] is None
                                                and again.get("text") == r.get("text"))
            if not first["answer_unchanged_at_end"]:
                print("serve_load: WARNING: the first request, sent again at the end, got a different answer "
                      f"({again.get('error') or 'text differs'})", flush=True)
            rec = record(points, first, complete=True)
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
            srv.stop()

    write_json(out, rec)
    print_table(rec)
    print(f"serve_load: wrote {out}", flush=True)
    if args.plot:
        plot(rec, Path(args.plot))
        print(f"serve_load: wrote {args.plot}", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    try:
        return run(args, argv)
    except BenchFailure as e:
        print(f"serve_load: {e}", file=sys.stderr)
        return 1
    except ModuleNotFoundError as e:  # the server's or the client's dependencies are not installed here
        print(f"serve_load: missing Python package {e.name!r} (runmap serve needs fastapi, uvicorn, pydantic, "
              f"prometheus-client; the clients need openai)", file=sys.stderr)
        return 1
    except TimeoutError as e:  # concurrent.futures' timeout is an OSError subclass with no text: say what waited
        print(f"serve_load: a request or a client worker did not finish in time ({e or 'no answer'}; "
              f"--request-timeout-s is {args.request_timeout_s} s)", file=sys.stderr)
        return 1
    except OSError as e:  # writing the record or the plot
        print(f"serve_load: {getattr(e, 'filename', None) or args.out}: {e.strerror or e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"serve_load: interrupted (the record at {args.out}, if any, holds the client counts measured)",
              file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
