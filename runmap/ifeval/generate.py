"""IFEval answer generation with the RunMap engine: greedy, chat template, batched, resumable.

Resumability contract (what a crash or Ctrl-C can and cannot lose):

* Answers are appended to the output JSONL one line each, and after every batch the file is flushed
  and ``fsync``-ed: an answer written before an interruption is never lost.
* On (re)start the file is read back. A torn last line (no final newline, or not JSON: what a crash in
  the middle of a write leaves) is cut off with ``truncate``; any other bad line is an error, never
  silently dropped. Prompts already answered are skipped.
* The sidecar ``OUT.meta.json`` (written atomically before the first batch and after each one) records
  model, pack, executor, regime and the generation settings. A rerun with different settings, another
  pack or other inputs is refused, so one response file never mixes two configurations.

This module imports torch / the engine only inside ``run_cli``; the IO core takes any object with the
engine's ``generate`` API, so it runs (and is tested) without a model. It must not import jsonschema,
nltk or the scorer: it runs on the GPU machine, which has none of them.
"""
from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from runmap.resources import data_dir
from runmap.kernels.registry import EXECUTOR_NAMES
from runmap.residency.contracts import CONTRACT_NAMES
from runmap.argtypes import checked_text, int_at_least
from runmap.atomic import write_json
from runmap.provenance import sha256_file, utc_timestamp

DEFAULT_INPUTS = data_dir() / "ifeval" / "input_data.jsonl"
META_KIND = "runmap.ifeval-generation"
# Settings that must agree between the answers already in a file and a run that appends to it.
# batch_size is not among them: it may change between sessions (e.g. after running out of memory).
RESUME_KEYS = ("max_new_tokens", "temperature", "greedy", "chat", "stop")


class IFEvalGenerateError(ValueError):
    """Bad input, output or resume state; the message names the file and line at fault."""


@dataclass(frozen=True)
class Prompt:
    key: int
    prompt: str


@dataclass
class GenerationSettings:
    """What the engine is asked for. Greedy means temperature 0 (argmax)."""

    max_new_tokens: int = 1280
    batch_size: int = 32
    temperature: float = 0.0
    greedy: bool = True
    chat: bool = True
    stop: list = field(default_factory=list)
    order: str = "longest prompt first"  # batches of similar length waste less padding


def sidecar_path(out: Path) -> Path:
    out = Path(out)
    return out.with_name(out.name + ".meta.json")


def read_prompts(path: Path, limit: int | None = None) -> list[Prompt]:
    """The first ``limit`` prompts (all when None) of an IFEval input JSONL, in file order."""
    path = Path(path)
    if limit is not None and limit < 1:
        raise IFEvalGenerateError(f"--limit must be at least 1, got {limit}")
    out, seen = [], {}
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise IFEvalGenerateError(f"{path}: no such file") from None
    for i, line in enumerate(lines, start=1):
        if limit is not None and len(out) >= limit:
            break
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise IFEvalGenerateError(f"{path}:{i}: malformed JSON ({e.msg})") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str) or not isinstance(obj.get("key"), int):
            raise IFEvalGenerateError(f"{path}:{i}: needs an integer 'key' and a string 'prompt'")
        if obj["prompt"] in seen:
            raise IFEvalGenerateError(f"{path}:{i}: same prompt as line {seen[obj['prompt']]}")
        seen[obj["prompt"]] = i
        out.append(Prompt(obj["key"], obj["prompt"]))
    if not out:
        raise IFEvalGenerateError(f"{path}: no prompts")
    return out


