"""The inference engine: a pack, the expert cache, an executor and the model, wired for generation.

Stable Python API (the IFEval and campaign code call exactly this)::

    from runmap.engine.engine import Engine
    eng = Engine.from_pack(pack_dir, *, executor="grouped", resident=None, device=None, max_batch=8,
                           max_seq_len=None, policy=None, expert_format="int4", max_group=None,
                           cuda_graphs=True, prefill_chunk=None, fused=True, host_source=None,
                           skip_experts=False, verify_pack=None, routing="model", routing_seed=0,
                           record_routes=False, cache_contract="v1", segments=True, gpu_budget=None,
                           warm_up=None)
    results = eng.generate(prompts, *, max_new_tokens=128, temperature=0.0, top_p=1.0, seed=None,
                           stop=(), chat=False, on_token=None, ignore_eos=False)
    run = eng.run(prompts, **same)   # GenerationRun: results + prefill/decode seconds, token counts, tok/s
    eng.last_timing   # dict: prefill_s, decode_s, ttft_s, prompt_tokens, new_tokens, decode_tok_s, batch
    eng.stats()       # EngineStats (runmap.engine.telemetry): typed counters, memory, observations
    eng.telemetry()   # dict valid under schemas/telemetry.schema.json (write it with runmap.engine.telemetry.write)
    eng.logits(token_ids, *, executor=None, fused=None) -> float32 (T, V) logits of every position of one
                      prompt; executor / fused override the engine's for this call only (checks)
    eng.host_source   # the HostSource of the expert cache (None for the fp16 baseline), for reuse
    eng.close()

Arguments:
    pack_dir       a directory written by ``runmap pack`` (manifest.json, safetensors, tokenizer files)
    executor       a name of runmap.kernels.registry.EXECUTORS; recorded in telemetry
    resident       routed experts per layer kept on the device, top_k..E; None = all (full residency)
    device         "cuda" / "cpu" / torch.device; None = cuda if available else cpu
    max_batch      rows decoded together; longer prompt lists are processed in groups of max_batch
    max_seq_len    KV cache length (prompt + new tokens); None = min(max_position_embeddings, 4096).
                   The KV cache (max_batch x max_seq_len) is allocated once at startup.
    policy         eviction policy of the cache (partial residency): "lru" or "lfu-decay"; None = lru, or
                   lfu-decay (half-life in decode steps) under expert_placement="host-read" (also where "auto"
                   becomes host-read)
    expert_format  "int4" (the product: qpacked experts through the cache and an executor) or "fp16"
                   (BASELINE ONLY: every expert dequantized once to FP16 on the device, torch matmuls,
                   no cache; exists so that the effect of compression can be isolated)
    max_group      largest batch union leased at once (partial residency; default min(top_k x max_batch,
                   resident // 2), at least top_k); larger unions are split into token groups (per-call path) or
                   expert groups (grouped segment chain)
    cuda_graphs    capture the decode step in CUDA graphs: whole under full residency, as segments cut at each
                   routing decision under partial residency (SegmentDecoder; a batch whose union may exceed one
                   lease in groups of leases per layer)
    segments       partial residency: decode in CUDA-graph segments (True, with cuda_graphs); "eager" also runs the
                   segment chain on the CPU, without graphs (tests); False: the per-call eager path
    prefill_chunk  prompt tokens per row per prefill forward pass (bounds activation memory of long prompts); None =
                   PREFILL_CHUNK (8,192: passes that long keep the H200 busy, results/campaigns/h200-floor, where
                   1,024-token passes left it waiting for the host half of the time, and an 8,192-token prompt in
                   one pass decodes each layer's experts once instead of twice: 73.6 against 84.9 ms,
                   results/campaigns/h200-prefill/probe), or 1,024 with gpu_budget or
                   partial residency (runmap.engine.budget.PREFILL_CHUNK_UNDER_BUDGET: activations compete with
                   resident experts there; partial residency also runs the grouped executor without its
                   decoded-weights mode)
    fused          CUDA: fused Triton ops replacing torch sequences (runmap.kernels.fused_ops): True = DEFAULT_FUSED
                   (prologue, norm, router, attn, gemv, imposed, shared; the prologue left out for a per-head q/k-norm
                   family; "imposed", a routing workload's gate weights in one launch, acts with "router"; "shared",
                   a shared expert of several rows in two launches between its GEMMs and, with "gemv", one token's
                   inside the grouped executor's launches), or an
                   iterable of FUSED_OPS names; False = pure torch. Ignored on CPU.
    host_source    a runmap.residency.host_source.HostSource already built from this pack (another engine's
                   ``host_source``): the cache reuses it instead of reading and hash-verifying every expert again.
                   Its identity must equal the pack's; this engine's reader is closed and watched by it (its
                   reads count in request_pack_reads). int4 only (the fp16 baseline reads its own rows).
    verify_pack    hash the pack's non-routed and small files before use (None: unless RUNMAP_PACK_VERIFY=0;
                   runmap.format.packfile.PackReader); expert rows are always verified by the host source
    routing        the routing workload (runmap.workload.routing): "model" (the router's own top-k),
                   "calibrated[:FAMILY]" or "trace:FILE" (ids imposed per layer; the router still weighs them)
    routing_seed   seed of the calibrated workload's draws (batch n of a run draws from (seed, n))
    record_routes  keep the routed ids of every layer and pass: ``eng.routes`` (RouteRecorder) gives the trace
                   and replayed hit rates. On CUDA graphs it adds one small copy per MoE layer to the step.
    gpu_budget     bytes (runmap.engine.budget.parse_size("8GiB")): instead of resident, plan the device memory
                   (non-routed weights, KV cache, workspaces, spare rows) and keep as many experts per layer as fit;
                   ``eng.budget_plan`` says how; on CUDA torch's allocator is capped at the budget (until close()).
                   Where the placement is or becomes host-read or two-site, all but HOST_READ_SPARES of the planned
                   spare rows then hold resident experts too (host_read_spares; ``eng.resident`` says how many)
    budget_kv_rows KV-cache rows the plan counts when a caller keeps more than max_batch
    warm_up        run ``eng.warm_up()`` before returning (compile every prefill size class and capture the decode
                   step, so the first request runs warm); None = on CUDA (under partial residency the passes move
                   experts as a request's would; the eviction policy's history is restored). ``runmap serve`` warms its engine itself, ``runmap generate`` and
                   ``runmap logits`` run one request and skip it
    cache_contract "v1" (default: pageable host source -> pinned staging -> device) or "v2" (the host source
                   registered as pinned memory once, rows copied straight into spare rows; docs/cache-contract.md)
    skip_experts   PROFILING ONLY: routed experts return zeros (router and everything else still run), so the
                   decode time without the expert GEMVs can be measured; outputs are wrong by design
    prompts        list[str] (tokenized with the pack's tokenizer; ``chat=True`` applies its chat template)
                   or list[list[int]] (token ids, used as they are)
    stop           stop strings; a row also stops on the tokenizer's / config's EOS id
    on_token       streaming callback ``on_token(row, token_id, text_delta)`` (see runmap.engine.generation)
    ignore_eos     benchmarks only: do not stop at EOS (every row generates max_new_tokens unless a stop string hits)
    returns        list of GenerationResult(text, token_ids, finish_reason, prompt_tokens), in prompt order

Residency: under full residency every expert row is published once at startup; the decode step reads
static row tables and calls the executor with validate=False, so it is captured whole in a CUDA graph
(one graph per (batch, KV-length bucket); attention reads only the bucket's KV prefix), and so is a prefill
pass of one row up to 4,096 positions or of several rows up to 2,048 in all (runmap.engine.prefill_graph: padded
on the right to its length bucket). Under partial residency every MoE call admits a request, leases the batch
union of the routed ids (split into groups of at most max_group experts), runs the executor on the lease's rows
and releases without a host wait: the release records an event on the compute stream that every later copy into a
freed row waits for (the transport's release fence), so no row is rewritten while a queued kernel may still read it.
"""
from __future__ import annotations

import contextlib
import functools
import os
import time
from collections import Counter

import numpy as np
import torch

from runmap.arch.config import ModelConfig
from runmap.engine.generation import (GenerationError, GenerationResult, GenerationRun, encode_prompt, generate_batch,
                                     prefill_warmup_shapes)
from runmap.engine.model import KVCache, Transformer, experts_dense_torch, load_weights, run_pieces
from runmap.engine.prefill_graph import GraphPrefiller
from runmap.engine.mixed_step import MixedStepper
from runmap.kernels.registry import CPU_SITE_EXECUTORS, EXECUTOR_NAMES as EXECUTORS, GRAPH_SAFE_EXECUTORS as GRAPH_EXECUTORS
from runmap.engine.telemetry import DECODE_PATHS, PREFILL_PATHS
from runmap.residency.regimes import regime_of
from runmap.residency.contracts import CONTRACT_NAMES
from runmap.workload.routing import ImposedRouting, RoutingError, parse_routing

EXPERT_FORMATS = ("int4", "fp16")
# The two-site step on a GPU: "graph" (default) captures the whole step as one CUDA graph whose layers wait on the
# device for the host's CPU sum only where the split gave the CPU site experts (kernels/site_split.py add_site_sum); "chain"
# is the earlier 2L + 1 segments with a host wait between each (for A/B measurements; docs/engine.md).
TWO_SITE_STEP_ENV = "RUNMAP_TWO_SITE_STEP"
# How the one-graph step's host learns that a layer's routed ids are in pinned memory: "event" (default; an external
# event recorded in the graph, cudaEventSynchronize) or "poll" (a spin on the count's slot in pinned memory, which the
# graph's copy overwrites; for A/B measurements of the host's wake-up latency)
TWO_SITE_WAIT_ENV = "RUNMAP_TWO_SITE_WAIT"
# How a layer's ids, input, gate weights, keep mask and count reach the host in the one-graph step: "copy" (default;
# five copies into pinned memory after the split kernel) or "mapped" (the split kernel stores them straight into the
# pinned memory, mapped into the device's address space: no copy between the split and the event the host waits on;
# needs the event wait). Why: on an H100 the host waited 58-77 us a layer for the next layer's ids after publishing,
# whatever the CPU share (results/campaigns/h100-two-site-host-ab); the copies are part of that chain. For A/B runs
TWO_SITE_HANDOFF_ENV = "RUNMAP_TWO_SITE_HANDOFF"
# How the one-graph step's host computes a layer's CPU part: "mask" (the default with a cpu-native site) runs a call
# bound once to the layer's pinned ids, keep mask, gate weights and input, which computes the pairs the device split
# left to the CPU with no Python in between, and checks the split against the host's rule after the step's last join;
# "rule" (the only form for other CPU executors) applies the rule and checks the split first, then prepares the
# call from the rule's experts (for A/B measurements of the host's per-layer cost; docs/engine.md)
TWO_SITE_JOIN_ENV = "RUNMAP_TWO_SITE_JOIN"
# Placement auto with both sites: the smallest decode batch whose steps may be two-site ones (an integer >= 1; default
# runmap.engine.placement.TWO_SITE_MIN_BATCH). Below it host-read's step always runs; for A/B runs of the step chooser
# against host-read alone at small batches
TWO_SITE_MIN_BATCH_ENV = "RUNMAP_TWO_SITE_MIN_BATCH"
# The two-site step's promotions: at most this many layers promote an expert after a step (an integer >= 1; unset:
# every layer that qualifies, as under host-read). Under host-read a step's promotions run while the next step runs on
# the device; after a two-site step the host, which the device waits for at each layer's join, runs them before the
# next step: ~300 us each on an H100 (results/campaigns/h100-llama-matched-sites-b1: 2.9 a step, 879 us of a 5.7 ms
# batch-1 step). For A/B runs
TWO_SITE_PROMOTIONS_ENV = "RUNMAP_TWO_SITE_PROMOTIONS"
# The one-graph two-site step's split: "off" (default) divides each layer's absent experts by the CPU rate learned in
# use against the link's rate probed at build; "wait" also moves that link rate after each step by how long the host
# waited for the ids (TwoSitePlacement.BALANCE_*: the device part late -> more to the CPU). For A/B runs
TWO_SITE_BALANCE_ENV = "RUNMAP_TWO_SITE_BALANCE"
# The allowed values of the two-site step's choice variables (checked by check_two_site_env whenever an engine is
# built, whatever its placement: a typo is refused even where the variable would not apply; the defaults are set where
# they are read, some depending on the device or the CPU site)
TWO_SITE_ENV_CHOICES = {TWO_SITE_STEP_ENV: ("graph", "chain"), TWO_SITE_WAIT_ENV: ("event", "poll"),
                        TWO_SITE_HANDOFF_ENV: ("copy", "mapped"), TWO_SITE_JOIN_ENV: ("mask", "rule"),
                        TWO_SITE_BALANCE_ENV: ("off", "wait")}
POLL_LIMIT_S = 60.0  # a poll that long means the device stopped: the step raises instead of spinning for ever
PREFILL_CHUNK = 8192  # prompt tokens per row per prefill pass, by default (from_pack's prefill_chunk)
FUSED_OPS = ("prologue", "norm", "router", "attn", "gemv", "imposed", "shared")
# Default on CUDA. "imposed" (the gate weights of a routing workload's ids in one launch on the fused router's logits,
# instead of ~7 torch launches per MoE layer) passed its GPU tests on an H100 on 2026-12-06 and, in the same call,
# lifted calibrated full-residency decode from 800 to 1,162 tok/s (OLMoE batch 1) and 373 to 479 (Qwen1.5-MoE)
# (results/campaigns/h100-imposed-fused). The router is two launches (logits over many programs, then softmax +
# top-k): 5.4 us per layer vs 16.5 us for torch's linear + softmax + topk on the H200
# (results/kernels/explore/h200-decode.json).
# In a decode step the logits launch is the norm's (add_norm_router_logits) and the prologue is the attention's.
# Removed after measuring: "tails" (the attention's combine in its split launch, the routing in the norm's launch, each
# by the launch's last program on a device counter: two launches fewer per layer) and "attn-tail" (its attention part)
# passed their GPU tests and were slower or no faster on an H100 (OLMoE batch 1 1,105.6 and 1,175.9 against 1,185.6 and
# 1,182.2 tok/s; results/campaigns/h100-decode-tails, h100-step-ablation; the code is in bc0a1c2..a6edef6). So was
# "sliced" (a decode layer's routed gate/up and down in one launch, each program one slice of an expert's intermediate
# columns and that slice's share of down into an fp32 partial): on an H100, 36 us per OLMoE layer against 19.4 for the
# two launches, and decode 917.7 against 1,212.8 tok/s (results/campaigns/h100-sliced; the code is at e6aa2d1).
DEFAULT_FUSED = ("prologue", "norm", "router", "attn", "gemv", "imposed", "shared")


def is_count(value) -> bool:
    """An int >= 1 and not a bool (a spare-row count, a batch size): what from_pack's and a spec's counts must be."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _two_site_min_batch(given: int | None = None) -> int:
    """The step chooser's minimum batch: ``given`` (from_pack's two_site_min_batch), else TWO_SITE_MIN_BATCH_ENV's
    value, else the placement's default; EngineError unless an integer >= 1."""
    from runmap.engine.placement import TWO_SITE_MIN_BATCH

    if given is not None:
        if not is_count(given):
            raise EngineError(f"two_site_min_batch={given!r}: allowed values are integers >= 1 (a decode batch size)")
        return given
    value = _env_count(TWO_SITE_MIN_BATCH_ENV, "a decode batch size")
    return TWO_SITE_MIN_BATCH if value is None else value


def _env_choice(name: str) -> str | None:
    """The environment variable ``name`` (one of TWO_SITE_ENV_CHOICES) if set, checked; EngineError naming it, its value
    and the allowed ones otherwise."""
    raw = os.environ.get(name)
    allowed = TWO_SITE_ENV_CHOICES[name]
    if raw is not None and raw not in allowed:
        raise EngineError(f"{name}={raw!r}: allowed values are " + " and ".join(repr(a) for a in allowed))
    return raw


def check_two_site_env(min_batch_given: bool = False) -> None:
    """Each variable of the two-site step's options that is set (TWO_SITE_ENV_CHOICES, the promotion bound, the chooser
    minimum unless ``min_batch_given``: from_pack's argument then wins over it), checked before an engine is built:
    EngineError naming the first bad one; the mapped handoff with the poll wait is refused here too (the handoff's
    buffers are read once an event says the split kernel completed; the poll reads the count before that)."""
    for name in TWO_SITE_ENV_CHOICES:
        _env_choice(name)
    _env_count(TWO_SITE_PROMOTIONS_ENV, "layers promoting an expert after a two-site step")
    if not min_batch_given:
        _env_count(TWO_SITE_MIN_BATCH_ENV, "a decode batch size")
    if os.environ.get(TWO_SITE_HANDOFF_ENV) == "mapped" and os.environ.get(TWO_SITE_WAIT_ENV) == "poll":
        raise EngineError(f"{TWO_SITE_HANDOFF_ENV}=mapped needs the one-graph step with the event wait; "
                          f"{TWO_SITE_WAIT_ENV} is 'poll'")


def _env_count(name: str, meaning: str) -> int | None:
    """The environment variable ``name`` as an integer >= 1 (``meaning``: what it counts, for the error), None when
    unset; EngineError naming it and its value otherwise."""
    raw = os.environ.get(name)
    if raw is None:
        return None
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise EngineError(f"{name}={raw!r}: allowed values are integers >= 1 ({meaning})")
    return value


class EngineError(ValueError):
    """Bad engine arguments (executor, residency, format, device)."""


# What Engine.prefill_pieces yields once every kernel of its pass is queued (before it reads anything back).
PASS_QUEUED = "pass-queued"


def _moe_experts():
    """The executors' entry point, imported on first use: it pulls in Triton, which must not be loaded
    before the CLI has chosen its backend (TRITON_INTERPRET on a machine without CUDA)."""
    from runmap.kernels.executors import moe_experts

    return moe_experts


def _without_decoded_mode(moe, *args, config=None, **kwargs):
    """``moe_experts`` with the grouped executor's decoded-weights mode off (runmap.kernels.grouped DEQUANT)."""
    return moe(*args, config={**(config or {}), "DEQUANT": False}, **kwargs)


# the placements whose decode steps read absent experts over the link from the registered host source
HOST_READ_PLACEMENTS = ("host-read", "two-site")
# the placements host_read_spares (ExpertCache.lend_spares) may apply to: auto may become one of the two
LENDING_PLACEMENTS = HOST_READ_PLACEMENTS + ("auto",)
# Spare rows per layer kept by default where the residency comes from a GPU budget (gpu_budget: the user gave bytes,
# not a resident count) and the placement is or becomes host-read or two-site; the rest of the planned miss group's
# spares are lent to residency (ExpertCache.lend_spares). Those placements move experts only by promotions, one per
# layer at a time, so one spare is all they use. On an H100 (results/campaigns/h100-llama-matched-lent) lending decoded
# 1.25-1.45x faster than the same rows without it, in the same call (OLMoE, matched --n-cpu-moe 4 / 12 / 16, batch 1
# and 8). An explicit resident count is kept as asked (host_read_spares lends there); a host_read_spares of at least
# the miss group (max_group) lends nothing.
HOST_READ_SPARES = 1


def _check_host_read(executor: str, resident: int, experts: int, device, contract: str,
                     emulate_link_gb_s: float | None = None, placement: str = "host-read") -> None:
    """Placement host-read's (and two-site's) preconditions, each an EngineError naming the value and what is
    allowed."""
    if executor != "grouped":
        raise EngineError(f"expert placement {placement!r} runs on the grouped executor only (its kernels read host "
                          f"rows); got executor {executor!r}")
    if resident >= experts:
        raise EngineError(f"expert placement {placement!r} reads absent experts from the host source; with all "
                          f"{experts} experts resident none is absent: give --resident N below it or a --gpu-budget")
    if torch.device(device).type == "cuda" and contract != "v2":
        raise EngineError(f"expert placement {placement!r} reads the registered host source over the link: it needs "
                          "contract v2 (--cache-contract v2), which registers and maps it")
    if emulate_link_gb_s is not None:
        raise EngineError(f"expert placement {placement!r} reads over the real link inside its kernels; an emulated "
                          "link (emulate_link_gb_s) paces copies only, so it cannot be emulated")


def _host_read_possible(executor: str, resident: int, experts: int, device, contract: str,
                        emulate_link_gb_s: float | None) -> bool:
    """Placement host-read's preconditions (_check_host_read) hold: ``auto`` may then choose it, and its rate can be
    measured."""
    try:
        _check_host_read(executor, resident, experts, device, contract, emulate_link_gb_s)
    except EngineError:
        return False
    return True


