"""The benchmark campaign runner: expand a campaign spec into configurations, run each one on the
engine (or a baseline), and write one JSON record per configuration (schemas/bench-record.schema.json).

Spec: specs/campaigns/*.yaml (schemas/campaign-spec.schema.json). A group is the cartesian product
model x resident x executor x batch x prompt_len x decode_len; configurations with the same id in two
groups run once (the first group names it). Configurations that share an engine (same model, kind,
executor, residency) run back to back on one engine instance, so the host source is built once.

What one configuration measures (all on the campaign's device, figures of the same run only):
  warmup runs (untimed: kernel compilation, cache fill), then `repeats` timed runs of
  generate(prompts (batch, prompt_len), max_new_tokens=decode_len); decode tok/s is the median with
  min and max; peak memory spans warmup + timed runs on an engine that is already built; cache hits,
  misses and host->device bytes are the telemetry deltas over the timed runs only.

This module imports neither jsonschema nor snakemake (it runs on the GPU machine); spec validation
happens in ``load_spec`` only when jsonschema is importable.
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime as _dt
import gc
import inspect
import itertools
import json
import re
import shlex
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Callable

import torch
import yaml

from runmap.bench import metrics as bm
from runmap.arch.config import ModelConfig, load_preset
from runmap.atomic import write_json
from runmap.provenance import utc_timestamp

RECORD_VERSION = "bench-record-v1"
from runmap.bench.registry import BASELINE_KINDS
from runmap.residency.observations import OBSERVATION_NAMES as REQUIRED_ZERO
DEFAULT_PARAMS = {"repeats": 3, "warmup": 1, "warmup_new_tokens": 4, "policy": "lru", "seed": 0}


class BenchError(RuntimeError):
    """A campaign spec or a configuration cannot be run as written."""


# ---- spec ---------------------------------------------------------------------------------------

def load_spec(path: str | Path, validate: bool = True) -> dict:
    """Parse a campaign YAML; validate it against campaign-spec.schema.json when jsonschema exists."""
    path = Path(path)
    try:
        spec = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise BenchError(f"{path}: cannot read campaign spec: {e}") from e
    if validate:
        try:
            from runmap.conformance.schemas import validate_document
        except ImportError:  # the GPU machine has no jsonschema; the spec was validated in CI
            validate_document = None
        if validate_document is not None:
            try:
                bad = validate_document(spec, "campaign-spec", file=str(path))
            except ModuleNotFoundError:
                bad = []
            if bad:
                raise BenchError(f"{path}: not a valid campaign spec:\n  " + "\n  ".join(map(str, bad)))
    for g in spec["groups"]:
        for m in g["models"]:
            if m not in spec["models"]:
                raise BenchError(f"{path}: group {g['name']!r} names model {m!r}, not in models {sorted(spec['models'])}")
    return spec


def _as_list(v) -> list:
    return list(v) if isinstance(v, (list, tuple)) else [v]


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    """One configuration. resident is resolved to an integer (experts per layer when full)."""

    id: str
    group: str
    kind: str  # engine | engine-fp16 | hf-bf16
    model: str
    preset: str
    executor: str  # engine executor, or the baseline path (hf-bf16 / torch-fp16)
    resident: int
    experts_per_layer: int
    batch: int
    prompt_len: int
    decode_len: int
    params: tuple  # sorted (key, value) pairs of run parameters

    @property
    def p(self) -> dict:
        return dict(self.params)

    @property
    def regime(self) -> str:
        return "full" if self.resident == self.experts_per_layer else "partial"

    @property
    def expert_format(self) -> str:
        return {"engine": "int4", "engine-fp16": "fp16", "hf-bf16": "bf16"}[self.kind]

    def engine_key(self) -> tuple:
        """Configurations with equal keys can share one engine instance."""
        p = self.p
        return (self.model, self.kind, self.executor, self.resident, p.get("max_batch"), p.get("max_seq_len"),
                p.get("policy"))


def config_id(model: str, kind: str, executor: str, resident: int, batch: int, prompt_len: int, decode_len: int) -> str:
    return f"{model}__{kind}__{executor}__r{resident}__b{batch}__p{prompt_len}__d{decode_len}"


def expand(spec: dict) -> list[BenchConfig]:
    """Every configuration of the spec in run order, duplicates (same id) dropped."""
    defaults = {**DEFAULT_PARAMS, **spec.get("defaults", {})}
    presets = {name: load_preset(m["preset"])[0] for name, m in spec["models"].items()}
    out: dict[str, BenchConfig] = {}
    for g in spec["groups"]:
        params = {**defaults, **g.get("params", {})}
        for model in g["models"]:
            cfg = presets[model]
            e = cfg.num_experts
            if g["kind"] == "engine":
                residents = [e if r == "full" else r for r in _as_list(g["resident"])]
                executors = g["executors"]
            else:
                residents, executors = [e], ["hf-bf16" if g["kind"] == "hf-bf16" else "torch-fp16"]
            for r in residents:
                if r > e:
                    raise BenchError(f"group {g['name']!r}: resident {r} > {e} experts per layer of {model}")
            # spec order is run order (put what matters most first: a --deadline-s run skips the tail)
            for r, ex, b, pl, dl in itertools.product(residents, executors, _as_list(g["batch"]),
                                                      _as_list(g["prompt_len"]), _as_list(g["decode_len"])):
                p = dict(params)
                p.setdefault("max_batch", None)
                p.setdefault("max_seq_len", None)
                cid = config_id(model, g["kind"], ex, r, b, pl, dl)
                if cid not in out:
                    out[cid] = BenchConfig(cid, g["name"], g["kind"], model, spec["models"][model]["preset"], ex, r, e,
                                           b, pl, dl, tuple(sorted(p.items())))
    configs = list(out.values())
    # Engine capacity defaults: the largest batch / sequence any configuration of the model asks for,
    # so one engine serves every batch size of a residency (its KV cache is sized for that maximum).
    need_b: dict[str, int] = {}
    need_s: dict[str, int] = {}
    for c in configs:
        need_b[c.model] = max(need_b.get(c.model, 1), c.batch)
        need_s[c.model] = max(need_s.get(c.model, 2), c.prompt_len + c.decode_len)
    done = []
    for c in configs:
        p = c.p
        if p["max_batch"] is None:
            p["max_batch"] = need_b[c.model]
        if p["max_seq_len"] is None:
            p["max_seq_len"] = need_s[c.model]
        if c.batch > p["max_batch"] or c.prompt_len + c.decode_len > p["max_seq_len"]:
            raise BenchError(f"{c.id}: batch/lengths exceed max_batch={p['max_batch']} / max_seq_len={p['max_seq_len']}")
        done.append(dataclasses.replace(c, params=tuple(sorted(p.items()))))
    # Group configurations sharing an engine together (stable within a key): first-appearance order.
    order: dict[tuple, int] = {}
    for c in done:
        order.setdefault(c.engine_key(), len(order))
    return sorted(done, key=lambda c: order[c.engine_key()])


def filter_configs(configs: list[BenchConfig], only: str | None) -> list[BenchConfig]:
    if not only:
        return configs
    rx = re.compile(only)
    return [c for c in configs if rx.search(c.id)]


# ---- telemetry helpers ----------------------------------------------------------------------------

def _total(x) -> int | float | None:
    """A counter that may be an int, a per-layer list or a dict of per-layer values -> one number."""
    if x is None:
        return None
    if isinstance(x, bool):
        raise BenchError(f"telemetry counter is a bool ({x!r})")
    if isinstance(x, (int, float)):
        return x
    if isinstance(x, dict):
        if "status" in x:  # already a measure
            return x.get("value") if x.get("status") == bm.OBSERVED else None
        vals = [_total(v) for v in x.values()]
    elif isinstance(x, (list, tuple)):
        vals = [_total(v) for v in x]
    else:
        raise BenchError(f"telemetry counter of unexpected type {type(x).__name__}")
    return None if any(v is None for v in vals) else sum(vals)


def _find(tel: dict, *names: str):
    """First of `names` at the top level of the telemetry dict or one level down."""
    for n in names:
        if n in tel:
            return tel[n]
    for v in tel.values():
        if isinstance(v, dict):
            for n in names:
                if n in v:
                    return v[n]
    return None


def _delta(before: dict, after: dict, *names: str) -> dict:
    a, b = _total(_find(after, *names)), _total(_find(before, *names))
    if a is None or b is None:
        return bm.unknown(f"engine telemetry reports no {names[0]}")
    return bm.observed(a - b)


def _measure_from(tel: dict, *names: str) -> dict:
    v = _find(tel, *names)
    if isinstance(v, dict) and "status" in v:
        return {k: v[k] for k in ("status", "value", "reason", "unit", "source") if k in v}
    v = _total(v)
    return bm.observed(v) if v is not None else bm.unknown(f"engine telemetry reports no {names[0]}")


def _observations(tel: dict, kind: str) -> dict:
    if kind == "hf-bf16":  # nothing in transformers' model is instrumented for the cache contract
        return {n: bm.unsupported("transformers' model has no expert cache to instrument") for n in REQUIRED_ZERO}
    obs = tel.get("observations") or {}
    out = {}
    for n in REQUIRED_ZERO:
        o = obs.get(n)
        if o is None:
            out[n] = bm.unknown("engine telemetry has no such observation")
        else:
            # pass through exactly what instrumentation said; the conformance checks judge it
            out[n] = dict(o) if isinstance(o, dict) else o
    return out


# ---- running ----------------------------------------------------------------------------------------

def make_prompts(vocab_size: int, batch: int, prompt_len: int, seed: int) -> list[list[int]]:
    """Deterministic token ids in [3, vocab): ids 0-2 are special in both presets' tokenizers."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + batch * 1009 + prompt_len)
    ids = torch.randint(3, vocab_size, (batch, prompt_len), generator=g)  # (B, P) int64
    return ids.tolist()


