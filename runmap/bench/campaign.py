"""The benchmark campaign runner: expand a campaign spec into configurations, run each one on the
engine (or a baseline), and write one JSON record per configuration (schemas/bench-record.schema.json).

Spec: specs/campaigns/*.yaml (schemas/campaign-spec.schema.json). A group is the cartesian product
model x resident x executor x batch x prompt_len x decode_len; configurations with the same id in two
groups run once (the first group names it). Configurations that share an engine (same model, kind,
executor, residency) run back to back on one engine instance, so the host source is built once.

What one configuration measures (all on the campaign's device, figures of the same run only):
  warmup runs (untimed: kernel compilation, cache fill), then `repeats` timed runs of
  Engine.run(prompts (batch, prompt_len), max_new_tokens=decode_len, ignore_eos=True); decode tok/s is the
  median with min and max; peak memory spans warmup + timed runs on an engine that is already built; cache
  hits, misses and host->device bytes are EngineStats deltas over the timed runs only; the byte floor uses
  the device copy bandwidth measured at the start of the same run. With `check: true` the logits of one
  prompt are compared with the reference executor's (and, on CUDA, with torch ops instead of the fused ones).

Baselines: transformers' bf16 model eager (kind hf-bf16) and with a static KV cache and its decode step under
torch.compile (kind hf-bf16-compile; compilation happens in the warmup and is recorded apart, in
``baseline.compile_s``, never in tok/s), and the engine with FP16 experts (engine-fp16). Every record gets
the ratio to each baseline of the same run, and engine records ``ratios.decode_vs_strongest_baseline``: the
ratio to the fastest transformers path measured for their model, batch and lengths, naming it.

With ``profile: true`` a record also carries ``profile``: the per-kernel breakdown (torch.profiler) of one
prefill and of one decode step of the configuration, measured after the timed runs (runmap.bench.profile).

Variants (run parameters cuda_graphs, fused, skip_experts) are engine construction options; a
configuration with non-default ones carries a suffix in its id (``__nographs``, ``__torchops``,
``__skipexperts``, ``__fused-<ops>``) and ``config.variant`` names it.

The bench talks to the engine only through its typed interface (``Engine.from_pack`` arguments,
``Engine.run`` -> GenerationRun, ``Engine.stats`` -> EngineStats, ``Engine.logits``); the transformers
baseline is wrapped to the same interface here. Output is written to a hidden directory beside the
campaign directory and moved into place at the end; an existing campaign is never overwritten without
``overwrite=True``, and never by a run that failed.

This module imports neither jsonschema nor snakemake (it runs on the GPU machine); spec validation
happens in ``load_spec`` only when jsonschema is importable.
"""
from __future__ import annotations

import dataclasses
import datetime as _dt
import gc
import itertools
import json
import os
import re
import shlex
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path
from types import MappingProxyType
from typing import Any, Callable, Protocol

import torch
import yaml

from runmap.bench import metrics as bm
from runmap.workload.routing import RoutingError, parse_routing
from runmap.arch.config import ModelConfig, load_preset
from runmap import atomic
from runmap.atomic import remove_stale_temporaries, write_json
from runmap.bench.baselines import BaselineUnavailable
from runmap.bench.checks import RECORD_VERSION, RECORD_VERSIONS  # what it writes, what it reads
from runmap.bench.registry import BASELINE_KINDS, HF_KINDS
from runmap.engine.engine import DEFAULT_FUSED, FUSED_OPS, LENDING_PLACEMENTS, is_count
from runmap.engine.generation import GenerationResult, GenerationRun
from runmap.engine.telemetry import DECODE_PATHS, PREFILL_PATHS, EngineStats
from runmap.kernels.common import chained
from runmap.provenance import utc_timestamp
from runmap.residency.observations import OBSERVATION_NAMES as REQUIRED_ZERO
from runmap.residency.regimes import regime_of

DEFAULT_PARAMS = {"repeats": 3, "warmup": 1, "warmup_new_tokens": 4, "policy": None, "seed": 0,
                  "cuda_graphs": True, "fused": True, "skip_experts": False, "check": False,
                  "check_prompt_len": 24, "check_tolerance": 0.01, "check_min_route_agreement": 0.5,
                  "routing": "model",
                  "cache_contract": "v1", "gpu_budget": None, "expert_placement": "gpu", "prefetch": False,
                  "emulate_link_gb_s": None, "matched_n_cpu_moe": None, "max_group": None, "two_site_share": None,
                  "host_read_spares": None, "two_site_min_batch": None, "profile": False, "profile_top": 12}
VARIANT_PARAMS = ("cuda_graphs", "fused", "skip_experts", "routing", "cache_contract", "expert_placement", "prefetch",
                  "emulate_link_gb_s", "two_site_share", "host_read_spares", "two_site_min_batch")
CHECK_EXECUTOR = "reference"


def _site_record(st: EngineStats, d) -> dict | None:
    """The record's ``sites`` block: what the CPU site and next-layer prefetch did in this configuration's timed runs
    (``d``: the counter deltas over them; the engine may be shared with other rows) and the placement's plan
    (``st``: the stats after them), and the decode steps by the path that ran them. None when neither was on and
    every decode step was a full-residency CUDA graph (or there was none): a partial-residency row always says which
    path decoded it (the one-lease chain, the grouped chain, per call)."""
    steps = {k: getattr(d, f"decode_steps_{k}") for k in DECODE_PATHS}
    if st.placement is None and not st.prefetch and not any(v for k, v in steps.items() if k != "graphs"):
        return None
    out = {"expert_placement": st.placement["mode"] if st.placement is not None else "gpu", "prefetch": st.prefetch,
           "decode_steps": steps}
    if st.placement is not None:
        out["placement"] = dict(st.placement)
        out["cpu_site_experts"] = d.cpu_site_experts
        if st.placement["mode"] in ("host-read", "two-site"):
            out.update(host_reads=d.decode_host_reads, host_read_bytes=d.decode_host_read_bytes,
                       prefill_host_reads=d.prefill_host_reads, prefill_host_read_bytes=d.prefill_host_read_bytes,
                       promotions=d.promotions)
    if st.prefetch:
        n = d.prefetched_experts
        out.update({"prefetches": d.prefetches, "prefetched_experts": n, "prefetch_used": d.prefetch_used,
                    "prefetches_skipped": d.prefetches_skipped, "prefetches_aborted": d.prefetches_aborted,
                    # of the experts the timed runs' prefetches moved, the share a lease used in them, and the bytes
                    # of the rest (an expert prefetched near the end may still be used later: an upper bound)
                    "prefetch_accuracy": min(1.0, d.prefetch_used / n) if n else None,
                    "prefetch_wasted_bytes": max(0, n - d.prefetch_used) * st.row_bytes})
    return out


class BenchError(RuntimeError):
    """A campaign spec or a configuration cannot be run as written."""


class UsageError(BenchError):
    """A command-line argument does not fit the spec (bad --only regex, --pack of an unknown model)."""


class OutputExistsError(BenchError):
    """The campaign directory already holds a campaign; nothing was written (pass overwrite to replace it)."""


# ---- spec ---------------------------------------------------------------------------------------

def load_spec(path: str | Path, validate: bool = True) -> dict:
    """Parse a campaign YAML; validate it against campaign-spec.schema.json when jsonschema exists."""
    path = Path(path)
    try:
        spec = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise BenchError(f"{path}: cannot read campaign spec: {e}") from e
    if validate:
        from runmap.conformance.schemas import validate_document

        try:
            bad = validate_document(spec, "campaign-spec", file=str(path))
        except ModuleNotFoundError:  # jsonschema (imported on first use) is absent on the GPU machine; CI validated the spec
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
    kind: str  # engine | engine-fp16 | hf-bf16 | hf-bf16-compile
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
        return regime_of(self.resident, self.experts_per_layer)

    @property
    def expert_format(self) -> str:
        return {"engine": "int4", "engine-fp16": "fp16", "hf-bf16": "bf16", "hf-bf16-compile": "bf16"}[self.kind]

    @property
    def variant(self) -> str:
        return variant_tag(self.p)

    def engine_key(self) -> tuple:
        """Configurations with equal keys can share one engine instance."""
        p = self.p
        return (self.model, self.kind, self.executor, self.resident, p.get("max_batch"), p.get("max_seq_len"),
                p.get("policy"), p.get("gpu_budget"), p.get("max_group")) + tuple(p.get(k) for k in VARIANT_PARAMS)


def _fused_tuple(v) -> tuple:
    """The fused-ops run parameter (true = the engine default, false = none, or a list) as a sorted tuple."""
    if v is True:
        return tuple(sorted(DEFAULT_FUSED))
    if v is False or v is None:
        return ()
    bad = sorted(set(v) - set(FUSED_OPS))
    if bad:
        raise BenchError(f"fused ops {bad} unknown; choose from {list(FUSED_OPS)}")
    return tuple(sorted(set(v)))