def _check_routing():
    """The executors' host routing check (runmap.kernels.executors.check_routing), imported on first use."""
    from runmap.kernels.executors import check_routing

    return check_routing


def _next_layer_predictor(model, cfg):
    """predict(layer, x) -> int64 (N, k): layer + 1's router applied to layer's MoE input x (fp16 (N, H)), the
    published next-layer prediction (the residual stream changes little between adjacent layers)."""
    from runmap.engine.model import route

    def predict(layer, x):
        return route(x, model.w.layers[layer + 1].router32, cfg.top_k, cfg.norm_topk_prob)[0]
    return predict


def _workload_predictor(model):
    """predict(layer, x) -> int64 (N, k) or None: under a routing workload, the workload's own prediction of layer + 1's
    ids for these rows (``model.imposed_pred``, made from each stream's past before the step was drawn; the router's
    prediction would name the model's experts, not the imposed ones). None when the pass has none (a replay)."""
    def predict(layer, x):
        pred = model.imposed_pred
        return None if pred is None else pred[layer + 1]
    predict.from_workload = True
    return predict


# ---- routed-experts backends -------------------------------------------------------------------------

class CachedExperts:
    """Routed experts from the ExpertCache through an executor (the product path)."""

    def __init__(self, cache, executor: str, layout, top_k: int):
        self.cache, self.executor, self.layout, self.top_k = cache, executor, layout, top_k
        self.full = cache.full_residency
        self.num_layers = cache.num_layers
        self.validate = True
        self._pass_ids: list | None = None  # (layer, ids) of the eager pass in checked_pass, else None
        self.moe = _moe_experts()
        if not self.full and executor == "grouped":
            # partial residency runs the INT4 loop only: the decoded-weights mode's workspace (every expert of a layer
            # in fp16: 0.8 GB for OLMoE, 2.8 GB for Mixtral) would take the memory this regime keeps for experts
            self.moe = functools.partial(_without_decoded_mode, self.moe)
        self._req = None
        self.h2d_seconds = 0.0  # host wall time of acquisitions that ran a miss transaction
        self.cpu_site = None  # the CPU site (runmap.kernels.cpu_int4.CpuExpertSite), built on first use
        self.cpu_executor = "cpu-native"  # its kernel (Engine.from_pack's cpu_executor, or the executor if a CPU site)
        self.cpu_site_prepare_s = None  # wall time of repacking every expert at build (a placement that may use it)
        # where absent experts are computed (runmap.engine.placement): None = the miss transaction (gpu)
        self.placement = None
        # next-layer prefetch (issue 24 item 4): predict(layer, x) -> int64 (N, k) expert ids of layer + 1 from layer's
        # MoE input, or None (off)
        self.predict = None
        if self.full:
            self.tables = [cache.static_row_table(l) for l in range(self.num_layers)]  # int32 (E,) each
        self.storage = [cache.storage(l) for l in range(self.num_layers)]  # uint8 (R, row_bytes) each
        # partial residency, segment decode: per-layer row tables at fixed addresses, refreshed from each lease
        self.static_tables = None if self.full else [
            torch.full((cache.num_experts,), -1, dtype=torch.int32, device=cache.device) for _ in range(self.num_layers)]
        # the published row table each static table was last refreshed from: a generation's tables are immutable
        # and a layer's is replaced only when that layer publishes, so an unchanged one needs no copy
        self.static_sources: list | None = None if self.full else [None] * self.num_layers
        self.host_rows: list | None = None  # the host-read site's rows per layer (enable_host_read), else None
        self._pending_promotion: np.ndarray | None = None  # the last host-read step's ids, not yet promoted from

    @contextlib.contextmanager
    def checked_pass(self):
        """Full residency: the routing of one eager forward pass checked once, at its end, instead of by the
        executor before each layer (two device-to-host reads per layer, ~4 ms of a 126-token prefill on the H200
        host: results/serve/probe/README.md). Within the pass the executor runs with validate=False, as in a
        captured decode step: an id outside [0, E) yields NaN rows, never another expert's (the static table
        maps every expert); at the end one read of a flag over every layer's ids, and on a bad id the host check
        of that layer raises its usual error before the pass's logits reach anyone. Nested passes share one."""
        if not self.full or not self.validate or self._pass_ids is not None:
            yield
            return
        self._pass_ids = []
        try:
            yield
            seen = self._pass_ids
            if seen:
                flat = torch.cat([ids.reshape(-1) for _, ids in seen])  # every routed id of the pass
                if bool(((flat < 0) | (flat >= self.cache.num_experts)).any()):
                    check = _check_routing()
                    for layer, ids in seen:  # the first layer with a bad id raises, naming token, slot and expert
                        check(ids, self.tables[layer], self.storage[layer].shape[0])
                    raise RuntimeError("a routed id outside [0, E) was seen in this pass but no layer's check named it")
        finally:
            self._pass_ids = None

    @contextlib.contextmanager
    def outside_pass(self):
        """Calls made between the pieces of an open checked pass (an eager decode step while a server interleaves a
        join's prefill) are not part of that pass: the executor checks their routing as usual."""
        saved, self._pass_ids = self._pass_ids, None
        try:
            yield
        finally:
            self._pass_ids = saved

    # Full residency: one request per generate call, every layer leased whole (no miss can happen).
    def begin(self):
        if self.full and self._req is None:
            self._req = self.cache.admit()
            for layer in range(self.num_layers):
                self._req.acquire_all(layer)

    def end(self):
        if self._req is not None:
            if self.cache.device.type == "cuda":
                torch.cuda.current_stream(self.cache.device).synchronize()
            self._req.release()
            self._req = None

    def rides_shared(self, n_rows: int) -> bool:
        """Whether a call of ``n_rows`` rows may take a shared expert (``shared``): one token, full residency on the
        grouped executor's device rows, in its decode form (runmap.kernels.grouped.SharedExpert; a top-k past
        DECODE_FORM_MAX_PAIRS would take sorted runs on a GPU)."""
        from runmap.kernels.grouped import DECODE_FORM_MAX_PAIRS

        return n_rows == 1 and self.full and self.executor == "grouped" and self.top_k <= DECODE_FORM_MAX_PAIRS

    def __call__(self, layer, x, ids, gw, shared=None):
        """x fp16 (N, H), ids int64 (N, k), gw fp32 (N, k) -> fp16 (N, H). shared: a one-token shared expert
        (runmap.kernels.grouped.SharedExpert) computed in the executor's launches and added, where ``rides_shared``."""
        if shared is not None and not self.rides_shared(x.shape[0]):
            raise EngineError(f"a shared expert rides in one token's grouped launches under full residency only "
                              f"({x.shape[0]} rows, executor {self.executor}, full residency {self.full})")
        if self.full and self.executor in CPU_SITE_EXECUTORS:  # computed from the host source, not the cache's rows
            with self.cache.monitored():  # as the other paths: a copy out of expert storage here would be counted
                return self.site().moe(layer, x, ids, gw)
        if self.full:
            validate = self.validate
            if validate and self._pass_ids is not None:  # checked at the end of the pass (checked_pass)
                self._pass_ids.append((layer, ids))
                validate = False
            # inside the copy monitor too: an eager call is seen each time, a CUDA-graph step when it is captured
            # (a copy out of expert rows in the step would show then), so expert_d2h_bytes covers this path
            with self.cache.monitored():
                return self.moe(self.executor, x, ids, gw, self.storage[layer], self.tables[layer], self.layout,
                                validate=validate, shared=shared)
        if self.host_rows is not None:  # placement host-read: a prompt's pass (its decode steps are HostReadDecoder's)
            return self._host_read_pass(layer, x, ids, gw)
        nxt = None
        if self.predict is not None and layer + 1 < self.num_layers:
            nxt = self.predict(layer, x)  # (N, k) device: queued before this layer's experts, read with ids below
        ids_h = ids.cpu()  # host decision: which experts to lease (partial residency only)
        # the call's size is the CPU rate's class, for the decision here and for every group call of _placed
        # (a prompt pass's groups of a few tokens are still a pass: synchronous on this thread, not a decode step)
        if self.mixed(x.shape[0]):
            return self._placed(layer, x, ids, gw, ids_h)
        if nxt is not None:
            nxt = nxt.cpu()
        groups = self._groups(ids_h)
        whole = len(groups) == 1  # one group (the usual decode case): no gather / scatter
        out = x if whole else torch.empty_like(x)
        for rows in groups:
            req = self.cache.admit()
            try:
                lease = self.acquire(req, layer, ids_h if whole else ids_h[rows])
                # The lease is the routing check: its group is the union of exactly these ids, every one mapped
                # to a published row, so the executor's own host check (validate) is not repeated here.
                with self.cache.monitored():  # a copy out of the leased rows would count in expert_d2h_bytes
                    if whole:
                        out = self.moe(self.executor, x, ids, gw, lease.storage, lease.row_table, self.layout,
                                       validate=False)
                    else:
                        sel = torch.as_tensor(rows, device=x.device)
                        out[sel] = self.moe(self.executor, x[sel].contiguous(), ids[sel], gw[sel], lease.storage,
                                            lease.row_table, self.layout, validate=False)
            finally:
                # Released without waiting for the kernel: the release records an event on the compute stream
                # and any later copy into a row it frees waits for that event on the transfer stream
                # (CudaTransport.note_release), so no row is rewritten while a queued kernel may still read it.
                req.release()
        if nxt is not None:  # the next layer's predicted experts move while the device computes this layer's
            self.prefetch(layer + 1, nxt)
        return out

    def prefetch(self, layer, predicted):
        """Publish the predicted experts of ``layer`` (int64 (N, k) host) that are absent, most often predicted
        first, at most max_group of them (the cache's prefetch: a miss transaction with no lease; a prediction
        that finds no room or fails before publication is dropped, never an error of the request)."""
        counts = Counter(e for e in predicted.reshape(-1).tolist() if e >= 0)  # -1: no prediction (a trace's start)
        if not counts:
            return
        self._timed(self.cache.prefetch, layer, [e for e, _ in counts.most_common(self.cache.max_group)])

    def mixed(self, tokens: int) -> bool:
        """True when a layer call (per-call path) or decode step (segment chain) of ``tokens`` tokens may compute absent
        experts at the CPU site: always with placement cpu; with auto, in a decode step of the segment chain when its
        step chooser's mode is ``cpu`` (AutoPlacement.decode_step), elsewhere while its rule would choose the CPU at the
        current hit rate and the CPU site's rate for calls of that size. Otherwise the plain path or chain runs."""
        return self.placement is not None and self.placement.uses_cpu_now(tokens)

    def site(self):
        """The CPU site over the cache's host source (runmap.kernels.cpu_int4.CpuExpertSite), built on first use."""
        if self.cpu_site is None:
            from runmap.kernels.cpu_int4 import CpuExpertSite

            self.cpu_site = CpuExpertSite(self.cache.host, executor=self.cpu_executor)
        return self.cpu_site

    def _placed(self, layer, x, ids, gw, ids_h):
        """Partial residency with a CPU site: each group's absent experts that the placement gives the CPU are
        computed there from the host source while the device computes the leased ones; the two sums are added.
        x fp16 (N, H), ids int64 (N, k), gw fp32 (N, k), ids_h = ids on the host -> fp16 (N, H)."""
        out = torch.empty_like(x)
        x_h = gw_h = None
        for rows in self._groups(ids_h):
            sel = rows if len(rows) < x.shape[0] else None  # None: the whole batch
            req = self.cache.admit()
            try:
                lease = self.acquire(req, layer, ids_h if sel is None else ids_h[rows], place=self.placement,
                                     tokens=x.shape[0])
                xs, idss, gws, ids_hs = ((x, ids, gw, ids_h) if sel is None else
                                         (x[rows].contiguous(), ids[rows], gw[rows], ids_h[rows]))
                on_cpu = torch.isin(ids_hs, torch.tensor(lease.cpu_experts, dtype=ids_hs.dtype))  # (n, k) bool
                if lease.cpu_experts and x_h is None:
                    # (N, H) fp16 and (N, k) fp32: both read before the device work is queued, so that the CPU site
                    # then runs while the device computes (a host copy after it would wait for the device part)
                    x_h, gw_h = x.to("cpu"), gw.to("cpu")
                with self.cache.monitored():  # a copy out of the leased rows would count in expert_d2h_bytes
                    y = self._device_part(xs, idss, gws, ids_hs, ~on_cpu, lease)  # fp32 (n, H) or None, queued
                    if lease.cpu_experts:  # runs while the device computes the leased experts
                        xc, gwc = (x_h, gw_h) if sel is None else (x_h[rows], gw_h[rows])
                        t_cpu = time.perf_counter()
                        yc = self.site().moe_subset(layer, xc, ids_hs, gwc, lease.cpu_experts)  # fp32 (n, H)
                        self.observe_cpu(len(lease.cpu_experts), time.perf_counter() - t_cpu)
                        yc = yc.to(x.device)
                        y = yc if y is None else y + yc
            finally:
                req.release()
            if sel is None:
                return y.to(torch.float16)
            out[torch.as_tensor(rows, device=x.device)] = y.to(torch.float16)
        return out

    def _device_part(self, x, ids, gw, ids_h, keep, lease):
        """The executor over the (token, slot) pairs in ``keep`` (bool (n, k) host) through the lease's rows ->
        fp32 (n, H), or None when no pair is kept. Batch 1 keeps its slots as columns (one token, k' experts);
        larger batches run the kept pairs as single-expert rows, summed back per token."""
        if not bool(keep.any()):
            return None
        if bool(keep.all()):
            return self.moe(self.executor, x, ids, gw, lease.storage, lease.row_table, self.layout,
                            validate=False).to(torch.float32)
        if x.shape[0] == 1:
            cols = torch.nonzero(keep[0]).flatten().to(x.device)  # (k',)
            return self.moe(self.executor, x, ids[:, cols].contiguous(), gw[:, cols].contiguous(), lease.storage,
                            lease.row_table, self.layout, validate=False).to(torch.float32)
        tok, slot = (t.to(x.device) for t in torch.nonzero(keep, as_tuple=True))  # (P,) each
        y = self.moe(self.executor, x[tok].contiguous(), ids[tok, slot][:, None].contiguous(),
                     gw[tok, slot][:, None].contiguous(), lease.storage, lease.row_table, self.layout,
                     validate=False)  # (P, H) fp16: each kept pair's weighted expert output
        out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
        return out.index_add_(0, tok, y.to(torch.float32))

    def acquire(self, req, layer, ids, place=None, tokens: int | None = None):
        """``req.acquire(layer, ids, place)``, timed as ``_timed`` says; the placement sees every layer call's
        routed ids first, whichever path makes it (auto's reuse estimate). ``tokens``: the size of the whole call
        when ``ids`` are one token group of it (auto's CPU rate class; default the rows of ``ids``)."""
        if self.placement is not None:
            self.placement.observe(layer, ids, tokens)
        return self._timed(req.acquire, layer, ids, place)

    def observe_cpu(self, n_experts: int, seconds: float) -> None:
        """Tell an auto placement what a CPU-site call of ``n_experts`` experts cost in use (its rule's CPU rate)."""
        observe = getattr(self.placement, "observe_cpu", None)
        if observe is not None:
            observe(n_experts * self.cache.host.layout.row_bytes, seconds)

    def _timed(self, call, *args):
        """``call(*args)`` (an acquisition or a prefetch), adding its wall time to ``h2d_seconds`` when it moved expert
        bytes host -> device (the rate bytes_h2d / h2d_seconds is then over every path that moves expert bytes: eager
        calls, segments and prefetches)."""
        bytes0, t0 = self.cache.counters["bytes_h2d"], time.perf_counter()
        out = call(*args)
        if self.cache.counters["bytes_h2d"] != bytes0:
            seconds = time.perf_counter() - t0
            self.h2d_seconds += seconds
            observe = getattr(self.placement, "observe_transfer", None)
            if observe is not None:  # auto's transfer rate in use, the host transaction included
                observe(self.cache.counters["bytes_h2d"] - bytes0, seconds)
        return out

    def static_experts(self, layer, x, ids, gw, table=None, host_read: bool = False):
        """Segment decode: the executor on the layer's whole storage through a row table at a fixed address (the
        layer's static table, refreshed from the lease before the segment runs, or ``table``: int32 (E,) device);
        validate=False, so it can be captured. ``host_read``: entries R + e of ``table`` read host row e over the
        link (the two-site chain)."""
        table = self.static_tables[layer] if table is None else table
        extra = {"host_rows": self.host_rows[layer]} if host_read else {}
        with self.cache.monitored():  # a copy out of expert rows in the segment would show when it is captured
            return self.moe(self.executor, x, ids, gw, self.storage[layer], table, self.layout, validate=False,
                            **extra)

    def _groups(self, ids_h: torch.Tensor) -> list[list[int]]:
        """Split token rows so that each group's union of expert ids has at most max_group members."""
        cap = self.cache.max_group
        groups, cur, union = [], [], set()
        for t, row in enumerate(ids_h.tolist()):
            new = union | set(row)
            if cur and len(new) > cap:
                groups.append(cur)
                cur, new = [], set(row)
            cur.append(t)
            union = new
        if cur:
            groups.append(cur)
        return groups

    # ---- the host-read site (placement host-read, HostReadDecoder) -----------------------------------------------
    def enable_host_read(self) -> None:
        """Set up the host-read site: each layer's host rows (the registered host source mapped into the device's
        address space; runmap.residency.transport.mapped_rows) and the (L, E) int32 row tables of its steps at fixed
        addresses, entry e = e's device row where resident in the step's generation, else R + e (host row e)."""
        from runmap.residency.transport import mapped_rows

        c, L, E = self.cache, self.num_layers, self.cache.num_experts
        self.host_rows = [mapped_rows(c.host, layer, c.device) for layer in range(L)]  # uint8 (E, row_bytes) each
        self._hr_host = np.zeros((L, E), dtype=np.int32)  # what hr_tables hold, kept on the host
        self.hr_tables = torch.full((L, E), -1, dtype=torch.int32, device=c.device)
        self._hr_maps: list = [None] * L  # per layer the mapping (an immutable generation's) hr_tables hold

    def measure_host_read_gb_s(self, layer: int = 0, repeats: int = 5) -> float:
        """The host-read site's rate (GB/s of expert bytes) for placement ``auto``'s choice: the executor computing one
        token's top_k experts with every one read from the host source (on a GPU over the link, through the mapping),
        best of ``repeats`` calls, each on experts no earlier call read (so none is served from the device's L2)
        while the layer has enough; one untimed call first (compilation, the first touch of the mapping). On a GPU
        each call is timed by events while the device is held busy until its launches are queued, so the host's
        launch work (which a decode step's graph does not pay) is not in the rate; on the CPU by the wall clock."""
        from runmap.residency.transport import mapped_rows

        c, k = self.cache, self.top_k
        dev, E = c.device, c.num_experts
        host = mapped_rows(c.host, layer, dev)  # uint8 (E, row_bytes)
        table = host_to_device(c.rows_per_layer + np.arange(E, dtype=np.int32), dev)  # int32 (E,): all host rows
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(1, self.layout.hidden_size, generator=gen).to(device=dev, dtype=torch.float16)  # (1, H)
        gw = torch.full((1, k), 1.0 / k, dtype=torch.float32, device=dev)  # (1, k)

        # (1, k) each: call i reads experts i*k .. i*k + k - 1 (wrapping only in a layer of fewer than (repeats+1) k)
        ids = [torch.tensor([[(i * k + j) % E for j in range(k)]], dtype=torch.int64).to(dev) for i in range(repeats + 1)]

        def call(i):
            self.moe(self.executor, x, ids[i], gw, self.storage[layer], table, self.layout, validate=False,
                     host_rows=host)

        call(repeats)  # untimed: the experts after the timed ones'
        best = float("inf")
        for i in range(repeats):
            if dev.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                torch.cuda._sleep(1_000_000)  # ~0.5 ms of device time: the call's launches are queued meanwhile
                start.record()
                call(i)
                end.record()
                end.synchronize()
                seconds = start.elapsed_time(end) / 1e3
            else:
                t0 = time.perf_counter()
                call(i)
                seconds = time.perf_counter() - t0
            best = min(best, seconds)
        return k * c.row_bytes / max(best, 1e-9) / 1e9

    def host_read_table(self, mapping) -> np.ndarray:
        """int32 (E,) row table of one layer for the host-read site: ``mapping``'s device row where the expert is
        mapped, else R + e (row e of the layer's host rows)."""
        table = self.cache.rows_per_layer + np.arange(self.cache.num_experts, dtype=np.int32)
        if mapping:
            table[list(mapping.keys())] = list(mapping.values())
        return table

    def point_host_read_tables(self, req) -> None:
        """Make hr_tables name ``req``'s generation (a copy on the compute stream, queued before the step that reads
        them; none when they already do). The request pins that generation, so its rows stay what the tables say
        until it is released. The copy's source is a pinned snapshot, which torch's pinned-memory allocator does not
        reuse before the copy ran (a step still in flight may have one queued)."""
        changed = False
        for layer in range(self.num_layers):
            m = req.mapping(layer)
            if self._hr_maps[layer] is not m:  # a publication replaces one layer's mapping object and shares the others
                self._hr_host[layer] = self.host_read_table(m)
                self._hr_maps[layer] = m
                changed = True
        if changed:
            src = torch.from_numpy(self._hr_host)
            self.hr_tables.copy_(src.pin_memory() if self.cache.device.type == "cuda" else src, non_blocking=True)

    def defer_promotion(self, ids: np.ndarray) -> None:
        """Keep a host-read step's routed ids (int (L, B, k), copied) for ``promote_pending``, which the next step calls
        once its own work is queued: a promotion's host work and copy then run beside that step instead of between
        the two. The next step reads the expert from the host source once more; that is the price."""
        self._pending_promotion = np.array(ids, copy=True)

    def promote_pending(self, max_layers: int | None = None) -> int:
        """Promote from the reads kept by ``defer_promotion`` (ExpertCache.promote_step, timed as a transfer), once, in
        at most ``max_layers`` layers (None: every layer that qualifies); returns the experts promoted. Safe beside a
        queued host-read step: a promotion publishes into a spare row and its victim's row is reused only after every
        request pinning the victim's generation (that step's) is released."""
        ids, self._pending_promotion = self._pending_promotion, None
        if ids is None:
            return 0
        return sum(map(len, self._timed(self.cache.promote_step, ids, self.placement.margin, max_layers)))

    @contextlib.contextmanager
    def policy_kept(self):
        """ExpertCache.policy_kept, and a pending promotion set aside meanwhile and put back after (work inside, a
        warm-up's pad-token steps, neither uses it nor leaves its own)."""
        saved, self._pending_promotion = self._pending_promotion, None
        try:
            with self.cache.policy_kept():
                yield
        finally:
            self._pending_promotion = saved

    def host_read_experts(self, layer, x, ids, gw):
        """A host-read step's layer: x fp16 (N, H), ids int64 (N, k), gw fp32 (N, k) -> fp16 (N, H); resident experts
        from their device rows, absent ones from the host rows, in the same launches (validate=False: capturable)."""
        with self.cache.monitored():  # a copy out of expert rows in the step would show when it is captured
            return self.moe(self.executor, x, ids, gw, self.storage[layer], self.hr_tables[layer], self.layout,
                            validate=False, host_rows=self.host_rows[layer])

    def _host_read_pass(self, layer, x, ids, gw):
        """Placement host-read, an eager layer call (a prompt's pass, a served join): x fp16 (N, H), ids int64 (N, k),
        gw fp32 (N, k) -> fp16 (N, H). One request pins the current generation; resident experts are read from their
        device rows and absent ones over the link from the host source, each once per row tile of its pairs (the
        grouped executor's sorted runs: once for a short prompt), in one call. No miss transaction: placement gpu's
        path would split the call into token groups of at most max_group experts (one token each at top-8) and move
        each group's absent experts, ~30 transactions per layer of a 32-token prompt. The reads are noted as a
        decode step's are (hits, host reads, the policy's uses); nothing is promoted from a prompt."""
        ids_h = ids.cpu()  # (N, k): checked and noted before anything runs
        req = self.cache.admit()
        try:
            req.note_host_reads(layer, ids_h.numpy())  # raises on an id outside [0, E) (the routing check)
            table = host_to_device(self.host_read_table(req.mapping(layer)), x.device)  # int32 (E,)
            with self.cache.monitored():  # a copy out of expert rows here would count in expert_d2h_bytes
                return self.moe(self.executor, x, ids, gw, self.storage[layer], table, self.layout, validate=False,
                                host_rows=self.host_rows[layer])
        finally:
            # released without waiting for the kernels: a row this request pins is rewritten only after its release
            # event on the compute stream (CudaTransport.note_release), i.e. after these kernels ran
            req.release()

    def telemetry(self) -> dict:
        return self.cache.telemetry()