def _generate_kwargs(engine) -> dict:
    """Ask for exactly max_new_tokens per row when the engine can be told to ignore EOS."""
    try:
        params = inspect.signature(engine.generate).parameters
    except (TypeError, ValueError):
        return {}
    kw = {}
    if "temperature" in params:
        kw["temperature"] = 0.0
    if "ignore_eos" in params:
        kw["ignore_eos"] = True
    elif "stop_at_eos" in params:
        kw["stop_at_eos"] = False
    return kw


def _timing_values(t: dict, batch: int, prompt_len: int) -> tuple[float, float, float, int, int]:
    """(prefill tok/s, decode tok/s, ttft s, prompt tokens, new tokens) from engine.last_timing."""
    for k in ("prefill_s", "decode_s", "ttft_s", "new_tokens"):
        if k not in t:
            raise BenchError(f"engine.last_timing lacks {k!r}: {sorted(t)}")
    prompt_tokens = int(t.get("prompt_tokens", batch * prompt_len))
    new_tokens = int(t["new_tokens"])
    if t["prefill_s"] <= 0 or t["decode_s"] <= 0:
        raise BenchError(f"engine.last_timing has a non-positive duration: {t}")
    decode = t.get("decode_tok_s")
    if decode is None:
        decode = new_tokens / t["decode_s"]
    return prompt_tokens / t["prefill_s"], float(decode), float(t["ttft_s"]), prompt_tokens, new_tokens


