"""The five required-zero observations of resident-qpacked-cache-v1, from instrumentation
(docs/cache-contract.md#observations).

Names, units and statuses mirror ``specs/architecture.yaml`` observations and
``schemas/common.schema.json#/$defs/observation``. A value is written only when instrumentation
produced it (OBSERVED); otherwise the status is UNKNOWN or UNSUPPORTED with a reason.
"""
from __future__ import annotations

OBSERVED, UNKNOWN, UNSUPPORTED = "OBSERVED", "UNKNOWN", "UNSUPPORTED"
STATUSES = (OBSERVED, UNKNOWN, UNSUPPORTED)

REQUIRED_ZERO = {
    "expert_d2h_bytes": "bytes",
    "writebacks": "count",
    "host_source_rewrites": "count",
    "request_hash_work": "bytes",
    "request_pack_reads": "bytes",
}  # name -> unit: the registry of observation names
OBSERVATION_NAMES: tuple[str, ...] = tuple(REQUIRED_ZERO)


def observed(name: str, value: int | float, source: str) -> dict:
    return {"status": OBSERVED, "value": value, "unit": REQUIRED_ZERO[name], "source": source}


def unknown(name: str, reason: str) -> dict:
    return {"status": UNKNOWN, "unit": REQUIRED_ZERO[name], "reason": reason}


def unsupported(name: str, reason: str) -> dict:
    return {"status": UNSUPPORTED, "unit": REQUIRED_ZERO[name], "reason": reason}


def cache_observations(transport, host, writebacks: int) -> dict:
    """Build the observation block from the cache's instrumented counters.

    transport: the cache's Transport (counts bytes by direction; it has no device -> host path).
    host: the HostSource (rewrite attempts, hash bytes after startup, the closed pack reader).
    writebacks: the cache's count of evicted rows copied anywhere (eviction only drops mappings).
    """
    obs = {
        "expert_d2h_bytes": observed("expert_d2h_bytes", transport.d2h_bytes,
                                     f"{type(transport).__name__} byte counters (the only path touching expert rows)"),
        "writebacks": observed("writebacks", writebacks, "ExpertCache eviction path counter"),
    }
    frozen = host.check_frozen()
    if getattr(host, "pages_protected", False):
        obs["host_source_rewrites"] = observed(
            "host_source_rewrites", host.rewrite_attempts,
            "HostSource.write_row refusals + read-only flag check; pages mprotect(PROT_READ), so a write "
            "through any alias would have faulted" + ("" if frozen else " (array found writable)"))
    else:
        obs["host_source_rewrites"] = unknown(
            "host_source_rewrites", "host pages could not be made read-only (no mprotect): a write through the "
            "torch alias would not be seen")
    obs["request_hash_work"] = observed("request_hash_work", host.hash_bytes_after_seal,
                                        "HostSource hash counter after startup")
    reader = host.reader
    if reader is None:
        obs["request_pack_reads"] = unknown(
            "request_pack_reads", "host source built from in-memory rows; no pack reader to instrument")
    elif not hasattr(reader, "bytes_read"):
        obs["request_pack_reads"] = unsupported(
            "request_pack_reads", f"{type(reader).__name__} exposes no bytes_read counter")
    else:
        readers = [(reader, host.pack_bytes_at_seal)] + host.watched_readers
        after = sum(int(getattr(r, "bytes_read", 0)) - int(at) for r, at in readers)
        refused = sum(int(getattr(r, "reads_after_close", 0)) for r, _ in readers)
        obs["request_pack_reads"] = observed(
            "request_pack_reads", after,
            f"pack reader bytes_read after startup ({len(readers)} closed reader(s); {refused} refused read attempts)")
    return obs


def all_zero(obs: dict) -> bool:
    """True when every required observation is OBSERVED with value 0."""
    return all(obs.get(n, {}).get("status") == OBSERVED and obs[n].get("value") == 0 for n in REQUIRED_ZERO)