class SkipExperts:
    """Profiling stand-in (``skip_experts=True``): routed experts return zeros; the cache underneath is kept
    (full residency leases, telemetry) so everything but the expert arithmetic runs as usual."""

    def __init__(self, inner):
        self.inner, self.validate = inner, True
        self.h2d_seconds = 0.0

    def begin(self):
        self.inner.begin()

    def end(self):
        self.inner.end()

    def __call__(self, layer, x, ids, gw):
        return torch.zeros_like(x)

    def telemetry(self):
        return self.inner.telemetry()

    def nbytes(self) -> int:
        return self.inner.nbytes()


class DenseFp16Experts:
    """BASELINE: every expert dequantized once to FP16 on the device; torch matmuls per unique expert.
    No cache and no executor: used only to isolate what compression changes (never the product default)."""

    def __init__(self, rows_per_layer, layout, device):
        self.layout, self.device = layout, torch.device(device)
        wdtype = torch.float16 if self.device.type == "cuda" else torch.float32  # CPU: see model.linear
        self.w = []
        for rows in rows_per_layer:  # uint8 (E, row_bytes) host
            layer = []
            for e in range(rows.shape[0]):
                d = layout.dequantize_expert(rows[e].to(self.device))
                layer.append(tuple(d[p].to(wdtype) for p in ("gate", "up", "down")))
            self.w.append(layer)
        self.validate = True
        self.h2d_seconds = 0.0

    def begin(self):
        pass

    def end(self):
        pass

    def __call__(self, layer, x, ids, gw):
        return experts_dense_torch(x, ids, gw, lambda e: self.w[layer][e])

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.w for exp in layer for t in exp)

    def telemetry(self) -> None:
        return None


# ---- CUDA graph decode ----------------------------------------------------------------------------------

class _StaticStepInputs:
    """The fixed-address inputs of a captured decode step of batch B: tok int64 (B, 1), slot int64 (1,), pad int64
    (B,), and when the engine has them, the imposed routes and the recorded routes, int64 (L, B, k) each."""

    def __init__(self, engine: "Engine", batch: int):
        self.e, self.B = engine, batch
        dev, L, k = engine.device, engine.cfg.num_layers, engine.cfg.top_k
        self.tok = torch.zeros(batch, 1, dtype=torch.long, device=dev)
        self.slot = torch.zeros(1, dtype=torch.long, device=dev)
        self.pad = torch.zeros(batch, dtype=torch.long, device=dev)
        # imposed routes are copied in before each step; recorded routes are copied out by the step itself
        self.imposed = torch.zeros(L, batch, k, dtype=torch.long, device=dev) if engine.imposed is not None else None
        # the workload's predictions of the same ids (next-layer prefetch under a routing workload)
        self.imposed_pred = torch.zeros(L, batch, k, dtype=torch.long, device=dev) \
            if engine.workload_predicts else None
        self.recorded = torch.zeros(L, batch, k, dtype=torch.long, device=dev) if engine.routes is not None else None

    def fits(self, engine: "Engine") -> bool:
        """Whether these buffers serve the engine's current routing workload and route recorder: a step captured
        without them (warm_up sets both aside) would route by the router and record nothing."""
        return (self.imposed is not None) == (engine.imposed is not None) and \
            (self.imposed_pred is not None) == engine.workload_predicts and \
            (self.recorded is not None) == (engine.routes is not None)

    def _load(self, tok, slot: int, pad) -> np.ndarray:
        """Copy one step's inputs in (and its imposed routes); returns the step's real-token mask (B, 1)."""
        self.tok.copy_(tok.view(self.B, 1))
        self.slot.fill_(slot)
        self.pad.copy_(pad)
        real = np.ones((self.B, 1), dtype=bool)
        if self.imposed is not None:
            self.imposed.copy_(host_to_device(self.e.imposed.draw(real), self.e.device), non_blocking=True)
            if self.imposed_pred is not None:
                self.imposed_pred.copy_(host_to_device(self.e.imposed.prediction, self.e.device), non_blocking=True)
        return real


class GraphDecoder(_StaticStepInputs):
    """Decode steps of batch B captured as CUDA graphs, one per KV-length bucket.

    Static inputs: tok int64 (B, 1), slot int64 (1,), pad int64 (B,); positions = slot - pad and the
    attention mask are computed inside the graph, so a step costs two tiny copies and one replay."""

    def __init__(self, engine: "Engine", batch: int, pool):
        super().__init__(engine, batch)
        self.pool = pool
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def _experts(self, layer, x, ids, gw, shared=None):
        """The step's routed experts (Transformer.forward's callback): the engine's, full residency's static tables.
        shared: only where ``rides_shared`` (the engine's experts may be a stand-in without it: SkipExperts)."""
        if shared is None:
            return self.e.experts(layer, x, ids, gw)
        return self.e.experts(layer, x, ids, gw, shared=shared)

    def rides_shared(self, n_rows: int) -> bool:
        """Whether ``_experts`` takes a one-token shared expert: the engine's experts say (CachedExperts.rides_shared);
        those without the method (SkipExperts, DenseFp16Experts) take none."""
        from runmap.engine.model import rides_shared

        return rides_shared(self.e.experts, n_rows)

    def _step(self, n_keys):
        e = self.e
        pos = (self.slot - self.pad).unsqueeze(1)  # (B, 1)
        e.experts.validate = False  # no host sync inside a graph: static tables of full residency
        e.model.imposed = self.imposed
        if self.recorded is not None:
            e.model.route_sink = lambda layer, ids: self.recorded[layer].copy_(ids)
        try:
            return e.model.forward(self.tok, pos, e.kv, self.slot, self.pad, n_keys, self._experts)
        finally:
            e.experts.validate = True
            e.model.imposed = e.model.route_sink = None

    def _capture(self, n_keys):
        self.graphs[n_keys] = capture_graph(lambda: self._step(n_keys), self.e.device, self.pool)

    def run(self, tok, slot: int, pad) -> torch.Tensor:
        """tok int64 (B,), slot: KV slot of the new tokens, pad int64 (B,) -> float32 logits (B, V) (a static
        buffer, valid until the next call)."""
        n_keys = self.e.bucket(slot + 1)
        real = self._load(tok, slot, pad)
        if n_keys not in self.graphs:
            self._capture(n_keys)
        g, out = self.graphs[n_keys]
        g.replay()
        if self.recorded is not None:
            self.e.routes.end_pass(real, self.recorded, decode=True)
        return out