@dataclasses.dataclass
class RunContext:
    """Facts shared by every record of one `runmap bench` invocation."""

    campaign: str
    run_id: str
    command: str
    device: torch.device
    device_info: dict
    software: dict
    git: dict
    copy_bw: dict

    @classmethod
    def create(cls, campaign: str, device: torch.device, command: str, measure_bandwidth: bool = True) -> "RunContext":
        rid = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ") + "-" + uuid.uuid4().hex[:6]
        bw = bm.copy_bandwidth(device) if measure_bandwidth else bm.unknown("copy bandwidth not measured (--no-bandwidth)")
        return cls(campaign, rid, command, device, bm.device_info(device), bm.software_info(), bm.git_info(), bw)


def run_config(engine, c: BenchConfig, model_cfg: ModelConfig, ctx: RunContext, engine_info: dict) -> dict:
    """Warm up, time `repeats` runs and build the record of one configuration."""
    p = c.p
    prompts = make_prompts(model_cfg.vocab_size, c.batch, c.prompt_len, p["seed"])
    kw = _generate_kwargs(engine)
    peak = bm.PeakMemory(ctx.device)
    peak.reset()
    warm_tokens = min(p["warmup_new_tokens"], c.decode_len)
    warm_key = (ctx.device.type, model_cfg.num_heads, model_cfg.num_kv_heads, model_cfg.head_dim, c.prompt_len,
                c.decode_len, p["max_batch"], p["max_seq_len"])
    eager_first = (p["warmup"] > 0 and ctx.device.type == "cuda" and c.kind != "hf-bf16"
                   and getattr(engine, "use_graphs", True) is False and warm_key not in _WARM_EAGER)
    if eager_first:
        # Eager decode (no CUDA graph: partial residency, the fp16 baseline) may compile a kernel variant per
        # KV length on first use (H200 campaign of 2026-11-29: the fused decode-attention kernel takes the
        # key count as a constexpr, ~0.3 s per length). The first eager configuration of the process warms
        # up over every decode length the timed runs will reach, so they measure steady state.
        warm_tokens = c.decode_len
        _WARM_EAGER.add(warm_key)
    for _ in range(p["warmup"]):
        engine.generate(prompts, max_new_tokens=warm_tokens, **kw)
    tel0 = engine.telemetry()
    prefill, decode, ttft = [], [], []
    prompt_tokens = new_tokens = 0
    cap = p.get("max_config_s")
    notes = []
    with bm.Stopwatch(ctx.device) as sw:
        for i in range(p["repeats"]):
            engine.generate(prompts, max_new_tokens=c.decode_len, **kw)
            pf, dc, tt, prompt_tokens, new_tokens = _timing_values(dict(engine.last_timing), c.batch, c.prompt_len)
            prefill.append(pf)
            decode.append(dc)
            ttft.append(tt)
            if cap is not None and i + 1 < p["repeats"] and time.perf_counter() - sw.t0 > cap:
                notes.append(f"timed repeats cut to {i + 1} of {p['repeats']}: {time.perf_counter() - sw.t0:.1f} s "
                             f"> max_config_s {cap} (the campaign's time budget)")
                break
    tel1 = engine.telemetry()
    mem = peak.read()
    if new_tokens != c.batch * c.decode_len:
        notes.append(f"a timed run generated {new_tokens} tokens, not batch x decode_len = {c.batch * c.decode_len} "
                     "(the engine stopped rows at EOS); tok/s use the tokens actually generated")

    reported_exec = tel1.get("executor")
    if c.kind == "engine" and reported_exec is not None and reported_exec != c.executor:
        raise BenchError(f"{c.id}: asked for executor {c.executor!r}, engine telemetry says {reported_exec!r}")
    reported_regime = tel1.get("regime")
    if reported_regime is not None and reported_regime != c.regime:
        raise BenchError(f"{c.id}: configuration regime {c.regime!r}, engine telemetry says {reported_regime!r}")

    hits, misses = _delta(tel0, tel1, "hits"), _delta(tel0, tel1, "misses")
    if bm.is_observed(hits) and bm.is_observed(misses) and hits["value"] + misses["value"] > 0:
        hit_rate = bm.observed(hits["value"] / (hits["value"] + misses["value"]))
    else:
        hit_rate = bm.unknown("no expert lookups observed" if bm.is_observed(hits) else "hits/misses not reported")
    h2d = _delta(tel0, tel1, "bytes_h2d", "h2d_bytes")
    h2d_s = _delta(tel0, tel1, "h2d_seconds", "h2d_s", "transfer_s")
    if bm.is_observed(h2d) and bm.is_observed(h2d_s) and h2d_s["value"] > 0:
        h2d_rate = bm.observed(h2d["value"] / h2d_s["value"] / 1e9)
    elif bm.is_observed(h2d) and h2d["value"] == 0:
        h2d_rate = bm.unknown("no host->device expert bytes in the timed runs")
    else:
        h2d_rate = bm.unknown("engine telemetry reports no host->device transfer time")
    gen_tokens = new_tokens * len(decode)
    h2d_per_tok = bm.observed(h2d["value"] / gen_tokens) if bm.is_observed(h2d) and gen_tokens else bm.unknown("no h2d bytes")
    if c.kind in BASELINE_KINDS:
        no_cache = bm.unsupported("transformers' model has no expert cache" if c.kind == "hf-bf16" else
                                  "the fp16-expert baseline runs no expert cache (experts dequantized on the device)")
        hits = misses = hit_rate = h2d = h2d_rate = h2d_per_tok = no_cache
        cache = {k: no_cache for k in ("resident_bytes", "spare_bytes", "staging_bytes")}
        if c.kind == "engine-fp16":
            cache["resident_bytes"] = _measure_from(tel1, "resident_bytes")  # the dequantized fp16 experts
    else:
        cache = {k: _measure_from(tel1, k) for k in ("resident_bytes", "spare_bytes", "staging_bytes")}

    floor = bm.byte_floor(model_cfg, c.expert_format, c.batch, ctx.copy_bw)
    dec_stats = bm.repeat_stats(decode)
    rec = {
        "record_version": RECORD_VERSION,
        "id": c.id,
        "campaign": ctx.campaign,
        "group": c.group,
        "run_id": ctx.run_id,
        "command": ctx.command,
        "created_utc": utc_timestamp(),
        "kind": c.kind,
        "executor": c.executor,
        "regime": c.regime,
        "config": {
            "model": c.model, "preset": c.preset, "arch": model_cfg.arch, "num_layers": model_cfg.num_layers,
            "experts_per_layer": c.experts_per_layer, "top_k": model_cfg.top_k, "resident": c.resident,
            "expert_format": c.expert_format, "block_size": engine_info.get("block_size"),
            "batch": c.batch, "prompt_len": c.prompt_len, "decode_len": c.decode_len,
            "repeats": len(decode), "warmup": p["warmup"], "max_batch": p["max_batch"],
            "max_seq_len": p["max_seq_len"], "policy": p["policy"] if c.kind == "engine" else None,
            "seed": p["seed"], "pack": engine_info.get("pack"), "checkpoint": engine_info.get("checkpoint"),
        },
        "device": ctx.device_info,
        "software": ctx.software,
        "git": ctx.git,
        "memory": {**mem, "scope": "warmup + timed runs on an already built engine (torch allocator peaks)"},
        "cache": cache,
        "timing": {
            "prefill_tok_s": bm.repeat_stats(prefill),
            "decode_tok_s": dec_stats,
            "ttft_s": bm.repeat_stats(ttft),
            "prompt_tokens": prompt_tokens,
            "new_tokens": new_tokens,
        },
        "cache_stats": {"hits": hits, "misses": misses, "hit_rate": hit_rate},
        "h2d": {"bytes": h2d, "gb_s": h2d_rate, "bytes_per_token": h2d_per_tok},
        "observations": _observations(tel1, c.kind),
        "byte_floor": floor,
        "ratios": {"decode_vs_byte_floor": bm.ratio(bm.observed(dec_stats["median"]), floor["floor_decode_tok_s"],
                                                    "decode tok/s over byte floor")},
        "engine": {**{k: v for k, v in engine_info.items() if k not in ("pack", "checkpoint")},
                   "timed_wall_s": sw.seconds, "reported_executor": reported_exec,
                   "warmup_new_tokens": warm_tokens if p["warmup"] else 0,
                   "full_length_warmup": eager_first},
    }
    if notes:
        rec["notes"] = notes
    return rec