def recover_answers(out: Path, prompts: list[Prompt]) -> dict[str, dict]:
    """Read the answers already in ``out`` (prompt -> record), cutting off a torn last line in place.

    Raises IFEvalGenerateError for a bad line that is not the last, a duplicate answer, or an answer
    to a prompt outside ``prompts``.
    """
    out = Path(out)
    if not out.exists():
        return {}
    data = out.read_bytes()
    allowed = {p.prompt for p in prompts}
    answers: dict[str, dict] = {}
    pos, good_end, lineno = 0, 0, 0
    while pos < len(data):
        nl = data.find(b"\n", pos)
        end = len(data) if nl < 0 else nl + 1
        lineno += 1
        raw = data[pos:end]
        is_last = end >= len(data)
        try:
            if nl < 0:
                raise ValueError("no newline: torn write")
            rec = json.loads(raw.decode("utf-8"))
            if not isinstance(rec, dict) or not isinstance(rec.get("prompt"), str) or not isinstance(
                    rec.get("response"), str):
                raise ValueError("not an answer record")
        except (ValueError, UnicodeDecodeError) as e:
            if is_last:
                break  # what a crash mid-write leaves: dropped below, the prompt is asked again
            raise IFEvalGenerateError(f"{out}:{lineno}: unreadable answer line ({e}); not a crash artifact "
                                      f"(later lines exist), fix or remove the file") from None
        if rec["prompt"] not in allowed:
            raise IFEvalGenerateError(f"{out}:{lineno}: answer to a prompt that is not among the selected inputs "
                                      f"(other inputs or a smaller --limit?): {rec['prompt'][:60]!r}")
        if rec["prompt"] in answers:
            raise IFEvalGenerateError(f"{out}:{lineno}: second answer to the same prompt (key {rec.get('key')})")
        answers[rec["prompt"]] = rec
        pos = good_end = end
    if good_end < len(data):
        print(f"ifeval generate: {out}: dropping a torn last line ({len(data) - good_end} bytes)", file=sys.stderr)
        with open(out, "r+b") as f:
            f.truncate(good_end)
            f.flush()
            os.fsync(f.fileno())
    return answers


def _check_resume(meta_old: dict | None, meta_new: dict, out: Path, n_answered: int) -> None:
    """Refuse to append to answers made under another configuration."""
    if n_answered and meta_old is None:
        raise IFEvalGenerateError(f"{out} holds {n_answered} answers but {sidecar_path(out)} is missing: their "
                                  f"settings are unknown; use a new --out")
    if meta_old is None or not n_answered:
        return
    diffs = []
    for k in RESUME_KEYS:
        if meta_old.get("generation", {}).get(k) != meta_new["generation"].get(k):
            diffs.append(f"generation.{k}: {meta_old.get('generation', {}).get(k)!r} -> {meta_new['generation'].get(k)!r}")
    for k in ("executor", "regime", "resident", "shard"):
        if meta_old.get(k) != meta_new.get(k):
            diffs.append(f"{k}: {meta_old.get(k)!r} -> {meta_new.get(k)!r}")
    for outer, inner in (("pack", "content_sha256"), ("inputs", "sha256"), ("model", "name")):
        a, b = (meta_old.get(outer) or {}).get(inner), (meta_new.get(outer) or {}).get(inner)
        if a != b:
            diffs.append(f"{outer}.{inner}: {a!r} -> {b!r}")
    if diffs:
        raise IFEvalGenerateError(f"{out}: its {n_answered} answers were made with other settings ("
                                  + "; ".join(diffs) + "); use a new --out or the same settings")


def _sum_timing(acc: dict, timing) -> None:
    """Add the numeric fields of ``engine.last_timing`` (a dict or dataclass) into ``acc``."""
    if timing is None:
        return
    if not isinstance(timing, dict):
        timing = asdict(timing) if hasattr(timing, "__dataclass_fields__") else vars(timing)
    for k, v in timing.items():
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            acc[k] = acc.get(k, 0) + v


def generate_answers(prompts: list[Prompt], out: Path, engine, settings: GenerationSettings, meta: dict,
                     progress: bool = True) -> dict:
    """Answer every prompt not yet answered in ``out``; returns the final sidecar metadata.

    engine: any object with ``generate(list[str], *, max_new_tokens, temperature, chat, stop)`` returning
    one result per prompt with ``.text``, ``.token_ids`` and ``.finish_reason``; optional
    ``last_timing`` and ``telemetry()``. meta: model / pack / executor / regime / inputs records.
    """
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "a", encoding="utf-8") as f:
        try:
            # one writer per answers file: a second process would interleave lines and double-answer prompts
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise IFEvalGenerateError(f"{out}: another `runmap ifeval generate` is writing this file") from None
        return _generate_into(f, prompts, out, engine, settings, meta, progress)