class SegmentDecoder(_StaticStepInputs):
    """Partial-residency decode steps of batch B as CUDA-graph segments, one chain per KV-length bucket.

    A decode step is cut at every MoE layer's routing decision: segment 0 runs the embedding, layer 0's
    attention and router and copies layer 0's routed ids into pinned host memory; segment l (1..L-1) runs layer
    l-1's routed experts (through a static per-layer row table), the residual, layer l's attention and router,
    and copies layer l's ids out; segment L runs the last layer's experts and the logits. Between segments the
    host waits for one event, reads the ids from pinned memory, leases the layer's group (a miss transaction if
    needed, under the cache contract as always), copies the lease's row table into the static table on the
    compute stream when it changed since the last refresh, and replays the next segment. One request holds the
    step's leases (one per layer) and is released once the last segment is queued (the transport's release fence
    orders any later copy into those rows after it): one admission and one release per step, not per layer.

    Used when every layer's batch union fits one lease (top_k x B <= max_group). A larger batch runs the grouped
    chain (``grouped=True``): the routing segment also copies the layer's input and gate weights to static device
    buffers and zeroes an FP32 sum; the host splits the layer's union into groups of at most max_group experts (the
    resident ones first, so that only the last groups miss) and, per group, leases the group, copies the group's row
    table, ids and keep mask (one int32 row) to the device and replays the layer's group graph (the executor over
    every (token, slot) pair, the pairs of other groups pointed at this group's experts in turn with their gate
    weight zeroed, added to the sum). The all-hit groups share one request; before each group that misses the earlier
    request is released, so that its miss transaction may evict their experts behind the release fence. The next
    segment reads the sum. Every routed pair is computed once; the executor rounds each group's sum to FP16 before
    the FP32 sum adds it (one rounding per group instead of one per layer call). No request is held across layers.
    ``capture=False`` runs the same chain without graphs (the CPU, and the warm-up before a capture).

    With a placement that may compute absent experts at the CPU site in this step (``cpu``; ``auto``'s ``cpu``
    steps; auto-split where its rule gives the CPU site experts) each MoE layer is cut once more: the routing segment also copies the layer's input and
    gate weights to pinned host memory; the host leases the group with the placement, and the next segment runs the
    device part (the executor over the static row table with the CPU-site slots' gate weights zeroed and their ids
    pointed at a row the step's request pins); while it runs, the host computes the CPU-site experts from the host
    source and copies their FP32 sum to a static device buffer, which the segment after adds (2L + 1 segments). The
    grouped chain with a CPU site keeps L + 1 segments: the placement is asked once per layer about every absent
    expert, the experts it gives the CPU site start on the job thread before the first group (their pairs keep 0 in
    the groups' device steps), and their sum is copied in before the next segment.

    Placement two-site (``two_site=True``, with ``mixed``; docs/engine.md "Two sites in one step"): the same 2L + 1
    segments, without a lease, and the device part does not wait for the host. The step's one request pins the
    generation it reads; the host-read tables are pointed at it and the step's CPU share (fixed-point) copied to the
    device before the first segment. Each layer's device part starts with runmap.kernels.site_split: from the routed
    ids and the generation's table it decides on the device which absent experts the CPU site computes and writes the
    slots row (a resident expert -> its device row, an absent one the GPU computes -> R + e, host row e read over the
    link by the executor, one at the CPU site -> the lowest resident row with keep 0). So the host queues the device
    part right after the routing segment, then waits for the ids, applies the same rule (TwoSitePlacement.split with
    the step's share), notes the layer's reads with the cache (``note_host_reads`` with the CPU's share as ``cpu``:
    it checks the ids and counts hits, host reads and CPU-site experts), starts the CPU part and collects it while
    the device part runs. Any batch up to the split kernel's bound (B x top_k <= 1,024, E <= 256; checked when the
    engine is built) runs this one chain: nothing is leased, so no group bound applies. After the step (its request
    released) the hottest absent experts are promoted as under host-read.

    The one-graph form (``one_graph``: on a GPU by default, TWO_SITE_STEP_ENV): the same layers captured as ONE graph
    per KV bucket. Each layer copies its ids, input and gate weights and the split kernel's count c of CPU-site experts
    to pinned memory and records an external event; after the device part, kernels/site_split.add_site_sum adds the
    CPU sum, which it reads from pinned host memory once the host has written the step's sequence number into the
    layer's flag, and waits for nothing where c = 0. The host replays the step at once, then per layer waits for the
    event, applies the same rule, checks its count against the device's, computes the CPU part on its own thread into
    the pinned sum and publishes. So a layer that gives the CPU nothing costs no host round trip and no launch."""

    def __init__(self, engine: "Engine", batch: int, pool, capture: bool, mixed: bool = False,
                 grouped: bool = False, two_site: bool = False):
        super().__init__(engine, batch)
        if two_site and (grouped or not mixed):
            raise EngineError("the two-site chain is the one-lease mixed chain's shape: mixed=True, grouped=False")
        self.two_site = bool(two_site)
        # the one-graph two-site step (class docstring): on a GPU unless RUNMAP_TWO_SITE_STEP=chain; on the CPU device
        # only when RUNMAP_TWO_SITE_STEP=graph (tests: its eager steps join each layer before queueing the join, so
        # the interpreter, which runs the join's wait on this thread, finds the layer published)
        self.one_graph = bool(two_site) and engine.experts.placement.step_form == "graph"
        # how the host learns that a layer's ids are in pinned memory: an event recorded in the graph, or (poll) the
        # count's copy landing in a slot the host set to -1 before the replay (TWO_SITE_WAIT_ENV)
        self.poll = self.one_graph and engine.experts.placement.step_wait == "poll" and engine.device.type == "cuda"
        self._last_end = None  # when this chain's last one-graph step left run() (the gap to the next: note_step)
        if self.two_site:  # the step's CPU share in units of SHARE_ONE and its sequence number, on the device
            pin = engine.device.type == "cuda"
            self.share_host = torch.zeros(2, dtype=torch.int32, pin_memory=pin)  # [share, seq]
            self.step_dev = torch.zeros(2, dtype=torch.int32, device=engine.device)
            self.share_dev, self.seq_dev = self.step_dev[0:1], self.step_dev[1:2]
            self._share_q = 0
            self._seq = 0  # steps admitted by this chain (the value a one-graph join waits for in its layer's flag)
            from runmap.kernels.site_split import add_site_sum, two_site_split  # (kernels import once chosen)

            self._split_kernel, self._join_kernel = two_site_split, add_site_sum
        self.pool, self.capture = pool, capture
        cfg, dev = engine.cfg, engine.device
        self.L, self.k = cfg.num_layers, cfg.top_k
        self.host_ids = torch.zeros(self.L, batch, self.k, dtype=torch.long, pin_memory=dev.type == "cuda")
        self.host_ids_np = self.host_ids.numpy()  # (L, B, k) the same pinned memory, read without a torch call
        # next-layer prefetch: layer l + 1's predicted ids (its router on layer l's MoE input), written by the segment
        # that routes layer l and read on the host while the next segment runs (row 0 is unused)
        # (a workload's predictor has nothing to give while the engine runs without its workload: warm_up)
        ex = engine.experts
        # (nor under a CPU site: a prefetch would transfer what the placement computes where it lies)
        predicts = ex.predict is not None and not mixed and \
            (not getattr(ex.predict, "from_workload", False) or self.imposed_pred is not None)
        self.host_pred = (torch.zeros(self.L, batch, self.k, dtype=torch.long, pin_memory=dev.type == "cuda")
                          if predicts else None)
        # mixed sites: the chain of the steps on which the placement may give the CPU site experts
        self.mixed = bool(mixed)
        if self.mixed:
            pin, H, E = dev.type == "cuda", cfg.hidden_size, cfg.num_experts
            self.host_x = torch.zeros(self.L, batch, H, dtype=torch.float16, pin_memory=pin)  # each layer's MoE input
            self.host_gw = torch.zeros(self.L, batch, self.k, dtype=torch.float32, pin_memory=pin)  # its gate weights
            self.host_cpu_out = torch.zeros(self.L, batch, H, dtype=torch.float32, pin_memory=pin)  # the CPU sum
            # the same pinned memory as numpy arrays: the CPU part reads and writes them without a torch call
            self.host_x_np, self.host_gw_np = self.host_x.numpy(), self.host_gw.numpy()
            self.host_cpu_out_np = self.host_cpu_out.numpy()
            # per layer, one int32 row the host writes after each lease and copies to the device in one transfer:
            # the device part's row table (E,) for this step's ids (leased experts -> their rows, CPU-site experts
            # -> a row the step's request pins) and its keep mask (B, k) (0: the slot's expert is on the CPU site)
            self.host_slots = torch.zeros(self.L, E + batch * self.k, dtype=torch.int32, pin_memory=pin)
            self.host_slots_np = self.host_slots.numpy()
            self.slots = torch.zeros(self.L, E + batch * self.k, dtype=torch.int32, device=dev)
            self.cpu_out = torch.zeros(self.L, batch, H, dtype=torch.float32, device=dev)  # the CPU site's sum
            self.layer_cpu: list[tuple] = [()] * self.L  # this step's CPU-site experts per layer
            self.cpu_set = [False] * self.L  # cpu_out[l] holds a non-zero sum
            self.cpu_parts = 0  # layer calls of this chain whose CPU part computed experts
            self._jobs: list = [None] * self.L  # the CPU part in flight on the site's job thread, per layer
        if self.one_graph:
            from runmap.residency.transport import mapped_tensor

            L, H, pin = self.L, cfg.hidden_size, dev.type == "cuda"
            self.count_dev = torch.zeros(L, dtype=torch.int32, device=dev)  # per layer: c, the split kernel's count
            self.host_count = torch.zeros(L, dtype=torch.int32, pin_memory=pin)  # c copied out with the ids
            self.host_count_np = self.host_count.numpy()
            # and the device's keep mask of the pairs (0: the CPU site computes the pair's expert), checked by the host
            self.host_keep = torch.zeros(L, batch * self.k, dtype=torch.int32, pin_memory=pin)
            self.host_keep_np = self.host_keep.numpy()
            # per layer the host's publication flag (the step's sequence number once the CPU sum is whole) and a
            # flag the join sets when it gave up waiting, both pinned host memory the device reads / writes directly
            self.host_flags = torch.zeros(L, 1, dtype=torch.int32, pin_memory=pin)
            self.host_flags_np = self.host_flags.numpy()
            self.flags_dev = mapped_tensor(self.host_flags, dev)  # (L, 1)
            self.host_err = torch.zeros(1, 1, dtype=torch.int32, pin_memory=pin)
            self.host_err_np = self.host_err.numpy()
            self.err_dev = mapped_tensor(self.host_err, dev).view(1)
            self.sums_dev = mapped_tensor(self.host_cpu_out.view(L, batch * H), dev)  # (L, B H) the CPU sums
            # recorded inside the captured step (external events): the host waits for layer l's ids, input, gate
            # weights and count in pinned memory
            self.events = [torch.cuda.Event(external=True) if pin else None for _ in range(L)]
            # join "mask": per layer a call bound to its pinned ids, keep mask, gate weights and input (made on first
            # use), all sharing one scratch: the layers are joined one after another
            self.mask_join = engine.experts.placement.step_join == "mask"
            # handoff "mapped" (TWO_SITE_HANDOFF_ENV): the split kernel writes the layer's ids, input, gate weights,
            # keep mask and count through these device views of the same pinned memory, instead of five copies
            self.mapped_handoff = engine.experts.placement.step_handoff == "mapped"
            if self.mapped_handoff:
                Bk = batch * self.k
                self.map_ids = mapped_tensor(self.host_ids.view(L, Bk), dev).view(L, batch, self.k)
                self.map_x = mapped_tensor(self.host_x.view(L, batch * H), dev).view(L, batch, H)
                self.map_gw = mapped_tensor(self.host_gw.view(L, Bk), dev).view(L, batch, self.k)
                self.map_keep = mapped_tensor(self.host_keep, dev)  # (L, B k)
                self.map_count = mapped_tensor(self.host_count.view(L, 1), dev)  # (L, 1)
            self._masked: list = [None] * L
            self._masked_scratch = None
            self._join_s = np.zeros((L, 3))  # join "mask": per layer seconds waiting, binding, in the CPU part
        # grouped chain: batches whose union may exceed one lease (class docstring)
        self.grouped = bool(grouped)
        if self.grouped:
            pin, E, Bk = dev.type == "cuda", cfg.num_experts, batch * self.k
            self.max_groups = -(-min(E, Bk) // engine.experts.cache.max_group)
            # per layer and group one int32 row the host writes after the group's lease: the row table (E,) of the
            # group's experts, the pairs' ids (B k) (other groups' pairs spread over this group's) and keep mask (B k);
            # one host row per group, so a row is never rewritten while its copy to the device may be pending
            self.group_host = torch.zeros(self.L, self.max_groups, E + 2 * Bk, dtype=torch.int32, pin_memory=pin)
            self.group_host_np = self.group_host.numpy()
            self.group_slots = torch.zeros(self.L, E + 2 * Bk, dtype=torch.int32, device=dev)  # the group being run
            # each layer's MoE input fp16 (B, H), gate weights fp32 (B, k) and the groups' FP32 sum (B, H), at the fixed
            # addresses the group graphs read and write
            H = cfg.hidden_size
            self.group_x = torch.zeros(self.L, batch, H, dtype=torch.float16, device=dev)
            self.group_gw = torch.zeros(self.L, batch, self.k, dtype=torch.float32, device=dev)
            self.group_sum = torch.zeros(self.L, batch, H, dtype=torch.float32, device=dev)
            self.group_graphs: list | None = None  # per layer: the group step captured (with the first chain)
            self.group_pool = None
            self.groups_run = 0  # group steps of this chain (a layer call runs one or more)
        self.chains: dict[int, tuple[list, torch.Tensor]] = {}  # n_keys -> (graphs, logits)
        self._keep: list = []  # tensors living across segment boundaries (kept out of the pool's reuse)
        self.capture_graphs: list | None = None  # the chain being captured
        self._req = None  # the step's request: its leases' rows may be read by queued segments until released

    # the routed-experts callback of Transformer.forward in segment mode ---------------------------------------
    def _cut(self):
        """End the segment being captured and begin the next."""
        self.capture_graphs[-1].capture_end()
        nxt = torch.cuda.CUDAGraph()
        nxt.capture_begin(pool=self.pool)
        self.capture_graphs.append(nxt)

    def _experts(self, layer, x, ids, gw):
        if self.mixed and not self.grouped:
            return self._mixed_experts(layer, x, ids, gw)
        ex = self.e.experts
        pred = ex.predict(layer, x) if self.host_pred is not None and layer + 1 < self.L else None  # (B, k)
        capturing = self.capture_graphs is not None
        if self.grouped:  # the group steps' inputs at fixed addresses, their sum zeroed (class docstring)
            self.group_x[layer].copy_(x)
            self.group_gw[layer].copy_(gw)
            self.group_sum[layer].zero_()
            if self.mixed:  # the CPU part reads the layer's input and gate weights from pinned memory
                self.host_x[layer].copy_(x, non_blocking=capturing)
                self.host_gw[layer].copy_(gw, non_blocking=capturing)
        self.host_ids[layer].copy_(ids, non_blocking=capturing)
        if capturing:  # end this segment after the ids are copied out: the host decides between segments (run)
            if pred is not None:
                self.host_pred[layer + 1].copy_(pred, non_blocking=True)
                self._keep.append(pred)
            self._keep += [x, ids, gw]
            self._cut()
        else:  # eager chain: the host decision right here
            self._lease(layer)
        if not self.grouped:
            out = ex.static_experts(layer, x, ids, gw)
        elif self.mixed:  # as the per-call path adds the two sums
            out = (self.group_sum[layer] + self.cpu_out[layer]).to(x.dtype)
        else:
            out = self.group_sum[layer].to(x.dtype)
        if pred is not None and not capturing:  # the experts are queued: the prefetch overlaps them
            ex.prefetch(layer + 1, pred.cpu())
        return out

    def _expert_groups(self, layer) -> tuple[list[tuple[list[int], bool]], tuple]:
        """This step's union of routed experts of ``layer``: (the experts the device computes, in groups of at most
        max_group, each with whether it transfers an expert absent now; the experts the CPU site computes). The
        resident experts come first, so that the groups before the last misses are all hits and no miss evicts an
        expert a later group of this step would have found. With a CPU site (mixed) the placement is asked once, about
        every absent expert of the layer, as on one lease (its choice is checked again by the cache at the lease that
        places them)."""
        cache = self.e.experts.cache
        union = np.unique(self.host_ids_np[layer]).tolist()
        mapped = cache.mapping(layer)
        absent = [e for e in union if e not in mapped]
        cpu = ()
        if self.mixed and absent:
            cpu = tuple(sorted({int(e) for e in self.e.experts.placement(tuple(absent))}))
            absent = [e for e in absent if e not in cpu]
        order = [e for e in union if e in mapped] + absent
        cap = cache.max_group
        groups = [order[i:i + cap] for i in range(0, len(order), cap)]
        return [(g, any(e not in mapped for e in g)) for g in groups], cpu

    def _run_groups(self, layer) -> None:
        """Lease, run and release the groups of ``layer`` in turn (graphs replayed when captured, else eagerly). The
        all-hit groups share one request; each group that misses gets its own, admitted after the earlier groups'
        request was released, so that its transaction may recycle the rows their leases protected (a release costs
        the host ~40-85 us on the H200, results/campaigns/h200-txn-host-path/phases.log). With a CPU site (mixed)
        the experts the placement gives it are computed at once on the site's job thread, started before the first
        group so that it overlaps the groups' leases, transfers and device steps; they are leased last with every one
        placed at the CPU site (no row, counted by the cache) and collected by ``_cpu_part``."""
        ex = self.e.experts
        if ex.placement is not None:  # auto's reuse estimate sees the layer's whole union once, as on one lease
            ex.placement.observe(layer, self.host_ids_np[layer])  # (B, k): its rows are the call's tokens
        groups, cpu = self._expert_groups(layer)
        if self.mixed:
            self.layer_cpu[layer] = cpu
            if cpu:
                self._start_cpu_part(layer, cpu)
        cap = ex.cache.max_group
        req = None
        try:
            for g, (group, misses) in enumerate(groups):
                if req is not None and misses:
                    # without waiting for the queued group steps: the release fence orders any later copy into the
                    # rows their leases held after them
                    req, old = None, req
                    old.release()
                if req is None:
                    req = ex.cache.admit()
                lease = ex._timed(req.acquire, layer, group, None)
                self._write_group(layer, g, lease)
                self.group_slots[layer].copy_(self.group_host[layer, g], non_blocking=True)  # on the compute stream
                if self.group_graphs is not None:
                    self.group_graphs[layer].replay()
                else:
                    self._group_step(layer)
                self.groups_run += 1
            for i in range(0, len(cpu), cap):  # the CPU site's experts: a lease that places every one of them there
                if req is None:
                    req = ex.cache.admit()
                part = cpu[i:i + cap]
                req.acquire(layer, part, lambda absent, part=part: part)
        finally:
            if req is not None:
                req.release()

    def _write_group(self, layer, g, lease) -> None:
        """Group ``g``'s int32 row of ``layer`` (group_host) from its lease: row table, ids and keep mask."""
        E, Bk = self.e.cfg.num_experts, self.B * self.k
        buf = self.group_host_np[layer, g]
        for e, row in lease.rows.items():
            buf[e] = row
        flat = self.host_ids_np[layer].reshape(-1)  # (B k,)
        inside = np.isin(flat, lease.experts)
        ids = buf[E:E + Bk]
        ids[:] = flat
        # the pairs of other groups go to the group's experts in turn, not all to one: the executor serves an expert's
        # pairs in blocks of rows (16 in batch 8's sorted runs), and one expert holding every outside pair would
        # take several blocks, each reading its weights again
        outside = ~inside
        ids[outside] = np.resize(np.asarray(lease.experts, dtype=np.int32), int(outside.sum()))
        buf[E + Bk:] = inside

    def _group_step(self, layer) -> None:
        """One group of ``layer`` on the device: the executor over every pair through the group's row table, the pairs
        outside the group zero-weighted, added to the layer's FP32 sum (fixed addresses: captured once per layer)."""
        E, B, k = self.e.cfg.num_experts, self.B, self.k
        slots = self.group_slots[layer]
        table, ids, keep = slots[:E], slots[E:E + B * k].view(B, k), slots[E + B * k:].view(B, k)
        y = self.e.experts.static_experts(layer, self.group_x[layer], ids, self.group_gw[layer] * keep, table=table)
        self.group_sum[layer].add_(y.to(torch.float32))  # (B, H)

    def _capture_groups(self) -> None:
        """Each layer's group step as a CUDA graph of its own pool (it replays between the chain's segments)."""
        self.group_pool = torch.cuda.graph_pool_handle()
        self.group_graphs = [capture_graph(functools.partial(self._group_step, layer), self.e.device,
                                           self.group_pool)[0] for layer in range(self.L)]

    def _mixed_experts(self, layer, x, ids, gw):
        """The routed experts of ``layer`` with a CPU site (class docstring): x fp16 (B, H), ids int64 (B, k),
        gw fp32 (B, k) -> fp16 (B, H)."""
        ex = self.e.experts
        capturing = self.capture_graphs is not None
        if not (self.one_graph and self.mapped_handoff):  # (mapped: the split kernel stores them, _one_graph_experts)
            self.host_ids[layer].copy_(ids, non_blocking=capturing)
            self.host_x[layer].copy_(x, non_blocking=capturing)
            self.host_gw[layer].copy_(gw, non_blocking=capturing)
        if capturing and not self.one_graph:
            self._keep += [x, ids, gw]
            # the host leases here: routing decision, placement, CPU part started, row table and mask (two-site: the
            # device part is queued first and the host's part runs beside it)
            self._cut()
        elif not self.two_site:
            self._lease(layer)
        if self.one_graph:
            return self._one_graph_experts(layer, x, ids, gw, capturing)
        if self.two_site:  # the slots row decided on the device (class docstring)
            self._split_kernel(ids.contiguous(), ex.hr_tables[layer], self.share_dev, ex.cache.rows_per_layer,
                               self.slots[layer])
        E, (B, k) = self.e.cfg.num_experts, ids.shape
        table, keep = self.slots[layer, :E], self.slots[layer, E:].view(B, k).to(torch.float32)  # (E,), (B, k)
        # (B, H) fp16: the leased experts only (two-site: the resident and host-read ones)
        out = ex.static_experts(layer, x, ids, gw * keep, table=table, host_read=self.two_site)
        if capturing:
            self._keep.append(out)
            self._cut()  # the host collects the CPU part here and copies its sum to cpu_out
        else:
            if self.two_site:
                self._lease(layer)
            self._cpu_part(layer)
        return (out.to(torch.float32) + self.cpu_out[layer]).to(out.dtype)  # as the per-call path adds the two sums

    def _one_graph_experts(self, layer, x, ids, gw, capturing):
        """The one-graph two-site step's layer (class docstring): the split on the device with its count copied out
        beside the ids, an event, the device part, then the join (``add_site_sum``), which waits only where the CPU
        site has experts. Eager (not capturing), the host joins the layer right here, before queueing the join."""
        ex = self.e.experts
        E, (B, k) = self.e.cfg.num_experts, ids.shape
        count = self.count_dev[layer:layer + 1]
        handoff = None
        if self.mapped_handoff:  # the kernel stores what the host reads into its pinned memory itself
            handoff = (x.contiguous(), gw.contiguous(), self.map_ids[layer], self.map_x[layer], self.map_gw[layer],
                       self.map_keep[layer], self.map_count[layer])
        self._split_kernel(ids.contiguous(), ex.hr_tables[layer], self.share_dev, ex.cache.rows_per_layer,
                           self.slots[layer], count, handoff=handoff)
        if not self.mapped_handoff:
            self.host_count[layer:layer + 1].copy_(count, non_blocking=capturing)
            self.host_keep[layer].copy_(self.slots[layer, E:], non_blocking=capturing)  # (B k,) which pairs the CPU has
        if self.events[layer] is not None:
            self.events[layer].record()
        table, keep = self.slots[layer, :E], self.slots[layer, E:].view(B, k).to(torch.float32)  # (E,), (B, k)
        out = ex.static_experts(layer, x, ids, gw * keep, table=table, host_read=True)  # (B, H) fp16
        if not capturing:  # eager: the layer published before its join is queued (its wait then ends at once)
            self._join_layer(layer)
        return self._join_kernel(out, self.sums_dev[layer].view(B, -1), count, self.flags_dev[layer], self.seq_dev,
                                 self.err_dev)

    def _join_layer(self, layer) -> None:
        """The host's part of ``layer`` in the one-graph step: wait for the layer's ids, compute the CPU site's experts
        into the pinned sum the join reads and publish it (the layer's flag := the step's sequence number). A layer with
        none publishes nothing: its join does not wait. The device's split is checked against the host's rule (the
        same experts, not only as many) and the layers' reads are noted with the cache after the last join
        (``_note_joined_layers``): the device waits at each layer's join for this thread, so per-layer bookkeeping
        would be on its critical path.

        Join "mask" (``mask_join``): the CPU computes the pairs the device's keep mask left it, in one bound call; the
        rule is checked for every layer at once after the last join (a mismatch still fails the step, whose output the
        failure discards; the C kernel checks each id it reads before it reads a row). Join "rule": the rule
        (``_split_sites``) and its check first, then a call prepared from the rule's experts."""
        t_wait = time.perf_counter()
        if self.poll:  # the count's copy lands after the ids', input's and gate weights' (stream order)
            count, spins = self.host_count_np, 0
            while count[layer] < 0:
                spins += 1
                if not spins & 0xFFFF and time.perf_counter() - t_wait > POLL_LIMIT_S:
                    raise EngineError(f"two-site step, layer {layer}: its ids did not arrive in {POLL_LIMIT_S:g} s")
        elif self.events[layer] is not None:
            self.events[layer].synchronize()
        ex = self.e.experts
        t_split = time.perf_counter()
        if self.mask_join:  # only the call and the publication here: the check and the counts after the last join
            if self.host_count_np[layer] > 0:
                call = self._masked[layer]
                if call is None:  # (bound on first use, outside the timed call: the split learns the CPU site's
                    call = self._masked[layer] = self._bind_masked(layer)  # rate from these seconds)
                t0 = time.perf_counter()
                call()
                self.host_flags_np[layer, 0] = self._seq  # after the sum's last store (the device reads the flag,
                # then the sum)
                t1 = time.perf_counter()
            else:
                t0 = t1 = t_split
            self._join_s[layer] = (t_split - t_wait, t0 - t_split, t1 - t0)  # wait, bind, CPU part
            return
        n_absent, cpu = self._check_split(layer)
        ex.placement.count_split(n_absent, len(cpu))
        if not cpu:
            ex.placement.note_join(t_split - t_wait, time.perf_counter() - t_split, 0.0, False)
            return
        t0 = time.perf_counter()
        if ex.site().native:  # on this thread: nothing else to drive until the join is published (no job hand-off)
            self._native_cpu_call(layer, cpu)()
        else:
            self._cpu_part_here(layer, cpu)
        t1 = time.perf_counter()
        self.host_flags_np[layer, 0] = self._seq  # after the sum's last store (the device reads the flag, then it)
        ex.observe_cpu(len(cpu), t1 - t0)
        ex.placement.note_join(t_split - t_wait, t0 - t_split, t1 - t0, True)
        self.cpu_parts += 1

    def _check_splits(self) -> tuple[np.ndarray, np.ndarray]:
        """Join "mask", after the step's last join: the host's rule (TwoSitePlacement.split_mask) applied to every
        layer's ids at once and checked against the device's split: as many experts per layer (its count) and the same
        pairs zeroed (its keep mask: exactly the pairs of the rule's experts). Returns int (L,) absent experts and
        bool (L, E) the CPU site's experts; raises EngineError naming the first wrong layer and both sides."""
        L, E = self.L, self.e.cfg.num_experts
        ids = self.host_ids_np.reshape(L, -1)  # (L, B k)
        if ids.min() < 0 or ids.max() >= E:
            layer = int(np.flatnonzero((ids < 0).any(1) | (ids >= E).any(1))[0])
            raise EngineError(f"two-site step, layer {layer}: routed expert ids {sorted(set(ids[layer].tolist()))} "
                              f"outside [0, {E})")
        pairs = np.bincount((ids + E * np.arange(L)[:, None]).ravel(), minlength=L * E).reshape(L, E)  # (L, E)
        absent = (pairs > 0) & ~self._req.resident_mask()  # (L, E)
        rule = self.e.experts.placement.split_mask(pairs, absent, self._share_q)  # (L, E)
        counts = rule.sum(axis=1)
        wrong = np.flatnonzero(self.host_count_np != counts)
        if wrong.size:
            layer = int(wrong[0])
            raise EngineError(f"two-site step, layer {layer}: the device's split gave the CPU site "
                              f"{int(self.host_count_np[layer])} experts, the host's rule {int(counts[layer])} "
                              f"({np.flatnonzero(rule[layer]).tolist()})")
        zeroed = self.host_keep_np == 0  # (L, B k)
        wrong = np.flatnonzero((zeroed != np.take_along_axis(rule, ids, axis=1)).any(axis=1))
        if wrong.size:
            layer = int(wrong[0])
            raise EngineError(f"two-site step, layer {layer}: the device's split gave the CPU site experts "
                              f"{sorted(set(ids[layer][zeroed[layer]].tolist()))}, the host's rule "
                              f"{np.flatnonzero(rule[layer]).tolist()}")
        return absent.sum(axis=1), rule

    def _check_split(self, layer) -> tuple[int, tuple]:
        """The host's rule applied to ``layer``'s ids (``_split_sites``) and checked against the device's split: as
        many experts (its count) and the same ones (the pairs its keep mask zeroed). Returns (absent experts, the
        CPU site's experts); raises EngineError naming the layer and both sides otherwise."""
        n_absent = self._split_sites(layer, start=False, note=False)
        cpu = self.layer_cpu[layer]
        if int(self.host_count_np[layer]) != len(cpu):
            raise EngineError(f"two-site step, layer {layer}: the device's split gave the CPU site "
                              f"{int(self.host_count_np[layer])} experts, the host's rule {len(cpu)} ({list(cpu)})")
        # the same experts, not only as many (the join adds the CPU's sum where the device zeroed pairs), and no zeroed
        # pair where the rule gives the CPU none (its pairs would be dropped)
        flat = self.host_ids_np[layer].reshape(-1)
        on_device_rule = set(flat[self.host_keep_np[layer] == 0].tolist())
        if on_device_rule != set(cpu):
            raise EngineError(f"two-site step, layer {layer}: the device's split gave the CPU site experts "
                              f"{sorted(on_device_rule)}, the host's rule {list(cpu)}")
        return n_absent, cpu

    def _bind_masked(self, layer):
        """Join "mask": the CPU site's call bound to ``layer``'s pinned ids, keep mask, gate weights and input,
        writing its pinned sum (``CpuExpertSite.bind_masked_call``), with the team of ``_cpu_threads``."""
        site = self.e.experts.site()
        if self._masked_scratch is None:
            self._masked_scratch = site.masked_scratch(self.B, self.k)
        return site.bind_masked_call(layer, self.host_x_np[layer], self.host_ids_np[layer], self.host_keep_np[layer],
                                     self.host_gw_np[layer], self.host_cpu_out_np[layer], self._cpu_threads(),
                                     self._masked_scratch)

    def _replay_one_graph(self, graph) -> float:
        """Queue the one-graph step, then join each layer on the host as its ids arrive. Returns the seconds the
        replay took to queue (the rest of the call is the joins)."""
        if self.poll:  # (every count of the step before was seen: no copy of it is pending)
            self.host_count_np[:] = -1
        t0 = time.perf_counter()
        graph.replay()
        queued = time.perf_counter() - t0
        for layer in range(self.L):
            self._join_layer(layer)
        self._note_joined_layers()
        return queued

    def _note_joined_layers(self) -> None:
        """After the one-graph step's last join. Join "mask": every layer's split checked at once (``_check_splits``),
        then per layer in order its split counted, its CPU part's seconds given to the CPU rate and its join's times
        noted (the check's seconds shared among the layers), as the joins did one layer at a time before: the step's
        share was fixed at its start, so nothing the device or a join reads changes. Then the reads of every layer
        noted with the cache in one call (ExpertCache.note_host_read_step with each layer's CPU-site experts: the same
        checks, counters, ticks and policy uses as a call per layer). Why here: the device waits at each layer's join
        for this thread, so this work between joins was on its critical path (~40 us of checking and ~65 us of
        bookkeeping per layer against a 120 us CPU part at n-cpu-moe 12 on an H100,
        results/campaigns/h100-llama-matched-sites-b1). A step that failed before this noted nothing with the cache
        (its output is discarded)."""
        ex = self.e.experts
        if not self.mask_join:  # join "rule": each layer was checked and counted at its join
            ex.cache.note_host_read_step(self._req, self.host_ids_np, cpu=self.layer_cpu)
            return
        t0 = time.perf_counter()
        n_absent, cpu = self._check_splits()  # (L,), bool (L, E)
        n_cpu = cpu.sum(axis=1).tolist()
        self.layer_cpu = [tuple(np.flatnonzero(row).tolist()) if n else () for row, n in zip(cpu, n_cpu)]
        check_s = (time.perf_counter() - t0) / self.L
        placement = ex.placement
        for layer, (absent, n) in enumerate(zip(n_absent.tolist(), n_cpu)):
            placement.count_split(absent, n)  # (before observe_cpu: a starved split's rate reset then drops only
            # what came before this layer's call)
            wait_s, bind_s, cpu_s = self._join_s[layer].tolist()
            if n:
                ex.observe_cpu(n, cpu_s)
                self.cpu_parts += 1
            # (split: the bind, where this layer's first CPU part made it, plus its share of the check)
            placement.note_join(wait_s, bind_s + check_s, cpu_s, n > 0)
        ex.cache.note_host_read_step(self._req, self.host_ids_np, cpu=cpu)

    def check_joins(self, wait: bool = False) -> None:
        """Raise if a join of this chain gave up waiting for the host's CPU sum (its step's output was NaN, never a
        sum quietly left out). ``wait``: first wait for the steps queued so far (a run's end). The chain refuses every
        later step after it: something held the host for seconds, or a sum was never published."""
        if not self.one_graph:
            return
        if wait and self.e.device.type == "cuda":
            torch.cuda.current_stream(self.e.device).synchronize()
        if self.host_err_np[0, 0]:
            from runmap.kernels.site_split import MAX_SPINS

            raise EngineError(f"a two-site step of batch {self.B}: a layer's join gave up waiting for the host's CPU "
                              f"sum after {MAX_SPINS} polls (that step's output was NaN); this batch size's step "
                              "refuses to run on")

    def _unblock_joins(self) -> None:
        """A step that failed between its layers: publish every layer, so that no join of the step's queued work
        waits for a host that will not come (the step's output is not used: the failure propagates)."""
        if self.one_graph:
            self.host_flags_np[:, 0] = self._seq

    def _start_cpu_part(self, layer, experts) -> None:
        """Start the CPU-site experts ``experts`` of ``layer`` on the site's job thread (cpu-native executors), from
        the pinned copies of the layer's input, ids and gate weights into host_cpu_out[layer]: called from the
        placement decision (inside the one-lease chain's lease; in the grouped chain before its first group), so the
        kernel runs while the host finishes the leases (miss transactions' copies included) and the device part runs.
        Other CPU executors run in ``_cpu_part``, on this thread."""
        site = self.e.experts.site()
        if not site.native:
            return
        # checked, grouped and bound here; the job thread then only enters the C kernel (which releases the GIL)
        t0 = time.perf_counter()
        call = self._native_cpu_call(layer, experts)
        prepare_s = time.perf_counter() - t0

        def job():  # -> the CPU site's seconds for this call: its preparation here plus the kernel there (auto's rate)
            t1 = time.perf_counter()
            call()
            return prepare_s + time.perf_counter() - t1
        self._jobs[layer] = site.submit(job)

    def _native_cpu_call(self, layer, experts):
        """The cpu-native site's call computing ``experts`` of ``layer`` from the pinned copies of the layer's input,
        ids and gate weights into host_cpu_out[layer], checked and bound (``prepare_subset_arrays``), not yet run."""
        return self.e.experts.site().prepare_subset_arrays(layer, self.host_x_np[layer], self.host_ids_np[layer],
                                                           self.host_gw_np[layer], experts,
                                                           self.host_cpu_out_np[layer], self._cpu_threads())

    def _cpu_threads(self) -> int:
        """The cpu-native site's team for this chain's CPU parts: the site's own count, else the caller's count (not
        the job thread's default) less one: the main thread keeps driving the device while the kernel runs, and a team
        thread sharing its core would hold back the whole team (h200-placement-split: with every core in the team the
        kernel took ~490 us per layer instead of ~300 and the host's lease work 2-3x longer)."""
        return self.e.experts.site().native_threads or max(1, torch.get_num_threads() - 1)

    def _cpu_part_here(self, layer, experts) -> None:
        """A CPU executor without a job thread: ``experts`` of ``layer`` computed on this thread from the host copies of
        the layer's input, ids and gate weights, their FP32 sum written to host_cpu_out[layer]."""
        ex = self.e.experts
        with ex.cache.monitored():  # as on the per-call path: a copy out of expert rows here would be counted
            yc = ex.site().moe_subset(layer, self.host_x[layer], self.host_ids[layer], self.host_gw[layer], experts)
        self.host_cpu_out[layer].copy_(yc)  # (B, H) fp32

    def _placing(self, layer):
        """The engine's placement, wrapped so that the experts it gives the CPU site start computing at once."""
        placement = self.e.experts.placement

        def place(absent):
            chosen = tuple(sorted({int(e) for e in placement(absent)}))
            if chosen and set(chosen) <= set(absent):  # (the cache refuses any other answer after this returns)
                self._start_cpu_part(layer, chosen)
            return chosen
        return place

    def _cpu_part(self, layer):
        """This step's CPU-site experts of ``layer``: the job started at the placement decision collected (or, for a
        CPU executor without a job thread, computed here from the host copies of the layer's input and gate weights),
        their FP32 sum copied to the layer's static device buffer (zeroed once when a layer has none)."""
        cpu = self.layer_cpu[layer]
        if cpu:
            ex = self.e.experts
            job = self._jobs[layer]
            if job is not None:
                try:
                    seconds = job.result()  # preparation + kernel time (a failure in the job raises here)
                finally:
                    if job.done():  # interrupted while it still runs: _drain_jobs waits for it before the release
                        self._jobs[layer] = None
            else:
                t_cpu = time.perf_counter()
                self._cpu_part_here(layer, cpu)
                seconds = time.perf_counter() - t_cpu
            ex.observe_cpu(len(cpu), seconds)
            self.cpu_out[layer].copy_(self.host_cpu_out[layer], non_blocking=True)
            self.cpu_set[layer] = True
            self.cpu_parts += 1
        elif self.cpu_set[layer]:
            self.cpu_out[layer].zero_()
            self.cpu_set[layer] = False

    def _lease(self, layer):
        ex = self.e.experts
        if self.two_site:
            self._split_sites(layer)
            return
        if self.grouped:
            self._run_groups(layer)
            if self.mixed:
                self._cpu_part(layer)
            return
        if not self.mixed:
            lease = ex.acquire(self._req, layer, self.host_ids_np[layer])
            if ex.static_sources[layer] is not lease.row_table:
                ex.static_tables[layer].copy_(lease.row_table, non_blocking=True)  # (E,) on the compute stream
                ex.static_sources[layer] = lease.row_table
            return
        lease = ex.acquire(self._req, layer, self.host_ids_np[layer], self._placing(layer))
        self._write_slots(layer, lease)

    def _write_slots(self, layer, lease):
        """Mixed chain: the row table entries of this step's ids and the keep mask of ``layer`` (host_slots) from the
        lease, copied to the device in one transfer. A CPU-site expert's slots get keep 0 and a row the step's request
        pins (a complete published expert whose zero-weighted contribution the mask removes)."""
        E, cpu = self.e.cfg.num_experts, lease.cpu_experts
        self.layer_cpu[layer] = cpu
        ids = self.host_ids_np[layer]  # (B, k)
        buf = self.host_slots_np[layer]
        rows = lease.rows
        pinned = self._req.pinned_row(layer) if cpu else None
        keep = buf[E:]
        for j, e in enumerate(ids.reshape(-1).tolist()):
            row = rows.get(e)
            if row is None:
                if e not in cpu:
                    raise EngineError(f"layer {layer}: routed expert {e} is neither leased nor at the CPU site")
                buf[e], keep[j] = pinned, 0
            else:
                buf[e], keep[j] = row, 1
        self.slots[layer].copy_(self.host_slots[layer], non_blocking=True)  # (E + B k,) on the compute stream

    def _split_sites(self, layer, start: bool = True, note: bool = True) -> int:
        """Two-site chain, on the host: the CPU site's share of ``layer``'s absent experts by the rule the device part's
        split kernel applied (the step's share), the layer's reads noted, the CPU part started (class docstring; the
        one-graph step computes it itself, ``start=False``, and notes every layer's reads in one call after its last
        join, ``note=False`` then ``_note_joined_layers``: per-layer bookkeeping would sit between joins the device
        waits for, and the CPU kernel checks the ids itself before it reads a row). Returns the number of absent
        experts."""
        ex = self.e.experts
        req = self._req
        ids = self.host_ids_np[layer]  # (B, k)
        mapping = req.mapping(layer)
        experts, pairs = np.unique(ids, return_counts=True)
        absent = [(e, n) for e, n in zip(experts.tolist(), pairs.tolist()) if e not in mapping]
        cpu = ex.placement.split(absent, self._share_q) if absent else ()
        self.layer_cpu[layer] = cpu
        if note:
            self._note_split(layer, len(absent))
        if cpu and start:
            self._start_cpu_part(layer, cpu)
        return len(absent)

    def _note_split(self, layer, n_absent: int) -> None:
        """The layer's reads noted with the cache and its split counted (``_split_sites``)."""
        cpu = self.layer_cpu[layer]
        self._req.note_host_reads(layer, self.host_ids_np[layer], cpu=cpu)  # checks every id is in [0, E), the CPU
        # site's experts routed and absent (nothing counted otherwise)
        self.e.experts.placement.count_split(n_absent, len(cpu))  # (a refused layer is not a split)

    def _drain_jobs(self) -> None:
        """Wait for every CPU part still in flight (a failure between segments): their buffers are reused next step."""
        for layer, job in enumerate(getattr(self, "_jobs", ())):
            if job is not None:
                job.exception()  # waits; the error, if any, was or will be raised by the failure being handled
                self._jobs[layer] = None

    def _release(self):
        self._drain_jobs()
        req, self._req = self._req, None
        if req is not None:
            req.release()

    def _forward(self, n_keys):
        e = self.e
        pos = (self.slot - self.pad).unsqueeze(1)  # (B, 1)
        e.model.imposed, e.model.imposed_pred = self.imposed, self.imposed_pred
        if self.recorded is not None:
            e.model.route_sink = lambda layer, ids: self.recorded[layer].copy_(ids)
        try:
            return e.model.forward(self.tok, pos, e.kv, self.slot, self.pad, n_keys, self._experts)
        finally:
            e.model.imposed = e.model.imposed_pred = e.model.route_sink = None

    def _admit_step(self):
        """The step's one request (the grouped chain holds none: its requests live within one layer call). Two-site:
        the host-read tables pointed at its generation and the step's CPU share copied to the device, both queued
        before the step's first segment."""
        ex = self.e.experts
        self._req = None if self.grouped else ex.cache.admit()
        if self.two_site:
            self.check_joins()
            ex.point_host_read_tables(self._req)
            self._share_q = ex.placement.share_q()
            self._seq = self._seq % (2**31 - 1) + 1
            self.share_host[0], self.share_host[1] = self._share_q, self._seq
            # (a pinned source rewritten only at the next step's start, after this step's events were waited for)
            self.step_dev.copy_(self.share_host, non_blocking=True)

    def _run_eager(self, n_keys):
        self.capture_graphs = None
        done = False
        try:
            self._admit_step()  # (inside: a failure after the admission, in the two-site copies, releases it below)
            out = self._forward(n_keys)
            if self.one_graph:  # its layers were joined inside the forward (_one_graph_experts, eager)
                self._note_joined_layers()
            done = True
        finally:
            if not done and self.one_graph:  # joins already queued must not wait for layers the host will not join
                self._unblock_joins()
                if self.e.device.type == "cuda":
                    torch.cuda.current_stream(self.e.device).synchronize()
            self._release()
        return out

    @contextlib.contextmanager
    def _uncounted(self):
        """Two-site: the capture's eager warm-up steps (real steps: they note reads, run CPU parts) leave the cache's
        counters, its eviction policy and the placement's split counts as they were, as a host-read capture, which
        notes nothing, does (the CPU site's rate they measured stays: real calls). Other chains: nothing."""
        if not self.two_site:
            yield
            return
        ex = self.e.experts
        counters, split, joins = dict(ex.cache.counters), ex.placement.split_counts(), list(ex.placement.joins)
        with ex.policy_kept():
            try:
                yield
            finally:
                ex.cache.counters.clear()
                ex.cache.counters.update(counters)
                ex.placement.split_counts(split)
                ex.placement.joins = joins

    def _capture(self, n_keys):
        side = torch.cuda.Stream(self.e.device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), self._uncounted():  # warm-up outside capture (Triton compilation, cuBLAS handles)
            for _ in range(2):
                self._run_eager(n_keys)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize(self.e.device)
        if self.grouped and self.group_graphs is None:  # after the eager runs (Triton compiled, cuBLAS handles made)
            self._capture_groups()
        with torch.cuda.stream(side):
            g = torch.cuda.CUDAGraph()
            g.capture_begin(pool=self.pool)
            self.capture_graphs = [g]
            try:
                out = self._forward(n_keys)
                self.capture_graphs[-1].capture_end()
            except BaseException:
                # a failure mid-capture (an out-of-memory error under --gpu-budget's cap, an interrupt) leaves the
                # side stream capturing: every later synchronize, this engine's close() included, would then fail
                # with "operation not permitted when stream is capturing" instead of this error
                _end_capture(self.capture_graphs[-1])
                raise
            finally:
                graphs, self.capture_graphs = self.capture_graphs, None
        torch.cuda.current_stream().wait_stream(side)
        want = 1 if self.one_graph else 2 * self.L + 1 if self.mixed and not self.grouped else self.L + 1
        if len(graphs) != want:
            raise EngineError(f"segment capture made {len(graphs)} graphs for {self.L} MoE layers (expected {want})")
        self.chains[n_keys] = (graphs, out)

    def run(self, tok, slot: int, pad) -> torch.Tensor:
        """tok int64 (B,), slot int, pad int64 (B,) -> float32 logits (B, V) (a static buffer when captured)."""
        e = self.e
        n_keys = e.bucket(slot + 1) if e.device.type == "cuda" else slot + 1
        real = self._load(tok, slot, pad)
        if not self.capture:
            out = self._run_eager(n_keys)
        else:
            if n_keys not in self.chains:
                self._capture(n_keys)
            graphs, out = self.chains[n_keys]
            ev = torch.cuda.Event()
            done = False
            t_in = time.perf_counter()  # the one-graph step's host phases (TwoSitePlacement.note_step)
            try:
                self._admit_step()
                t_admitted = time.perf_counter()
                if self.one_graph:  # the whole step queued at once; the host joins the layers that need it
                    replay_s = self._replay_one_graph(graphs[0])
                    t_joined = time.perf_counter()
                for i, g in enumerate(() if self.one_graph else graphs):
                    g.replay()
                    if i == len(graphs) - 1:
                        break
                    if self.two_site:
                        layer, part = divmod(i, 2)
                        if part == 0:  # layer's routing is queued: its device part is queued next, without waiting
                            ev.record()
                        else:  # the device part runs: the host's share of the layer beside it
                            ev.synchronize()  # layer's routed ids (and input, gate weights) are in pinned memory
                            self._lease(layer)
                            self._cpu_part(layer)
                        continue
                    if self.mixed and not self.grouped:
                        layer, part = divmod(i, 2)
                        if part == 0:  # layer's routing is queued: wait for its ids, lease with the placement
                            ev.record()
                            ev.synchronize()
                            self._lease(layer)
                        else:  # layer's device part is queued: the CPU site computes meanwhile
                            self._cpu_part(layer)
                        continue
                    layer = i
                    if self.host_pred is not None and layer > 0:
                        # while segment `layer` runs (layer - 1's experts, layer's attention and router), move
                        # layer's predicted experts (written by the previous segment, already waited for); no
                        # queued kernel reads layer's rows before its lease refreshes the static table
                        e.experts.prefetch(layer, self.host_pred[layer].numpy())
                    ev.record()
                    ev.synchronize()  # this layer's routed ids are in pinned memory
                    self._lease(layer)  # grouped: each group of the layer leased, queued and released
                done = True
            finally:
                if not done:  # a failure between segments: no kernel of this chain reads those rows any more
                    self._unblock_joins()
                    torch.cuda.current_stream(e.device).synchronize()
                self._release()  # every segment reading the step's rows is queued
        t_released = time.perf_counter()
        if self.two_site:  # while the last segment runs: a promotion's copy waits for the release fence of its rows
            e.experts.defer_promotion(self.host_ids_np)
            e.experts.promote_pending(e.experts.placement.promotions_per_step)
        if self.one_graph and self.capture:
            t_out = time.perf_counter()
            e.experts.placement.note_step(t_admitted - t_in, replay_s, t_joined - t_admitted - replay_s,
                                          t_released - t_joined, t_out - t_released,
                                          None if self._last_end is None else t_in - self._last_end)
            self._last_end = t_out
        if self.recorded is not None:
            e.routes.end_pass(real, self.recorded, decode=True)
        return out


class HostReadDecoder(GraphDecoder):
    """Partial-residency decode steps with the host-read site (placement host-read): one CUDA graph per KV-length
    bucket, as under full residency. Each layer's experts run through the grouped executor with the step's row
    table (CachedExperts.hr_tables): resident experts from their device rows, absent ones read over the link from
    the registered host source, so no miss transaction and no host round trip happen inside the step. After the
    step the stream copies every layer's routed ids into pinned host memory (two buffers, used in turn).

    Per step t: admit a request (it pins the generation whose rows the step reads), point the tables at that
    generation, queue the replay and the copy of its ids; then finish step t - 1 while step t runs: wait for it,
    tell the cache what each layer routed (ExpertCache.note_host_read_step: hits and host reads, seen by the eviction
    policy), release its request, and promote from its ids (CachedExperts.promote_pending -> ExpertCache.promote_step:
    a miss transaction under every rule of the contract, publishing a generation step t does not read). The call
    returns with step t queued, so the host's work between two steps (the caller's sampling and stop checks
    included) runs beside a step instead of in a gap between two: the device waited ~190 us of host time per OLMoE
    step on the H200 host when each step was finished before the next was queued
    (results/residency/host-read-host-cost-h200.log). ``finish`` ends the step in flight (Engine.run calls it after
    a run's last step, so that a record counts all of its steps). ``capture=False`` runs the same step eagerly (the
    CPU: done when queued)."""

    def __init__(self, engine: "Engine", batch: int, pool, capture: bool):
        super().__init__(engine, batch, pool)
        self.capture = capture
        L, k, dev = engine.cfg.num_layers, engine.cfg.top_k, engine.device
        self.routed = torch.zeros(L, batch, k, dtype=torch.long, device=dev)  # the step's ids, written by the step
        pin = dev.type == "cuda"
        # (L, B, k) each: step t's ids land in buffer t % 2, read by the host while step t + 1 runs
        self.host_ids = [torch.zeros(L, batch, k, dtype=torch.long, pin_memory=pin) for _ in range(2)]
        self._turn = 0
        self.in_flight = None  # (request, event or None, buffer) of the step queued and not yet ended
        self._ending = None  # the step before it while run / finish end it

    def rides_shared(self, n_rows: int) -> bool:
        """A host-read step's experts take no shared expert (its ``_experts`` has no ``shared``)."""
        return False

    def _experts(self, layer, x, ids, gw):
        self.routed[layer].copy_(ids)
        return self.e.experts.host_read_experts(layer, x, ids, gw)

    def run(self, tok, slot: int, pad) -> torch.Tensor:
        """tok int64 (B,), slot int, pad int64 (B,) -> float32 logits (B, V) (a static buffer, valid until the next
        call), queued on the current stream (the caller reads them as any device result)."""
        e = self.e
        ex = e.experts
        cuda = e.device.type == "cuda"
        n_keys = e.bucket(slot + 1) if cuda else slot + 1
        real = self._load(tok, slot, pad)
        turn = self._turn
        req = ex.cache.admit()
        try:
            ex.point_host_read_tables(req)
            if not self.capture:
                out = self._step(n_keys)
            else:
                if n_keys not in self.graphs:
                    self._capture(n_keys)
                g, out = self.graphs[n_keys]
                g.replay()
            self.host_ids[turn].copy_(self.routed, non_blocking=cuda)  # (L, B, k), after the step on the stream
            ev = None
            if cuda:
                ev = torch.cuda.Event()
                ev.record(torch.cuda.current_stream(e.device))
        except BaseException:
            # nothing queued may read rows a released request pinned: wait for the device, then end both steps
            # unnoted (a failure here leaves the cache FAULTED, or the process is being interrupted)
            if cuda:
                torch.cuda.current_stream(e.device).synchronize()
            req.release()
            self.abandon()
            raise
        # step t - 1 stays reachable (self._ending) until released, whatever interrupts what follows
        self._ending, self.in_flight = self.in_flight, (req, ev, turn)
        self._turn = 1 - turn
        try:
            self._finish()
            if self.recorded is not None:
                e.routes.end_pass(real, self.recorded, decode=True)
            ex.promote_pending()  # from step t - 1's ids, beside step t (on the CPU: after it)
        except BaseException:
            if cuda:
                torch.cuda.current_stream(e.device).synchronize()
            self.abandon()
            raise
        return out

    def finish(self) -> None:
        """End the step in flight, if any (wait, note, release; its promotion is left pending, as after any step)."""
        self._ending, self.in_flight = self.in_flight, None
        try:
            self._finish()
        except BaseException:
            self.abandon()
            raise

    def abandon(self) -> None:
        """After a failure: release the steps not yet ended without noting them (the caller has waited for the
        device). Releasing a request twice does nothing."""
        ending, self._ending = self._ending, None
        flight, self.in_flight = self.in_flight, None
        for step in (ending, flight):
            if step is not None:
                step[0].release()

    def _finish(self) -> None:
        """End ``self._ending`` (the step before the one in flight), if any: wait for it, note its routed ids,
        release its request and keep the ids for the next promotion."""
        if self._ending is None:
            return
        req, ev, turn = self._ending
        ex = self.e.experts
        if ev is not None:
            ev.synchronize()  # its routed ids are in pinned memory, its kernels done
        ids = self.host_ids[turn].numpy()  # (L, B, k)
        ex.cache.note_host_read_step(req, ids)
        req.release(waited=True)  # its kernels are done (ev): no release marker behind the step now running
        self._ending = None
        ex.defer_promotion(ids)  # promoted beside the next step


def _end_capture(graph: torch.cuda.CUDAGraph) -> None:
    """End ``graph``'s capture after a failure inside it, discarding the graph: the stream leaves capture mode whether
    or not the capture was already invalidated (the error that ends an invalid capture is the one being handled)."""
    if torch.cuda.is_current_stream_capturing():
        try:
            graph.capture_end()
        except RuntimeError:
            pass


def capture_graph(fn, device, pool, stream=None) -> tuple:
    """fn run twice on a side stream (cuBLAS handles, Triton compilation: nothing of that inside a capture), then
    captured into a CUDA graph sharing ``pool``: (graph, what the captured call returned). ``stream``: capture on
    that stream (its warm-up runs there too) instead of torch's one default capture stream. Why: cuBLAS keeps a
    workspace per handle and stream, and a captured GEMM keeps the capture stream's; two graphs that may replay at
    the same time (a server's join beside its decode steps) must not share it."""
    side = torch.cuda.Stream(device) if stream is None else stream
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, pool=pool, stream=stream):
        out = fn()
    return g, out


