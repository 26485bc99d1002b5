"""IFEval runs started from the page: ``runmap ifeval generate`` and ``runmap ifeval score`` on the
server's engine, writing the same files.

A run is a folder ``ROOT/NAME/`` laid out as the pipeline's IFEval stage lays out its own:
``inputs.jsonl`` (the first ``limit`` prompts of the vendored IFEval inputs, or all 541),
``answers.jsonl`` with its sidecar ``answers.jsonl.meta.json`` (runmap.ifeval.generate.generate_answers:
appended and fsync-ed per batch, resumable, refusing other settings), then ``score/results.jsonl`` and
``score/summary.json`` (runmap.ifeval.score). Nothing is re-implemented: the generation loop is
``generate_answers`` with an engine stand-in whose ``generate`` submits every prompt of a batch to the
scheduler (so the prompts share the running batch with chat requests) and waits for them.

Stop: the stand-in cancels its in-flight requests and raises ``StopRequested`` (a KeyboardInterrupt, so
the sidecar records the session as "interrupted", as Ctrl-C on the CLI would); the answers of finished
batches are on disk. Start again with the same name and settings to resume: answered prompts are skipped.
One run at a time.
"""
from __future__ import annotations

import re
import sys
import threading
import time
from pathlib import Path

from runmap.atomic import write_text
from runmap.engine.generation import GenerationResult
from runmap.ifeval.generate import (DEFAULT_INPUTS, GenerationSettings, IFEvalGenerateError, _pack_records,
                                    generate_answers, read_prompts, recover_answers, sidecar_path)
from runmap.provenance import sha256_file
from runmap.serve.batching import SamplingParams
from runmap.serve.protocol import ApiError
from runmap.serve.scheduler import Ticket

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
TOTAL_PROMPTS = 541
BATCH_ROWS = 4


class StopRequested(KeyboardInterrupt):
    """Raised inside generate_answers when the page asks the run to stop (recorded as 'interrupted')."""


class _SchedulerEngine:
    """What generate_answers needs of an engine (``generate`` and ``telemetry``), served by the scheduler."""

    def __init__(self, job: "IFEvalRuns"):
        self.job = job

    def generate(self, prompts, *, max_new_tokens, temperature, chat, stop):
        job = self.job
        sched = job.scheduler()
        if job._stop.is_set():
            raise StopRequested()
        done = threading.Semaphore(0)
        tickets = []
        for p in prompts:
            ids = job.encode(p, chat)
            params = SamplingParams(max_new_tokens=max_new_tokens, temperature=float(temperature), stop=tuple(stop))
            box = {}

            def sink(ev, box=box):
                if ev[0] in ("done", "error"):
                    box["ev"] = ev
                    if ev[0] == "done" and ev[1].finish_reason != "cancelled":
                        job._progress(1)
                    done.release()

            tickets.append((sched.submit(Ticket(ids, params, sink, endpoint="ifeval")), box, len(ids)))
        pending = len(tickets)
        while pending:
            if done.acquire(timeout=0.2):
                pending -= 1
            elif job._stop.is_set():
                for t, _, _ in tickets:
                    sched.cancel(t)
                raise StopRequested()
        results = []
        for _, box, n in tickets:
            kind, payload = box["ev"]
            if kind == "error":
                raise IFEvalGenerateError(f"the engine failed on a prompt: {payload.message}")
            if payload.finish_reason == "cancelled":
                raise StopRequested()
            results.append(GenerationResult(payload.text, payload.token_ids, payload.finish_reason, n))
        return results

    def telemetry(self):
        return self.job.telemetry()