def attach_ratios(records: list[dict]) -> list[dict]:
    """Fill ratios to each baseline: same model, batch, prompt and decode lengths, same run."""
    base: dict[tuple, dict] = {}
    for r in records:
        if r["kind"] in BASELINE_KINDS:
            key = (r["run_id"], r["config"]["model"], r["config"]["batch"], r["config"]["prompt_len"],
                   r["config"]["decode_len"], r["kind"])
            base.setdefault(key, r)
    for r in records:
        cfgd = r["config"]
        for kind in BASELINE_KINDS:
            if r["kind"] == kind:
                continue
            b = base.get((r["run_id"], cfgd["model"], cfgd["batch"], cfgd["prompt_len"], cfgd["decode_len"], kind))
            if b is None:
                why = f"no {kind} baseline with the same model, batch and lengths in run {r['run_id']}"
                r["ratios"][f"decode_vs_{kind}"] = bm.unknown(why)
                r["ratios"][f"peak_allocated_vs_{kind}"] = bm.unknown(why)
                continue
            r["ratios"][f"decode_vs_{kind}"] = bm.ratio(
                bm.observed(r["timing"]["decode_tok_s"]["median"]), bm.observed(b["timing"]["decode_tok_s"]["median"]),
                f"decode tok/s over {kind}")
            r["ratios"][f"peak_allocated_vs_{kind}"] = bm.ratio(
                r["memory"]["peak_allocated_bytes"], b["memory"]["peak_allocated_bytes"], f"peak allocated over {kind}")
    return records


