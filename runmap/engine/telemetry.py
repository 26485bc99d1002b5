"""Engine telemetry: what ran (executor, regime, residency) and what the cache observed.

``build(engine)`` returns a dict valid under ``schemas/telemetry.schema.json``; ``write(path, doc)``
writes it atomically (temp file in the same directory, then os.replace). Every ``runmap generate`` /
``runmap logits`` run writes one. No jsonschema import here (this runs on the GPU machine too); the
schema is checked by the tests and by ``runmap validate``.

Counters are cumulative since engine startup (the cache's own counters); ``runs`` counts generate calls.
``h2d_seconds`` is the host wall time of the lease acquisitions that had misses (each miss transaction
is synchronous: pageable -> pinned staging -> device, waited on), so bytes_h2d / h2d_seconds is the
effective host->device rate of the miss path, staging included.

``snapshot(engine)`` returns the same figures as a typed ``EngineStats`` (what a benchmark reads: no dict
keys to guess); ``EngineStats.since(earlier)`` gives the counter deltas between two snapshots. Hits, misses and
host->device bytes are also split by phase (``prefill_*``: made by prefill passes; ``decode_*`` = the rest), so
that a decode figure (misses per decoded token, the transfer bound) never carries the prompt's misses.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from types import MappingProxyType

from runmap.atomic import write_json
from runmap.provenance import utc_timestamp

SCHEMA_VERSION = "runmap-telemetry-v1"
from runmap.residency.observations import OBSERVATION_NAMES as OBS_NAMES, REQUIRED_ZERO as OBS_UNITS

DECODE_PATHS = ("graphs", "chain", "chain_groups", "chain_cpu", "chain_groups_cpu", "host_read", "two_site",
                "per_call")  # Engine.decode_paths; fields decode_steps_<path> below
PREFILL_PATHS = ("graphs", "eager")  # Engine.prefill_paths; fields prefill_passes_<path> below


FP16_NO_CACHE = "expert_format fp16 baseline: experts are dequantized device tensors, no expert cache runs"


@dataclasses.dataclass(frozen=True, kw_only=True)
class PhaseSiteCounters:
    """The counters a snapshot and a delta both carry beyond hits / misses / bytes: the part prefill passes made
    (Engine.prefill; the rest is decode steps'), experts computed at the CPU site, and next-layer prefetch (the
    cache's counters; runmap/engine/placement.py, ExpertCache.prefetch)."""

    prefill_hits: int = 0
    prefill_misses: int = 0
    prefill_bytes_h2d: int = 0
    prefill_cpu_site_experts: int = 0
    prefill_host_reads: int = 0  # placement host-read: a prompt pass reads absent experts over the link too
    prefill_host_read_bytes: int = 0
    cpu_site_experts: int = 0
    prefetches: int = 0
    prefetched_experts: int = 0
    prefetch_used: int = 0
    prefetches_skipped: int = 0
    prefetches_aborted: int = 0
    # the host-read site (placement host-read): absent experts its decode steps read over the link, their bytes, and the
    # experts promoted into device rows beside the next step (ExpertCache.note_host_reads / promote)
    host_reads: int = 0
    host_read_bytes: int = 0
    promotions: int = 0
    # decode steps by the path that ran them (Engine.decode, DECODE_PATHS): full-residency CUDA graphs, the
    # partial-residency segment chain (one lease per layer, or groups of leases for a batch whose union may exceed
    # one: chain_groups), either with a CPU part (chain_cpu, chain_groups_cpu), placement host-read's one-graph steps,
    # placement two-site's chain (host reads and a CPU part per layer), or eager layer calls (the per-call path)
    decode_steps_graphs: int = 0
    decode_steps_chain: int = 0
    decode_steps_chain_groups: int = 0
    decode_steps_chain_cpu: int = 0
    decode_steps_chain_groups_cpu: int = 0
    decode_steps_host_read: int = 0
    decode_steps_two_site: int = 0
    decode_steps_per_call: int = 0
    # Engine.prefill calls by the path that ran them (PREFILL_PATHS): a captured CUDA graph of the prompt padded to its
    # length bucket (runmap.engine.prefill_graph), or the eager pass
    prefill_passes_graphs: int = 0
    prefill_passes_eager: int = 0


def _engine_stats(fields: dict) -> "EngineStats":
    return EngineStats(**{k: MappingProxyType(v) if k in ("observations", "placement") and v is not None else v
                          for k, v in fields.items()})


@dataclasses.dataclass(frozen=True)
class EngineStats(PhaseSiteCounters):
    """Typed snapshot of what an engine ran and what its cache observed (cumulative since startup).

    has_cache is False for the fp16 baseline: its counters are zero and its observations UNKNOWN with a
    reason. observations: name -> measure dict (status, value/reason, unit, source) as instrumentation
    wrote it. Memory figures are bytes the engine holds, not allocator peaks."""

    executor: str
    expert_format: str
    regime: str
    device: str
    cuda_graphs: bool
    fused: tuple  # fused ops active in the decode step (empty on the CPU)
    skip_experts: bool  # profiling variant: routed experts return zeros
    resident: int
    has_cache: bool
    policy: str | None
    hits: int
    misses: int
    evictions: int
    bytes_h2d: int
    h2d_seconds: float
    generations: int
    runs: int
    resident_bytes: int
    spare_bytes: int
    staging_bytes: int
    nonrouted_bytes: int
    kv_cache_bytes: int
    observations: MappingProxyType
    placement: MappingProxyType | None = None  # the placement's plan (mode, measured rates, decisions); None = gpu
    prefetch: bool = False  # next-layer prefetch on
    row_bytes: int = 0

    def __reduce__(self):
        # a snapshot crosses to the HTTP process when the engine runs in its own (runmap.serve.engine_process), and a
        # mapping proxy does not pickle: its fields go as plain dicts and are wrapped again on arrival
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return _engine_stats, ({k: dict(v) if isinstance(v, MappingProxyType) else v for k, v in fields.items()},)

    @property
    def hit_rate(self) -> float | None:
        """Share of the routed experts looked up that were resident: hits / (hits + misses + experts computed at the
        CPU site), so that a CPU placement does not read as 1.0."""
        looked = self.hits + self.misses + self.cpu_site_experts
        return self.hits / looked if looked else None

    def since(self, earlier: "EngineStats") -> "CounterDelta":
        """Counter deltas from ``earlier`` (a snapshot of the same engine) to this snapshot."""
        return CounterDelta(**{f.name: getattr(self, f.name) - getattr(earlier, f.name)
                               for f in dataclasses.fields(CounterDelta)})


@dataclasses.dataclass(frozen=True)
class CounterDelta(PhaseSiteCounters):
    hits: int
    misses: int
    evictions: int
    bytes_h2d: int
    h2d_seconds: float
    runs: int

    @property
    def decode_cpu_site_experts(self) -> int:
        return self.cpu_site_experts - self.prefill_cpu_site_experts

    @property
    def decode_hits(self) -> int:
        return self.hits - self.prefill_hits

    @property
    def decode_misses(self) -> int:
        return self.misses - self.prefill_misses

    @property
    def decode_bytes_h2d(self) -> int:
        return self.bytes_h2d - self.prefill_bytes_h2d

    @property
    def decode_host_reads(self) -> int:
        return self.host_reads - self.prefill_host_reads

    @property
    def decode_host_read_bytes(self) -> int:
        return self.host_read_bytes - self.prefill_host_read_bytes


def snapshot(engine, cache: dict | None = None) -> EngineStats:
    """EngineStats of an ``runmap.engine.engine.Engine`` (``cache``: its cache's telemetry, when already read)."""
    if cache is None:
        cache = engine.experts.telemetry()  # None for the fp16 baseline (no cache)
    common = dict(
        **{f"decode_steps_{k}": v for k, v in engine.decode_paths.items()},
        **{f"prefill_passes_{k}": v for k, v in engine.prefill_paths.items()},
        executor=engine.executor, expert_format=engine.expert_format, regime=engine.regime, device=str(engine.device),
        cuda_graphs=engine.use_graphs, fused=tuple(sorted(engine.model.fused)), skip_experts=engine.skip_experts,
        resident=engine.resident, runs=len(engine._runs), nonrouted_bytes=engine.model.w.nbytes(),
        kv_cache_bytes=engine.kv.nbytes() if engine.kv is not None else 0)
    if cache is None:
        return EngineStats(**common, has_cache=False, policy=None, hits=0, misses=0, evictions=0, bytes_h2d=0,
                           h2d_seconds=0.0, generations=0, resident_bytes=engine.experts.nbytes(), spare_bytes=0,
                           staging_bytes=0, observations=MappingProxyType(
                               {n: {"status": "UNKNOWN", "unit": OBS_UNITS[n], "reason": FP16_NO_CACHE}
                                for n in OBS_NAMES}))
    c, cap = cache["counters"], cache["capacity"]
    placement = getattr(engine.experts, "placement", None)
    sites = dict(placement=MappingProxyType(placement.describe()) if placement is not None else None,
                 prefetch=getattr(engine.experts, "predict", None) is not None, row_bytes=cap["row_bytes"],
                 **{k: c.get(k, 0) for k in ("cpu_site_experts", "prefetches", "prefetched_experts", "prefetch_used",
                                             "prefetches_skipped", "prefetches_aborted", "host_reads",
                                             "host_read_bytes", "promotions")})
    return EngineStats(**common, **sites, has_cache=True, policy=cache["policy"], hits=c["hits"], misses=c["misses"],
                       evictions=c["evictions"], bytes_h2d=c["bytes_h2d"], h2d_seconds=engine.experts.h2d_seconds,
                       generations=c["generations"],
                       resident_bytes=cap["num_layers"] * cap["resident"] * cap["row_bytes"],
                       spare_bytes=cap["num_layers"] * cap["spares"] * cap["row_bytes"],
                       staging_bytes=cap["staging_bytes"], observations=MappingProxyType(dict(cache["observations"])),
                       **{f"prefill_{k}": v for k, v in engine.prefill_counts.items()})


def build(engine) -> dict:
    """Telemetry dict of an ``runmap.engine.engine.Engine`` (see the schema for every field)."""
    cfg = engine.cfg
    cache = engine.experts.telemetry()  # None for the fp16 baseline (no cache)
    st = snapshot(engine, cache)
    doc = {
        "schema": SCHEMA_VERSION,
        "created_utc": utc_timestamp(),
        "pack": {"path": str(engine.pack_dir), "identity": engine.pack_identity},
        "arch": cfg.arch,
        "executor": st.executor,
        "expert_format": st.expert_format,
        "regime": st.regime,
        "device": st.device,
        "cuda_graphs": st.cuda_graphs,
        "num_layers": cfg.num_layers,
        "num_experts": cfg.num_experts,
        "top_k": cfg.top_k,
        "resident_per_layer": [st.resident] * cfg.num_layers,
        "max_batch": engine.max_batch,
        "max_seq_len": engine.max_seq_len,
        "load_s": engine.load_s,
        "runs": st.runs,
        "last_timing": engine.last_timing,
        "nonrouted_bytes": st.nonrouted_bytes,
        "kv_cache_bytes": st.kv_cache_bytes,
        "hits": st.hits, "misses": st.misses, "bytes_h2d": st.bytes_h2d, "generations": st.generations,
        "hit_rate": st.hit_rate, "h2d_seconds": st.h2d_seconds, "resident_bytes": st.resident_bytes,
        "spare_bytes": st.spare_bytes, "staging_bytes": st.staging_bytes,
        "cache": cache,
        "observations": dict(st.observations),
    }
    if st.placement is not None:
        site = engine.experts.cpu_site
        doc["placement"] = {**st.placement, "cpu_site_experts": st.cpu_site_experts,
                            "cpu_site": site.describe() if site is not None else None,
                            # every expert repacked at build (a placement that may use the CPU site), seconds
                            "cpu_site_prepare_s": engine.experts.cpu_site_prepare_s}
    return doc


def write(path, doc: dict) -> Path:
    """Write ``doc`` as JSON to ``path`` atomically. Returns the path."""
    return write_json(path, doc, default=str)
