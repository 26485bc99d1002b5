"""resident-qpacked-cache-v1: the expert residency cache (docs/cache-contract.md; every rule there holds here).

Vocabulary
----------
* **Storage**: per layer one device tensor uint8 (R, row_bytes), R = resident + spares, fixed at startup.
  A row is *published* (mapped in the current generation), a *free spare*, *fenced* (a spare whose last
  copy may still be in flight after an aborted transaction), or *retiring* (dropped from the mapping
  while a live request may still read it through an older generation).
* **Generation**: an immutable, numbered mapping (layer, expert) -> row plus one int32 (E,) device
  row table per layer (-1 = not mapped). Publication is one reference assignment.
* **Request** (``cache.admit()``): pins the generation current at admission (and every newer one it
  leases from) until ``release()``. **Lease** (``req.acquire(layer, ids)``): the batch union of one
  layer, all mapped in the lease's generation.
* **Miss transaction** (serialized): reserve free spares and staging buffers, host -> staging ->
  device row per missing expert (event per copy), wait for every event, upload the new row table,
  publish the complete group atomically. Eviction only drops mappings; victim rows become spares when
  no live request pins a generation that maps them.
* **Placement** (``req.acquire(layer, ids, place=f)``): ``f`` gets the group's experts that are absent (mapped in
  neither the request's generation nor the current one) and returns those the caller computes at the CPU site
  from the immutable host source; they are left out of the lease (no row, no transfer, no publication, no
  eviction on their behalf) and counted in ``cpu_site_experts``, never in hits or misses. The route is unchanged:
  every routed expert is computed, on the GPU from a leased row or on the CPU from the host source.
* **Prefetch** (``cache.prefetch(layer, ids)``): a miss transaction for a *predicted* group (the next layer's
  experts, before its routing is known), with every rule of one (spares, staging, all copies complete before one
  atomic publication, leases protected) but no lease. A prediction never fails a request: a prefetch that finds
  no room is skipped (``prefetches_skipped``, after the busy refusal it counts) and one whose copies fail before
  publication is aborted as any transaction and reported, not raised (``prefetches_aborted``); a failure after
  publication faults the cache as always. ``prefetch_used`` counts prefetched experts a later lease used.
* **Host-read site** (``req.note_host_reads(layer, ids)``, ``cache.promote(layer, ids)``): a decode step that reads
  absent experts straight from the registered host source over the link (the GPU's kernels, through a row table
  whose absent entries name host rows) runs no transaction: its request pins the generation whose rows it reads, as
  any request, and afterwards tells the cache what it routed (hits, and misses served by the host source in
  ``host_reads`` / ``host_read_bytes``; the eviction policy sees every use). Residency changes only by ``promote``: a
  miss transaction with no lease for the hottest absent expert, when the eviction policy values it above the coldest
  evictable resident by a margin, with every rule of a miss transaction (the engine runs it while the next step
  runs: that step's request pins the generation it reads, so a victim's row is not reused under it).
* **Failures**: before publication -> ``TransactionAborted`` (spares and staging back, rows with an
  unfinished copy fenced until its event completes, the old generation stays authoritative); after
  publication -> FAULTED, every later admission or acquisition raises ``CacheFaultedError``.

The same code runs with CPU tensors (``CpuTransport``) and on CUDA (``CudaTransport``).
"""
from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections import Counter
from types import MappingProxyType

import numpy as np
import torch

from runmap.residency.eviction import make_policy
from runmap.residency.host_source import HostSource
from runmap.residency.instruments import ExpertCopyMonitor
from runmap.residency.observations import all_zero, cache_observations
from runmap.residency.transport import Transport, TransferError, default_transport

CONTRACT_ID = "resident-qpacked-cache-v1"


class CacheError(RuntimeError):
    """Base class of cache runtime errors."""


class CacheConfigError(ValueError):
    """Startup refused: capacity, budget or arguments cannot satisfy the contract."""


class CacheFaultedError(CacheError):
    """The cache is FAULTED after an ambiguous failure following a publication; nothing is admitted."""


class CacheBusyError(CacheError):
    """A miss cannot proceed now (spare rows or evictable experts are held by live requests).
    Nothing changed; release requests and retry."""


class TransactionAborted(CacheError):
    """A miss transaction failed before publication; the previous generation is still authoritative."""


@dataclasses.dataclass(frozen=True)
class Generation:
    number: int
    maps: tuple  # per layer: MappingProxyType {expert: row}
    tables: tuple  # per layer: int32 (E,) device tensor, -1 where unmapped


@dataclasses.dataclass(frozen=True)
class Lease:
    """A layer's routed group on one generation. ``row_table`` int32 (E,) device tensor, ``storage``
    uint8 (R, row_bytes) device tensor, ``rows`` {expert: row} for the group only."""

    layer: int
    experts: tuple
    generation: int
    row_table: torch.Tensor
    storage: torch.Tensor
    rows: MappingProxyType
    cpu_experts: tuple = ()  # routed experts of the batch union placed at the CPU site (not leased, no row)


_RESERVED = object()  # staging buffer taken by the running transaction, copy not issued yet


class _Staging:
    __slots__ = ("index", "tensor", "event", "uses")

    def __init__(self, index, tensor):
        self.index, self.tensor, self.event, self.uses = index, tensor, None, 0