def variant_tag(p: dict) -> str:
    """'default', or the non-default engine options of a configuration joined by '.' (also its id suffix)."""
    parts = []
    if p.get("cuda_graphs") is False:
        parts.append("nographs")
    fused = p.get("fused", tuple(sorted(DEFAULT_FUSED)))
    if tuple(fused) != tuple(sorted(DEFAULT_FUSED)):
        parts.append("-".join(("fused",) + tuple(fused)) if fused else "torchops")
    if p.get("skip_experts"):
        parts.append("skipexperts")
    if p.get("cache_contract", "v1") != "v1":
        parts.append("contract-" + p["cache_contract"])
    if p.get("expert_placement", "gpu") != "gpu":
        parts.append("placement-" + p["expert_placement"])
    if p.get("prefetch"):
        parts.append("prefetch")
    if p.get("two_site_share") is not None:  # 0.5 -> share0p5
        parts.append("share" + f"{p['two_site_share']:g}".replace(".", "p"))
    if p.get("host_read_spares") is not None:  # 2 -> hrspares2
        parts.append(f"hrspares{p['host_read_spares']}")
    if p.get("two_site_min_batch") is not None:  # 1 -> sitesb1
        parts.append(f"sitesb{p['two_site_min_batch']}")
    if p.get("max_group") is not None and p.get("matched_n_cpu_moe") is None:  # (a matched row's is implied)
        parts.append(f"maxgroup{p['max_group']}")
    if p.get("emulate_link_gb_s") is not None:  # 13 -> link13gbs; 12.5 -> link12p5gbs
        parts.append("link" + f"{p['emulate_link_gb_s']:g}".replace(".", "p") + "gbs")
    routing = p.get("routing", "model")
    if routing != "model":  # calibrated:qwen2_moe -> routing-calibrated-qwen2-moe; trace:dir/a.json -> routing-trace-a
        name = routing if not routing.startswith("trace:") else "trace:" + Path(routing[6:]).stem
        parts.append("routing-" + re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-"))
    return ".".join(parts) or "default"


def config_id(model: str, kind: str, executor: str, resident: int | str, batch: int, prompt_len: int, decode_len: int,
              variant: str = "default") -> str:
    """resident: experts per layer (``r<N>``), or the tag of a GPU budget (``budget-16gib``: the plan decides N,
    which the record's config.resident then gives)."""
    res = f"r{resident}" if isinstance(resident, int) else resident
    cid = f"{model}__{kind}__{executor}__{res}__b{batch}__p{prompt_len}__d{decode_len}"
    return cid if variant == "default" else f"{cid}__{variant}"


BUDGET_RESIDENT = "budget"  # a group's `resident` when its run parameter gpu_budget decides the residency
MATCHED_RESIDENT = "ncmoe"  # a group's `resident` when the run parameter matched_n_cpu_moe decides the residency


def matched_resident(cfg: ModelConfig, n_cpu_moe: int) -> int:
    """Experts per layer resident on the GPU so that the engine's GPU expert rows hold what llama.cpp's
    ``--n-cpu-moe n_cpu_moe`` keeps there (the expert tensors of the first n_cpu_moe MoE layers stay in host memory):
    T = E x (L - n) / L rows per layer, rounded down. Partial residency also holds ``max_group`` spare rows per layer
    (where misses land before publication); a matched row runs with the least, top_k (matched_max_group), so
    resident = T - top_k. Never below top_k (one token's experts must fit): from T < 2 top_k on the engine holds more
    than llama.cpp (at n = L llama.cpp holds none; the record's notes say so). n = 0 is full residency (no spares)."""
    layers, e, k = cfg.num_layers, cfg.num_experts, cfg.top_k
    rows = e * (layers - min(n_cpu_moe, layers)) // layers
    return e if rows >= e else max(k, rows - k)


def matched_max_group(cfg: ModelConfig, n_cpu_moe: int) -> int | None:
    """The engine's max_group (spare rows per layer) of a matched row: top_k under partial residency, None (the
    engine's own choice; full residency has no spares) at n = 0."""
    return None if matched_resident(cfg, n_cpu_moe) >= cfg.num_experts else cfg.top_k


def _matched(v, group: str, cfg: ModelConfig) -> list[int]:
    """The matched_n_cpu_moe run parameter (an integer or a list) as integers in [0, num_layers]."""
    out = []
    for x in _as_list(v):
        if isinstance(x, bool) or not isinstance(x, int) or not 0 <= x <= cfg.num_layers:
            raise BenchError(f"group {group!r}: matched_n_cpu_moe {x!r}: expected an integer in [0, "
                             f"{cfg.num_layers}] (llama.cpp's --n-cpu-moe over this model's {cfg.num_layers} layers)")
        out.append(x)
    return out


def budget_tag(nbytes: int) -> str:
    """'budget-16gib' for 16 GiB (binary units when exact, else bytes): the id part of a budget configuration."""
    for shift, unit in ((40, "tib"), (30, "gib"), (20, "mib")):
        if nbytes % (1 << shift) == 0:
            return f"budget-{nbytes >> shift}{unit}"
    return f"budget-{nbytes}b"


def _budgets(v, group: str) -> list[int]:
    """The gpu_budget run parameter (a size, e.g. "16GiB", or a list of sizes) as bytes."""
    from runmap.engine.budget import BudgetError, parse_size

    try:
        return [parse_size(x) if isinstance(x, str) else int(x) for x in _as_list(v)]
    except (BudgetError, TypeError, ValueError) as e:
        raise BenchError(f"group {group!r}: gpu_budget: {e}") from None


def nonrouted_fp16_bytes(cfg: ModelConfig) -> int:
    """FP16 bytes of the non-routed tensors (a pack's non-routed file less its small header)."""
    return sum(2 * int(torch.Size(s).numel()) for s in cfg.adapter.nonrouted_tensors(cfg).values())


def plan_budget(cfg: ModelConfig, budget: int, max_batch: int, max_seq_len: int, pack: str | None = None):
    """The engine's GPU-budget plan (runmap.engine.budget) of a configuration: from the pack's manifest when the
    pack is at hand, else from the preset (block 256, the non-routed FP16 bytes without the file's header; the
    engine builder checks that the pack's own plan agrees)."""
    from runmap.engine.budget import BudgetError, plan, plan_for_pack
    from runmap.format.packfile import is_pack_dir
    from runmap.format.qpack import DEFAULT_BLOCK_SIZE, RowLayout

    try:
        if pack and is_pack_dir(Path(pack)):
            return plan_for_pack(pack, budget, max_batch=max_batch, max_seq_len=max_seq_len)
        row_bytes = RowLayout.build(cfg.hidden_size, cfg.moe_intermediate_size, DEFAULT_BLOCK_SIZE).row_bytes
        return plan(cfg, row_bytes, nonrouted_fp16_bytes(cfg), budget, max_batch=max_batch, max_seq_len=max_seq_len)
    except BudgetError as e:
        raise BenchError(str(e)) from None


def expand(spec: dict, packs: dict | None = None) -> list[BenchConfig]:
    """Every configuration of the spec in run order, duplicates (same id) dropped. ``packs`` (model -> pack
    directory, the spec's own ``pack`` entries otherwise) lets a gpu_budget configuration take its residency from
    the pack's manifest; without one it comes from the preset."""
    defaults = {**DEFAULT_PARAMS, **spec.get("defaults", {})}
    presets = {name: load_preset(m["preset"])[0] for name, m in spec["models"].items()}
    out: dict[str, BenchConfig] = {}
    for g in spec["groups"]:
        params = {**defaults, **g.get("params", {})}
        for model in g["models"]:
            cfg = presets[model]
            e = cfg.num_experts
            budgets = _budgets(params["gpu_budget"], g["name"]) if params.get("gpu_budget") is not None else []
            matched = _matched(params["matched_n_cpu_moe"], g["name"], cfg) \
                if params.get("matched_n_cpu_moe") is not None else []
            if matched and g["kind"] != "engine":
                raise BenchError(f"group {g['name']!r}: matched_n_cpu_moe is an engine option; a {g['kind']} "
                                 "baseline runs its own path")
            if g["kind"] == "engine":
                residents = [e if r == "full" else r for r in _as_list(g["resident"])]
                executors = g["executors"]
                if matched or MATCHED_RESIDENT in residents:
                    if residents != [MATCHED_RESIDENT] or not matched or budgets:
                        raise BenchError(f"group {g['name']!r}: llama.cpp's --n-cpu-moe decides the residency: give "
                                         f"resident: {MATCHED_RESIDENT} together with the run parameter "
                                         f"matched_n_cpu_moe (and no other resident, no gpu_budget), got resident "
                                         f"{g['resident']!r}, matched_n_cpu_moe {params.get('matched_n_cpu_moe')!r}")
                    residents = []
                if budgets or BUDGET_RESIDENT in residents:
                    if residents != [BUDGET_RESIDENT] or not budgets:
                        raise BenchError(f"group {g['name']!r}: a GPU budget decides the residency: give resident: "
                                         f"{BUDGET_RESIDENT} together with the run parameter gpu_budget (and no other "
                                         f"resident), got resident {g['resident']!r}, gpu_budget "
                                         f"{params.get('gpu_budget')!r}")
                    residents = []
            else:
                residents, executors = [e], [BASELINE_KINDS[g["kind"]]]
                if budgets:
                    raise BenchError(f"group {g['name']!r}: gpu_budget is an engine option; a {g['kind']} baseline "
                                     "runs its own path")
            for r in residents:
                if r > e:
                    raise BenchError(f"group {g['name']!r}: resident {r} > {e} experts per layer of {model}")
                if r < cfg.top_k:
                    raise BenchError(f"group {g['name']!r}: resident {r} < top_k {cfg.top_k} of {model} (one token's "
                                     f"routed experts must fit); resident must be in [{cfg.top_k}, {e}]")
            gp = dict(params)
            gp["fused"] = _fused_tuple(gp["fused"])
            try:  # 'calibrated' alone means the model's family: resolved here so ids and records name it
                gp["routing"] = parse_routing(gp["routing"], default_family=cfg.arch).name
            except RoutingError as e:
                raise BenchError(f"group {g['name']!r}: {e}") from None
            if g["kind"] != "engine":
                odd = [k for k in VARIANT_PARAMS + ("check",) if gp[k] != DEFAULT_PARAMS.get(k)
                       and not (k == "fused" and gp[k] == _fused_tuple(True))]
                if odd:
                    raise BenchError(f"group {g['name']!r}: {odd} are engine options; a {g['kind']} baseline "
                                     "runs its own path")
            if gp.get("two_site_share") is not None and gp.get("expert_placement") != "two-site":
                raise BenchError(f"group {g['name']!r}: two_site_share fixes placement two-site's CPU share; "
                                 f"expert_placement is {gp.get('expert_placement', 'gpu')!r}")
            if gp.get("host_read_spares") is not None and gp.get("expert_placement") not in LENDING_PLACEMENTS:
                raise BenchError(f"group {g['name']!r}: host_read_spares lends placement host-read's idle spare rows to "
                                 f"residency (host-read, two-site or auto); expert_placement is "
                                 f"{gp.get('expert_placement', 'gpu')!r}")
            for name in ("host_read_spares", "two_site_min_batch"):  # (the schema takes 1.0 for an integer)
                v = gp.get(name)
                if v is not None and not is_count(v):
                    raise BenchError(f"group {g['name']!r}: {name} {v!r}: allowed values are integers >= 1")
            if gp.get("two_site_min_batch") is not None and gp.get("expert_placement") != "auto":
                raise BenchError(f"group {g['name']!r}: two_site_min_batch is the smallest batch auto's step "
                                 f"chooser may run two-site steps at; expert_placement is "
                                 f"{gp.get('expert_placement', 'gpu')!r}")
            if gp["check"] and gp["skip_experts"]:
                raise BenchError(f"group {g['name']!r}: check with skip_experts compares zeroed experts with the "
                                 "reference; drop one of them")
            # spec order is run order (put what matters most first: a --deadline-s run skips the tail); a budget
            # entry's residency is planned below, once the engine's capacity (max_batch, max_seq_len) is known
            # (resident, gpu budget, matched --n-cpu-moe): one of the three decides the residency
            entries = [(r, None, None) for r in residents] + [(-1, nb, None) for nb in budgets] + \
                [(matched_resident(cfg, n), None, n) for n in matched]
            for (r, nb, ncmoe), ex, b, pl, dl in itertools.product(entries, executors, _as_list(g["batch"]),
                                                                   _as_list(g["prompt_len"]),
                                                                   _as_list(g["decode_len"])):
                p = dict(gp)
                p["gpu_budget"] = nb
                p["matched_n_cpu_moe"] = ncmoe
                if ncmoe is not None:
                    p["max_group"] = matched_max_group(cfg, ncmoe)
                p.setdefault("max_batch", None)
                p.setdefault("max_seq_len", None)
                tag = budget_tag(nb) if nb is not None else f"ncmoe{ncmoe}" if ncmoe is not None else r
                cid = config_id(model, g["kind"], ex, tag, b, pl, dl, variant_tag(p))
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
        need_s[c.model] = max(need_s.get(c.model, 2), c.prompt_len + c.decode_len,
                              c.p["check_prompt_len"] if c.p["check"] else 0)  # the check's prompt fits too
    done = []
    for c in configs:
        p = c.p
        if p["max_batch"] is None:
            p["max_batch"] = need_b[c.model]
        if p["max_seq_len"] is None:
            p["max_seq_len"] = need_s[c.model]
        if c.batch > p["max_batch"] or c.prompt_len + c.decode_len > p["max_seq_len"]:
            raise BenchError(f"{c.id}: batch/lengths exceed max_batch={p['max_batch']} / max_seq_len={p['max_seq_len']}")
        if p["check"] and p["check_prompt_len"] > p["max_seq_len"]:
            raise BenchError(f"{c.id}: check_prompt_len {p['check_prompt_len']} exceeds max_seq_len={p['max_seq_len']}")
        resident = c.resident
        if p["gpu_budget"] is not None:
            pack = (packs or {}).get(c.model) or spec["models"][c.model].get("pack")
            try:
                resident = plan_budget(presets[c.model], p["gpu_budget"], p["max_batch"], p["max_seq_len"], pack).resident
            except BenchError as e:
                raise BenchError(f"{c.id}: {e}") from None
        done.append(dataclasses.replace(c, resident=resident, params=tuple(sorted(p.items()))))
    # Group configurations sharing an engine together (stable within a key): first-appearance order.
    order: dict[tuple, int] = {}
    for c in done:
        order.setdefault(c.engine_key(), len(order))
    return sorted(done, key=lambda c: order[c.engine_key()])


def filter_configs(configs: list[BenchConfig], only: str | None) -> list[BenchConfig]:
    if not only:
        return configs
    try:
        rx = re.compile(only)
    except re.error as e:
        raise UsageError(f"--only {only!r} is not a regular expression: {e}") from None
    return [c for c in configs if rx.search(c.id)]


def check_model_names(spec: dict, names, flag: str) -> None:
    """Every NAME of --pack / --checkpoint NAME=DIR must be a model of the spec."""
    bad = sorted(set(names) - set(spec["models"]))
    if bad:
        raise UsageError(f"{flag} names {bad}, not models of campaign {spec['name']!r} "
                         f"(its models: {sorted(spec['models'])})")


def existing_campaign(camp_dir: Path) -> list[str]:
    """What in a campaign directory a new run would replace: campaign.json and records/*.json."""
    camp_dir = Path(camp_dir)
    found = [str(camp_dir / "campaign.json")] if (camp_dir / "campaign.json").exists() else []
    rec = camp_dir / "records"
    if rec.is_dir():
        n = sum(1 for f in rec.iterdir() if f.suffix == ".json" and not f.name.startswith("."))
        if n:
            # records no campaign.json describes are no complete campaign (copied by hand, or a publish
            # killed under an earlier version, which removed the old campaign.json first): named as such
            found.append(f"{rec}/ ({n} records" + ("" if found else ", and no campaign.json: not a complete campaign")
                         + ")")
    return found


# ---- the engine interface the bench drives ---------------------------------------------------------

class BenchEngine(Protocol):
    """What the runner calls: runmap.engine.engine.Engine implements it; the transformers baseline is
    wrapped to it (HFTarget). ``logits`` (with ``routes=`` imposing (T, L, k) expert ids) and ``logits_with_routes``
    (logits and the int64 (T, L, k) sorted expert ids routed at each position) are called only for configurations with
    ``check: true``; the
    transformers baselines (kinds hf-bf16, hf-bf16-compile) also answer ``baseline_info(batch)``."""

    routing: str  # the routing workload's name (runmap.workload.routing)
    routes: Any  # runmap.engine.routes.RouteRecorder of the routes that ran, or None when not recorded

    def run(self, prompts, *, max_new_tokens: int, ignore_eos: bool = False) -> GenerationRun: ...

    def stats(self) -> EngineStats: ...

    def reset_placement_reports(self) -> None: ...

    def close(self) -> None: ...


class HFTarget:
    """runmap.bench.baselines.HFBaseline (transformers bf16, greedy) behind the bench's engine interface."""

    routing = "model"  # transformers' model routes with its own router
    routes = None

    def __init__(self, hf, cfg: ModelConfig, device: torch.device):
        self.hf, self.cfg, self.device = hf, cfg, device
        self.runs = 0

    def run(self, prompts, *, max_new_tokens: int, ignore_eos: bool = False) -> GenerationRun:
        # transformers' loop here never stops early (no EOS check): ignore_eos holds by construction
        rows = self.hf.generate(prompts, max_new_tokens=max_new_tokens)
        t = self.hf.last_timing
        self.runs += 1
        results = tuple(GenerationResult("", list(r), "length", len(p)) for r, p in zip(rows, prompts))
        return GenerationRun(results=results, prefill_s=t["prefill_s"], decode_s=t["decode_s"], ttft_s=t["ttft_s"],
                             prompt_tokens=t["prompt_tokens"], new_tokens=t["new_tokens"],
                             decode_tok_s=t["decode_tok_s"], batch=len(prompts), groups=1)

    def stats(self) -> EngineStats:
        why = "transformers' model has no expert cache to instrument"
        return EngineStats(
            executor=self.hf.executor, expert_format="bf16", regime="full", device=str(self.device), cuda_graphs=False,
            fused=(), skip_experts=False, resident=self.cfg.num_experts, has_cache=False, policy=None, hits=0,
            misses=0, evictions=0, bytes_h2d=0, h2d_seconds=0.0, generations=0, runs=self.runs,
            resident_bytes=None, spare_bytes=None, staging_bytes=None, nonrouted_bytes=None, kv_cache_bytes=None,
            observations=MappingProxyType({n: bm.unsupported(why) for n in REQUIRED_ZERO}))

    def reset_placement_reports(self) -> None:
        """Nothing to reset: no expert placement."""

    def baseline_info(self, batch: int) -> dict:
        """The record's ``baseline``: the transformers path that ran and, for the compiled one, its compile
        settings and the wall time of the call that compiled this batch size (kept out of every tok/s)."""
        out = {"hf_mode": self.hf.mode, "status": "OBSERVED"}
        if self.hf.mode == "static-compile":
            cs = self.hf.compile_s.get(batch)
            out["compile"] = dict(self.hf.compile_info)
            out["compile_s"] = (bm.observed(cs) if cs is not None else
                                bm.unknown("no decode step ran before the timed runs (warmup 0 or decode_len 1): "
                                           "the first timed run compiled"))
        return out

    def close(self) -> None:
        compiled = self.hf is not None and self.hf.mode != "eager"
        self.hf = None
        if compiled:  # the compiled graphs (and their CUDA-graph memory pool) would outlive the model otherwise
            import torch._dynamo

            torch._dynamo.reset()


# ---- running ----------------------------------------------------------------------------------------

def make_prompts(vocab_size: int, batch: int, prompt_len: int, seed: int) -> list[list[int]]:
    """Deterministic token ids in [3, vocab): ids 0-2 are special in both presets' tokenizers."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + batch * 1009 + prompt_len)
    ids = torch.randint(3, vocab_size, (batch, prompt_len), generator=g)  # (B, P) int64
    return ids.tolist()


def _timing_values(run: GenerationRun, cid: str) -> tuple[float, float, float, int, int]:
    """(prefill tok/s, decode tok/s, ttft s, prompt tokens, new tokens) of one timed run."""
    if not (run.prefill_s > 0 and run.decode_s > 0):
        raise BenchError(f"{cid}: a timed run has a non-positive duration (prefill {run.prefill_s} s, "
                         f"decode {run.decode_s} s)")
    return run.prefill_tok_s, float(run.decode_tok_s), float(run.ttft_s), int(run.prompt_tokens), int(run.new_tokens)


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
    h2d_bw: dict

    @classmethod
    def create(cls, campaign: str, device: torch.device, command: str, measure_bandwidth: bool = True) -> "RunContext":
        rid = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ") + "-" + uuid.uuid4().hex[:6]
        bw = bm.copy_bandwidth(device) if measure_bandwidth else bm.unknown("copy bandwidth not measured (--no-bandwidth)")
        h2d = bm.h2d_bandwidth(device) if measure_bandwidth else bm.unknown("H2D bandwidth not measured (--no-bandwidth)")
        return cls(campaign, rid, command, device, bm.device_info(device), bm.software_info(), bm.git_info(), bw, h2d)


def _bytes_measure(v: int | None, why: str) -> dict:
    return bm.observed(v) if v is not None else bm.unsupported(why)


def logits_check(engine, c: BenchConfig, model_cfg: ModelConfig, stats: EngineStats) -> dict:
    """Logits of one prompt: the engine's executor against the reference executor (same engine, same pack),
    and on CUDA the engine's fused ops against torch ops.

    A router decision is discrete: where two experts' scores are within fp16 rounding of each other, the engine and
    the FP32 reference executor may route a position differently, and that position's logits (and, through
    attention, later ones) then differ by more than rounding. Over a long prompt such near-ties become likely (an
    8,192-token prompt: 16 layers x 8,192 top-k choices). So the check has two parts: the arithmetic (the reference executor run on the engine's own routes, every position within
    ``check_tolerance`` of the largest |logit|: any difference there is the executors' or the non-routed path's, not a
    near-tie) and the routing (the fraction of positions whose experts equal those the reference's own routing
    chose in every layer, at least ``check_min_route_agreement``: a router or executor bug that moves most routes
    fails it; a subtle router bug is left to the router's own tests). The difference against the reference's own
    routing, over every position, is recorded beside them (records made before routes were compared carry only that
    one, and runmap.bench.checks judges them by it)."""
    p = c.p
    prompt = make_prompts(model_cfg.vocab_size, 1, p["check_prompt_len"], p["seed"] + 1)[0]
    mine, my_routes = engine.logits_with_routes(prompt)  # (T, V), (T, L, k)
    ref, ref_routes = engine.logits_with_routes(prompt, executor=CHECK_EXECUTOR)  # the reference's own routing
    mine, ref = mine.float(), ref.float()
    diff = (mine - ref).abs().max().item()
    scale = ref.abs().max().item()
    agree = (mine.argmax(-1) == ref.argmax(-1)).float().mean().item()
    if stats.device.startswith("cuda") and stats.fused:
        fused = bm.observed((mine - engine.logits(prompt, fused=False).float()).abs().max().item())
    elif stats.device.startswith("cuda"):
        fused = bm.unsupported("this engine runs no fused ops (torch ops already)")
    else:
        fused = bm.unsupported(f"device {stats.device}: the fused ops run on CUDA only")
    tol, min_routes = float(p["check_tolerance"]), float(p["check_min_route_agreement"])
    routes_agree = (my_routes == ref_routes).flatten(1).all(1).float().mean().item()
    on_mine = engine.logits(prompt, executor=CHECK_EXECUTOR, routes=my_routes).float()  # (T, V)
    same_routes = (mine - on_mine).abs().max().item()  # NaN (fails) if either is not finite
    passed = same_routes <= tol * scale and routes_agree >= min_routes
    return {
        "reference_executor": CHECK_EXECUTOR, "prompt_tokens": len(prompt),
        "executor_vs_reference_max_abs": bm.observed(diff), "logit_scale": bm.observed(scale),
        "argmax_agreement": bm.observed(agree), "fused_vs_torch_max_abs": fused,
        "routes_agree": bm.observed(routes_agree), "executor_vs_reference_same_routes_max_abs": bm.observed(same_routes),
        "tolerance": tol, "min_route_agreement": min_routes, "passed": bool(passed),
        "method": f"every position of a {len(prompt)}-token prompt: max |logits - logits of the reference executor on "
                  "the same routes| <= tolerance x the largest |reference logit|, and the positions whose routed "
                  "experts equal the reference's own choice in every layer >= min_route_agreement of all",
    }


def run_config(engine: BenchEngine, c: BenchConfig, model_cfg: ModelConfig, ctx: RunContext, engine_info: dict) -> dict:
    """Warm up, time `repeats` runs and build the record of one configuration."""
    p = c.p
    prompts = make_prompts(model_cfg.vocab_size, c.batch, c.prompt_len, p["seed"])
    peak = bm.PeakMemory(ctx.device)
    peak.reset()
    s_pre = engine.stats()
    warm_tokens = min(p["warmup_new_tokens"], c.decode_len)
    warm_key = (ctx.device.type, model_cfg.num_heads, model_cfg.num_kv_heads, model_cfg.head_dim, c.prompt_len,
                c.decode_len, p["max_batch"], p["max_seq_len"])
    eager_first = (p["warmup"] > 0 and ctx.device.type == "cuda" and c.kind not in HF_KINDS
                   and s_pre.cuda_graphs is False and warm_key not in _WARM_EAGER)
    if eager_first:
        # Eager decode (no CUDA graph: partial residency, the fp16 baseline) may compile a kernel variant per
        # KV length on first use (H200 campaign of 2026-11-29: the fused decode-attention kernel takes the
        # key count as a constexpr, ~0.3 s per length). The first eager configuration of the process warms
        # up over every decode length the timed runs will reach, so they measure steady state.
        warm_tokens = c.decode_len
        _WARM_EAGER.add(warm_key)
    warm_ttft, warm_wall = [], []
    for _ in range(p["warmup"]):
        t_w = time.perf_counter()
        warm_ttft.append(engine.run(prompts, max_new_tokens=warm_tokens, ignore_eos=True).ttft_s)
        bm.sync(ctx.device)
        warm_wall.append(time.perf_counter() - t_w)
    s0 = engine.stats()
    engine.reset_placement_reports()  # the record's placement joins / step phases: this row's timed runs only
    routes = engine.routes
    route_mark = routes.mark() if routes is not None else 0
    prefill, decode, ttft = [], [], []
    prompt_tokens = new_tokens = 0
    cap = p.get("max_config_s")
    notes = []
    with bm.Stopwatch(ctx.device) as sw:
        for i in range(p["repeats"]):
            run = engine.run(prompts, max_new_tokens=c.decode_len, ignore_eos=True)
            pf, dc, tt, prompt_tokens, new_tokens = _timing_values(run, c.id)
            prefill.append(pf)
            decode.append(dc)
            ttft.append(tt)
            if cap is not None and i + 1 < p["repeats"] and time.perf_counter() - sw.t0 > cap:
                notes.append(f"timed repeats cut to {i + 1} of {p['repeats']}: {time.perf_counter() - sw.t0:.1f} s "
                             f"> max_config_s {cap} (the campaign's time budget)")
                break
    s1 = engine.stats()
    mem = peak.read()
    if new_tokens != c.batch * c.decode_len:
        notes.append(f"a timed run generated {new_tokens} tokens, not batch x decode_len = {c.batch * c.decode_len} "
                     "(a row stopped early); tok/s use the tokens actually generated")

    if c.kind == "engine" and s1.executor != c.executor:
        raise BenchError(f"{c.id}: asked for executor {c.executor!r}, engine stats say {s1.executor!r}")
    if s1.regime != c.regime:
        raise BenchError(f"{c.id}: configuration regime {c.regime!r}, engine stats say {s1.regime!r}")
    if c.kind == "engine" and s1.skip_experts != bool(p["skip_experts"]):
        raise BenchError(f"{c.id}: skip_experts={p['skip_experts']} asked, engine stats say {s1.skip_experts}")

    d = s1.since(s0)
    decode_tokens = (new_tokens - c.batch) * len(decode)  # what the decode steps made: each row's first is the prefill's
    if c.kind in BASELINE_KINDS:
        no_cache = bm.unsupported("transformers' model has no expert cache" if c.kind in HF_KINDS else
                                  "the fp16-expert baseline runs no expert cache (experts dequantized on the device)")
        hits = misses = hit_rate = h2d = h2d_rate = h2d_per_tok = h2d_prefill = no_cache
        decode_cache = {}
        cache = {k: no_cache for k in ("resident_bytes", "spare_bytes", "staging_bytes")}
        if c.kind == "engine-fp16":  # the dequantized fp16 experts
            cache["resident_bytes"] = _bytes_measure(s1.resident_bytes, "engine reports no expert bytes")
    elif not s1.has_cache:
        raise BenchError(f"{c.id}: an INT4 engine without an expert cache")
    else:
        hits, misses = bm.observed(d.hits), bm.observed(d.misses)
        # the hit rate is over every routed expert looked up: experts a placement computed at the CPU site were not
        # resident either (they are neither hits nor misses of the cache)
        looked = d.hits + d.misses + d.cpu_site_experts
        hit_rate = bm.observed(d.hits / looked) if looked else bm.unknown("no expert lookups observed")
        decode_looked = d.decode_hits + d.decode_misses + d.decode_cpu_site_experts
        decode_cache = {"decode_hits": bm.observed(d.decode_hits), "decode_misses": bm.observed(d.decode_misses),
                        "decode_hit_rate": bm.observed(d.decode_hits / decode_looked) if decode_looked else
                        bm.unknown("no expert lookups in decode steps")}
        if s1.placement is not None:
            decode_cache["cpu_site_experts"] = bm.observed(d.cpu_site_experts)
            decode_cache["decode_cpu_site_experts"] = bm.observed(d.decode_cpu_site_experts)
        h2d = bm.observed(d.bytes_h2d)
        if d.h2d_seconds > 0:
            h2d_rate = bm.observed(d.bytes_h2d / d.h2d_seconds / 1e9)
        elif d.bytes_h2d == 0:
            h2d_rate = bm.unknown("no host->device expert bytes in the timed runs")
        else:
            h2d_rate = bm.unknown("host->device bytes without a measured transfer time")
        # decode steps' bytes only: the prompt's misses are the prefill's, not a decoded token's
        # host-read steps' reads cross the link as a copy's bytes would (a prompt pass's reads are the prefill's)
        h2d_per_tok = (bm.observed((d.decode_bytes_h2d + d.decode_host_read_bytes) / decode_tokens) if decode_tokens
                       else bm.unknown("no tokens generated"))
        h2d_prefill = bm.observed(d.prefill_bytes_h2d + d.prefill_host_read_bytes)
        cache = {k: _bytes_measure(getattr(s1, k), f"engine reports no {k}")
                 for k in ("resident_bytes", "spare_bytes", "staging_bytes")}
    if c.kind in HF_KINDS:  # nothing in transformers' model is instrumented for the cache contract
        obs = {n: bm.unsupported("transformers' model has no expert cache to instrument") for n in REQUIRED_ZERO}
    else:  # exactly what instrumentation said; the conformance checks judge it
        obs = {n: dict(s1.observations[n]) if n in s1.observations else
               bm.unknown("engine stats have no such observation") for n in REQUIRED_ZERO}

    routing_rec = None
    # the experts per layer that ran: the configuration's, or more where the engine lent idle spares to residency
    # (host_read_spares)
    resident = s1.resident if c.kind == "engine" else c.resident
    spares_kept = s1.spare_bytes // s1.row_bytes // model_cfg.num_layers if s1.spare_bytes and s1.row_bytes else 0
    # the spec's host_read_spares, or where the engine lent a GPU budget's spares by default the spares it kept
    hr_spares = p.get("host_read_spares")
    if hr_spares is None and resident > c.resident:
        hr_spares = spares_kept
    if c.kind == "engine":
        routing_rec = {"workload": engine.routing}
        if routes is not None:
            rp = routes.replay_decode(resident, since=route_mark)
            routing_rec.update(replay_lru_hit_rate=bm.observed(rp["lru"]), replay_belady_hit_rate=bm.observed(rp["belady"]),
                               replay_decode_steps=rp["decode_steps"])
        else:
            why = "full residency: every expert is resident, nothing to replay" if c.regime == "full" else \
                "the routes were not recorded"
            routing_rec.update(replay_lru_hit_rate=bm.unsupported(why), replay_belady_hit_rate=bm.unsupported(why))
        if s1.has_cache:
            routing_rec["misses_per_token"] = (bm.observed(d.decode_misses / decode_tokens) if decode_tokens else
                                               bm.unknown("no tokens generated"))  # decode steps' misses
    floor = bm.byte_floor(model_cfg, c.expert_format, c.batch, ctx.copy_bw)
    dec_stats = bm.repeat_stats(decode)
    is_engine = c.kind == "engine"
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
            "experts_per_layer": c.experts_per_layer, "top_k": model_cfg.top_k, "resident": resident,
            "expert_format": c.expert_format, "block_size": engine_info.get("block_size"),
            "batch": c.batch, "prompt_len": c.prompt_len, "decode_len": c.decode_len,
            "repeats": len(decode), "warmup": p["warmup"], "max_batch": p["max_batch"],
            "max_seq_len": p["max_seq_len"],
            # the policy the cache ran (None asks for the engine's default: lru, lfu-decay under placement host-read)
            "policy": (s1.policy if s1.has_cache else p["policy"]) if is_engine else None,
            "seed": p["seed"], "pack": engine_info.get("pack"), "checkpoint": engine_info.get("checkpoint"),
            "variant": c.variant,
            "cuda_graphs": bool(p["cuda_graphs"]) if is_engine else None,
            "fused": list(p["fused"]) if c.kind not in HF_KINDS else None,
            "skip_experts": bool(p["skip_experts"]),
            "routing": engine.routing if c.kind not in HF_KINDS else None,
            # which transformers path a baseline record measured (eager | static-compile); null otherwise
            "hf_mode": HF_KINDS.get(c.kind),
            "cache_contract": p["cache_contract"] if is_engine else None,
            # where absent experts ran (gpu: transferred; cpu / auto: the CPU site) and next-layer prefetch
            "expert_placement": p.get("expert_placement", "gpu") if is_engine else None,
            "prefetch": bool(p.get("prefetch")) if is_engine else None,
            # an EMULATED slower host link (runmap.residency.transport.pace): misses paced to this rate; null = real
            "emulate_link_gb_s": p.get("emulate_link_gb_s") if is_engine else None,
            # placement two-site's CPU share fixed by the spec (null: from the measured rates, or another placement)
            "two_site_share": p.get("two_site_share") if is_engine else None,
            # spare rows per layer kept where the placement reads absent experts over the link, the rest resident
            "host_read_spares": hr_spares if is_engine else None,
            # auto's step chooser: the smallest batch it may run two-site steps at, set by the spec (null: the default)
            "two_site_min_batch": p.get("two_site_min_batch") if is_engine else None,
            # the llama.cpp --n-cpu-moe row whose GPU expert bytes this residency matches (resident = E(L-n)/L)
            "matched_n_cpu_moe": p.get("matched_n_cpu_moe") if is_engine else None,
            # --gpu-budget: the budget asked for (bytes) and the engine's plan of it, which set `resident` (more where
            # host-read or two-site lent the plan's idle spares to residency: host_read_spares)
            "gpu_budget": p.get("gpu_budget"),
            "budget_plan": engine_info.get("budget_plan"),
            # where the weights came from: a packed checkpoint, a pack synthesized directly, transformers' init
            "weights": engine_info.get("weights"),
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
            # the first warmup request's time to first token: an engine's first request when the engine is new
            # (engine.fresh: the configuration that built it), against the timed (warm) requests' ttft_s
            "first_request_ttft_s": bm.observed(warm_ttft[0]) if warm_ttft else bm.unknown("no warmup run"),
            # wall time of the untimed warmup runs (compilation, graph capture, cache fill): kept out of tok/s
            "warmup_s": bm.observed(sum(warm_wall)) if warm_wall else bm.unknown("no warmup run"),
        },
        "cache_stats": {"hits": hits, "misses": misses, "hit_rate": hit_rate, **decode_cache},
        "h2d": {"bytes": h2d, "gb_s": h2d_rate, "bytes_per_token": h2d_per_tok, "prefill_bytes": h2d_prefill,
                "link_gb_s": ctx.h2d_bw},
        "observations": obs,
        "byte_floor": floor,
        "ratios": {"decode_vs_byte_floor": bm.ratio(bm.observed(dec_stats["median"]), floor["floor_decode_tok_s"],
                                                    "decode tok/s over byte floor")},
        "engine": {**{k: v for k, v in engine_info.items() if k not in ("pack", "checkpoint", "budget_plan")},
                   "timed_wall_s": sw.seconds, "reported_executor": s1.executor,
                   "cuda_graphs": s1.cuda_graphs, "fused_ops": list(s1.fused), "skip_experts": s1.skip_experts,
                   # the engine's own: the timed runs' prefill passes by path (runmap.engine.prefill_graph), and
                   # whether the chained kernels launched with PDL (runmap.kernels.common.chained; RUNMAP_PDL)
                   **({"prefill_passes": {k: getattr(d, f"prefill_passes_{k}") for k in PREFILL_PATHS},
                       "chained_launches": chained(ctx.device)["CHAINED"]}
                      if c.kind in ("engine", "engine-fp16") else {}),
                   "warmup_new_tokens": warm_tokens if p["warmup"] else 0,
                   "full_length_warmup": eager_first},
    }
    if routing_rec is not None:
        rec["routing"] = routing_rec
    site = _site_record(s1, d) if is_engine else None
    if site is not None:
        rec["sites"] = site
    if c.kind in HF_KINDS:
        rec["baseline"] = engine.baseline_info(c.batch)
        if rec["baseline"]["hf_mode"] != HF_KINDS[c.kind]:  # never one path's figures under the other's label
            raise BenchError(f"{c.id}: kind {c.kind} asks for transformers path {HF_KINDS[c.kind]!r}, the baseline "
                             f"ran {rec['baseline']['hf_mode']!r}")
    if engine_info.get("weights_note"):
        notes.append(engine_info["weights_note"])
    if is_engine and p.get("emulate_link_gb_s") is not None:
        notes.append(f"EMULATION: the miss path's host->device copies were paced to {p['emulate_link_gb_s']:g} GB/s "
                     "(runmap.residency.transport.pace), standing in for a slower link than this machine's")
    ncmoe = p.get("matched_n_cpu_moe") if is_engine else None
    if ncmoe is None and resident > c.resident:  # a GPU budget's rows, lent by default (Engine.from_pack)
        notes.append(f"{resident - c.resident} of the planned spare rows per layer lent to residency (host-read family "
                     f"placement, host_read_spares {spares_kept}): {resident} resident + {spares_kept} spare where the "
                     f"plan kept {c.resident} + {resident - c.resident + spares_kept}")
    if ncmoe is not None:
        layers, e = model_cfg.num_layers, c.experts_per_layer
        exact = e * (layers - ncmoe) / layers
        held = resident + spares_kept
        lent = (f" ({resident - c.resident} of the matched top_k spares lent to residency, host_read_spares)"
                if resident > c.resident else "")
        notes.append(f"matched to llama.cpp --n-cpu-moe {ncmoe}: {resident} of {e} experts per layer resident{lent} + "
                     f"{spares_kept} spare rows (where misses land before publication) = {held} GPU expert rows per "
                     "layer; "
                     f"llama.cpp keeps {exact:g} per layer's worth of routed-expert bytes on the GPU"
                     + (f"; the engine needs at least top_k = {model_cfg.top_k} resident rows and top_k spares, so it "
                        "holds more GPU expert bytes than that llama.cpp row" if held > exact else
                        "; rounded down" if held < exact else ""))
    if p["skip_experts"]:
        notes.append("profiling variant: routed experts return zeros (decode time without the expert GEMVs); "
                     "outputs are not the model's")
    if p["profile"]:  # after the timed runs and their stats: profiling adds no work to what they measured
        from runmap.bench.profile import profile_config

        rec["profile"] = profile_config(engine, prompts, c.decode_len, ctx.device, top=int(p["profile_top"]))
    if p["check"]:
        rec["check"] = logits_check(engine, c, model_cfg, s1)
    if notes:
        rec["notes"] = notes
    return rec


def attach_strongest_baseline(records: list[dict]) -> None:
    """ratios.decode_vs_strongest_baseline and prefill_vs_strongest_baseline of every engine record: its decode (and
    prefill) tok/s over the fastest transformers path (kinds HF_KINDS: eager, static cache + torch.compile) measured
    for its model, batch and lengths in the same run (the smallest observed <phase>_vs_<kind> ratio), with
    ``baseline`` naming that kind and ``compared`` every transformers baseline's ratio or status (one that failed or
    did not run is UNKNOWN there: its place is never taken by another path under its name). The FP16-expert engine
    is our own path, not a transformers one, and is not a candidate."""
    for r in records:
        if r["kind"] in BASELINE_KINDS:
            continue
        rat = r.get("ratios") or {}
        for phase in ("decode", "prefill"):
            found = {k: rat[f"{phase}_vs_{k}"] for k in HF_KINDS if f"{phase}_vs_{k}" in rat}
            seen = {k: m for k, m in found.items() if bm.is_observed(m)}
            compared = {k: (m["value"] if bm.is_observed(m) else m.get("status")) for k, m in found.items()}
            if not seen:
                m = {**bm.unknown("no transformers baseline with the same model, batch and lengths was measured in "
                                  "this run"), "compared": compared}
            else:
                kind = min(seen, key=lambda k: seen[k]["value"])
                m = {**seen[kind], "baseline": kind, "compared": compared}
            rat[f"{phase}_vs_strongest_baseline"] = m


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
                r["ratios"][f"prefill_vs_{kind}"] = bm.unknown(why)
                r["ratios"][f"peak_allocated_vs_{kind}"] = bm.unknown(why)
                continue
            r["ratios"][f"decode_vs_{kind}"] = bm.ratio(
                bm.observed(r["timing"]["decode_tok_s"]["median"]), bm.observed(b["timing"]["decode_tok_s"]["median"]),
                f"decode tok/s over {kind}")
            r["ratios"][f"prefill_vs_{kind}"] = (  # warm prefill: prompt tokens over TTFT, same prompts
                bm.ratio(bm.observed(r["timing"]["prefill_tok_s"]["median"]),
                         bm.observed(b["timing"]["prefill_tok_s"]["median"]), f"prefill tok/s over {kind}")
                if "prefill_tok_s" in r["timing"] and "prefill_tok_s" in b["timing"] else
                bm.unknown("a record of the pair carries no prefill tok/s"))
            r["ratios"][f"peak_allocated_vs_{kind}"] = bm.ratio(
                r["memory"]["peak_allocated_bytes"], b["memory"]["peak_allocated_bytes"], f"peak allocated over {kind}")
    attach_transfer_bounds(records)
    attach_strongest_baseline(records)
    return records


def attach_transfer_bounds(records: list[dict]) -> None:
    """Partial-residency records: timing.transfer_bound_tok_s = 1 / (full-residency seconds per token + missed
    bytes per token / same-run pinned H2D rate), the full-residency record being the same run's with the same
    model, executor, batch, lengths, routing and fused ops (an A/B of fused ops in one run bounds each side by its
    own full step); and ratios.decode_vs_transfer_bound. A record of an emulated slower
    link (config.emulate_link_gb_s) is bounded by that link's rate where it is below the measured one (its
    ``source`` says so)."""
    def key(r):
        c = r["config"]
        return (r["run_id"], c["model"], r["executor"], c["batch"], c["prompt_len"], c["decode_len"], c.get("routing"),
                c.get("skip_experts"), tuple(sorted(c.get("fused") or ())))

    full = {key(r): r for r in records if r["kind"] == "engine" and r["regime"] == "full"}
    for r in records:
        if r["kind"] != "engine" or r["regime"] == "full":
            continue
        f, link, per_tok = full.get(key(r)), r["h2d"].get("link_gb_s"), r["h2d"].get("bytes_per_token")
        if f is None:
            bound = bm.unknown(f"no full-residency record with the same model, executor, batch, lengths, routing "
                               f"and fused ops in run {r['run_id']}")
        elif not (link and bm.is_observed(link)) or not bm.is_observed(per_tok):
            bound = bm.unknown("no same-run pinned H2D rate or no observed bytes per token")
        else:
            t_full = 1.0 / f["timing"]["decode_tok_s"]["median"]
            rate, emulated = link["value"], r["config"].get("emulate_link_gb_s")
            if emulated and emulated < rate:
                rate = emulated
            bound = bm.observed(1.0 / (t_full + per_tok["value"] / (rate * 1e9)))
            if rate != link["value"]:
                bound["source"] = (f"EMULATED link: {rate:g} GB/s (runmap.residency.transport.pace) in place of the "
                                   f"measured {link['value']:.1f} GB/s")
        r["timing"]["transfer_bound_tok_s"] = bound
        r["ratios"]["decode_vs_transfer_bound"] = bm.ratio(bm.observed(r["timing"]["decode_tok_s"]["median"]), bound,
                                                           "decode tok/s over the transfer bound")


# ---- engines --------------------------------------------------------------------------------------

EngineFactory = Callable[[BenchConfig, dict, torch.device], tuple[Any, dict]]


_WARM_EAGER: set[tuple] = set()  # eager-decode shapes already warmed up over the full decode length


def _block_size(pack: Path) -> int | None:
    man = Path(pack) / "manifest.json"
    if not man.is_file():
        return None
    try:
        m = json.loads(man.read_text())
    except (OSError, ValueError):
        return None
    return m.get("block_size", (m.get("quantization") or {}).get("block_size"))


def lift_allocator_cap(device: torch.device) -> None:
    """Let torch's allocator use the whole GPU ``device`` again. By index: torch refuses a device without one
    (ValueError), and a campaign's device is plain "cuda" (that refusal failed every configuration without a
    budget in the first H200 run of h200-families)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    torch.cuda.set_per_process_memory_fraction(1.0, index)