# ---- engines --------------------------------------------------------------------------------------

EngineFactory = Callable[[BenchConfig, dict, torch.device], tuple[Any, dict]]


_WARM_EAGER: set[tuple] = set()  # eager-decode shapes already warmed up over the full decode length
_HOST_SOURCES: dict[str, Any] = {}  # resolved pack dir -> HostSource built (and hash-verified) once


@contextlib.contextmanager
def shared_host_source(pack: str | Path):
    """While active, ExpertCache.from_pack reuses the HostSource already built from this pack in this
    process instead of reading and hash-verifying every expert again.

    Why: building the host source of a real-size pack (read, page-touch, per-expert sha256 of 3.3 GB for
    OLMoE, 6.3 GB for Qwen) takes 5-15 s, repeated for each of the campaign's residency/executor engines.
    The host source is immutable after startup (contract rule 1) and no cache writes to it, so a later
    cache over the same pack reads exactly the same bytes; everything else in Engine.from_pack (weights,
    residency, spares, staging, max_group, executor) runs unchanged. The fresh reader is closed and watched by
    the host source (its reads count in request_pack_reads), and the identities must agree."""
    from runmap.residency import cache as cache_mod
    from runmap.residency.host_source import HostSource

    key = str(Path(pack).resolve())
    original = cache_mod.ExpertCache.__dict__["from_pack"]

    def from_pack(cls, reader, **kw):
        host = _HOST_SOURCES.get(key)
        if host is None:
            host = _HOST_SOURCES[key] = HostSource.from_pack(reader)
        else:
            ident = getattr(reader, "identity", None)
            host.watch_reader(reader)  # closed, and observed by every cache over the shared host source
            if ident != host.identity:
                raise BenchError(f"{pack}: pack identity {ident!r} differs from the shared host source's "
                                 f"{host.identity!r}; the pack changed during the campaign")
        return cls(host, **kw)

    cache_mod.ExpertCache.from_pack = classmethod(from_pack)
    try:
        yield
    finally:
        cache_mod.ExpertCache.from_pack = original


