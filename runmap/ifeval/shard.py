"""IFEval sharding: split the selected prompts across generation jobs, and merge the shards back.

Split: ``--shard I/N`` (1 <= I <= N) keeps the prompts whose rank in ascending ``key`` order is I-1 modulo N.
It depends only on the set of selected prompts (inputs + --limit), never on file order, batch size or the
machine, so N jobs started anywhere partition the prompts exactly; ranks, not ``key % N``, keep the shards'
sizes within one of each other (IFEval's keys are sparse).

Merge: ``merge_shards`` reads N shard answer files and their sidecars and refuses (IFEvalGenerateError, one
line naming the file) unless they are exactly the shards 1..N of one split, each complete, all made from the
same inputs / limit / pack / model / executor / regime / generation settings, and together answer every
selected prompt exactly once. It writes one answers file (in input order) and one sidecar of the unsharded
format (schemas/ifeval-generation.schema.json) plus ``merged_from``, each atomically; ``runmap ifeval score``
then scores it like an unsharded run.

Like generate.py, this module needs neither torch nor the scorer.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

from runmap.atomic import write_json, write_text
from runmap.ifeval.generate import META_KIND, RESUME_KEYS, IFEvalGenerateError, Prompt, read_prompts, sidecar_path
from runmap.provenance import sha256_file, utc_timestamp

_SHARD_RE = re.compile(r"^(\d+)/(\d+)$")
# What every shard must share with the others (dotted paths into the sidecar). generation.batch_size is not
# among them: batching changes no greedy answer (the merge test checks this), and a shard may have been
# resumed with a smaller batch after running out of memory.
SAME_KEYS = tuple(f"generation.{k}" for k in RESUME_KEYS) + (
    "executor", "regime", "resident", "max_seq_len", "model.name", "pack.content_sha256", "inputs.sha256",
    "inputs.limit", "inputs.prompts", "shard.count")


def parse_shard(text: str) -> tuple[int, int]:
    """'2/3' -> (2, 3); anything else, or I outside 1..N, is IFEvalGenerateError."""
    m = _SHARD_RE.match(text.strip())
    if not m:
        raise IFEvalGenerateError(f"--shard {text!r}: expected I/N, e.g. 1/4 (the first of four shards)")
    i, n = int(m[1]), int(m[2])
    if n < 1 or not 1 <= i <= n:
        raise IFEvalGenerateError(f"--shard {text!r}: needs 1 <= I <= N")
    return i, n


def select_shard(prompts: list[Prompt], index: int, count: int) -> list[Prompt]:
    """The prompts of shard ``index`` of ``count`` (1-based), in their input order."""
    ranked = sorted(prompts, key=lambda p: p.key)
    keep = {p.key for r, p in enumerate(ranked) if r % count == index - 1}
    return [p for p in prompts if p.key in keep]


def shard_record(index: int, count: int, shard: list[Prompt]) -> dict:
    """The sidecar's ``shard`` field: which part of the split this file answers."""
    keys = sorted(p.key for p in shard)
    return {"index": index, "count": count, "prompts": len(shard), "split": "rank in key order mod count",
            "keys_sha256": _keys_sha256(keys)}


def _keys_sha256(keys: list[int]) -> str:
    import hashlib

    return hashlib.sha256(json.dumps(sorted(keys)).encode()).hexdigest()


def _get(meta: dict, dotted: str):
    cur = meta
    for part in dotted.split("."):
        if not isinstance(cur, dict):
            return None
        cur = cur.get(part)
    return cur


def _read_answers(path: Path) -> list[dict]:
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise IFEvalGenerateError(f"{path}: no such file") from None
    out = []
    for i, line in enumerate(lines, start=1):
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise IFEvalGenerateError(f"{path}:{i}: malformed JSON ({e.msg})") from None
        if not isinstance(rec, dict) or not isinstance(rec.get("prompt"), str) or not isinstance(rec.get("response"), str):
            raise IFEvalGenerateError(f"{path}:{i}: not an answer record ('prompt' and 'response' strings)")
        out.append(rec)
    return out