class EngineBuilder:
    """The default engine factory: builds the engine (or baseline) of a configuration through
    Engine.from_pack's explicit arguments.

    Host sources are shared within one builder (one campaign run): building the host source of a
    real-size pack (read, page-touch, per-expert sha256 of 3.3 GB for OLMoE, 6.3 GB for Qwen) takes
    5-15 s, and it is immutable after startup (contract rule 1), so a later engine of the same pack is
    given the first one's (``host_source=``); the engine checks the pack identity and watches its own
    closed reader."""

    def __init__(self):
        self.host_sources: dict[str, Any] = {}  # resolved pack dir -> HostSource

    def __call__(self, c: BenchConfig, model_entry: dict, device: torch.device) -> tuple[BenchEngine, dict]:
        p = c.p
        budget = p.get("gpu_budget")
        if budget is None and device.type == "cuda":
            # an engine built with a GPU budget capped torch's allocator for the whole process: lift the cap,
            # or a later configuration of the same run (full residency, the transformers baseline) would inherit it
            lift_allocator_cap(device)
        if c.kind in HF_KINDS:
            from runmap.bench.baselines import HFBaseline

            cfg = load_preset(c.preset)[0]
            # the static cache is sized once for the longest configuration, as the engine's KV cache is
            hf = HFBaseline(cfg, device=device, checkpoint=model_entry.get("checkpoint"), seed=p["seed"],
                            mode=HF_KINDS[c.kind], max_cache_len=p["max_seq_len"])
            info = {"checkpoint": model_entry.get("checkpoint"), "pack": None, "block_size": None, "load_s": hf.load_s,
                    "weights": hf.weights_source}
            if not model_entry.get("checkpoint"):
                info["weights_note"] = (f"speed only: {hf.weights_source} on the device, not the pack's weights "
                                        "(its speed depends on shapes, not on values)")
            return HFTarget(hf, cfg, device), info
        from runmap.engine.engine import Engine

        pack = model_entry.get("pack")
        if not pack or not Path(pack).is_dir():
            raise BenchError(f"{c.id}: model {c.model!r} has no pack directory ({pack!r}); give --pack {c.model}=DIR")
        key = str(Path(pack).resolve())
        shared = self.host_sources.get(key) if c.kind == "engine" else None
        t0 = time.perf_counter()
        eng = Engine.from_pack(
            pack, executor=c.executor if c.kind == "engine" else "grouped",
            resident=None if (c.regime == "full" or budget is not None) else c.resident, gpu_budget=budget,
            device=device, max_batch=p["max_batch"], max_group=p.get("max_group") if c.kind == "engine" else None,
            max_seq_len=p["max_seq_len"], policy=p["policy"], expert_format="int4" if c.kind == "engine" else "fp16",
            cuda_graphs=bool(p["cuda_graphs"]),
            # the default set as True, not as its list: the engine then drops what a family cannot fuse (the
            # prologue of per-head q/k norms, Qwen3), where an explicit list naming it is refused
            fused=True if tuple(p["fused"]) == _fused_tuple(True) else tuple(p["fused"]),
            skip_experts=bool(p["skip_experts"]),
            host_source=shared, routing=p["routing"], routing_seed=p["seed"], cache_contract=p["cache_contract"],
            expert_placement=p.get("expert_placement", "gpu") if c.kind == "engine" else "gpu",
            prefetch=bool(p.get("prefetch")) and c.kind == "engine",
            emulate_link_gb_s=p.get("emulate_link_gb_s") if c.kind == "engine" else None,
            two_site_share=p.get("two_site_share") if c.kind == "engine" else None,
            host_read_spares=p.get("host_read_spares") if c.kind == "engine" else None,
            two_site_min_batch=p.get("two_site_min_batch") if c.kind == "engine" else None,
            # the replayed hit rates of partial residency need the routes that ran (full residency has no misses)
            record_routes=c.kind == "engine" and c.regime != "full")
        bm.sync(device)
        load_s = time.perf_counter() - t0
        if budget is not None and eng.budget_plan.resident != c.resident:
            eng.close()
            raise BenchError(f"{c.id}: the pack's GPU-budget plan keeps {eng.budget_plan.resident} experts per layer, "
                             f"the configuration was planned with {c.resident} (give --pack so that both read the "
                             "pack's manifest)")
        if eng.host_source is not None:
            self.host_sources.setdefault(key, eng.host_source)
        info = {"pack": str(pack), "checkpoint": model_entry.get("checkpoint"), "block_size": _block_size(pack),
                "load_s": load_s,
                # in load_s: the engine's warm-up at build (compilation and capture; None when it did not run one)
                "warm_up_s": getattr(eng, "warm_up_s", None),
                # partial residency: decode steps as CUDA-graph segments up to this batch, eager above it
                "segment_graphs_max_batch": (eng.experts.cache.max_group // eng.cfg.top_k) if eng.use_segments else 0,
                "host_source": ("reused: built and hash-verified by an earlier engine of this run" if shared is not None
                                else "built by this engine"),
                "eos_stopping": "off (Engine.run ignore_eos: every row decodes decode_len tokens)"}
        prep = getattr(getattr(eng, "experts", None), "cpu_site_prepare_s", None)
        if prep is not None:  # the CPU site's repack of every expert at build: in load_s, never in a timed run
            info["cpu_site_prepare_s"] = prep
        if eng.budget_plan is not None:
            info["budget_plan"] = eng.budget_plan.to_dict()
        from runmap.synth.direct_pack import synthesized_label, weights_label

        info["weights"] = weights_label(pack)
        label = synthesized_label(pack)
        if label is not None:
            info["weights_note"] = f"speed only: {label.get('note')}"
        return eng, info


def _free_device(device: torch.device) -> None:
    """After the last reference to an engine is dropped: collect cycles and hand cached blocks back, so
    the next configuration's reserved-memory peak does not include a previous engine's cache."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


PUBLISHED = ("records", "campaign.json")  # what a run replaces; anything else in a campaign directory is kept
OLD_MARKER = ".old-"  # the fallback publish parks the previous campaign directory as .NAME.old-PID-*


def _carry_over(src: Path, dst: Path) -> None:
    """Put ``src`` (a file, link or folder the campaign directory holds besides records/ and campaign.json)
    at ``dst`` inside the new campaign directory: hard links where the filesystem allows (no bytes copied,
    and the old directory is removed right after), copies otherwise."""
    def link_or_copy(a, b):
        try:
            os.link(a, b, follow_symlinks=False)
        except OSError:
            shutil.copy2(a, b, follow_symlinks=False)

    if src.is_dir() and not src.is_symlink():
        shutil.copytree(src, dst, symlinks=True, copy_function=link_or_copy)
    else:
        link_or_copy(src, dst)


def _publish(tmp: Path, camp_dir: Path) -> None:
    """Move a finished run's directory (records/ and campaign.json) into place as the campaign directory.

    Every state a kill can leave is the old campaign or the new one, never records without the
    campaign.json that describes them: a new directory appears in one rename; into an existing one, the
    files a run does not own (README.md, report.md, ...) are first linked into the new directory, which is
    then swapped with the old one in one atomic exchange (``renameat2(RENAME_EXCHANGE)``), and the old
    one, now at the temporary name, is removed. Where the filesystem has no exchange, the old directory is
    renamed aside to ``.NAME.old-PID-*`` and the new one renamed in: a kill between the two renames leaves
    no campaign directory, and ``recover_interrupted_publish`` (the next run's first step) puts the old
    one back."""
    if camp_dir.is_symlink():  # publish into the directory the link names, beside it (renames stay on one fs)
        target = camp_dir.resolve()
        if target.parent != tmp.parent:
            moved = Path(tempfile.mkdtemp(prefix=f".{target.name}.partial-{os.getpid()}-", dir=target.parent))
            os.rmdir(moved)
            shutil.move(tmp, moved)
            tmp = moved
        camp_dir = target
    if not camp_dir.exists():  # a new campaign: records/ and campaign.json appear together, in one rename
        os.replace(tmp, camp_dir)
        return
    os.chmod(tmp, camp_dir.stat().st_mode & 0o7777)  # the campaign directory keeps its mode (mkdtemp's is 0700)
    for entry in sorted(camp_dir.iterdir()):
        if entry.name not in PUBLISHED:
            _carry_over(entry, tmp / entry.name)
    if atomic.exchange_paths(tmp, camp_dir):
        shutil.rmtree(tmp, ignore_errors=True)  # tmp now holds the old campaign (a leftover is a stale temp dir)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{camp_dir.name}{OLD_MARKER}{os.getpid()}-", dir=camp_dir.parent))
    os.replace(camp_dir, old)  # a directory renamed over an empty one
    os.replace(tmp, camp_dir)
    shutil.rmtree(old, ignore_errors=True)


def recover_interrupted_publish(camp_dir: Path) -> Path | None:
    """Undo what a publish killed between its two renames (filesystems without an atomic exchange) left:
    no campaign directory, and the previous one parked as ``.NAME.old-PID-*`` by a process that is gone.
    The newest such directory is renamed back (the killed run's own output stays in its temp directory,
    removed as stale). Only once a campaign directory exists are parked directories of dead processes
    removed: they are then the remains of a publish that completed. Returns the restored directory, or None."""
    camp_dir = Path(camp_dir)
    restored = None
    if not camp_dir.exists() and not camp_dir.is_symlink():
        prefix = f".{camp_dir.name}{OLD_MARKER}"
        try:
            names = os.listdir(camp_dir.parent)
        except OSError:
            names = []
        parked = []
        for n in names:
            pid, sep, _ = n[len(prefix):].partition("-")
            p = camp_dir.parent / n
            if n.startswith(prefix) and sep and pid.isdigit() and atomic.pid_gone(int(pid)) and p.is_dir() \
                    and not p.is_symlink():
                parked.append(p)
        if parked:
            newest = max(parked, key=lambda p: p.stat().st_mtime_ns)
            os.replace(newest, camp_dir)
            restored = camp_dir
            print(f"runmap bench: {camp_dir} restored from {newest.name} (a run was killed while publishing "
                  "over it; that run's output is discarded)", file=sys.stderr)
    if camp_dir.exists():
        remove_stale_temporaries(camp_dir, marker=OLD_MARKER)
    return restored


def run_campaign(spec: dict, out_root: Path, *, configs: list[BenchConfig] | None = None,
                 device: str | None = None, packs: dict | None = None, checkpoints: dict | None = None,
                 engine_factory: EngineFactory | None = None, command: str | None = None,
                 deadline_s: float | None = None, keep_going: bool = False, progress: bool = True,
                 measure_bandwidth: bool = True, overwrite: bool = False) -> dict:
    """Run the configurations (default: all of the spec) and write records + campaign.json under
    out_root/<name>/. Returns the campaign summary (also written).

    Raises OutputExistsError, before writing anything, when out_root/<name>/ already holds campaign.json or
    records and ``overwrite`` is False. Everything is written to a hidden temp directory in out_root and
    moved into place at the end (``_publish``); a run that failed (an exception, or a failed configuration
    under keep_going) does not replace an existing campaign: its output is kept in a hidden ``.NAME.failed-*``
    directory, whose path is printed."""
    from tqdm import tqdm

    t_start = time.perf_counter()
    check_model_names(spec, (packs or {}).keys(), "--pack")
    check_model_names(spec, (checkpoints or {}).keys(), "--checkpoint")
    out_root = Path(out_root)
    camp_dir = out_root / spec["name"]
    recover_interrupted_publish(camp_dir)  # a campaign parked by a publish that was killed is put back first
    existing = existing_campaign(camp_dir)
    if existing and not overwrite:
        raise OutputExistsError(f"{camp_dir} already holds a campaign ({', '.join(existing)}); nothing written "
                                "(pass --overwrite to replace it, or choose another --out)")
    configs = expand(spec, packs) if configs is None else configs
    dev = bm.resolve_device(device or spec["device"])
    models = {k: dict(v) for k, v in spec["models"].items()}
    for k, v in (packs or {}).items():
        models[k]["pack"] = v
    for k, v in (checkpoints or {}).items():
        models[k]["checkpoint"] = v
    factory = engine_factory or EngineBuilder()
    ctx = RunContext.create(spec["name"], dev, command or shlex.join(["runmap", *sys.argv[1:]]), measure_bandwidth)
    presets = {m: load_preset(models[m]["preset"])[0] for m in {c.model for c in configs}}
    out_root.mkdir(parents=True, exist_ok=True)
    # a killed run cannot remove its temp directory: it carries the writer's PID, and the next run removes
    # those whose process is gone (runmap.atomic); a failed run's kept output is renamed out of that pattern
    remove_stale_temporaries(camp_dir, marker=".partial-")
    tmp = Path(tempfile.mkdtemp(prefix=f".{spec['name']}.partial-{os.getpid()}-", dir=out_root))
    rec_dir = tmp / "records"
    rec_dir.mkdir()

    done, failed, skipped, records = [], [], [], []
    engine, key, info = None, None, {}
    raised = True
    bar = tqdm(configs, desc=f"bench {spec['name']}", unit="cfg", disable=not progress, dynamic_ncols=True)
    if not progress:  # nor transformers' own bars (a baseline's "Loading weights") in logs asked to have none
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    try:
        for c in bar:
            if deadline_s is not None and time.perf_counter() - t_start > deadline_s:
                skipped.append({"id": c.id, "reason": f"deadline of {deadline_s:.0f} s reached"})
                continue
            bar.set_postfix_str(c.id[-48:])
            try:
                if key != c.engine_key():
                    if engine is not None:
                        engine.close()
                        engine = None
                        _free_device(dev)
                    key = None
                    engine, info = factory(c, models[c.model], dev)
                    _free_device(dev)  # load-time temporaries must not count in the run's reserved peak
                    key = c.engine_key()
                    info = {**info, "fresh": True}
                else:
                    info = {**info, "fresh": False}
                rec = run_config(engine, c, presets[c.model], ctx, info)
            except Exception as e:  # noqa: BLE001 - recorded, then re-raised unless --keep-going
                failed.append({"id": c.id, "error": f"{type(e).__name__}: {e}"})
                if engine is not None:
                    engine.close()
                engine, key = None, None
                _free_device(dev)
                # a baseline path that cannot run this model (torch.compile failing on it) is a finding of the
                # run, listed as failed with its error; the other configurations still run
                if not keep_going and not isinstance(e, BaselineUnavailable):
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
        raised = False
    finally:
        if engine is not None:
            engine.close()
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
        write_json(tmp / "campaign.json", summary, indent=1)
        if existing and (raised or failed):
            kept = Path(tempfile.mkdtemp(prefix=f".{spec['name']}.failed-", dir=out_root))
            os.replace(tmp, kept)  # kept for inspection: not a stale temporary of a killed run
            print(f"runmap bench: the run failed; {camp_dir} is left as it was; this run's output is in {kept}",
                  file=sys.stderr)
        else:
            _publish(tmp, camp_dir)
    return summary


def load_records(*dirs: str | Path) -> list[dict]:
    """Every record (*.json) below the given directories (a records/ dir or any parent of one); hidden
    directories (a run's temp output) are skipped."""
    out = []
    for d in dirs:
        d = Path(d)
        files = [d] if d.is_file() else sorted(
            p for p in d.rglob("*.json") if p.parent.name == "records"
            and not any(part.startswith(".") for part in p.relative_to(d).parts))
        for f in files:
            try:
                doc = json.loads(f.read_text())
            except (OSError, ValueError) as e:
                raise BenchError(f"{f}: not a readable JSON record: {e}") from e
            if isinstance(doc, dict) and doc.get("record_version") in RECORD_VERSIONS:
                doc["_path"] = str(f)
                out.append(doc)
    return out