def default_engine_factory(c: BenchConfig, model_entry: dict, device: torch.device):
    """Build the engine (or baseline) of a configuration. Returns (engine, info for the record)."""
    p = c.p
    if c.kind == "hf-bf16":
        from runmap.bench.baselines import HFBaseline

        cfg = load_preset(c.preset)[0]
        eng = HFBaseline(cfg, device=device, checkpoint=model_entry.get("checkpoint"), seed=p["seed"])
        return eng, {"checkpoint": model_entry.get("checkpoint"), "pack": None, "block_size": None,
                     "load_s": eng.load_s, "weights": eng.weights_source}
    from runmap.engine.engine import Engine

    pack = model_entry.get("pack")
    if not pack or not Path(pack).is_dir():
        raise BenchError(f"{c.id}: model {c.model!r} has no pack directory ({pack!r}); give --pack {c.model}=DIR")
    kw = dict(executor=c.executor if c.kind == "engine" else "grouped",
              resident=None if c.regime == "full" else c.resident, device=device,
              max_batch=p["max_batch"], max_seq_len=p["max_seq_len"], policy=p["policy"],
              expert_format="int4" if c.kind == "engine" else "fp16")
    t0 = time.perf_counter()
    shared = str(Path(pack).resolve()) in _HOST_SOURCES
    with shared_host_source(pack):
        eng = Engine.from_pack(pack, **kw)
    bm.sync(device)
    load_s = time.perf_counter() - t0
    block = None
    man = Path(pack) / "manifest.json"
    if man.is_file():
        try:
            m = json.loads(man.read_text())
            block = m.get("block_size", (m.get("quantization") or {}).get("block_size"))
        except (OSError, ValueError):
            block = None
    info = {"pack": str(pack), "checkpoint": model_entry.get("checkpoint"), "block_size": block, "load_s": load_s,
            "cuda_graphs": bool(getattr(eng, "use_graphs", False)),
            "host_source": ("reused: built and hash-verified by an earlier engine of this run" if shared
                            and c.kind == "engine" else "built by this engine")}
    tok = getattr(eng, "tokenizer", None)
    if tok is not None and hasattr(tok, "eos_ids"):
        # Synthetic weights emit EOS at random; a row that stops early still occupies the batch but its
        # tokens stop counting. Stopping is a sampling-loop decision, not model arithmetic, so the bench
        # disables it: every row decodes exactly decode_len tokens.
        tok.eos_ids = frozenset()
        info["eos_stopping"] = "disabled by the bench (every row decodes decode_len tokens)"
    return eng, info