class Request:
    """One admitted request: a context manager; ``acquire`` per layer, ``release`` at the end."""

    def __init__(self, cache: "ExpertCache", gen: Generation, rid: int):
        self._cache = cache
        self.id = rid
        self.generation = gen.number  # latest generation this request captured
        self._gen = gen
        self.pins: set[int] = {gen.number}
        self.leases: list[Lease] = []
        self.released = False

    def acquire(self, layer: int, expert_ids, place=None) -> Lease:
        """Lease the batch union of ``expert_ids`` (int tensor of any shape, or iterable) in ``layer``.

        ``place``: None (every expert of the union is leased, absent ones through a miss transaction) or a
        callable ``place(absent: tuple[int, ...]) -> iterable[int]`` called under the cache's lock with the
        union's absent experts (sorted); the experts it returns (a subset of ``absent``) are computed by the
        caller at the CPU site and appear in ``Lease.cpu_experts`` instead of the lease's group."""
        return self._cache._acquire(self, layer, expert_ids, place)

    def pinned_row(self, layer: int) -> int:
        """A row mapped in ``layer`` by this request's latest generation (the lowest such row). The request pins that
        generation until it is released, so the row's bytes stay a complete published expert until then, although
        the expert is not leased: for a reader that needs some valid row to point at without using its result
        (the segment chain's slots computed at the CPU site, whose gate weight is zeroed on the device)."""
        if self.released:
            raise CacheError(f"request {self.id} is released; it pins no generation")
        return min(self._gen.maps[layer].values())  # never empty: a generation maps resident >= 1 experts per layer

    def mapping(self, layer: int) -> MappingProxyType:
        """{expert: row} of ``layer`` in this request's latest generation: rows it pins (their bytes stay a complete
        published expert until release), what a host-read step may read from the device."""
        return self._gen.maps[layer]

    def resident_mask(self) -> np.ndarray:
        """bool (L, E), read-only: the experts mapped in this request's latest generation (``mapping`` of every layer
        at once)."""
        with self._cache._lock:  # (_resident_mask keeps its last few masks: a dict the other callers change too)
            if self.released:
                raise CacheError(f"request {self.id} is released; it pins no generation")
            mask = self._cache._resident_mask(self._gen).view()
        mask.flags.writeable = False
        return mask

    def note_host_reads(self, layer: int, expert_ids, cpu=()) -> int:
        """After a host-read step of this request: its routed ids of ``layer`` (any int shape) were read from this
        request's generation where mapped and from the host source elsewhere. Counts hits, misses and host reads
        and lets the eviction policy see the uses; returns the host reads. No transaction, no lease.

        ``cpu``: the experts of the union that the CPU site computed from the host source instead (a two-site step,
        placement two-site): each must be routed in ``expert_ids`` and absent from this request's generation
        (CacheError otherwise, nothing counted). They count in ``cpu_site_experts``, never in hits, misses or host
        reads; the eviction policy sees their use like any other (a promotion may then bring the hottest in)."""
        return self._cache._note_host_reads(self, layer, expert_ids, cpu)

    def acquire_all(self, layer: int) -> Lease:
        """Lease every expert of ``layer`` (full residency only: no miss can happen)."""
        if not self._cache.full_residency:
            raise CacheError("acquire_all needs full residency (resident == experts per layer)")
        return self._cache._acquire(self, layer, range(self._cache.num_experts))

    def release(self, waited: bool = False) -> None:
        """Give back the request's leases and pins. ``waited=True``: the caller has waited for every kernel that read
        its rows (an event recorded after them), so no release marker is recorded and later copies into the rows it
        frees are not ordered after work queued since (a host-read step ends the step before while the next one
        runs; a marker behind the running step would hold the promotion's copy until that step ends)."""
        self._cache._release(self, waited)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()
        return False


def _cpu_site_refusal(layer: int, bad: list) -> CacheError:
    """The one error of a host-read step's note naming CPU-site experts ``bad`` of ``layer`` that are not absent experts
    routed in the step (ExpertCache._cpu_site_mask, note_host_read_step's mask form)."""
    return CacheError(f"layer {layer}: experts {bad} at the CPU site are not absent experts routed in this step (only "
                      f"those may go there)")