class IFEvalRuns:
    """The page's IFEval runs (one at a time) under ``root``."""

    def __init__(self, root: Path, *, pack_dir: Path, model_name: str, scheduler, encode, telemetry, info,
                 command: str, inputs: Path = DEFAULT_INPUTS):
        self.root, self.pack_dir, self.model_name = Path(root), Path(pack_dir), model_name
        self.scheduler, self.encode, self.telemetry, self.info = scheduler, encode, telemetry, info
        self.command, self.inputs = command, Path(inputs)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._state = {"state": "idle"}

    # ---- status -----------------------------------------------------------------------------------------
    def status(self) -> dict:
        with self._lock:
            s = dict(self._state)
        if s.get("total"):
            s["progress"] = round(s.get("answered", 0) / s["total"], 4)
        return s

    def _set(self, **kw) -> None:
        with self._lock:
            self._state.update(kw)

    def _progress(self, n: int) -> None:
        with self._lock:
            self._state["answered"] = min(self._state.get("answered", 0) + n, self._state.get("total", 0))

    def runs(self) -> list[dict]:
        """The run folders under root with their sidecar status and, when scored, prompt-level strict accuracy."""
        import json

        out = []
        if not self.root.is_dir():
            return out
        for d in sorted(p for p in self.root.iterdir() if p.is_dir()):
            side = sidecar_path(d / "answers.jsonl")
            row = {"name": d.name, "status": None, "answered": None, "prompts": None, "scored": False}
            try:
                meta = json.loads(side.read_text(encoding="utf-8"))
                row.update(status=meta.get("status"), answered=meta.get("counts", {}).get("answered"),
                           prompts=meta.get("counts", {}).get("prompts"),
                           max_new_tokens=meta.get("generation", {}).get("max_new_tokens"))
            except (OSError, ValueError):
                pass
            row["scored"] = (d / "score" / "summary.json").is_file()
            out.append(row)
        return out

    # ---- control ----------------------------------------------------------------------------------------
    def start(self, *, limit: int | None, max_new_tokens: int, batch_size: int | None = None,
              name: str | None = None) -> dict:
        """Start (or resume) a run; ApiError (400 / 409) for bad settings or a run already going."""
        if limit is not None and not 1 <= limit <= TOTAL_PROMPTS:
            raise ApiError(400, f"limit must be in [1, {TOTAL_PROMPTS}] (or absent: all prompts), got {limit}",
                           param="limit")
        if max_new_tokens < 1:
            raise ApiError(400, f"max_new_tokens must be at least 1, got {max_new_tokens}", param="max_new_tokens")
        sched = self.scheduler()
        if sched is None or not sched.ready:
            raise ApiError(503, "the engine is not ready yet", type="server_error")
        # prompts per generate_answers batch (answers are written and synced per batch): several times the
        # engine's rows, so that the scheduler keeps every row busy while the batch's long answers finish
        batch_size = BATCH_ROWS * sched.max_batch if batch_size is None else batch_size
        if batch_size < 1:
            raise ApiError(400, f"batch_size must be at least 1, got {batch_size}", param="batch_size")
        name = name or f"{self.model_name}-n{limit or TOTAL_PROMPTS}-t{max_new_tokens}"
        if not NAME_RE.match(name):
            raise ApiError(400, f"run name {name!r}: letters, digits, '.', '_' and '-' only (at most 64)", param="name")
        with self._lock:
            if self._thread is not None and self._thread.is_alive():
                raise ApiError(409, f"IFEval run {self._state.get('name')!r} is {self._state.get('state')}; stop it "
                                    "first", code="run_in_progress")
            run_dir = self.root / name
            prompts = self._prepare_inputs(run_dir, limit)
            longest = max(len(self.encode(p.prompt, True)) for p in prompts)
            if longest + max_new_tokens - 1 > sched.max_seq_len:
                raise ApiError(400, f"the longest chat-formatted prompt of this selection has {longest} tokens; with "
                                    f"max_new_tokens {max_new_tokens} it does not fit the server's context "
                                    f"(--max-seq-len {sched.max_seq_len})", param="max_new_tokens")
            answers = run_dir / "answers.jsonl"
            already = len(recover_answers(answers, prompts)) if answers.exists() else 0
            self._stop.clear()
            self._state = {"state": "running", "name": name, "dir": str(run_dir), "limit": limit,
                           "max_new_tokens": max_new_tokens, "batch_size": batch_size, "total": len(prompts),
                           "answered": already, "resumed_from": already, "started": time.time(), "error": None,
                           "summary": None}
            self._thread = threading.Thread(target=self._run, args=(run_dir, prompts, limit, max_new_tokens,
                                                                    batch_size), name="runmap-ifeval", daemon=True)
            self._thread.start()
        return self.status()

    def stop(self) -> dict:
        with self._lock:
            alive = self._thread is not None and self._thread.is_alive()
            if alive and self._state.get("state") == "running":
                self._state["state"] = "stopping"
        if alive:
            self._stop.set()
        return self.status()

    def join(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    def _prepare_inputs(self, run_dir: Path, limit: int | None):
        """run_dir/inputs.jsonl: the selected prompts (written once; a later start must select the same)."""
        try:
            lines = self.inputs.read_text(encoding="utf-8").splitlines(keepends=True)
        except OSError as e:
            raise ApiError(500, f"{self.inputs}: cannot read the IFEval inputs ({e})", type="server_error") from None
        text = "".join(lines[:limit] if limit else lines)
        path = run_dir / "inputs.jsonl"
        if path.exists():
            if path.read_text(encoding="utf-8") != text:
                raise ApiError(409, f"run {run_dir.name!r} already exists with another prompt selection; choose another "
                                    "name or the same limit", param="name", code="run_exists")
        else:
            write_text(path, text)
        try:
            return read_prompts(path)
        except IFEvalGenerateError as e:
            raise ApiError(500, str(e), type="server_error") from None

    def _run(self, run_dir: Path, prompts, limit, max_new_tokens, batch_size) -> None:
        from runmap.ifeval.score import IFEvalError, score_files, write_outputs

        inputs = run_dir / "inputs.jsonl"
        answers = run_dir / "answers.jsonl"
        info = self.info()
        try:
            model, pack = _pack_records(self.pack_dir, self.model_name)
            meta = {
                "model": model,
                "pack": pack,
                "executor": info["executor"],
                "regime": info["regime"],
                "resident": info["resident"],
                "inputs": {"path": str(inputs), "sha256": sha256_file(inputs), "limit": limit, "prompts": len(prompts)},
                "max_seq_len": info["max_seq_len"],
                "device": info["device"],
                "engine_load_s": round(info["load_s"], 3),
                "command": f"{self.command} (page IFEval run {run_dir.name})",
            }
            settings = GenerationSettings(max_new_tokens=max_new_tokens, batch_size=batch_size)
            generate_answers(prompts, answers, _SchedulerEngine(self), settings, meta, progress=False)
        except StopRequested:
            self._set(state="stopped")
            return
        except (IFEvalGenerateError, ApiError, OSError) as e:
            self._set(state="failed", error=str(getattr(e, "message", e)))
            return
        except Exception as e:  # noqa: BLE001 - the page shows it; the server keeps serving
            print(f"runmap serve: IFEval run {run_dir.name} failed: {type(e).__name__}: {e}", file=sys.stderr)
            self._set(state="failed", error=f"{type(e).__name__}: {e}")
            return
        self._set(state="scoring", answered=len(prompts))
        try:
            results, summary = score_files(inputs, answers)
            write_outputs(run_dir / "score", results, summary)
        except (IFEvalError, OSError) as e:
            self._set(state="failed", error=f"scoring: {e}")
            return
        keep = {k: summary[k] for k in ("prompt_level", "instruction_level", "by_instruction", "by_category")}
        self._set(state="done", summary=keep, finished=time.time())