def _close(engine) -> None:
    close = getattr(engine, "close", None)
    if callable(close):
        close()


def _free_device(device: torch.device) -> None:
    """After the last reference to an engine is dropped: collect cycles and hand cached blocks back, so
    the next configuration's reserved-memory peak does not include a previous engine's cache."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def run_campaign(spec: dict, out_root: Path, *, configs: list[BenchConfig] | None = None,
                 device: str | None = None, packs: dict | None = None, checkpoints: dict | None = None,
                 engine_factory: EngineFactory | None = None, command: str | None = None,
                 deadline_s: float | None = None, keep_going: bool = False, progress: bool = True,
                 measure_bandwidth: bool = True) -> dict:
    """Run the configurations (default: all of the spec) and write records + campaign.json under
    out_root/<name>/. Returns the campaign summary (also written)."""
    from tqdm import tqdm

    t_start = time.perf_counter()
    configs = expand(spec) if configs is None else configs
    dev = bm.resolve_device(device or spec["device"])
    models = {k: dict(v) for k, v in spec["models"].items()}
    for k, v in (packs or {}).items():
        models.setdefault(k, {})["pack"] = v
    for k, v in (checkpoints or {}).items():
        models.setdefault(k, {})["checkpoint"] = v
    factory = engine_factory or default_engine_factory
    camp_dir = Path(out_root) / spec["name"]
    rec_dir = camp_dir / "records"
    rec_dir.mkdir(parents=True, exist_ok=True)
    ctx = RunContext.create(spec["name"], dev, command or shlex.join(["runmap", *sys.argv[1:]]), measure_bandwidth)
    presets = {m: load_preset(models[m]["preset"])[0] for m in {c.model for c in configs}}

    done, failed, skipped, records = [], [], [], []
    engine, key, info = None, None, {}
    bar = tqdm(configs, desc=f"bench {spec['name']}", unit="cfg", disable=not progress, dynamic_ncols=True)
    try:
        for c in bar:
            if deadline_s is not None and time.perf_counter() - t_start > deadline_s:
                skipped.append({"id": c.id, "reason": f"deadline of {deadline_s:.0f} s reached"})
                continue
            bar.set_postfix_str(c.id[-48:])
            try:
                if key != c.engine_key():
                    if engine is not None:
                        _close(engine)
                        engine = None
                        _free_device(dev)
                    key = None
                    engine, info = factory(c, models[c.model], dev)
                    _free_device(dev)  # load-time temporaries must not count in the run's reserved peak
                    key = c.engine_key()
                rec = run_config(engine, c, presets[c.model], ctx, info)
            except Exception as e:  # noqa: BLE001 - recorded, then re-raised unless --keep-going
                failed.append({"id": c.id, "error": f"{type(e).__name__}: {e}"})
                if engine is not None:
                    _close(engine)
                engine, key = None, None
                _free_device(dev)
                if not keep_going:
                    raise
                continue
            write_json(rec_dir / f"{c.id}.json", rec, indent=1)
            records.append(rec)
            done.append(c.id)
            if not progress:  # one line per configuration for logs
                mem = rec["memory"]["peak_allocated_bytes"]
                print(f"[{len(done) + len(failed)}/{len(configs)} {time.perf_counter() - t_start:6.1f}s] {c.id}: "
                      f"decode {rec['timing']['decode_tok_s']['median']:.1f} tok/s, prefill "
                      f"{rec['timing']['prefill_tok_s']['median']:.0f} tok/s, peak "
                      f"{mem['value'] / 2**30:.2f} GiB" if bm.is_observed(mem) else f"{c.id}: decode "
                      f"{rec['timing']['decode_tok_s']['median']:.1f} tok/s", flush=True)
            bar.set_postfix_str(f"{c.id[-32:]} {rec['timing']['decode_tok_s']['median']:.1f} tok/s")
    finally:
        if engine is not None:
            _close(engine)
            engine = None
            _free_device(dev)
        # ratios need every record of the run: rewrite them once all configurations finished
        for r in attach_ratios(records):
            write_json(rec_dir / f"{r['id']}.json", r, indent=1)
        accounted = set(done) | {f["id"] for f in failed} | {s["id"] for s in skipped}
        skipped += [{"id": c.id, "reason": "not run: the campaign was interrupted (deadline watchdog or Ctrl-C)"}
                    for c in configs if c.id not in accounted]
        summary = {
            "campaign": spec["name"], "description": spec["description"], "run_id": ctx.run_id,
            "command": ctx.command, "device": ctx.device_info, "software": ctx.software, "git": ctx.git,
            "copy_bandwidth_gb_s": ctx.copy_bw, "budget_note": spec.get("budget_note"),
            "wall_s": time.perf_counter() - t_start, "configs": len(configs),
            "done": done, "failed": failed, "skipped": skipped,
        }
        write_json(camp_dir / "campaign.json", summary, indent=1)
    return summary


def load_records(*dirs: str | Path) -> list[dict]:
    """Every record (*.json) below the given directories (a records/ dir or any parent of one)."""
    out = []
    for d in dirs:
        d = Path(d)
        files = [d] if d.is_file() else sorted(p for p in d.rglob("*.json") if p.parent.name == "records")
        for f in files:
            try:
                doc = json.loads(f.read_text())
            except (OSError, ValueError) as e:
                raise BenchError(f"{f}: not a readable JSON record: {e}") from e
            if isinstance(doc, dict) and doc.get("record_version") == RECORD_VERSION:
                doc["_path"] = str(f)
                out.append(doc)
    return out