class ExpertCache:
    """See the module docstring. Build with ``from_pack`` or ``from_host``."""

    request_cls = Request  # what ``admit`` hands out

    def __init__(self, host: HostSource, *, resident: int, spares: int | None = None, staging: int | None = None,
                 max_group: int, device="cpu", policy="lru", budget_bytes: int | None = None,
                 transport: Transport | None = None, prefill: bool = True, copy_monitor: bool | str = True):
        """``copy_monitor``: watch every copy out of expert storage made by the cache (and inside
        ``monitored()`` blocks): True or "function" = a TorchFunctionMode, "dispatch" = a TorchDispatchMode
        (sees aten operations too, ~20x the cost; runmap/residency/instruments.py); False = no instrument, and
        the ``expert_d2h_bytes`` and ``writebacks`` observations are UNKNOWN."""
        self.host = host
        self.num_layers, self.num_experts, self.row_bytes = host.num_layers, host.num_experts, host.row_bytes
        self.layout = host.layout
        self.transport = transport if transport is not None else default_transport(device)
        self.device = self.transport.device
        self.contract = self.transport.contract
        self.transport.attach_host(host)  # v2 registers (pins) the host source here, before any copy
        self.policy = make_policy(policy)
        self._configure(resident, spares, staging, max_group, budget_bytes)
        self._lock = threading.RLock()
        self._faulted: BaseException | None = None
        self._in_txn = False
        self._tick = 0
        self._next_rid = 0
        self._pins: Counter = Counter()  # generation number -> live requests pinning it
        self._leased: list[Counter] = [Counter() for _ in range(self.num_layers)]  # expert -> live leases
        self._requests: dict[int, Request] = {}
        self._masks: dict[int, tuple] = {}  # generation -> (its maps, bool (L, E) mapped) (_resident_mask)
        self.counters = Counter({k: 0 for k in (
            "requests_admitted", "requests_released", "leases", "hits", "misses", "all_hit_leases",
            "transactions", "transactions_aborted", "busy_refusals", "bytes_h2d", "staging_reuses",
            "staging_waits", "evictions", "rows_recycled", "rows_fenced", "faults", "cpu_site_experts",
            "prefetches", "prefetched_experts", "prefetches_skipped", "prefetches_aborted", "prefetch_used",
            "host_reads", "host_read_bytes", "promotions", "promotions_skipped")})
        # per layer: experts a prefetch published that no lease has used yet (prefetch accuracy)
        self._prefetched: list[set[int]] = [set() for _ in range(self.num_layers)]
        self._storage = [self.transport.alloc_storage(self.rows_per_layer, self.row_bytes)
                         for _ in range(self.num_layers)]  # per layer (R, row_bytes)
        self.copy_monitor = (ExpertCopyMonitor("function" if copy_monitor is True else copy_monitor)
                             if copy_monitor else None)
        if self.copy_monitor is not None:
            for t in self._storage:
                self.copy_monitor.watch_storage(t)
            self.copy_monitor.watch_host(host.row_tensor(0, 0))
        # (row_bytes,) views of every device row and host row, made once: a miss transaction then indexes Python
        # lists instead of issuing two torch calls per copied row (each one goes through the copy monitor's mode)
        self._row_views = [list(t.unbind(0)) for t in self._storage]
        self._host_views = [[host.row_tensor(layer, e) for e in range(self.num_experts)]
                            for layer in range(self.num_layers)]
        self._staging = [_Staging(i, self.transport.alloc_staging(self.row_bytes)) for i in range(self.staging)]
        self.staging_bytes = sum(b.tensor.numel() for b in self._staging)  # v2's slots are one-byte tokens
        self._free: list[list[int]] = [list(range(self.rows_per_layer - 1, -1, -1)) for _ in range(self.num_layers)]
        self._fenced: list[list[tuple[int, object]]] = [[] for _ in range(self.num_layers)]
        self._retiring: list[list[tuple[int, int, int, int]]] = [[] for _ in range(self.num_layers)]
        self._since: list[dict[int, int]] = [{} for _ in range(self.num_layers)]  # row -> first gen mapping it
        empty = tuple(MappingProxyType({}) for _ in range(self.num_layers))
        self._current = Generation(0, empty, tuple(self.transport.upload_table([-1] * self.num_experts)
                                                   for _ in range(self.num_layers)))
        n0 = self.num_experts if self.full_residency else (self.resident if prefill else 0)
        if n0:
            self._startup_publish(n0)

    # --- construction -----------------------------------------------------------------------------
    @classmethod
    def from_pack(cls, reader, **kw) -> "ExpertCache":
        """Read the whole pack into the host source (reader closed afterwards), then build the cache."""
        return cls(HostSource.from_pack(reader), **kw)

    @classmethod
    def from_host(cls, host: HostSource, **kw) -> "ExpertCache":
        return cls(host, **kw)

    def _configure(self, resident, spares, staging, max_group, budget_bytes):
        e = self.num_experts
        if not isinstance(max_group, int) or max_group < 1:
            raise CacheConfigError(f"max_group must be a positive int (top_k x max batch), got {max_group!r}")
        group = min(max_group, e)  # a routed group never exceeds the experts of a layer
        if not (1 <= resident <= e):
            raise CacheConfigError(f"resident={resident} must be in [1, {e}] (experts per layer)")
        full = resident == e
        if spares is None:
            spares = 0 if full else group
        if staging is None:
            staging = min(group, 8) if full else group
        if resident < group:
            raise CacheConfigError(
                f"resident={resident} rows per layer cannot publish the largest routed group of {group} experts "
                f"(top_k x batch = {max_group}, capped at {e}); need resident >= {group}")
        if not full and spares < group:
            raise CacheConfigError(f"spares={spares} per layer cannot receive the largest routed group of {group} "
                                   f"missing experts; need spares >= {group}")
        if not full and staging < group:
            raise CacheConfigError(f"staging={staging} pinned buffers cannot stage the largest routed group of "
                                   f"{group} missing experts; need staging >= {group}")
        if staging < 1 or spares < 0:
            raise CacheConfigError(f"staging={staging} must be >= 1 and spares={spares} >= 0")
        self.resident, self.spares, self.staging, self.max_group = resident, spares, staging, group
        self.lent_rows = 0  # spare rows per layer made resident capacity (lend_spares)
        self.lent_by_default = False  # set by the engine where its default (not host_read_spares) lent them
        self.full_residency = full
        self.rows_per_layer = resident + spares
        dev_need = self.num_layers * (self.rows_per_layer * self.row_bytes + 2 * 4 * e)
        self.device_bytes = dev_need
        self.staging_bytes = staging * self.row_bytes
        if budget_bytes is None and self.device.type == "cuda":
            budget_bytes, _ = torch.cuda.mem_get_info(self.device)
        self.budget_bytes = budget_bytes
        if budget_bytes is not None and dev_need > budget_bytes:
            raise CacheConfigError(
                f"device budget too small: {self.num_layers} layers x (resident {resident} + spares {spares}) rows x "
                f"{self.row_bytes} bytes (+ row tables) = {dev_need} bytes needed ({dev_need / 2**30:.3f} GiB), "
                f"{budget_bytes} bytes available ({budget_bytes / 2**30:.3f} GiB)")

    # --- public API -----------------------------------------------------------------------------------
    def storage(self, layer: int) -> torch.Tensor:
        """uint8 (R, row_bytes) device tensor of ``layer``; rows are addressed through a lease's row table."""
        return self._storage[layer]

    @property
    def generation(self) -> int:
        """Number of the authoritative (current) generation."""
        return self._current.number

    @property
    def faulted(self) -> bool:
        return self._faulted is not None

    @property
    def state(self) -> str:
        return "FAULTED" if self._faulted is not None else "READY"

    def mapping(self, layer: int) -> dict[int, int]:
        """{expert: row} of the current generation (a copy)."""
        return dict(self._current.maps[layer])

    def static_row_table(self, layer: int) -> torch.Tensor:
        """int32 (E,) row table that never changes (full residency only), for CUDA graph capture."""
        if not self.full_residency:
            raise CacheError("static_row_table is only valid under full residency (resident == experts per layer)")
        self._check_faulted()
        return self._current.tables[layer]

    def admit(self) -> Request:
        """Admit a request on the current generation. Raises CacheFaultedError when FAULTED."""
        with self._lock, self._watch():
            self._check_faulted()
            gen = self._current
            rid = self._next_rid
            self._next_rid += 1
            req = self.request_cls(self, gen, rid)
            self._pins[gen.number] += 1
            self._requests[rid] = req
            self.counters["requests_admitted"] += 1
            return req

    def prefetch(self, layer: int, expert_ids) -> tuple:
        """Publish the experts of a predicted group (``expert_ids``: int tensor, array or iterable) that are not
        mapped in the current generation, through a miss transaction with no lease. Returns the experts it
        published (sorted; empty when all were resident, or when the prefetch was skipped or aborted).
        Raises CacheFaultedError when FAULTED or when the publication's aftermath fails; a BaseException
        (an interrupt) raised inside the transaction propagates after the abort, as for any transaction."""
        with self._lock, self._watch():
            self._check_faulted()
            group = self._group(layer, expert_ids)
            self._tick += 1
            cur = self._current
            missing = [e for e in group if e not in cur.maps[layer]]
            if not missing:
                return ()
            try:
                with self._watch(transaction=True):
                    self._transaction(layer, group, cur, missing)
            except CacheBusyError:
                self.counters["prefetches_skipped"] += 1
                return ()
            except TransactionAborted:
                self.counters["prefetches_aborted"] += 1
                return ()
            self.counters["prefetches"] += 1
            self.counters["prefetched_experts"] += len(missing)
            self._prefetched[layer].update(missing)
            # the predicted experts count as used now, so that the eviction policy keeps them for the routing
            # that follows (LRU: most recent)
            self.policy.touch(layer, tuple(missing), self._tick)
            return tuple(missing)

    def promote(self, layer: int, expert_ids, margin: float = 1.0) -> tuple:
        """Host-read residency: publish the absent expert of ``expert_ids`` (this step's host reads of ``layer``) that
        the eviction policy values most, when that value exceeds the coldest evictable resident's by ``margin``
        (lfu-decay: uses; lru: ticks), through a miss transaction with no lease. Returns the published expert (a
        1-tuple) or () when none qualified or the transaction found no room or aborted (``promotions_skipped``; the
        next step reads the expert from the host source again). Raises CacheFaultedError as ``prefetch``."""
        with self._lock, self._watch():
            self._check_faulted()
            used = self._used_mask(layer, expert_ids)
            values = self.policy.values_all(self.num_layers, self.num_experts, self._tick)[layer]
            return self._promote_layer(layer, used, values, margin)

    def promote_step(self, ids, margin: float = 1.0, max_layers: int | None = None) -> list[tuple]:
        """``promote`` of every layer in turn for one step's host reads (ids int (L, ...)), the policy's values of
        all layers computed at once: the same decisions and transactions as L calls. Returns each layer's result.
        ``max_layers``: promote in at most that many layers (each promotion is a transaction the caller waits for),
        those not full first, then those whose hottest absent expert is furthest above their coldest resident; None:
        every layer that qualifies. The ranking compares with the coldest resident, the rule with the coldest evictable
        one: a layer whose coldest are leased (a live request's) can be chosen and then promote nothing, using up its
        slot; a two-site step's promotions run after its request is released, so none is then."""
        if max_layers is not None and max_layers < 1:
            raise ValueError(f"max_layers={max_layers}: at least 1 (None for no bound)")
        with self._lock, self._watch():
            self._check_faulted()
            used = self._used_mask(None, ids)
            values = self.policy.values_all(self.num_layers, self.num_experts, self._tick)  # (L, E)
            out: list[tuple] = [()] * self.num_layers
            for layer in self._promotion_candidates(used, values, margin, max_layers):
                out[layer] = self._promote_layer(layer, used[layer], values[layer], margin)
            return out

    def _promotion_candidates(self, used: np.ndarray, values: np.ndarray, margin: float,
                              max_layers: int | None = None) -> list[int]:
        """The layers ``_promote_layer`` could promote in, decided for all layers at once (under the lock): every layer
        with an absent used expert whose best value reaches the coldest resident's + ``margin``, or that is not full.
        Exact: evictable experts are residents, so the coldest evictable is never colder than the coldest resident,
        and a layer left out would fail ``_promote_layer``'s own test; a promotion in one layer changes no other
        layer's mapping or any value. ``used``, ``values``: (L, E). ``max_layers``: the first that many by
        (not full, hottest absent value - coldest resident value) descending, returned in layer order."""
        cur = self._current
        res = self._resident_mask(cur)  # (L, E)
        absent = used & ~res
        best = np.where(absent, values, -np.inf).max(1)  # (L,) the hottest absent expert's value
        coldest = np.where(res, values, np.inf).min(1)  # (L,) the coldest resident's
        full = np.array([len(m) >= self.resident for m in cur.maps])
        layers = np.flatnonzero(absent.any(1) & (~full | (best >= coldest + margin)))
        if max_layers is None or len(layers) <= max_layers:
            return layers.tolist()
        gain = np.where(full[layers], best[layers] - coldest[layers], np.inf)  # a free row first
        keep = layers[np.argsort(-gain, kind="stable")[:max_layers]]
        return sorted(keep.tolist())

    def _promote_layer(self, layer: int, used: np.ndarray, values: np.ndarray, margin: float) -> tuple:
        """``promote``'s rule for ``layer`` (under the lock): used bool (E,) the step's union, values float (E,) the
        policy's values at the current tick (a promotion changes none of them)."""
        cur = self._current
        res = self._resident_mask(cur)[layer]
        absent = used & ~res
        if not absent.any():
            return ()
        evictable = res.copy()
        evictable[list(self._protected(layer, ()))] = False
        full = len(cur.maps[layer]) >= self.resident
        if full and not evictable.any():
            return ()
        best = int(np.flatnonzero(absent)[np.argmax(values[absent])])  # the first of the highest: the lowest id
        if full and values[best] < values[evictable].min() + margin:
            return ()
        try:
            with self._watch(transaction=True):
                self._transaction(layer, (best,), cur, [best])
        except (CacheBusyError, TransactionAborted):
            self.counters["promotions_skipped"] += 1
            return ()
        self.counters["promotions"] += 1
        return (best,)

    def _resident_mask(self, gen: Generation) -> np.ndarray:
        """bool (L, E): mapped in ``gen`` (kept for the last few generations: a host-read step asks once per step)."""
        kept = self._masks.get(gen.number)
        if kept is not None:
            return kept[1]
        # from the newest kept generation's mask, redoing only the layers whose mapping is another object (a
        # publication replaces one layer's and shares the others'), else from nothing
        base = self._masks[next(reversed(self._masks))] if self._masks else None
        hit = base[1].copy() if base is not None else np.zeros((self.num_layers, self.num_experts), dtype=bool)
        for layer, m in enumerate(gen.maps):
            if base is None or base[0][layer] is not m:
                hit[layer] = False
                hit[layer, list(m.keys())] = True
        if len(self._masks) > 4:
            self._masks.pop(next(iter(self._masks)))
        self._masks[gen.number] = (gen.maps, hit)
        return hit

    def _used_mask(self, layer: int | None, ids) -> np.ndarray:
        """A host-read step's batch unions as a checked bool mask: ``layer`` given, ids of that layer (any int shape)
        -> (E,); None, ids int (L, ...) of every layer -> (L, E). No max_group bound: a host-read step leases
        nothing, so its union may be any size."""
        rows = self.num_layers if layer is None else 1
        a = np.asarray(ids)
        if layer is None and a.shape[:1] != (rows,):
            raise ValueError(f"a host-read step's ids must be (layers={rows}, ...), got {a.shape}")
        if layer is not None and not (0 <= layer < self.num_layers):
            raise IndexError(f"layer {layer} out of range [0, {self.num_layers})")
        flat = a.reshape(rows, -1).astype(np.int64)
        if flat.size and (flat.min() < 0 or flat.max() >= self.num_experts):
            where = "a host-read step" if layer is None else f"layer {layer}"
            raise IndexError(f"{where}: expert ids {sorted(set(flat.ravel().tolist()))} outside [0, {self.num_experts})")
        used = np.zeros((rows, self.num_experts), dtype=bool)
        used[np.arange(rows)[:, None], flat] = True
        return used if layer is None else used[0]

    def note_host_read_step(self, req: Request, ids, cpu=None) -> int:
        """``req.note_host_reads`` for every layer of one step at once, in layer order (the same counters, policy uses
        and ticks as L calls): ids int (L, ...) the step's routed ids; ``cpu``: None, or per layer the experts the CPU
        site computed (L sequences, or one bool (L, E) mask; each layer's as ``note_host_reads``' ``cpu``, all checked
        before anything is counted). Returns the step's host reads."""
        with self._lock:
            self._check_noting(req)
            used = self._used_mask(None, ids)
            resident = self._resident_mask(req._gen)
            on_cpu = np.zeros_like(used)  # (L, E)
            if isinstance(cpu, np.ndarray) and cpu.dtype != bool:  # (rows of it would read as expert ids)
                raise ValueError(f"a step's CPU-site experts are per-layer sequences of expert ids or one bool "
                                 f"(layers, experts) mask, got a {cpu.dtype} array")
            if isinstance(cpu, np.ndarray):
                if cpu.shape != used.shape:
                    raise ValueError(f"a step's CPU-site mask must be (layers, experts) = {used.shape}, got {cpu.shape}")
                bad = cpu & (~used | resident)
                if bad.any():
                    layer = int(np.flatnonzero(bad.any(axis=1))[0])
                    raise _cpu_site_refusal(layer, np.flatnonzero(bad[layer]).tolist())
                on_cpu = cpu
            elif cpu is not None:
                if len(cpu) != self.num_layers:
                    raise ValueError(f"a step's CPU-site experts must be given per layer ({self.num_layers}), got "
                                     f"{len(cpu)}")
                for layer, experts in enumerate(cpu):
                    if len(experts):
                        on_cpu[layer] = self._cpu_site_mask(layer, experts, used[layer], resident[layer])
            ticks = self._tick + 1 + np.arange(self.num_layers)
            self._tick += self.num_layers
            self.policy.touch_layers(used, ticks)
            self.counters["cpu_site_experts"] += int(on_cpu.sum())
            return self._count_host_reads(used & ~on_cpu, resident)

    def _note_host_reads(self, req: Request, layer: int, expert_ids, cpu=()) -> int:
        with self._lock:
            self._check_noting(req)
            used = self._used_mask(layer, expert_ids)
            resident = self._resident_mask(req._gen)[layer]
            on_cpu = self._cpu_site_mask(layer, cpu, used, resident)
            self._tick += 1
            self.policy.touch(layer, np.flatnonzero(used), self._tick)
            self.counters["cpu_site_experts"] += int(on_cpu.sum())
            return self._count_host_reads(used & ~on_cpu, resident)

    def _cpu_site_mask(self, layer: int, cpu, used: np.ndarray, resident: np.ndarray) -> np.ndarray:
        """bool (E,): the CPU site's experts ``cpu`` of ``layer`` in a host-read step, each checked to be routed in it
        (``used``) and absent from its generation (``resident``), both bool (E,); CacheError naming the layer
        otherwise (before the caller counts anything)."""
        experts = sorted({int(e) for e in cpu})
        bad = [e for e in experts if not (0 <= e < self.num_experts) or not used[e] or resident[e]]
        if bad:
            raise _cpu_site_refusal(layer, bad)
        on_cpu = np.zeros_like(used)
        on_cpu[experts] = True
        return on_cpu

    @contextlib.contextmanager
    def policy_kept(self):
        """Around work whose routes are not a user's (a warm-up's pad tokens): the eviction policy's history (uses,
        scores) and the cache's clock are put back afterwards, so that neither a miss transaction's victims nor a
        promotion learn from it; the experts that work brought in stay, as after any request."""
        with self._lock:
            saved = self.policy._t.copy(), self.policy._s.copy(), self._tick
        try:
            yield
        finally:
            with self._lock:
                self.policy._t, self.policy._s, self._tick = saved

    def _check_noting(self, req: Request) -> None:
        if req.released:
            raise CacheError(f"request {req.id} was released; note a step's host reads before releasing it")
        self._check_faulted()

    def _count_host_reads(self, used: np.ndarray, resident: np.ndarray) -> int:
        """Count a host-read step's uses (bool masks of the same shape): hits where resident, misses served by the
        host source elsewhere. Returns the host reads."""
        reads = int((used & ~resident).sum())
        self.counters["hits"] += int(used.sum()) - reads
        self.counters["misses"] += reads
        self.counters["host_reads"] += reads
        self.counters["host_read_bytes"] += reads * self.row_bytes
        return reads

    def monitored(self):
        """Context manager: copies out of expert storage made inside the block (e.g. by the code that reads
        a lease's rows) count in the ``expert_d2h_bytes`` and ``writebacks`` observations."""
        if self.copy_monitor is None:
            return contextlib.nullcontext()
        return self.copy_monitor.scope(caller=True)

    def _watch(self, transaction: bool = False):
        if self.copy_monitor is None:
            return contextlib.nullcontext()
        return self.copy_monitor.scope(transaction=transaction)

    # --- internals: acquisition ----------------------------------------------------------------------
    def _check_faulted(self):
        if self._faulted is not None:
            raise CacheFaultedError(
                f"expert cache is FAULTED after an ambiguous failure following publication of generation "
                f"{self._current.number} ({type(self._faulted).__name__}: {self._faulted}); no request can be "
                f"admitted or served; restart the engine")

    def _group(self, layer, expert_ids) -> tuple:
        if not (0 <= layer < self.num_layers):
            raise IndexError(f"layer {layer} out of range [0, {self.num_layers})")
        if isinstance(expert_ids, torch.Tensor):
            ids = expert_ids.detach().reshape(-1).to("cpu").tolist()  # (T*k,) the batch's routed ids
        elif isinstance(expert_ids, np.ndarray):  # a host array (the segment decoder's pinned ids): no torch call
            ids = expert_ids.reshape(-1).tolist()
        else:
            ids = list(expert_ids)
        group = tuple(sorted({int(i) for i in ids}))
        if group and not (0 <= group[0] and group[-1] < self.num_experts):
            raise IndexError(f"layer {layer}: expert ids {group} outside [0, {self.num_experts})")
        if len(group) > self.max_group and not self.full_residency:  # full residency never misses
            raise CacheError(f"layer {layer}: routed group of {len(group)} experts exceeds the configured "
                             f"max_group {self.max_group}")
        return group

    def _acquire(self, req: Request, layer: int, expert_ids, place=None) -> Lease:
        with self._lock, self._watch():
            if req.released:
                raise CacheError(f"request {req.id} was released; admit a new one")
            self._check_faulted()
            group = self._group(layer, expert_ids)
            self._tick += 1
            gen = req._gen
            on_cpu = ()
            if place is not None:
                absent = tuple(e for e in group if e not in gen.maps[layer] and e not in self._current.maps[layer])
                if absent:
                    on_cpu = tuple(sorted({int(e) for e in place(absent)}))
                    if not set(on_cpu) <= set(absent):
                        raise CacheError(f"layer {layer}: placement put experts {sorted(set(on_cpu) - set(absent))} "
                                         f"at the CPU site; only absent experts {list(absent)} may go there")
                    group = tuple(e for e in group if e not in on_cpu)
            missing = [e for e in group if e not in gen.maps[layer]]
            if missing and gen is not self._current:
                cur = self._current
                cur_missing = [e for e in group if e not in cur.maps[layer]]
                if not cur_missing:
                    gen, missing = cur, []
            if missing:
                cur = self._current
                txn_missing = [e for e in group if e not in cur.maps[layer]]
                with self._watch(transaction=True):  # the copy monitor counts any copy out here as a writeback
                    gen = self._transaction(layer, group, cur, txn_missing)
                nmiss = len(txn_missing)
            else:
                nmiss = 0
                if not on_cpu:  # a group with experts at the CPU site was not all resident
                    self.counters["all_hit_leases"] += 1
            if gen.number not in req.pins:
                req.pins.add(gen.number)
                self._pins[gen.number] += 1
            if gen.number > req.generation:
                req.generation, req._gen = gen.number, gen
            self.counters["hits"] += len(group) - nmiss
            self.counters["misses"] += nmiss
            self.counters["cpu_site_experts"] += len(on_cpu)
            used = self._prefetched[layer].intersection(group)
            if used:
                self.counters["prefetch_used"] += len(used)
                self._prefetched[layer] -= used
            self.counters["leases"] += 1
            self.policy.touch(layer, group, self._tick)
            self._leased[layer].update(group)
            m = gen.maps[layer]
            lease = Lease(layer, group, gen.number, gen.tables[layer], self._storage[layer],
                          MappingProxyType({e: m[e] for e in group}), on_cpu)
            req.leases.append(lease)
            return lease

    def _release(self, req: Request, waited: bool = False) -> None:
        with self._lock, self._watch():
            if req.released:
                return
            req.released = True
            try:
                if not waited:
                    self.transport.note_release()
            except BaseException as exc:
                # Without the release marker later copies cannot be ordered after this request's reads:
                # drop its leases and pins (nothing leaks) but recycle nothing, and fault the cache.
                self._fault(exc)
                self._drop_request(req)
                raise
            self._drop_request(req)
            for layer in range(self.num_layers):
                self._reclaim_retiring(layer)

    def _drop_request(self, req: Request) -> None:
        """Give back everything a released request held: its leases and its generation pins."""
        for lease in req.leases:
            self._leased[lease.layer].subtract(lease.experts)
            self._leased[lease.layer] += Counter()  # drop zero counts
        for g in req.pins:
            self._pins[g] -= 1
            if self._pins[g] <= 0:
                del self._pins[g]
        req.leases = []
        self._requests.pop(req.id, None)
        self.counters["requests_released"] += 1

    # --- internals: row bookkeeping -------------------------------------------------------------------
    def _visible(self, since: int, until: int) -> bool:
        """True when a live request pins a generation in [since, until) (one that maps the row)."""
        return any(since <= g < until for g in self._pins)

    def _reclaim_retiring(self, layer: int) -> None:
        keep = []
        for item in self._retiring[layer]:
            row, _expert, since, until = item
            if self._visible(since, until):
                keep.append(item)
            else:
                self._free[layer].append(row)
                self.counters["rows_recycled"] += 1
        self._retiring[layer] = keep

    def _reclaim_fenced(self, layer: int) -> None:
        keep = []
        for row, ev in self._fenced[layer]:
            if self.transport.query(ev):
                self._free[layer].append(row)
            else:
                keep.append((row, ev))
        self._fenced[layer] = keep

    def _protected(self, layer: int, group: tuple) -> set[int]:
        """Experts that must not be evicted: the group being published and every live lease's group."""
        return set(group) | {e for e, c in self._leased[layer].items() if c > 0}

    def _retire(self, layer: int, row: int, expert: int, until: int) -> None:
        self._retiring[layer].append((row, expert, self._since[layer].pop(row), until))

    def _take_staging(self) -> _Staging:
        """A staging buffer whose last copy has completed (waits for the oldest if none is ready)."""
        for buf in self._staging:
            if buf.event is _RESERVED:
                continue
            if buf.event is None or self.transport.query(buf.event):
                return self._use_staging(buf)
        self.counters["staging_waits"] += 1
        buf = next((b for b in self._staging if b.event is not _RESERVED), None)
        if buf is None:
            raise CacheError("every staging buffer is reserved by this transaction")
        try:
            self.transport.wait(buf.event)
        except TransferError:
            pass  # that copy belonged to an aborted transaction: it has ended, the buffer is free
        return self._use_staging(buf)

    def _use_staging(self, buf: _Staging) -> _Staging:
        if buf.uses:
            self.counters["staging_reuses"] += 1
        buf.uses += 1
        buf.event = _RESERVED
        # rotate so that the next take prefers buffers idle for longest
        self._staging.remove(buf)
        self._staging.append(buf)
        return buf

    # --- internals: transactions ----------------------------------------------------------------------
    def _copy_rows(self, layer: int, experts: list[int], rows: list[int], submitted: list) -> None:
        """host (pageable) -> pinned staging -> device spare rows, one event per row, in batches of at
        most the staging pool; a buffer is taken only once its previous copy's event has completed."""
        todo = list(zip(experts, rows))
        for lo in range(0, len(todo), len(self._staging)):
            batch = todo[lo: lo + len(self._staging)]
            bufs: list[_Staging] = []

            def on_submit(j, ev, bufs=bufs, batch=batch):
                bufs[j].event = ev
                submitted.append((batch[j][1], ev))
                self.counters["bytes_h2d"] += self.row_bytes

            try:  # a failure (or an interrupt) while taking buffers gives back the ones already taken
                for _ in batch:
                    bufs.append(self._take_staging())
                dev_rows, host_rows = self._row_views[layer], self._host_views[layer]
                jobs = [(dev_rows[row], buf.tensor, host_rows[e]) for (e, row), buf in zip(batch, bufs)]
                self.transport.copy_rows(jobs, on_submit)
            finally:
                for buf in bufs:
                    if buf.event is _RESERVED:  # staged but never copied: nothing reads it
                        buf.event = None

    def _wait_all(self, submitted: list) -> None:
        for _row, ev in submitted:
            self.transport.wait(ev)

    def _transaction(self, layer: int, group: tuple, cur: Generation, missing: list[int]) -> Generation:
        if self._in_txn:
            raise CacheError("miss transactions are serialized in v1; a transaction is already running")
        self._in_txn = True
        try:
            self._reclaim_fenced(layer)
            self._reclaim_retiring(layer)
            mapped = cur.maps[layer]
            n_evict = len(mapped) + len(missing) - self.resident
            protected = self._protected(layer, group)
            candidates = [e for e in mapped if e not in protected]
            free = self._free[layer]
            if n_evict > len(candidates) or len(missing) > len(free):
                self.counters["busy_refusals"] += 1
                raise CacheBusyError(
                    f"layer {layer}: {len(missing)} missing experts need {len(missing)} free spare rows "
                    f"({len(free)} free, {len(self._retiring[layer])} retiring behind live requests, "
                    f"{len(self._fenced[layer])} fenced) and {max(n_evict, 0)} evictable experts "
                    f"({len(candidates)} not leased); release requests and retry")
            victims = self.policy.choose(layer, candidates, n_evict, self._tick) if n_evict > 0 else []
            rows = [free.pop() for _ in missing]
            submitted: list = []
            new_map = dict(mapped)
            for v in victims:
                del new_map[v]
            new_map.update(zip(missing, rows))
            table = [-1] * self.num_experts
            for e, r in new_map.items():
                table[e] = r
            try:
                self._copy_rows(layer, missing, rows, submitted)
                # the table goes behind the rows on the transfer stream; publication waits for all
                dev_table, table_ev = self.transport.upload_table_async(table)  # (E,) int32
                self._wait_all(submitted)
                if table_ev is not None:
                    self.transport.wait(table_ev)
            except BaseException as exc:
                # any failure before publication, an interrupt (KeyboardInterrupt, cancellation) included,
                # gives the spares and staging back; an interrupt then propagates as itself
                self._abort(layer, rows, submitted)
                if not isinstance(exc, Exception):
                    raise
                raise TransactionAborted(
                    f"layer {layer}: miss transaction for experts {missing} failed before publication "
                    f"({type(exc).__name__}: {exc}); generation {cur.number} remains authoritative") from exc
            gen = Generation(cur.number + 1,
                             cur.maps[:layer] + (MappingProxyType(new_map),) + cur.maps[layer + 1:],
                             cur.tables[:layer] + (dev_table,) + cur.tables[layer + 1:])
            self._current = gen  # publication: one reference assignment
            self.counters["transactions"] += 1
            for v in victims:
                self._retire(layer, mapped[v], v, gen.number)
            self._prefetched[layer].difference_update(victims)  # evicted before any lease used it: wasted
            for e, r in zip(missing, rows):
                self._since[layer][r] = gen.number
            self.counters["evictions"] += len(victims)
            try:
                self.transport.after_publish()
            except BaseException as exc:  # published, outcome unknown: FAULTED, whatever was raised
                self._fault(exc)
                # the publication stands: its victims' rows are reclaimed as after any publication (a prefetch may
                # publish with no live request, and nothing else would reclaim them)
                self._reclaim_retiring(layer)
                if not isinstance(exc, Exception):
                    raise
                raise CacheFaultedError(
                    f"layer {layer}: failure after publishing generation {gen.number} "
                    f"({type(exc).__name__}: {exc}); the cache is FAULTED") from exc
            self._reclaim_retiring(layer)
            return gen
        finally:
            self._in_txn = False

    def _abort(self, layer: int, rows: list[int], submitted: list) -> None:
        """Return reserved spares; a row whose copy may still be running stays fenced by its event."""
        self.counters["transactions_aborted"] += 1
        events = {row: ev for row, ev in submitted}
        for row in rows:
            ev = events.get(row)
            if ev is not None and not self.transport.query(ev):
                self._fenced[layer].append((row, ev))
                self.counters["rows_fenced"] += 1
            else:
                self._free[layer].append(row)

    def _fault(self, exc: BaseException) -> None:
        self._faulted = exc
        self.counters["faults"] += 1

    def _startup_publish(self, n: int) -> None:
        """Publish generation 1 holding experts [0, n) of every layer (all of them under full residency)."""
        maps, tables, submitted = [], [], []
        try:
            for layer in range(self.num_layers):
                experts = list(range(n))
                rows = [self._free[layer].pop() for _ in experts]
                self._copy_rows(layer, experts, rows, submitted)
                maps.append(dict(zip(experts, rows)))
            self._wait_all(submitted)
            for layer in range(self.num_layers):
                table = [-1] * self.num_experts
                for e, r in maps[layer].items():
                    table[e] = r
                tables.append(self.transport.upload_table(table))
            self.transport.after_publish()
        except Exception as exc:
            raise CacheConfigError(f"startup: loading the first generation failed ({type(exc).__name__}: {exc})") \
                from exc
        self._current = Generation(1, tuple(MappingProxyType(m) for m in maps), tuple(tables))
        for layer in range(self.num_layers):
            for r in maps[layer].values():
                self._since[layer][r] = 1
            self.policy.touch(layer, maps[layer], 0)

    def replace_policy(self, policy) -> None:
        """Use another eviction policy (a name or an EvictionPolicy) from now on, told the startup residency as the
        first one was. Only before the first request: a policy's history is the uses it saw, and a new one would
        miss them (the engine calls it when placement auto becomes host-read, whose promotions count uses)."""
        with self._lock:
            if self.counters["requests_admitted"] or self._tick:  # (a prefetch or promotion ticks the clock too)
                raise CacheConfigError("replace_policy: the eviction policy can change only before the first request "
                                       f"({self.counters['requests_admitted']} admitted, clock at {self._tick})")
            self.policy = make_policy(policy)
            for layer in range(self.num_layers):
                self.policy.touch(layer, self._current.maps[layer], 0)

    def lend_spares(self, keep: int) -> int:
        """Placement host-read (and two-site) only: keep ``keep`` spare rows per layer and count the rest as resident
        capacity, in the same storage (rows per layer, device bytes and row tables unchanged). Why: those placements
        never run a miss transaction in a step or a prompt pass (absent experts are read over the link), so the
        spares that receive a routed group of misses (max_group of them) sit idle; only promotions move experts, one
        per layer at a time. The new capacity is filled by promotions (a layer below its capacity promotes its
        hottest host-read expert at each step, ``promote``); max_group becomes ``keep`` (a lease of more would now be
        refused, never left waiting for rows that do not exist). Resident capacity stays below the layer's experts
        (the cache stays partial). Only before the first request, as ``replace_policy``. Returns the new resident
        count per layer."""
        with self._lock:
            if self.full_residency:
                raise CacheConfigError("lend_spares: full residency has no spare rows")
            if self.counters["requests_admitted"] or self._tick or self._in_txn:
                raise CacheConfigError("lend_spares: spare rows can be lent only before the first request "
                                       f"({self.counters['requests_admitted']} admitted, clock at {self._tick})")
            if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
                raise CacheConfigError(f"lend_spares: keep={keep!r} must be an integer >= 1 (a promotion needs a spare)")
            keep = min(keep, self.spares)
            resident = min(self.rows_per_layer - keep, self.num_experts - 1)
            if resident <= self.resident:
                return self.resident
            self.lent_rows = resident - self.resident
            self.resident, self.spares = resident, self.rows_per_layer - resident
            self.max_group = min(self.max_group, self.spares)
            return self.resident

    # --- inspection -------------------------------------------------------------------------------------
    def row_states(self, layer: int) -> dict[str, list[int]]:
        """Rows of ``layer`` by state (published, free, fenced, retiring); used by checks and tests."""
        return {
            "published": sorted(self._current.maps[layer].values()),
            "free": sorted(self._free[layer]),
            "fenced": sorted(r for r, _ in self._fenced[layer]),
            "retiring": sorted(r for r, *_ in self._retiring[layer]),
        }

    def leased_experts(self, layer: int) -> set[int]:
        return {e for e, c in self._leased[layer].items() if c > 0}

    def outstanding_leases(self) -> int:
        """Leases held by admitted requests that were not released yet."""
        with self._lock:
            return sum(len(r.leases) for r in self._requests.values())

    def live_requests(self) -> int:
        with self._lock:
            return len(self._requests)

    def staging_free(self) -> int:
        """Staging buffers a transaction could take now without waiting: not reserved, last copy complete."""
        with self._lock:
            return sum(1 for b in self._staging
                       if b.event is not _RESERVED and (b.event is None or self.transport.query(b.event)))

    def staging_reserved(self) -> int:
        """Staging buffers held by a running transaction (0 whenever no transaction runs)."""
        with self._lock:
            return sum(1 for b in self._staging if b.event is _RESERVED)

    def telemetry(self) -> dict:
        """Counters, capacity and the required-zero observations (schemas/observations.schema.json
        ``$defs/cache_telemetry``)."""
        with self._lock:
            obs = cache_observations(self.transport, self.host, self.copy_monitor)
            c = dict(self.counters)
            c["generations"] = self._current.number
            c["bytes_h2d_transport"] = self.transport.h2d_bytes
            c["leases_outstanding"] = sum(len(r.leases) for r in self._requests.values())
            c["staging_free"] = self.staging_free()
            if self.copy_monitor is not None:  # counted only where an instrument would have seen one
                c["writebacks"] = self.copy_monitor.writebacks
                c["bytes_d2h"] = self.copy_monitor.d2h_bytes
            return {
                "contract": self.contract,
                "state": self.state,
                "regime": "full" if self.full_residency else "partial",
                "device": str(self.device),
                "transport": self.transport.describe(),
                "policy": self.policy.name,
                "capacity": {
                    "num_layers": self.num_layers, "num_experts": self.num_experts, "row_bytes": self.row_bytes,
                    "resident": self.resident, "spares": self.spares, "staging": self.staging,
                    "max_group": self.max_group, "device_bytes": self.device_bytes,
                    "staging_bytes": self.staging_bytes, "host_source_bytes": self.host.nbytes,
                },
                "counters": c,
                "observations": obs,
                "observations_all_zero": all_zero(obs),
                "fault": None if self._faulted is None else f"{type(self._faulted).__name__}: {self._faulted}",
            }
