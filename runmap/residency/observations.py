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


def cache_observations(transport, host, monitor) -> dict:
    """Build the observation block from the cache's instruments.

    transport: the cache's Transport (its byte counters, reported alongside).
    host: the HostSource (verified page protection, rewrite refusals, hash bytes after startup, the closed
      pack reader).
    monitor: the cache's ExpertCopyMonitor (runmap/residency/instruments.py), a torch function or dispatch mode
      that sees every copy out of expert storage made by the cache and inside ``ExpertCache.monitored()`` blocks; None
      when the cache runs without it, which makes ``expert_d2h_bytes`` and ``writebacks`` UNKNOWN.
    """
    obs = {}
    if monitor is None:
        why = "cache built with copy_monitor=False: no instrument watched copies out of expert storage"
        obs["expert_d2h_bytes"] = unknown("expert_d2h_bytes", why)
        obs["writebacks"] = unknown("writebacks", why)
    else:
        mode = "TorchDispatchMode (aten operations)" if monitor.level == "dispatch" else \
            "TorchFunctionMode (torch calls from Python)"
        scope = (f"{mode} over {monitor.cache_scopes} cache entry points (admit, acquire with its miss "
                 f"transaction, release) and {monitor.caller_scopes} caller blocks (ExpertCache.monitored())")
        seen = f"; first copies: {monitor.events}" if monitor.events else ""
        obs["expert_d2h_bytes"] = observed(
            "expert_d2h_bytes", monitor.d2h_bytes,
            f"{scope}: bytes of expert storage copied into host memory ({monitor.d2h_copies} copies{seen}; "
            f"{type(transport).__name__} moved {transport.h2d_bytes} bytes host -> device)")
        obs["writebacks"] = observed(
            "writebacks", monitor.writebacks,
            f"{scope}: copies out of expert storage inside a miss transaction (the eviction path) or into the "
            "host source")
    frozen = host.check_frozen()
    if frozen and host.protection_holds():
        obs["host_source_rewrites"] = observed(
            "host_source_rewrites", host.rewrite_attempts,
            f"HostSource.write_row refusals; the whole host source is read-only, verified: {host.protection_detail}, "
            "so a write through any alias would have faulted")
    elif not frozen:
        obs["host_source_rewrites"] = unknown(
            "host_source_rewrites", "the host source array was found writable again: a write through it would "
            "not be seen")
    elif not host.protection_verified:
        obs["host_source_rewrites"] = unknown(
            "host_source_rewrites", f"host source protection not verified ({host.protection_detail}): a write "
            "through the torch alias would not be seen")
    else:
        obs["host_source_rewrites"] = unknown(
            "host_source_rewrites", "part of the host source became writable after startup (/proc/self/maps)")
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