def _generate_into(f, prompts: list[Prompt], out: Path, engine, settings: GenerationSettings, meta: dict,
                   progress: bool) -> dict:
    """generate_answers with ``out`` open for appending (``f``) and locked."""
    out, side = Path(out), sidecar_path(out)
    answered = recover_answers(out, prompts)
    meta_old = None
    if side.is_file():
        try:
            meta_old = json.loads(side.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise IFEvalGenerateError(f"{side}: unreadable sidecar ({e})") from None
    meta = {"kind": META_KIND, "version": 1, **meta, "generation": asdict(settings)}
    _check_resume(meta_old, meta, out, len(answered))
    sessions = list(meta_old.get("sessions", [])) if meta_old and answered else []
    todo = sorted((p for p in prompts if p.prompt not in answered), key=lambda p: (-len(p.prompt), p.key))
    session = {"started_at": utc_timestamp(), "batch_size": settings.batch_size, "skipped_already_answered": len(answered),
               "prompts": 0, "new_tokens": 0, "wall_s": 0.0, "batches": 0, "engine_timing": {},
               "finish_reasons": {}, "status": "running", "host": platform.node()}
    sessions.append(session)
    meta["sessions"] = sessions

    def publish(status: str) -> None:
        session["status"] = status
        done = len(answered)
        meta["status"] = status
        meta["counts"] = {"prompts": len(prompts), "answered": done, "remaining": len(prompts) - done}
        wall = sum(s["wall_s"] for s in sessions)
        toks = sum(s["new_tokens"] for s in sessions)
        meta["timing"] = {"wall_s": round(wall, 3), "new_tokens": toks,
                          "new_tokens_per_s": round(toks / wall, 3) if wall > 0 else None,
                          "sessions": len(sessions)}
        tel = getattr(engine, "telemetry", None)
        if callable(tel):
            try:
                meta["engine"] = {"telemetry": tel()}
            except Exception as e:  # telemetry must never lose answers; record why it is absent
                meta["engine"] = {"telemetry": None, "telemetry_error": f"{type(e).__name__}: {e}"}
        write_json(side, meta, ensure_ascii=False)

    publish("running")
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(prompts), initial=len(answered), desc="ifeval generate", unit="prompt",
                   file=sys.stderr, dynamic_ncols=True)
    t_session = time.perf_counter()
    try:
        for b in range(0, len(todo), settings.batch_size):
            batch = todo[b:b + settings.batch_size]
            t0 = time.perf_counter()
            results = engine.generate([p.prompt for p in batch], max_new_tokens=settings.max_new_tokens,
                                      temperature=settings.temperature, chat=settings.chat,
                                      stop=tuple(settings.stop))
            dt = time.perf_counter() - t0
            if len(results) != len(batch):
                raise IFEvalGenerateError(f"engine returned {len(results)} results for {len(batch)} prompts")
            lines = []
            for p, r in zip(batch, results):
                rec = {"key": p.key, "prompt": p.prompt, "response": r.text,
                       "finish_reason": r.finish_reason, "new_tokens": len(r.token_ids)}
                lines.append(json.dumps(rec, ensure_ascii=False) + "\n")
                session["new_tokens"] += rec["new_tokens"]
                fr = session["finish_reasons"]
                fr[str(r.finish_reason)] = fr.get(str(r.finish_reason), 0) + 1
                answered[p.prompt] = rec
            f.write("".join(lines))
            f.flush()
            os.fsync(f.fileno())
            session["prompts"] += len(batch)
            session["batches"] += 1
            session["wall_s"] = round(time.perf_counter() - t_session, 3)
            _sum_timing(session["engine_timing"], getattr(engine, "last_timing", None))
            publish("running")
            new = sum(len(r.token_ids) for r in results)
            if bar is not None:
                bar.update(len(batch))
                bar.set_postfix(tok_s=f"{new / max(dt, 1e-9):.1f}")
            else:  # logs (pipeline, remote runs) get one line per batch instead of a bar
                print(f"ifeval generate: batch {session['batches']}: {len(batch)} prompts, {new} new tokens in "
                      f"{dt:.1f} s ({new / max(dt, 1e-9):.1f} tok/s); {len(answered)}/{len(prompts)} answered",
                      file=sys.stderr, flush=True)
    except BaseException as e:
        session["wall_s"] = round(time.perf_counter() - t_session, 3)
        session["error"] = f"{type(e).__name__}: {e}"
        publish("interrupted" if isinstance(e, KeyboardInterrupt) else "failed")
        raise
    finally:
        if bar is not None:
            bar.close()
    session["wall_s"] = round(time.perf_counter() - t_session, 3)
    session["finished_at"] = utc_timestamp()
    publish("complete")
    return meta