def _read_meta(answers: Path) -> dict:
    side = sidecar_path(answers)
    try:
        meta = json.loads(side.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise IFEvalGenerateError(f"{side}: no such file (every shard needs the sidecar its generate run wrote)") from None
    except json.JSONDecodeError as e:
        raise IFEvalGenerateError(f"{side}: malformed JSON ({e.msg})") from None
    if not isinstance(meta, dict) or meta.get("kind") != META_KIND:
        raise IFEvalGenerateError(f"{side}: not a `runmap ifeval generate` sidecar (kind {META_KIND!r})")
    if not isinstance(meta.get("shard"), dict):
        raise IFEvalGenerateError(f"{side}: not a shard (no 'shard' field; was it generated with --shard I/N?)")
    if meta.get("status") != "complete":
        raise IFEvalGenerateError(f"{side}: shard {meta['shard'].get('index')}/{meta['shard'].get('count')} has status "
                                  f"{meta.get('status')!r}, not 'complete'; rerun its generate job to finish it")
    return meta


def merge_shards(shard_answers: list[Path], inputs: Path, out: Path, limit: int | None = None) -> dict:
    """Check and merge shard answer files into ``out`` (+ sidecar). Returns the merged sidecar."""
    if not shard_answers:
        raise IFEvalGenerateError("no shard answer files given")
    paths = [Path(p) for p in shard_answers]
    metas = [_read_meta(p) for p in paths]
    count = metas[0]["shard"].get("count")
    by_index: dict[int, Path] = {}
    for p, m in zip(paths, metas):
        idx = m["shard"].get("index")
        if idx in by_index:
            raise IFEvalGenerateError(f"{p}: shard {idx}/{count} given twice (also {by_index[idx]})")
        by_index[idx] = p
    for p, m in zip(paths[1:], metas[1:]):
        for key in SAME_KEYS:
            a, b = _get(metas[0], key), _get(m, key)
            if a != b:
                raise IFEvalGenerateError(f"{p}: {key} is {b!r} but {paths[0]} has {a!r}; shards of one run must "
                                          f"share inputs, pack and settings")
    missing = sorted(set(range(1, count + 1)) - set(by_index))
    if missing:
        raise IFEvalGenerateError(f"shard(s) {', '.join(f'{i}/{count}' for i in missing)} missing: {len(paths)} of "
                                  f"{count} shard files given")
    prompts = read_prompts(inputs, limit)
    if sha256_file(inputs) != _get(metas[0], "inputs.sha256") or limit != _get(metas[0], "inputs.limit"):
        raise IFEvalGenerateError(f"{inputs} (limit {limit}) is not the inputs the shards answered "
                                  f"({_get(metas[0], 'inputs.path')}, limit {_get(metas[0], 'inputs.limit')})")
    wanted = {p.prompt: p for p in prompts}
    merged: dict[str, dict] = {}
    where: dict[str, str] = {}
    for p, m in zip(paths, metas):
        idx = m["shard"]["index"]
        expect = {q.prompt for q in select_shard(prompts, idx, count)}
        for lineno, rec in enumerate(_read_answers(p), start=1):
            here = f"{p}:{lineno}"
            if rec["prompt"] not in wanted:
                raise IFEvalGenerateError(f"{here}: answer to a prompt that is not among the selected inputs")
            if rec["prompt"] in merged:
                raise IFEvalGenerateError(f"{here}: prompt (key {wanted[rec['prompt']].key}) already answered at "
                                          f"{where[rec['prompt']]}")
            if rec["prompt"] not in expect:
                raise IFEvalGenerateError(f"{here}: key {wanted[rec['prompt']].key} does not belong to shard "
                                          f"{idx}/{count}")
            merged[rec["prompt"]] = rec
            where[rec["prompt"]] = here
    absent = [q for q in prompts if q.prompt not in merged]
    if absent:
        keys = ", ".join(str(q.key) for q in absent[:5]) + (f" and {len(absent) - 5} more" if len(absent) > 5 else "")
        raise IFEvalGenerateError(f"the shards answer no prompt with key {keys}: {len(merged)} of {len(prompts)} answered")

    ordered = [merged[q.prompt] for q in prompts]  # input order: independent of how the shards were batched
    metas_sorted = [m for _, m in sorted(zip([m["shard"]["index"] for m in metas], metas), key=lambda t: t[0])]
    first = metas_sorted[0]
    sessions = [s for m in metas_sorted for s in m["sessions"]]
    wall = sum(s["wall_s"] for s in sessions)
    toks = sum(s["new_tokens"] for s in sessions)
    meta = {k: first[k] for k in ("kind", "version", "model", "pack", "executor", "regime", "resident", "inputs",
                                  "generation", "max_seq_len") if k in first}
    meta.update({
        "status": "complete",
        "counts": {"prompts": len(prompts), "answered": len(ordered), "remaining": 0},
        # wall_s sums the shards' sessions (device seconds, not elapsed time: the shards may have run at once)
        "timing": {"wall_s": round(wall, 3), "new_tokens": toks,
                   "new_tokens_per_s": round(toks / wall, 3) if wall > 0 else None, "sessions": len(sessions)},
        "sessions": sessions,
        "merged_from": [{"index": m["shard"]["index"], "count": count, "answers": str(p), "prompts": m["shard"]["prompts"],
                         "answers_sha256": sha256_file(p), "device": m.get("device"), "wall_s": m["timing"]["wall_s"],
                         "host": (m["sessions"][-1] or {}).get("host")}
                        for p, m in sorted(zip(paths, metas), key=lambda t: t[1]["shard"]["index"])],
        "merged_at": utc_timestamp(),
    })
    out = Path(out)
    # answers first, sidecar last: a sidecar saying 'complete' never describes a half-written answers file
    write_text(out, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in ordered))
    write_json(sidecar_path(out), meta, ensure_ascii=False)
    return meta
