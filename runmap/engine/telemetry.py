"""Engine telemetry: what ran (executor, regime, residency) and what the cache observed.

``build(engine)`` returns a dict valid under ``schemas/telemetry.schema.json``; ``write(path, doc)``
writes it atomically (temp file in the same directory, then os.replace). Every ``runmap generate`` /
``runmap logits`` run writes one. No jsonschema import here (this runs on the GPU machine too); the
schema is checked by the tests and by ``runmap validate``.

Counters are cumulative since engine startup (the cache's own counters); ``runs`` counts generate calls.
``h2d_seconds`` is the host wall time of the lease acquisitions that had misses (each miss transaction
is synchronous: pageable -> pinned staging -> device, waited on), so bytes_h2d / h2d_seconds is the
effective host->device rate of the miss path, staging included.
"""
from __future__ import annotations

from pathlib import Path
from runmap.atomic import write_json
from runmap.provenance import utc_timestamp

SCHEMA_VERSION = "runmap-telemetry-v1"
from runmap.residency.observations import OBSERVATION_NAMES as OBS_NAMES, REQUIRED_ZERO as OBS_UNITS


def build(engine) -> dict:
    """Telemetry dict of an ``runmap.engine.engine.Engine`` (see the schema for every field)."""
    cfg = engine.cfg
    cache = engine.experts.telemetry()  # None for the fp16 baseline (no cache)
    doc = {
        "schema": SCHEMA_VERSION,
        "created_utc": utc_timestamp(),
        "pack": {"path": str(engine.pack_dir), "identity": engine.pack_identity},
        "arch": cfg.arch,
        "executor": engine.executor,
        "expert_format": engine.expert_format,
        "regime": engine.regime,
        "device": str(engine.device),
        "cuda_graphs": engine.use_graphs,
        "num_layers": cfg.num_layers,
        "num_experts": cfg.num_experts,
        "top_k": cfg.top_k,
        "resident_per_layer": [engine.resident] * cfg.num_layers,
        "max_batch": engine.max_batch,
        "max_seq_len": engine.max_seq_len,
        "load_s": engine.load_s,
        "runs": len(engine._runs),
        "last_timing": engine.last_timing,
        "nonrouted_bytes": engine.model.w.nbytes(),
        "kv_cache_bytes": engine.kv.nbytes() if engine.kv is not None else 0,
    }
    if cache is None:
        reason = "expert_format fp16 baseline: experts are dequantized device tensors, no expert cache runs"
        doc.update(hits=0, misses=0, bytes_h2d=0, generations=0, hit_rate=None, h2d_seconds=0.0,
                   resident_bytes=engine.experts.nbytes(), spare_bytes=0, staging_bytes=0, cache=None,
                   observations={n: {"status": "UNKNOWN", "unit": OBS_UNITS[n], "reason": reason} for n in OBS_NAMES})
        return doc
    c, cap = cache["counters"], cache["capacity"]
    looked = c["hits"] + c["misses"]
    doc.update(
        hits=c["hits"], misses=c["misses"], bytes_h2d=c["bytes_h2d"], generations=c["generations"],
        hit_rate=(c["hits"] / looked) if looked else None,
        h2d_seconds=engine.experts.h2d_seconds,
        resident_bytes=cap["num_layers"] * cap["resident"] * cap["row_bytes"],
        spare_bytes=cap["num_layers"] * cap["spares"] * cap["row_bytes"],
        staging_bytes=cap["staging_bytes"],
        cache=cache,
        observations=cache["observations"],
    )
    return doc


def write(path, doc: dict) -> Path:
    """Write ``doc`` as JSON to ``path`` atomically. Returns the path."""
    return write_json(path, doc, default=str)