# --------------------------------------------------------------------------- CLI


def _check_shard(text: str) -> None:
    from runmap.ifeval.shard import parse_shard  # (shard imports this module)

    parse_shard(text)


def add_generate_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--packed", type=Path, required=True, help="pack directory (runmap pack output: manifest.json, "
                                                             "tensors, tokenizer with chat template)")
    p.add_argument("--out", type=Path, required=True,
                   help="answers JSONL (appended to; a rerun skips answered prompts); sidecar OUT.meta.json")
    p.add_argument("--inputs", type=Path, default=DEFAULT_INPUTS, help=f"IFEval input JSONL (default {DEFAULT_INPUTS})")
    p.add_argument("--limit", type=int_at_least(1), default=None, help="only the first N prompts of --inputs")
    p.add_argument("--max-new-tokens", type=int_at_least(1), default=1280, help="new tokens per answer at most (default 1280)")
    p.add_argument("--batch-size", type=int_at_least(1), default=32,
                   help="prompts per engine.generate call and the engine's max_batch (default 32; 32-64 on an H200)")
    p.add_argument("--executor", default="grouped", choices=EXECUTOR_NAMES,
                   help="routed-expert arithmetic path (default grouped)")
    p.add_argument("--resident", type=int_at_least(1), default=None,
                   help="experts per layer resident on the GPU (partial regime); default: all (full regime)")
    p.add_argument("--device", default=None, help="torch device (default: the engine's choice, cuda when present)")
    p.add_argument("--cache-contract", choices=CONTRACT_NAMES, default="v1",
                   help="partial residency: v1 (default) host source -> pinned staging -> GPU, v2 the host source pinned "
                        "once and copied straight into spare rows (docs/cache-contract.md); the answers are the same")
    p.add_argument("--max-seq-len", type=int_at_least(1), default=None,
                   help="KV-cache length; default: longest chat-formatted prompt + --max-new-tokens")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable); default: EOS only")
    p.add_argument("--shard", default=None, metavar="I/N", type=checked_text(_check_shard),
                   help="answer only shard I of N (1 <= I <= N) of the selected prompts: those whose rank in key order "
                        "is I-1 mod N; the sidecar records the shard, `runmap ifeval merge` joins the N files")
    p.add_argument("--model-name", default=None, help="model name recorded in the metadata (default: the pack "
                                                        "directory's name)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def pack_content_sha256(manifest: dict) -> str:
    """Identity of what a pack computes, without its timestamps, timings, paths or packing device.

    The manifest's own sha256 changes whenever the same checkpoint is packed again (created_utc, timing),
    so answers generated on one machine could not be resumed on another with a re-made pack; this hash
    covers the source files' hashes, model config, quantization rule, block size, row layout, the
    non-routed tensor list, every expert row's sha256 and (format v2) the sha256 of every file of the pack.
    """
    src = manifest.get("source") or {}
    content = {
        "format": manifest.get("format"),
        "source_files": src.get("files"),
        "model": manifest.get("model"),
        "quant_rule": manifest.get("quant_rule"),
        "block_size": manifest.get("block_size"),
        "row_layout": manifest.get("row_layout"),
        "nonrouted": {k: (manifest.get("nonrouted") or {}).get(k) for k in ("dtype", "tensors")},
        "experts": [(e.get("layer"), e.get("expert_sha256")) for e in manifest.get("layers") or []],
    }
    if "files" in manifest:  # v2: the non-routed, config and tokenizer bytes too
        content["files"] = manifest["files"]
    return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()


def _pack_records(packed: Path, model_name: str | None = None) -> tuple[dict, dict]:
    """(model, pack) records for the sidecar, from the pack's manifest.json."""
    man_path = packed / "manifest.json"
    if not man_path.is_file():
        raise IFEvalGenerateError(f"{packed}: no manifest.json (not a runmap pack)")
    try:
        man = json.loads(man_path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise IFEvalGenerateError(f"{man_path}: malformed JSON ({e})") from None
    cfg = man.get("model") or {}
    src = man.get("source") or {}
    model = {
        "name": model_name or packed.name,
        "arch": cfg.get("arch"),
        "source": {"path": src.get("path"), "architecture": src.get("architecture")},
        "dims": {k: cfg.get(k) for k in ("num_layers", "hidden_size", "num_experts", "top_k", "moe_intermediate_size",
                                         "vocab_size")},
        "max_position_embeddings": cfg.get("max_position_embeddings"),
    }
    pack = {"path": str(packed), "manifest_sha256": sha256_file(man_path), "content_sha256": pack_content_sha256(man),
            "block_size": man.get("block_size")}
    return model, pack


def _max_prompt_tokens(packed: Path, prompts: list[Prompt], chat: bool) -> int:
    from runmap.engine.tokenization import Tokenizer

    tok = Tokenizer(packed)
    enc = tok.encode_chat if chat else tok.encode
    return max(len(enc(p.prompt)) for p in prompts)


def run_cli(args) -> int:
    if args.batch_size < 1 or args.max_new_tokens < 1:
        raise IFEvalGenerateError("--batch-size and --max-new-tokens must be at least 1")
    shard = None
    if getattr(args, "shard", None):
        from runmap.ifeval.shard import parse_shard

        shard = parse_shard(args.shard)
    prompts = read_prompts(args.inputs, args.limit)
    model, pack = _pack_records(args.packed, args.model_name)
    settings = GenerationSettings(max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
                                  stop=list(args.stop))
    # the KV-cache length comes from all selected prompts, not the shard's: every shard then runs the engine
    # the unsharded run would build
    longest = _max_prompt_tokens(args.packed, prompts, settings.chat)
    selected = len(prompts)
    shard_rec = None
    if shard is not None:
        from runmap.ifeval.shard import select_shard, shard_record

        prompts = select_shard(prompts, *shard)
        if not prompts:
            raise IFEvalGenerateError(f"--shard {args.shard}: no prompt falls in this shard ({selected} selected "
                                      f"prompts for {shard[1]} shards)")
        shard_rec = shard_record(shard[0], shard[1], prompts)
    need = longest + settings.max_new_tokens
    max_seq_len = args.max_seq_len or need
    if max_seq_len < need:
        raise IFEvalGenerateError(f"--max-seq-len {max_seq_len} < longest prompt + --max-new-tokens = {need}")
    max_pos = model["max_position_embeddings"]
    if max_pos is not None and max_seq_len > max_pos:
        raise IFEvalGenerateError(
            f"longest chat-formatted prompt ({longest} tokens) + --max-new-tokens ({settings.max_new_tokens}) = "
            f"{max_seq_len} exceeds the model's max_position_embeddings ({max_pos}); use fewer prompts or tokens")
    from runmap.engine.engine import Engine

    t0 = time.perf_counter()
    engine = Engine.from_pack(args.packed, executor=args.executor, resident=args.resident, device=args.device,
                              max_batch=args.batch_size, max_seq_len=max_seq_len,
                              cache_contract=args.cache_contract)
    load_s = time.perf_counter() - t0
    meta = {
        "model": model,
        "pack": pack,
        "executor": args.executor,
        # what the engine made of --resident (None -> every expert: full residency)
        "regime": getattr(engine, "regime", "full" if args.resident is None else "partial"),
        "resident": getattr(engine, "resident", args.resident),
        "inputs": {"path": str(args.inputs), "sha256": sha256_file(args.inputs), "limit": args.limit,
                   "prompts": selected},
        "max_seq_len": max_seq_len,
        "device": str(getattr(engine, "device", args.device)),
        "engine_load_s": round(load_s, 3),
        "command": " ".join(sys.argv),
    }
    if shard_rec is not None:
        meta["shard"] = shard_rec
    meta = generate_answers(prompts, args.out, engine, settings, meta, progress=not args.no_progress)
    t = meta["timing"]
    print(f"answered {meta['counts']['answered']}/{meta['counts']['prompts']} prompts; this run "
          f"{meta['sessions'][-1]['prompts']} prompts, {meta['sessions'][-1]['new_tokens']} new tokens in "
          f"{meta['sessions'][-1]['wall_s']:.1f} s; total {t['new_tokens']} tokens, {t['wall_s']:.1f} s")
    print(f"wrote {args.out} and {sidecar_path(args.out)}")
    return 0
