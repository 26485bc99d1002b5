"""The server's Prometheus metrics (prometheus-client, one registry per server, text format at /metrics).

Request-side figures are counted where they happen (the scheduler thread and the HTTP handlers; the
client library's metrics are thread-safe). Engine-side figures (expert-cache hits, misses, evictions,
host->device bytes, the contract observations, what is loaded) are read at scrape time from the last
``EngineStats`` snapshot the scheduler thread took, so a scrape never touches the engine from another
thread. An observation is exported as ``runmap_contract_observation{observation, status, unit}``: its
value when OBSERVED, NaN when it is UNKNOWN or UNSUPPORTED (the status label says which).
"""
from __future__ import annotations

import math

from prometheus_client import (CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics,
                               generate_latest)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# seconds; first tokens include queueing and a prefill, so they reach further than the step buckets
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class ServeMetrics:
    """Every metric of one server. ``source`` (set later) gives the engine snapshot and scheduler state."""

    def __init__(self):
        disable_created_metrics()  # no *_created series: a scrape shows the figures, not creation times
        self.registry = r = CollectorRegistry(auto_describe=True)
        self.requests = Counter("runmap_requests", "Generation requests finished, by endpoint and finish reason",
                                ["endpoint", "finish_reason"], registry=r)
        self.errors = Counter("runmap_request_errors", "Requests refused with an error, by endpoint and HTTP status",
                              ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("runmap_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.generation_tokens = Counter("runmap_generation_tokens", "Generated tokens delivered", registry=r)
        self.ttft = Histogram("runmap_time_to_first_token_seconds", "Arrival to first generated token",
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("runmap_inter_token_latency_seconds", "Between consecutive tokens of one request",
                             buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram("runmap_request_latency_seconds", "Arrival to the last token of a request",
                             buckets=E2E_BUCKETS, registry=r)
        self.running = Gauge("runmap_requests_running", "Requests in the running batch", registry=r)
        self.waiting = Gauge("runmap_requests_waiting", "Requests waiting for a batch row", registry=r)
        self.source = None
        r.register(_EngineCollector(self))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector:
    def __init__(self, metrics: ServeMetrics):
        self.m = metrics

    def describe(self):
        return []  # dynamic: nothing to check at registration

    def collect(self):
        src = self.m.source
        ready = GaugeMetricFamily("runmap_ready", "1 once the engine is loaded and warmed up")
        ready.add_metric([], 1.0 if src is not None and src.ready else 0.0)
        yield ready
        if src is None or src.stats is None:
            return
        st, info = src.stats, src.info
        inf = InfoMetricFamily("runmap_engine", "What is loaded")
        inf.add_metric([], {k: str(info.get(k)) for k in ("model", "arch", "executor", "regime", "device",
                                                          "resident", "num_experts", "max_batch", "max_seq_len")})
        yield inf
        for name, doc, value in (
                ("runmap_expert_cache_hits", "Routed experts found resident (cache lookups that hit)", st.hits),
                ("runmap_expert_cache_misses", "Routed experts fetched from host memory", st.misses),
                ("runmap_expert_cache_evictions", "Resident experts evicted", st.evictions),
                ("runmap_h2d_bytes", "Expert bytes copied host -> device", st.bytes_h2d)):
            c = CounterMetricFamily(name, doc)
            c.add_metric([], float(value))
            yield c
        rate = GaugeMetricFamily("runmap_expert_cache_hit_rate", "hits / (hits + misses) since startup (NaN before any lookup)")
        rate.add_metric([], st.hit_rate if st.hit_rate is not None else math.nan)
        yield rate
        obs = GaugeMetricFamily("runmap_contract_observation",
                                "Cache contract observations (value when OBSERVED, NaN otherwise; see status)",
                                labels=["observation", "status", "unit"])
        for name, m in sorted(st.observations.items()):
            status = str(m.get("status", "UNKNOWN"))
            v = m.get("value") if status == "OBSERVED" else None
            obs.add_metric([name, status, str(m.get("unit", ""))], float(v) if isinstance(v, (int, float)) else math.nan)
        yield obs
        batch = src.batch_counters
        adm = CounterMetricFamily("runmap_batch_admissions", "Requests admitted to the batch: into an empty batch, "
                                  "or joining running rows between decode steps", labels=["how"])
        adm.add_metric(["empty_batch"], float(batch.get("admitted", 0) - batch.get("joined_running", 0)))
        adm.add_metric(["joined_running"], float(batch.get("joined_running", 0)))
        yield adm
        joins = CounterMetricFamily("runmap_batch_joins", "Joint prefills run: whole at a step boundary, "
                                    "interleaved with the running rows' decode steps, concurrent with them (a "
                                    "captured pass on a stream of its own), or mixed into one (a prompt computed "
                                    "inside a decode step)", labels=["how"])
        joins.add_metric(["whole"], float(batch.get("joins", 0) - batch.get("interleaved_joins", 0)
                                          - batch.get("concurrent_joins", 0) - batch.get("mixed_joins", 0)))
        joins.add_metric(["interleaved"], float(batch.get("interleaved_joins", 0)))
        joins.add_metric(["concurrent"], float(batch.get("concurrent_joins", 0)))
        joins.add_metric(["mixed"], float(batch.get("mixed_joins", 0)))
        yield joins
        steps = CounterMetricFamily("runmap_decode_steps", "Batched decode steps run")
        steps.add_metric([], float(batch.get("steps", 0)))
        yield steps
        late = src.compiles_after_ready() if hasattr(src, "compiles_after_ready") else None
        if late is not None:  # CUDA only: a kernel compiled inside a request stalled every running row
            c = CounterMetricFamily("runmap_kernel_compiles_after_ready",
                                    "Triton kernel variants compiled after the server reported ready")
            c.add_metric([], float(late["count"]))
            yield c
        mem = GaugeMetricFamily("runmap_engine_bytes", "Device bytes the engine holds, by part", labels=["part"])
        for part, v in (("nonrouted", st.nonrouted_bytes), ("kv_cache", st.kv_cache_bytes),
                        ("resident_experts", st.resident_bytes), ("spare_rows", st.spare_bytes),
                        ("staging", st.staging_bytes)):
            mem.add_metric([part], float(v))
        yield mem