def host_to_device(a: np.ndarray, device) -> torch.Tensor:
    """A host array on ``device`` without a host sync: through pinned memory and an asynchronous copy (torch's
    pinned-memory allocator does not reuse the buffer before the copy is done)."""
    t = torch.from_numpy(a)
    if device.type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)


# ---- the engine -------------------------------------------------------------------------------------

class Engine:
    """See the module docstring for the API."""

    def __init__(self, *, cfg: ModelConfig, model: Transformer, experts, tokenizer, device, executor: str,
                 expert_format: str, max_batch: int, max_seq_len: int, cuda_graphs: bool, prefill_chunk: int,
                 pack_dir: str, resident: int, load_s: float, pack_identity: str | None = None,
                 skip_experts: bool = False, imposed: ImposedRouting | None = None, routing: str = "model",
                 routes=None, segments=True):
        self.cfg, self.model, self.experts, self.tokenizer = cfg, model, experts, tokenizer
        # the fp16 baseline runs no executor: record what actually computes the experts
        self.device, self.expert_format = device, expert_format
        self.executor = "torch-fp16" if expert_format == "fp16" else executor
        self.max_batch, self.max_seq_len, self.prefill_chunk = max_batch, max_seq_len, prefill_chunk
        self.pack_dir, self.resident, self.load_s = pack_dir, resident, load_s
        self.pack_identity = pack_identity
        self.skip_experts = bool(skip_experts)
        if self.skip_experts:
            self.experts = SkipExperts(experts)
        self.kv = KVCache(cfg, max_batch, max_seq_len, device)
        self.routing, self.imposed, self.routes = routing, imposed, routes  # name, ImposedRouting, RouteRecorder
        self.cuda_graphs = bool(cuda_graphs)
        # reference and scalar synchronize with the host on every call, so they cannot be captured
        self.use_graphs = bool(cuda_graphs and device.type == "cuda" and resident == cfg.num_experts
                               and expert_format == "int4" and executor in GRAPH_EXECUTORS)
        # partial residency: decode steps as CUDA-graph segments cut at each routing decision (SegmentDecoder);
        # on the CPU the same chain runs without graphs when segments=True (tests)
        # a placement with a CPU site runs the chain with each layer's device part and CPU part in their own segments
        # (SegmentDecoder); prefill and batches past one lease run the per-call path
        self.use_segments = bool(segments and isinstance(experts, CachedExperts) and not experts.full
                                 and not self.skip_experts
                                 and ((device.type == "cuda" and executor in GRAPH_EXECUTORS) or segments == "eager"))
        # captured decoders by batch; one built without the buffers of the routing workload or the route recorder the
        # engine has now (warm_up's: it sets both aside) is rebuilt, never run (_StaticStepInputs.fits)
        self._graphs: dict[int, GraphDecoder] = {}
        self._segments: dict[int, SegmentDecoder] = {}  # batch -> chain without a CPU site
        self._mixed_segments: dict[int, SegmentDecoder] = {}  # batch -> chain with a CPU part per layer
        self._host_read: dict[int, HostReadDecoder] = {}  # batch -> host-read steps (placement host-read)
        self._two_site: dict[int, SegmentDecoder] = {}  # batch -> two-site chains (placement two-site)
        self._step_mode: str | None = None  # warm_up: the step a two-site placement runs, its chooser not asked
        self.decode_paths = dict.fromkeys(DECODE_PATHS, 0)  # decode steps by the path that ran them
        self.prefill_paths = dict.fromkeys(PREFILL_PATHS, 0)  # prefill passes by the path that ran them
        self._retired: list = []  # decoders replaced by _retire, kept until the pool is replaced
        self._prefiller: GraphPrefiller | None = None  # short prefill passes as CUDA graphs (use_graphs only)
        # placement host-read: partial-residency decode steps whole, with absent experts read from the host source
        self.use_host_read = bool(isinstance(experts, CachedExperts) and experts.host_rows is not None
                                  and not self.skip_experts)
        # placement two-site: host-read's sites plus the CPU site in one step, the segment chain with a CPU part
        self.use_two_site = self.use_host_read and getattr(experts.placement, "name", None) == "two-site"
        if self.use_two_site:  # the step's form (TWO_SITE_STEP_ENV; on the CPU device the chain unless asked)
            form = _env_choice(TWO_SITE_STEP_ENV) or ("graph" if device.type == "cuda" else "chain")
            experts.placement.step_form = form
            wait = _env_choice(TWO_SITE_WAIT_ENV) or "event"
            experts.placement.step_wait = wait if form == "graph" else None
            handoff = _env_choice(TWO_SITE_HANDOFF_ENV) or "copy"
            if handoff == "mapped" and form != "graph":  # (with the poll wait: refused by check_two_site_env)
                raise EngineError(f"{TWO_SITE_HANDOFF_ENV}=mapped needs the one-graph step; this engine's two-site "
                                  f"step is the {form} ({TWO_SITE_STEP_ENV})")
            experts.placement.step_handoff = handoff if form == "graph" else None
            join = _env_choice(TWO_SITE_JOIN_ENV)
            if form == "graph":
                native = experts.site().native
                if join == "mask" and not native:
                    raise EngineError(f"{TWO_SITE_JOIN_ENV}=mask needs a cpu-native CPU executor; this engine's is "
                                      f"{experts.cpu_executor}")
                join = join or ("mask" if native else "rule")
            experts.placement.step_join = join if form == "graph" else None
            experts.placement.promotions_per_step = _env_count(
                TWO_SITE_PROMOTIONS_ENV, "layers promoting an expert after a two-site step")
            balance = _env_choice(TWO_SITE_BALANCE_ENV) or "off"
            if balance == "wait" and form != "graph":
                raise EngineError(f"{TWO_SITE_BALANCE_ENV}=wait balances the one-graph step; this engine's two-site "
                                  f"step is the {form} (RUNMAP_TWO_SITE_STEP)")
            experts.placement.balance = "wait" if balance == "wait" else None
        self._pool = torch.cuda.graph_pool_handle() if (self.use_graphs or self.use_segments or self.use_host_read) \
            and device.type == "cuda" else None
        if self.use_graphs:
            self._prefiller = GraphPrefiller(self, self._pool)
        self._mixer: MixedStepper | None = None  # mixed steps (mixed_step), made at first use
        self.mixed_steps = {"graphs": 0, "eager": 0}  # mixed steps by the path that ran them
        self.last_timing: dict | None = None
        self.warm_up_s: float | None = None  # seconds of warm_up() (from_pack runs it on CUDA, full residency)
        self.budget_plan = None  # runmap.engine.budget.BudgetPlan when built with gpu_budget
        self._runs: list[dict] = []
        self._closed = False
        # the expert cache's hits / misses / host->device bytes made by prefill passes (telemetry splits by phase)
        self.prefill_counts = {"hits": 0, "misses": 0, "bytes_h2d": 0, "cpu_site_experts": 0, "host_reads": 0,
                              "host_read_bytes": 0}

    @contextlib.contextmanager
    def policy_kept(self):
        """Around work whose routes are not a user's (a warm-up's pad tokens): under partial residency the cache's
        eviction policy forgets it (ExpertCache.policy_kept). A user's host-read step still in flight is ended
        (noted) before; the work's own steps are ended inside."""
        inner = self._cached_experts()
        keep = inner is not None and not inner.cache.full_residency
        self.finish_decode_steps()
        placement = getattr(inner, "placement", None)
        kept = placement.kept() if hasattr(placement, "kept") else None  # two-site's split counts and CPU rate
        with (inner.policy_kept() if keep else contextlib.nullcontext()):
            try:
                yield
                self.finish_decode_steps()
            except BaseException:
                self._abandon_decode_steps()
                raise
            finally:
                if kept is not None:
                    placement.put_back(kept)

    @property
    def _step_chooser(self):
        """Placement auto with both sites: its StepChooser; None for every other placement."""
        return getattr(self.experts.placement, "steps", None) if self.use_two_site else None

    def warm_step_modes(self, batch: int) -> tuple:
        """The decode steps a warm-up must run at ``batch`` rows (each inside ``forced_step``): placement auto with both
        sites, host-read's step and, from its chooser's min_batch, the two-site step too; auto's rule in the segment
        chain, the step moving every miss and the step computing them at the CPU site (both chains captured, neither
        counted by its chooser); otherwise (None,), the one step the engine runs."""
        steps = self._step_chooser
        if steps is None:
            if getattr(getattr(self.experts, "placement", None), "decode_steps", None) is not None and self.use_segments:
                return ("transfer", "cpu")  # auto's rule: both chains of its decode steps (AutoPlacement.decode_steps)
            return (None,)
        return ("host-read", "two-site") if batch >= steps.min_batch else ("host-read",)

    @contextlib.contextmanager
    def forced_step(self, mode: str | None):
        """Decode steps inside run ``mode`` (``host-read`` or ``two-site`` with both sites; ``transfer`` or ``cpu``
        under auto's rule; None: as the placement chooses) without asking placement auto's step chooser, which would
        count them (warm-ups)."""
        # the setting's holder: auto's rule holds its own (AutoPlacement.forced_mode), the two-site step the engine's
        holder, attr = self, "_step_mode"
        if mode in ("transfer", "cpu"):
            holder, attr = getattr(self.experts, "placement", None), "forced_mode"
            if getattr(holder, "decode_steps", None) is None:
                raise EngineError(f"forced step {mode!r}: only under placement auto's rule (its decode step chooser)")
        elif mode not in (None, "host-read", "two-site"):
            raise EngineError(f"forced step {mode!r}: host-read, two-site, transfer, cpu or None")
        saved = getattr(holder, attr)
        setattr(holder, attr, mode)
        try:
            yield
        finally:
            setattr(holder, attr, saved)

    def finish_decode_steps(self) -> None:
        """End the host-read step still in flight, if any (HostReadDecoder.finish: wait for it, note its reads,
        release its request). ``run`` does it after a run's last step; a caller driving ``decode`` itself (a server)
        calls it before reading the cache's counters of its last step."""
        for dec in self._host_read.values():
            dec.finish()
        if self._step_chooser is not None:  # the next step is another run's: no step is timed across the two
            self._step_chooser.break_runs()
        auto_steps = getattr(getattr(self.experts, "placement", None), "decode_steps", None)
        if auto_steps is not None:  # placement auto's rule: the same for its chooser
            auto_steps.break_runs()
        for dec in self._two_site.values():  # a join that gave up in the run's last steps (its output was NaN)
            dec.check_joins(wait=True)

    def _abandon_decode_steps(self) -> None:
        """After a failure: wait for the device and release any host-read step in flight without noting it."""
        if any(dec.in_flight is not None or dec._ending is not None for dec in self._host_read.values()):
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()
            for dec in self._host_read.values():
                dec.abandon()

    @torch.inference_mode()
    def warm_up(self) -> float:
        """Compile and capture now what a request would otherwise pay for in its first call (on a fresh H200 host the
        first 512-token prefill took 6.7 s of Triton compilation, results/campaigns/h200-floor): one eager batch-1
        prefill per size class of pass up to one chunk (``prefill_warmup_shapes``: every size-derived kernel variant),
        with CUDA graphs the capture of a prefill of 1 and of max_batch rows at every length bucket a captured pass
        takes (runmap.engine.prefill_graph; max_batch rows padded and not), and a decode step of 1 and of max_batch
        rows. The tokens are the pad id (only shapes matter). The routing workload
        and the route recorder are set aside meanwhile and the engine's and cache's counters restored after, so
        nothing the engine reports counts these passes; under partial residency the eviction policy's history is put
        back too (``policy_kept``). Returns (and keeps as ``warm_up_s``) the seconds it took."""
        self._check_open()
        with self.policy_kept():
            return self._warm_up()

    def _warm_up(self) -> float:
        t0 = time.perf_counter()
        dev = self.device
        saved = self.imposed, self.routes, dict(self.prefill_counts), dict(self.decode_paths)
        cache = self._expert_cache()
        counters = dict(cache.counters) if cache is not None else None
        self.imposed = self.routes = None
        self.experts.begin()
        try:
            zero = torch.zeros(1, dtype=torch.long, device=dev)
            for lens in prefill_warmup_shapes(max_seq_len=self.max_seq_len, prefill_chunk=self.prefill_chunk,
                                              max_batch=1, top_k=self.cfg.top_k):
                tokens = torch.full((1, lens[0]), int(self.pad_id), dtype=torch.long, device=dev)
                run_pieces(self.prefill_pieces(tokens, zero, pad_host=[0]))  # eager: a server's passes compile too
            if self._graph_prefill():  # with the buffers of the engine's own routing workload and recorder
                # one row, and max_batch rows of equal and of unequal lengths (padded): a batch of max_batch prompts
                # captured its pass in its first call otherwise (h200-floor-pdl: 77.6 ms to the first token of a
                # batch of 8 against 10.7 ms warm)
                for B, padded in sorted({(1, False), (self.max_batch, False), (self.max_batch, self.max_batch > 1)}):
                    self._prefiller.prepare_buckets(B, imposed=saved[0] is not None, recorded=saved[1] is not None,
                                                    padded=padded)
            for B in sorted({1, self.max_batch}):
                zeros = torch.zeros(B, dtype=torch.long, device=dev)
                for mode in self.warm_step_modes(B):  # auto with both sites: each step its chooser may run at B
                    with self.forced_step(mode):
                        self.decode(zeros, 0, zeros)
            self.finish_decode_steps()  # noted before the counters are put back below
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
        finally:
            self.experts.end()
            self.imposed, self.routes = saved[0], saved[1]
            self.prefill_counts.update(saved[2])
            self.decode_paths.update(saved[3])
            if counters is not None:
                cache.counters.clear()
                cache.counters.update(counters)
        self.warm_up_s = time.perf_counter() - t0
        return self.warm_up_s

    @property
    def pad_id(self) -> int:
        """The token id left padding fills in (the config's pad token, else 0; padded positions are masked)."""
        return self.cfg.pad_token_id if self.cfg.pad_token_id is not None else 0

    @property
    def regime(self) -> str:
        return regime_of(self.resident, self.cfg.num_experts)

    @property
    def host_source(self):
        """The expert cache's HostSource (pass it to another Engine.from_pack of the same pack to reuse it);
        None for the fp16 baseline."""
        cache = self._expert_cache()
        return cache.host if cache is not None else None

    @classmethod
    def from_pack(cls, pack_dir, *, executor: str = "grouped", resident: int | None = None, device=None,
                  max_batch: int = 8, max_seq_len: int | None = None, policy: str | None = None,
                  expert_format: str = "int4", max_group: int | None = None, cuda_graphs: bool = True,
                  prefill_chunk: int | None = None, fused=True, host_source=None,
                  skip_experts: bool = False, verify_pack: bool | None = None, routing: str = "model",
                  routing_seed: int = 0, record_routes: bool = False, cache_contract: str = "v1",
                  segments=True, gpu_budget: int | None = None, budget_kv_rows: int | None = None,
                  expert_placement: str = "gpu", prefetch: bool = False,
                  emulate_link_gb_s: float | None = None, warm_up: bool | None = None,
                  cpu_executor: str = "cpu-native", placement_costs=None,
                  two_site_share: float | None = None, host_read_spares: int | None = None,
                  two_site_min_batch: int | None = None) -> "Engine":
        """two_site_share: placement two-site's CPU share of each layer's absent experts, fixed (None: from the measured
        rates, runmap.engine.placement.TwoSitePlacement). host_read_spares: under partial residency, where the
        placement is or becomes host-read or two-site (placements host-read, two-site, auto), keep this many spare rows
        per layer and make the rest resident capacity in the same device rows (ExpertCache.lend_spares: those placements
        move experts only by promotions, one per layer at a time); None: HOST_READ_SPARES (1) where gpu_budget planned
        the rows, none lent where resident was given; max_group or more lends nothing.
        two_site_min_batch: under ``auto`` with both sites, the smallest decode batch whose steps the step chooser may
        run as two-site steps (None: RUNMAP_TWO_SITE_MIN_BATCH, else placement.TWO_SITE_MIN_BATCH); refused with
        another placement. placement_costs: a runmap.engine.placement.PlacementCosts to decide ``auto`` /
        ``auto-split`` with instead of the rates measured at build (tests, what-if runs); its host_read_gb_s counts
        for ``auto`` only and only where placement host-read is possible (grouped executor, partial residency,
        contract v2 on a GPU, no emulated link), where build measures it otherwise."""
        from runmap.format.packfile import PackReader
        from runmap.engine.tokenization import Tokenizer

        t0 = time.perf_counter()
        if executor not in EXECUTORS:
            raise EngineError(f"unknown executor {executor!r}; choose one of {list(EXECUTORS)}")
        if cache_contract not in CONTRACT_NAMES:
            raise EngineError(f"unknown cache_contract {cache_contract!r}; choose one of {list(CONTRACT_NAMES)}")
        if expert_format not in EXPERT_FORMATS:
            raise EngineError(f"unknown expert_format {expert_format!r}; choose one of {list(EXPERT_FORMATS)}")
        device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
        from runmap.engine.placement import PLACEMENTS

        if expert_placement not in PLACEMENTS:
            raise EngineError(f"unknown expert placement {expert_placement!r}; choose one of {list(PLACEMENTS)}")
        if cpu_executor not in CPU_SITE_EXECUTORS:
            raise EngineError(f"unknown CPU-site executor {cpu_executor!r}; choose one of {list(CPU_SITE_EXECUTORS)}")
        if expert_placement != "gpu" and (executor in CPU_SITE_EXECUTORS or expert_format != "int4"):
            raise EngineError(f"expert placement {expert_placement!r} places absent experts beside a device executor "
                              f"on INT4 experts; executor {executor!r} with expert_format {expert_format!r} has none")
        if prefetch and expert_placement != "gpu":
            raise EngineError("prefetch moves predicted experts into spare rows; with expert placement "
                              f"{expert_placement!r} absent experts may run on the CPU instead: choose one of the two")
        if executor in CPU_SITE_EXECUTORS and device.type != "cpu":
            raise EngineError(f"executor {executor!r} computes on the CPU from the host source: use device='cpu' "
                              "(a mixed device/CPU placement is not implemented yet)")
        if device.type == "cuda" and not torch.cuda.is_available():  # never a silent fallback to the CPU
            raise EngineError(f"device {device}: no CUDA device here (torch.cuda.is_available() is False); "
                              "use --device cpu")
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if max_batch < 1 or (prefill_chunk is not None and prefill_chunk < 1):
            raise EngineError(f"max_batch ({max_batch}) and prefill_chunk ({prefill_chunk}) must be >= 1")
        # read before anything is built (a bad value is refused with nothing to undo); used where auto has both sites
        check_two_site_env(min_batch_given=two_site_min_batch is not None)
        min_batch = _two_site_min_batch(two_site_min_batch) if expert_placement == "auto" else None
        if two_site_min_batch is not None and expert_placement != "auto":
            _two_site_min_batch(two_site_min_batch)  # (a bad value is named first)
            raise EngineError(f"two_site_min_batch={two_site_min_batch} is placement auto's step-chooser minimum; "
                              f"expert placement is {expert_placement!r}")
        reader = PackReader(pack_dir, verify=verify_pack)
        cfg, layout, identity = reader.config, reader.layout, reader.identity
        try:
            spec = parse_routing(routing, default_family=cfg.arch)
            imposed = None if spec.kind == "model" else ImposedRouting(
                spec, num_layers=cfg.num_layers, num_experts=cfg.num_experts, top_k=cfg.top_k, seed=routing_seed)
        except (RoutingError, ValueError) as e:
            reader.close()
            raise EngineError(str(e)) from None
        routes = None
        if record_routes:
            from runmap.engine.routes import RouteRecorder

            routes = RouteRecorder(arch=cfg.arch, num_layers=cfg.num_layers, num_experts=cfg.num_experts,
                                   top_k=cfg.top_k, routing=spec.name, pack_identity=identity)
        E = cfg.num_experts
        if prefill_chunk is None:  # short passes where activations compete with resident experts: budget or partial
            from runmap.engine.budget import PREFILL_CHUNK_UNDER_BUDGET

            partial = gpu_budget is not None or (resident is not None and int(resident) != E)
            prefill_chunk = PREFILL_CHUNK_UNDER_BUDGET if partial else PREFILL_CHUNK
        budget_plan = None
        if gpu_budget is not None:
            from runmap.engine.budget import BudgetError, plan

            if resident is not None:
                reader.close()
                raise EngineError("give resident or gpu_budget, not both (the budget decides the residency)")
            msl = max_seq_len if max_seq_len is not None else min(cfg.max_position_embeddings, 4096)
            try:
                budget_plan = plan(cfg, layout.row_bytes, reader.nonrouted_file_bytes, int(gpu_budget),
                                   max_batch=max_batch, max_seq_len=msl, prefill_chunk=prefill_chunk,
                                   kv_rows=budget_kv_rows)
            except BudgetError as e:
                reader.close()
                raise EngineError(str(e)) from None
            resident = budget_plan.resident
        resident = E if resident is None else int(resident)
        if prefetch and resident == E:
            reader.close()
            raise EngineError(f"prefetch moves predicted experts into spare rows: it needs partial residency (got "
                              f"resident={resident} of {E})")
        if not cfg.top_k <= resident <= E:
            reader.close()
            raise EngineError(f"resident={resident} must be in [{cfg.top_k}, {E}]: at least top_k={cfg.top_k} "
                              f"(one token's routed experts) and at most the {E} experts per layer")
        if host_source is not None and host_source.identity != identity:
            reader.close()
            raise EngineError(f"{pack_dir}: pack identity {identity!r} differs from the given host source's "
                              f"{host_source.identity!r} (built from another pack, or the pack changed)")
        if expert_format == "fp16" and resident != E:
            reader.close()
            raise EngineError("expert_format='fp16' is a full-residency baseline; it cannot be combined with resident")
        if host_read_spares is not None and (not is_count(host_read_spares)
                                             or expert_placement not in LENDING_PLACEMENTS):
            reader.close()
            raise EngineError(f"host_read_spares={host_read_spares!r}: an integer >= 1, with expert placement host-read, "
                              f"two-site or auto (which may become one of them); this engine's is {expert_placement!r}")
        if two_site_share is not None and expert_placement != "two-site":
            reader.close()
            raise EngineError(f"two_site_share={two_site_share} is placement two-site's; expert placement "
                              f"{expert_placement!r} has no CPU share to fix")
        from runmap.engine.placement import TWO_SITE_MAX_EXPERTS, TWO_SITE_MAX_PAIRS, two_site_fits

        if expert_placement == "two-site" and not two_site_fits(E, cfg.top_k, max_batch):
            reader.close()
            raise EngineError(f"expert placement 'two-site' splits up to {TWO_SITE_MAX_EXPERTS} experts and "
                              f"{TWO_SITE_MAX_PAIRS:,} routed pairs per layer on the device; this engine has {E} experts "
                              f"and max_batch {max_batch} x top_k {cfg.top_k} = {cfg.top_k * max_batch} pairs")
        if expert_placement in HOST_READ_PLACEMENTS:
            try:
                _check_host_read(executor, resident, E, device, cache_contract, emulate_link_gb_s, expert_placement)
            except EngineError:
                reader.close()
                raise
        if max_seq_len is None:
            max_seq_len = min(cfg.max_position_embeddings, 4096)
        if budget_plan is not None and device.type == "cuda":
            # the plan is an estimate; the cap makes it a bound: past the budget torch raises out-of-memory
            total = torch.cuda.get_device_properties(device).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, budget_plan.budget / total), device)
        try:
            tokenizer = Tokenizer(reader.tokenizer_dir, eos_token_id=cfg.eos_token_id)
            weights = load_weights(reader.nonrouted, cfg, device)  # before the cache closes the reader
            model = Transformer(cfg, weights)
            fused_ops = frozenset(DEFAULT_FUSED if fused is True else (fused or ()))
            unknown = fused_ops - set(FUSED_OPS)
            if unknown:
                raise EngineError(f"unknown fused ops {sorted(unknown)}; choose from {list(FUSED_OPS)}")
            if model.per_head_qk_norm and "prologue" in fused_ops:
                # the fused prologue normalizes q/k over the whole projection only: by default a per-head family
                # takes the torch prologue; asking for the fused one explicitly is an error, never a wrong result
                if fused is not True:
                    reader.close()
                    raise EngineError(f"fused op 'prologue' cannot run {cfg.arch}'s per-head q/k norms; leave it out")
                fused_ops = fused_ops - {"prologue"}
            if device.type == "cuda":  # the fused ops are Triton kernels for the CUDA decode step only
                model.fused = fused_ops
            if expert_format == "fp16":
                rows = [reader.read_expert_rows(l) for l in range(cfg.num_layers)]
                for l, r in enumerate(rows):
                    reader.verify_expert_hashes(l, r)  # same startup check as the cache's host source
                reader.close()
                experts = DenseFp16Experts(rows, layout, device)
                del rows
            else:
                from runmap.residency.cache import ExpertCache

                if executor in CPU_SITE_EXECUTORS and resident != E:
                    reader.close()
                    raise EngineError(f"executor {executor!r} reads every expert from the host source: leave resident "
                                      f"at all {E} experts (partial residency has nothing to lease for it)")
                if resident == E:
                    group = min(cfg.top_k * max_batch, E)
                else:
                    group = max_group if max_group is not None else max(cfg.top_k, min(cfg.top_k * max_batch,
                                                                                         resident // 2))
                if group < cfg.top_k:
                    raise EngineError(f"max_group={group} is below top_k={cfg.top_k}: a single token's routed group "
                                      "could never be served")
                from runmap.residency.transport import default_transport

                transport = default_transport(device, contract=cache_contract)
                if emulate_link_gb_s is not None:  # an emulated slower link (benchmarks only; recorded)
                    from runmap.residency.transport import pace

                    pace(transport, emulate_link_gb_s)
                policy_asked = policy
                if policy is None:  # host-read promotes by use counts; the miss transaction evicts least recent
                    policy = "lfu-decay" if expert_placement in HOST_READ_PLACEMENTS else "lru"
                cache_policy = policy
                if expert_placement in HOST_READ_PLACEMENTS:
                    if policy == "lfu-decay":  # its half-life in decode steps: one tick per layer each step
                        from runmap.engine.placement import HostReadPlacement

                        cache_policy = HostReadPlacement.eviction_policy(cfg.num_layers)
                kw = dict(resident=resident, max_group=group, device=device, policy=cache_policy, transport=transport)
                if host_source is not None:
                    host_source.watch_reader(reader)  # closed; a read through it is still observed
                    cache = ExpertCache.from_host(host_source, **kw)
                else:
                    cache = ExpertCache.from_pack(reader, **kw)
                experts = CachedExperts(cache, executor, layout, cfg.top_k)
                # the CPU site's kernel: the executor itself when it is a CPU site, else the placement's choice
                experts.cpu_executor = executor if executor in CPU_SITE_EXECUTORS else cpu_executor
                if prefetch:
                    # the checkpoint's routing: layer L + 1's router on layer L's input; a routing workload: its own
                    # prediction from each stream's past (the router's would name the model's experts, not the
                    # workload's), made when the step is drawn
                    if imposed is None:
                        experts.predict = _next_layer_predictor(model, cfg)
                    else:
                        imposed.predicting = True
                        experts.predict = _workload_predictor(model)
                if expert_placement != "gpu":
                    from runmap.engine.placement import HostReadPlacement, make_placement

                    auto = expert_placement.startswith("auto")
                    two_site = expert_placement == "two-site"
                    host_read_rate = None  # measures the host-read site where that placement is possible here
                    given_read = placement_costs is not None and placement_costs.host_read_gb_s is not None
                    # measured on a GPU only: on the CPU device the host source is the device's own memory, no link to
                    # read over; there a rate given to auto (tests, what-if runs) exercises its choice
                    if (device.type == "cuda" or (auto and given_read)) and _host_read_possible(
                            executor, resident, E, device, cache_contract, emulate_link_gb_s):
                        host_read_rate = experts.measure_host_read_gb_s
                    # auto may run the two-site step where a batch can be large enough for it to be tried and the split
                    # kernel's bounds hold (as for placement two-site above)
                    both_sites = (min_batch is not None and max_batch >= min_batch
                                  and two_site_fits(E, cfg.top_k, max_batch))
                    experts.placement = make_placement(expert_placement, cache=cache,
                                                       site=experts.site() if (auto and placement_costs is None)
                                                       or two_site else None, costs=placement_costs,
                                                       host_read_rate=host_read_rate, share=two_site_share,
                                                       top_k=cfg.top_k, both_sites=both_sites, min_batch=min_batch)
                    if isinstance(experts.placement, HostReadPlacement):
                        if experts.cpu_site is not None and not experts.placement.may_use_cpu():
                            # auto's rate probe built it; host-read never uses it (two-site does)
                            experts.cpu_site.close()
                            experts.cpu_site = None
                        if auto and policy_asked in (None, "lfu-decay"):  # as placement host-read asked by name
                            cache.replace_policy(HostReadPlacement.eviction_policy(cfg.num_layers))
                        # the idle spares become resident capacity: as asked, or all but HOST_READ_SPARES where a
                        # budget planned the rows (a resident count given is kept unless host_read_spares says)
                        keep = host_read_spares if host_read_spares is not None else \
                            (HOST_READ_SPARES if gpu_budget is not None else None)
                        if keep is not None:
                            resident = cache.lend_spares(keep)
                            # (the placement line says whether the default or host_read_spares lent them)
                            cache.lent_by_default = host_read_spares is None
                        experts.enable_host_read()
                    if experts.placement.may_use_cpu() or getattr(experts.placement, "decode_steps", None):
                        # every expert repacked now: a decode step never pays a first use's repack (~30 ms each; auto's
                        # rule times decode steps at the CPU site whatever its rule says)
                        t_rep = time.perf_counter()
                        from runmap.kernels.cpu_int4 import usable_cpus

                        experts.site().prepare(workers=usable_cpus())
                        experts.cpu_site_prepare_s = time.perf_counter() - t_rep
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            eng = cls(cfg=cfg, model=model, experts=experts, tokenizer=tokenizer, device=device, executor=executor,
                       expert_format=expert_format, max_batch=max_batch, max_seq_len=max_seq_len,
                       cuda_graphs=cuda_graphs, prefill_chunk=prefill_chunk, pack_dir=str(pack_dir),
                       resident=resident, load_s=time.perf_counter() - t0, pack_identity=identity,
                       skip_experts=skip_experts, imposed=imposed, routing=spec.name, routes=routes,
                       segments=cuda_graphs and segments)
            eng.budget_plan = budget_plan
            # partial residency too: its first request compiled the partial path's kernels (3.02 s to the first
            # token against 0.47 s warm, results/campaigns/h200-grouped-chain)
            if warm_up if warm_up is not None else device.type == "cuda":
                eng.warm_up()
            return eng
        except BaseException:
            if budget_plan is not None and device.type == "cuda":  # no engine holds the cap: lift it again
                torch.cuda.set_per_process_memory_fraction(1.0, device)
            raise

    # ---- StepModel (runmap.engine.generation) ----------------------------------------------------------------
    def bucket(self, n: int) -> int:
        """KV prefix length attended by a decode step that needs n keys (powers of two from 256; graphs)."""
        b = 256
        while b < n:
            b *= 2
        return min(b, self.max_seq_len)

    def kv_buckets(self) -> list[int]:
        """Every value ``bucket`` takes, ascending: the KV lengths a captured decode step (or mixed step) is keyed by."""
        out = [self.bucket(1)]
        while out[-1] < self.max_seq_len:
            out.append(self.bucket(out[-1] + 1))
        return out

    def prefill(self, tokens: torch.Tensor, pad: torch.Tensor, all_logits: bool = False, *, kv=None,
                pad_host=None, kv_row0: int | None = None, padded_pass: bool = False) -> torch.Tensor:
        """tokens int64 (B, P), pad int64 (B,) (device) -> float32 (B, V) (or (B, P, V) with all_logits).
        Chunks of ``prefill_chunk`` tokens bound the activation memory of long prompts. ``kv``: the KVCache (or a
        ``rows`` view of it) the pass writes, rows 0..B-1 (default: the engine's); ``kv_row0``: instead, rows
        kv_row0..kv_row0+B-1 of the engine's own cache (a server's join into free rows); ``pad_host``: the same pads
        as host ints, when the caller has them (saves a device-to-host read). ``prefill_pieces`` run to its end, or
        with CUDA graphs a short pass of last-position logits into the engine's own cache replayed as a captured graph
        (runmap.engine.prefill_graph: the prompt padded on the right to its length bucket; ``padded_pass``: the
        padded pass even when no row is padded, so that one captured pass serves every join of a shape)."""
        B, P = tokens.shape
        if kv_row0 is not None:
            if kv is not None:
                raise ValueError("prefill takes kv or kv_row0, not both")
            if not 0 <= kv_row0 <= self.kv.max_batch - B:
                raise ValueError(f"kv_row0 {kv_row0} + {B} rows is outside the KV cache's {self.kv.max_batch} rows")
        row0 = kv_row0 or 0
        Pb = None
        if self._graph_prefill() and kv is None and not all_logits and self.model.route_log is None:
            Pb = self._prefiller.bucket_for(B, P)  # within one chunk and the KV cache, or None
        if Pb is None:
            self.prefill_paths["eager"] += 1
            if row0:
                kv = self.kv.rows(row0, row0 + B)
            return run_pieces(self.prefill_pieces(tokens, pad, all_logits, kv=kv, pad_host=pad_host))
        pad_h = pad.cpu().numpy() if pad_host is None else np.asarray(pad_host, dtype=np.int64)
        self.prefill_paths["graphs"] += 1
        with torch.inference_mode():  # its static buffers are inference tensors (made under generate's inference mode)
            # a copy: the captured pass's output lives in the graph pool, which a later capture or replay may reuse
            return self._prefiller.run(tokens, pad, pad_h, Pb, row0=row0, padded=padded_pass).clone()

    def join_pass_bucket(self, B: int, P: int) -> int | None:
        """The length bucket at which ``prefill(..., kv_row0=...)`` of B rows x P positions replays a captured pass
        (None: it runs eagerly)."""
        if not self._graph_prefill() or self.model.route_log is not None:
            return None
        return self._prefiller.bucket_for(B, P)

    def join_pass_concurrent(self, B: int, P: int) -> bool:
        """Whether the join pass of B rows x P positions into the cache's last B rows is captured in a pool and on a
        capture stream of its own, so that it may replay beside decode steps (``prepare_join_passes`` with
        concurrent=True; a pass captured before without it keeps the shared pool and runs in line)."""
        Pb = self.join_pass_bucket(B, P)
        if Pb is None:
            return False
        st = self._prefiller.captured(B, Pb, B > 1, self.imposed is not None, self.routes is not None,
                                      self.max_batch - B)
        return st is not None and st.in_join_pool

    def prepare_join_passes(self, concurrent: bool = False) -> int:
        """Capture, now, the passes a server's whole joins replay (``BatchRunner``: B rows into the cache's last B
        rows, padded when B > 1) at every row count and length bucket a captured pass takes; returns how many.
        ``concurrent``: those of fewer than max_batch rows into a memory pool and on a capture stream of their own
        (runmap serve --join-mode concurrent replays them beside decode steps). Nothing without graph prefill (CPU,
        partial residency, a GPU budget)."""
        if not self._graph_prefill():
            return 0
        self._prefiller.separate_joins = concurrent
        return sum(self._prefiller.prepare_buckets(B, imposed=self.imposed is not None,
                                                   recorded=self.routes is not None, padded=B > 1,
                                                   row0=self.max_batch - B)
                   for B in range(1, self.max_batch + 1))

    @property
    def workload_predicts(self) -> bool:
        """The routing workload also predicts each pass's ids (next-layer prefetch; ImposedRouting.predicting). A
        replayed route list (``logits``' check) predicts nothing."""
        return bool(getattr(self.imposed, "predicting", False))

    @property
    def steps_stay_on_device(self) -> bool:
        """Full residency with neither a routing workload nor a route recorder: a step's routed experts never call the
        expert cache's host path and no host code reads its routes, so a server may queue other work beside or inside
        its steps (interleaved, concurrent and mixed joins) without changing their order against either."""
        return self.imposed is None and self.routes is None and bool(getattr(self.experts, "full", False))

    def mixed_step_key(self, B: int, P: int, slot: int):
        """The shape of a mixed step (runmap.engine.mixed_step) of B running rows at KV slot ``slot`` and a joining
        prompt of P tokens, or None when none can run: not ``steps_stay_on_device`` (partial residency, a routing
        workload or a route recorder), on CUDA without captured passes (no CUDA graphs, a GPU budget), or a shape
        MixedStepper.key refuses."""
        if not self.steps_stay_on_device or (self.device.type == "cuda" and not self._graph_prefill()):
            return None
        return self._mixed_stepper().key(B, P, slot)

    def mixed_step(self, tokens: torch.Tensor, slot: int, pad: torch.Tensor, prompt: torch.Tensor, key) -> torch.Tensor:
        """One decode step of the running rows with a joining prompt computed in it: tokens int64 (B,), slot int, pad
        int64 (B,), prompt int64 (P,) (device), key = ``mixed_step_key(B, P, slot)`` -> float32 (B + 1, V), the rows'
        logits then the prompt's last position's. The prompt's keys and values land in the cache's last row, slots
        slot - Pb + 1 .. slot (left-padded to its bucket Pb; pad slot + 1 - P): the caller moves them to row B."""
        self.mixed_steps["graphs" if self.device.type == "cuda" else "eager"] += 1
        with torch.inference_mode():  # its static buffers are inference tensors
            return self._mixed_stepper().run(tokens, slot, pad, prompt, key)

    def prepare_mixed_steps(self) -> int:
        """Capture every mixed-step shape now (a server's warm-up under --join-mode mixed); returns how many (0 on the
        CPU and wherever ``mixed_step_key`` refuses every shape)."""
        if self.mixed_step_key(1, 1, self.max_seq_len - 1) is None:  # partial residency, no graphs, a budget, ...
            return 0
        with torch.inference_mode():
            return self._mixed_stepper().prepare()

    def _mixed_stepper(self) -> MixedStepper:
        if self._mixer is None:
            self._mixer = MixedStepper(self, self._pool, capture=self.device.type == "cuda")
        return self._mixer

    def prefill_pieces(self, tokens: torch.Tensor, pad: torch.Tensor, all_logits: bool = False, *, kv=None,
                       pad_host=None):
        """``prefill`` as a generator that yields after each layer's work is queued and returns the logits, so
        that a server can launch decode steps of its running rows between the layers of a joining request's
        prefill (runmap.serve.batching). The pass's arithmetic is the same however it is driven. The caller
        must not change the engine's routing workload, route recorder or residency while a pass is open."""
        cache = self._expert_cache()
        before = {k: cache.counters[k] for k in self.prefill_counts} if cache is not None else None
        try:
            logits = yield from self._prefill(tokens, pad, all_logits, self.kv if kv is None else kv, pad_host)
            return logits
        finally:
            if cache is not None:
                for k in self.prefill_counts:
                    self.prefill_counts[k] += cache.counters[k] - before[k]

    def _cached_experts(self) -> "CachedExperts | None":
        """The routed experts' CachedExperts, under a SkipExperts wrapper too (None for the fp16 baseline)."""
        inner = self.experts.inner if isinstance(self.experts, SkipExperts) else self.experts
        return inner if isinstance(inner, CachedExperts) else None

    def _expert_cache(self):
        """The routed experts' ExpertCache (None for the fp16 baseline)."""
        inner = self._cached_experts()
        return inner.cache if inner is not None else None

    def _prefill(self, tokens, pad, all_logits: bool, kv, pad_host):
        if pad_host is None:
            pad_h = pad.cpu().numpy()  # the one device-to-host read of a pass whose caller has no host pads
        else:
            pad_h = np.asarray(pad_host, dtype=np.int64)
        outs = []
        checked = getattr(self.experts, "checked_pass", contextlib.nullcontext)
        with checked():
            yield from self._prefill_chunks(tokens, pad, all_logits, pad_h, kv, outs)
            # every kernel of the pass is queued; what follows (the pass's routing check) reads a flag from the
            # device, so a caller that interleaves may wait for the device here before resuming
            yield PASS_QUEUED
        return torch.cat(outs, dim=1) if all_logits else outs[-1]

    def _prefill_chunks(self, tokens, pad, all_logits, pad_h, kv, outs):
        B, P = tokens.shape
        padded = bool(pad_h.any())
        for s0 in range(0, P, self.prefill_chunk):
            s1 = min(P, s0 + self.prefill_chunk)
            slots = torch.arange(s0, s1, device=self.device)  # (t,)
            pos = (slots[None, :] - pad[:, None]).clamp_(min=0)  # (B, t)
            real = np.arange(s0, s1)[None, :] >= pad_h[:, None]  # (B, t) host: the real (unpadded) tokens
            rows = None  # int64 (n,): the routed rows of the chunk's B*t positions, computed on the host
            if padded:
                rows = host_to_device(np.flatnonzero(real.reshape(-1)), self.device)
            with self._routing(real if self.imposed is not None or self.routes is not None else None):
                out = yield from self.model.forward_pieces(tokens[:, s0:s1], pos, kv, slots, pad, s1, self.experts,
                                                           token_rows=rows, causal_fresh=not padded,
                                                           all_logits=all_logits)
            if all_logits or s1 == P:
                outs.append(out)

    def decode(self, tokens: torch.Tensor, slot: int, pad: torch.Tensor) -> torch.Tensor:
        """tokens int64 (B,), slot int, pad int64 (B,) -> float32 (B, V)."""
        B = tokens.shape[0]
        if self.use_graphs:
            self.decode_paths["graphs"] += 1
            if B not in self._graphs or not self._graphs[B].fits(self):
                self._retire(self._graphs.get(B))
                self._graphs[B] = GraphDecoder(self, B, self._pool)
            return self._graphs[B].run(tokens, slot, pad)
        if self.use_two_site and (self._step_mode or self.experts.placement.step_mode(B, slot)) == "two-site":
            self.decode_paths["two_site"] += 1
            if any(d.in_flight is not None for d in self._host_read.values()):
                # placement auto: its host-read step in flight ends first, and promotes from its reads now (the
                # two-site step keeps its own reads for promotion, which would replace them)
                for other in self._host_read.values():
                    other.finish()
                self.experts.promote_pending()
            dec = self._two_site.get(B)
            if dec is None or not dec.fits(self):
                self._retire(dec)
                dec = self._two_site[B] = SegmentDecoder(self, B, self._pool,
                                                         capture=self.device.type == "cuda" and self.cuda_graphs,
                                                         mixed=True, two_site=True)
            return dec.run(tokens, slot, pad)
        if self.use_host_read:
            self.decode_paths["host_read"] += 1
            dec = self._host_read.get(B)
            for other in self._host_read.values():  # another batch size's step in flight ends first
                if other is not dec:
                    other.finish()
            if dec is None or not dec.fits(self):
                if dec is not None:
                    dec.finish()
                self._retire(dec)
                dec = self._host_read[B] = HostReadDecoder(self, B, self._pool,
                                                           capture=self.device.type == "cuda" and self.cuda_graphs)
            return dec.run(tokens, slot, pad)
        # the placement is asked once per step: a step on which it may give the CPU site experts runs the chain
        # with a CPU part per layer; otherwise (auto's transfer steps) the plain chain, as placement gpu. A
        # batch whose union may exceed one lease runs the grouped chain (with a CPU part when mixed).
        if self.use_segments:
            # placement auto's rule (no split): the step's mode (all absent experts moved, or all at the CPU site)
            # from its step chooser, which times the steps of each
            placement = self.experts.placement
            decode_step = getattr(placement, "decode_step", None)
            if decode_step is not None:
                decode_step(B, slot)
            try:
                mixed = self.experts.mixed(B)
                grouped = self.cfg.top_k * B > self.experts.cache.max_group
                self.decode_paths[("chain_groups" if grouped else "chain") + ("_cpu" if mixed else "")] += 1
                chains = self._mixed_segments if mixed else self._segments
                if B not in chains or not chains[B].fits(self):
                    self._retire(chains.get(B))
                    chains[B] = SegmentDecoder(self, B, self._pool, capture=self.device.type == "cuda", mixed=mixed,
                                               grouped=grouped)
                return chains[B].run(tokens, slot, pad)
            finally:
                if decode_step is not None:
                    placement.end_decode_step()
        self.decode_paths["per_call"] += 1
        slots = torch.tensor([slot], device=self.device)
        pos = (slots - pad).unsqueeze(1)  # (B, 1)
        # On CUDA the fused decode attention takes the key count as a constexpr: attending a bucket (keys past
        # the slot are masked, exactly as in graph mode) keeps it to a few compiled variants instead of one
        # per KV length.
        n_keys = self.bucket(slot + 1) if self.device.type == "cuda" else slot + 1
        outside = getattr(self.experts, "outside_pass", contextlib.nullcontext)
        with self._routing(np.ones((B, 1), dtype=bool), decode=True), outside():
            return self.model.forward(tokens.view(B, 1), pos, self.kv, slots, pad, n_keys, self.experts)

    def _graph_prefill(self) -> bool:
        """Whether short prefill passes replay captured graphs: with CUDA graphs under full residency, and not under a
        GPU budget (a captured pass keeps its activations in the graph pool, which the budget's plan does not count
        beside the eager passes' own)."""
        return self._prefiller is not None and self.budget_plan is None

    def _retire(self, decoder) -> None:
        """Keep a replaced decoder's graphs alive until reset_graphs / close: a memory pool whose last graph is freed
        is released, and a later capture into its handle fails inside torch's allocator."""
        if decoder is not None:
            self._retired.append(decoder)

    @contextlib.contextmanager
    def _routing(self, real: np.ndarray | None, decode: bool = False):
        """Around one eager forward pass: impose the workload's routes of the ``real`` (B, T) positions and
        record what was routed; nothing when the routing is the model's own and no trace is kept."""
        if real is None or (self.imposed is None and self.routes is None):
            yield
            return
        if self.imposed is not None:
            self.model.imposed = host_to_device(self.imposed.draw(real), self.device)  # (L, n, k)
            if self.workload_predicts:  # its prediction of the same rows, for the prefetch
                self.model.imposed_pred = host_to_device(self.imposed.prediction, self.device)  # (L, n, k)
        if self.routes is not None:
            self.model.route_sink = self.routes.sink
        try:
            yield
        finally:
            self.model.imposed = self.model.imposed_pred = self.model.route_sink = None
        if self.routes is not None:
            self.routes.end_pass(real, decode=decode)

    def _begin_group(self, prompts, max_new_tokens: int | None = None) -> None:
        """A new group of rows: the workload opens one stream per row, the recorder one stream per row. With
        ``max_new_tokens`` (a generate group) a routing workload that can draws every row's routes ahead now (its
        prompt and each decode step's token), outside the group's timed region (ImposedRouting.draw_ahead)."""
        if self.imposed is not None:
            self.imposed.begin(len(prompts))
            if max_new_tokens is not None:
                self.imposed.draw_ahead([len(p) + max_new_tokens - 1 for p in prompts])
        if self.routes is not None:
            self.routes.begin_group([len(p) for p in prompts])

    def reset_graphs(self) -> None:
        """Drop every captured decode graph and its memory pool (after changing executor / fused ops)."""
        self.finish_decode_steps()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._graphs.clear()
        self._segments.clear()
        self._mixed_segments.clear()
        self._host_read.clear()
        self._two_site.clear()
        self._retired.clear()
        if self._pool is not None:
            self._pool = torch.cuda.graph_pool_handle()
        if self._prefiller is not None:
            self._prefiller = GraphPrefiller(self, self._pool)
        self._mixer = None

    # ---- public API ---------------------------------------------------------------------------------------
    def encode(self, prompt, chat: bool = False) -> list[int]:
        return encode_prompt(self.tokenizer, prompt, chat, self.cfg.vocab_size)

    def generate(self, prompts, *, max_new_tokens: int = 128, temperature: float = 0.0, top_p: float = 1.0,
                 seed: int | None = None, stop=(), chat: bool = False, on_token=None,
                 ignore_eos: bool = False) -> list[GenerationResult]:
        return list(self.run(prompts, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed,
                             stop=stop, chat=chat, on_token=on_token, ignore_eos=ignore_eos).results)

    @torch.inference_mode()
    def run(self, prompts, *, max_new_tokens: int = 128, temperature: float = 0.0, top_p: float = 1.0,
            seed: int | None = None, stop=(), chat: bool = False, on_token=None,
            ignore_eos: bool = False) -> GenerationRun:
        """``generate`` returning a typed GenerationRun (results, prefill / decode seconds, token counts)."""
        self._check_open()
        self.finish_decode_steps()  # a step left in flight by a caller of decode counts there, not in this run
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            raise GenerationError("prompts must be a list of strings or a list of token-id lists")
        ids = [self.encode(p, chat) for p in prompts]
        pad_id = self.pad_id
        results, timings = [], []
        self.experts.begin()
        try:
            for g0 in range(0, len(ids), self.max_batch):
                self._begin_group(ids[g0:g0 + self.max_batch], max_new_tokens)
                res, tim = generate_batch(
                    self, ids[g0:g0 + self.max_batch], max_new_tokens=max_new_tokens, pad_id=pad_id,
                    eos_ids=frozenset() if ignore_eos else self.tokenizer.eos_ids, decode=self.tokenizer.decode,
                    stop=tuple(stop), temperature=temperature, top_p=top_p, on_token=on_token, row_offset=g0,
                    # each group of max_batch prompts draws from its own stream, so equal prompts in
                    # different groups do not repeat each other's samples
                    seed=None if seed is None else seed + g0)
                results += res
                timings.append(tim)
            if self.use_host_read:
                # the last step ended and its promotions made now, not beside the next run's first step: they then
                # count in this run (a campaign row's record), and the next run does not start from another run's reads
                self.finish_decode_steps()
                self.experts.promote_pending()
        except BaseException:
            self._abandon_decode_steps()
            raise
        finally:
            self.experts.end()
        out = GenerationRun.combine(results, timings)
        self.last_timing = out.timing_dict()
        self._runs.append(self.last_timing)
        return out

    @torch.inference_mode()
    def logits(self, token_ids, *, executor: str | None = None, fused=None, routes=None) -> torch.Tensor:
        """float32 (T, V) logits of every position of one prompt (token ids), computed by a prefill.

        executor: another INT4 executor for this call only (e.g. "reference", to check the engine's against
        it); fused: the fused ops for this call only (as in from_pack; False = pure torch); routes: int64
        (T, L, k) expert ids imposed at every position and layer instead of the router's choice (the gate weights
        stay the router's probabilities of those ids, as under an imposed routing workload), e.g. the routes
        ``logits_with_routes`` reported for another executor. All are restored afterwards; captured decode graphs
        are not touched (a prefill replays none)."""
        self._check_open()
        ids = self.encode(token_ids)
        if not ids or len(ids) > self.max_seq_len:
            raise GenerationError(f"need 1..{self.max_seq_len} tokens, got {len(ids)}")
        if routes is not None:
            want = (len(ids), self.cfg.num_layers, self.cfg.top_k)
            if tuple(routes.shape) != want:
                raise EngineError(f"routes: shape {tuple(routes.shape)}, expected {want} (positions, layers, top_k)")
            from runmap.workload.routing import ReplayedRoutes

            saved_routing = self.imposed, self.routes
            self.imposed, self.routes = ReplayedRoutes(torch.as_tensor(routes).cpu().numpy()), None
            try:
                return self.logits(ids, executor=executor, fused=fused)
            finally:
                self.imposed, self.routes = saved_routing
        if executor is not None:
            if not isinstance(self.experts, CachedExperts):
                raise EngineError(f"executor override needs the INT4 expert path (this engine: "
                                  f"{'skip_experts' if self.skip_experts else self.executor})")
            if executor not in EXECUTORS:
                raise EngineError(f"unknown executor {executor!r}; choose one of {list(EXECUTORS)}")
        ops = None
        if fused is not None:
            ops = frozenset(DEFAULT_FUSED if fused is True else (fused or ()))
            if ops - set(FUSED_OPS):
                raise EngineError(f"unknown fused ops {sorted(ops - set(FUSED_OPS))}; choose from {list(FUSED_OPS)}")
            if self.device.type != "cuda":
                ops = None  # ignored on the CPU, as in from_pack
        tokens = torch.tensor([ids], device=self.device)
        saved_ex = self.experts.executor if executor is not None else None
        saved_ops = self.model.fused
        try:
            if executor is not None:
                self.experts.executor = executor
            if ops is not None:
                self.model.fused = ops
            self.experts.begin()
            self._begin_group([ids])
            try:
                out = self.prefill(tokens, torch.zeros(1, dtype=torch.long, device=self.device), all_logits=True)
            finally:
                self.experts.end()
        finally:
            if executor is not None:
                self.experts.executor = saved_ex
            self.model.fused = saved_ops
        return out[0].cpu()

    def logits_with_routes(self, token_ids, *, executor: str | None = None, fused=None
                           ) -> tuple[torch.Tensor, torch.Tensor]:
        """``logits`` and the experts its prefill routed each position to: (float32 (T, V), int64 (T, L, k) with each
        layer's ids sorted), to compare two executors' routing position by position (the campaign's logits check).
        Costs one device-to-host copy of the ids per layer per pass."""
        self._check_open()
        saved_log = self.model.route_log
        self.model.route_log = []
        try:
            out = self.logits(token_ids, executor=executor, fused=fused)
            log = self.model.route_log
        finally:
            self.model.route_log = saved_log
        per_layer: dict[int, list[torch.Tensor]] = {}
        for layer, ids in log:  # one entry per layer per prefill pass, passes in prompt order
            per_layer.setdefault(layer, []).append(ids)
        if not per_layer:
            raise EngineError("no routing ran (skip_experts): nothing to report per position")
        routes = torch.stack([torch.cat(per_layer[i]).sort(-1).values for i in sorted(per_layer)], 1)  # (T, L, k)
        return out, routes.long()

    def stats(self):
        """Typed snapshot (runmap.engine.telemetry.EngineStats): counters since startup, memory, observations."""
        self._check_open()
        from runmap.engine.telemetry import snapshot

        return snapshot(self)

    def reset_placement_reports(self) -> None:
        """From here on, the placement's averaged reports (two-site joins and step phases in stats() and telemetry())
        cover only what runs next; its decisions are unchanged. The bench calls it before a configuration's timed runs,
        so a record does not average in the warm-ups and the rows an engine shared with it ran before."""
        self._check_open()
        placement = getattr(self.experts, "placement", None)  # (the FP16 baseline's experts have none)
        if placement is not None:
            placement.reset_reports()

    def telemetry(self) -> dict:
        self._check_open()
        from runmap.engine.telemetry import build

        return build(self)

    def close(self) -> None:
        """Release the device memory the engine holds (expert rows, non-routed weights, KV cache, CUDA
        graphs) by dropping every reference to it; later calls raise EngineError. Idempotent."""
        if self._closed:
            return
        self._abandon_decode_steps()  # a host-read step in flight: waited for and released, not noted
        self.experts.end()  # a held full-residency request is released before its rows are dropped
        if getattr(self.experts, "cpu_site", None) is not None:
            self.experts.cpu_site.close()  # the CPU site's expert worker threads (kernels/cpu_int4.py)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._graphs.clear()
        self._segments.clear()
        self._mixed_segments.clear()
        self._host_read.clear()
        self._two_site.clear()
        self._retired.clear()
        self._prefiller = None
        self._mixer = None
        self._pool = None
        self.kv = self.model = self.experts = None
        self._closed = True
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
            if self.budget_plan is not None:  # the budget's allocator cap was this engine's, not the process's
                torch.cuda.set_per_process_memory_fraction(1.0, self.device)

    def _check_open(self) -> None:
        if self._closed:
            raise EngineError(f"engine on {self.pack_dir} is closed; build a new one with Engine.from_pack")

