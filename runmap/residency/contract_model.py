"""Hypothesis contract model of resident-qpacked-cache-v1 (docs/cache-contract.md).

A ``RuleBasedStateMachine`` drives an ``ExpertCache`` through a ``ControlledTransport`` (copy
completions deferred, completed late and out of order, failures injected at every step) and checks
it after every rule against a plain-Python reference model of generations, pins, leases and row
states. ``make_machine`` builds the machine for a cache class (the real one or a deliberately broken
mutant from ``MUTANTS``) and a device; ``run_contract`` runs it with an example budget and returns
statistics for ``runmap contract``.

Used by ``runmap contract`` and by tests/test_contract_model.py (which also asserts that every
mutant is caught).
"""
from __future__ import annotations

import dataclasses
import hashlib
import random
from collections import Counter

import torch
from hypothesis import HealthCheck, Phase, seed as hyp_seed, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

try:  # lets the seed be set on the generated test; fall back to the public runner on older Hypothesis
    from hypothesis.stateful import get_state_machine_test
except ImportError:  # pragma: no cover
    get_state_machine_test = None

from runmap.residency.cache import CacheBusyError, CacheFaultedError, ExpertCache, TransactionAborted
from runmap.residency.observations import REQUIRED_ZERO
from runmap.format.qpack import RowLayout
from runmap.residency.transport import Event, Transport, TransferError, default_transport


class ContractViolation(AssertionError):
    """The cache broke a rule of resident-qpacked-cache-v1."""


def check(cond: bool, msg: str) -> None:
    if not cond:
        raise ContractViolation(msg)


# ---------------------------------------------------------------------------------------------------
# An in-memory pack with the runmap.format.packfile.PackReader API (counts bytes and refuses reads once closed)
# ---------------------------------------------------------------------------------------------------
class InMemoryPackClosed(RuntimeError):
    pass


class InMemoryPack:
    """rows: per layer uint8 (E, row_bytes) CPU tensors. Hashes are computed here, 'at pack time'."""

    def __init__(self, rows: list[torch.Tensor], layout: RowLayout):
        self.layout = layout
        self._rows = [r.clone() for r in rows]
        self.num_layers, self.num_experts = len(rows), rows[0].shape[0]
        self._sha = [[hashlib.sha256(memoryview(r[e].numpy())).hexdigest() for e in range(r.shape[0])]
                     for r in self._rows]
        self.identity = hashlib.sha256("".join(h for hs in self._sha for h in hs).encode()).hexdigest()
        self.bytes_read = 0
        self.reads_after_close = 0
        self.closed = False

    def read_expert_rows(self, layer):
        if self.closed:
            self.reads_after_close += 1
            raise InMemoryPackClosed(f"in-memory pack is closed: refused read of layer {layer}")
        self.bytes_read += self._rows[layer].numel()
        return self._rows[layer].clone()  # (E, row_bytes)

    def expert_sha256(self, layer):
        return list(self._sha[layer])

    def close(self):
        self.closed = True


# ---------------------------------------------------------------------------------------------------
# The controllable transport
# ---------------------------------------------------------------------------------------------------
GARBAGE = 0xA5
FAIL_KINDS = ("stage", "submit", "copy", "table", "after_publish")


class _FakeEvent(Event):
    __slots__ = ("id", "dst", "staging", "state", "inner", "fail")

    def __init__(self, eid, dst, staging, nbytes):
        super().__init__(None, nbytes)
        self.id, self.dst, self.staging, self.state, self.inner, self.fail = eid, dst, staging, "pending", None, False


class ControlledTransport(Transport):
    """Wraps a real transport; the test decides when each copy completes and which step fails.

    deferred=True: the bytes move only when the event completes (worst case for staging reuse and
    early publication). deferred=False: the real copy is issued at once (CUDA: on the real transfer
    stream) and the event completes when the test releases it *and* the real event has completed.
    ``arm(kind, k)`` makes the k-th operation of ``kind`` after arming fail: "stage", "submit",
    "copy" (the k-th copy completes with an error and garbage in its row), "table", "after_publish".
    """

    def __init__(self, inner: Transport, deferred: bool = True, rng: random.Random | None = None):
        super().__init__(inner.device)
        self.inner, self.deferred = inner, deferred
        self.rng = rng or random.Random(0)
        self.pending: list[_FakeEvent] = []
        self.events: list[_FakeEvent] = []
        self.staging_violations = 0
        self.out_of_order = 0
        self.armed: tuple[str, int] | None = None
        self.counts = Counter()
        self.fired: str | None = None

    # failure control ---------------------------------------------------------------------------------
    def arm(self, kind: str | None, k: int = 0) -> None:
        self.armed, self.counts, self.fired = ((kind, k) if kind else None), Counter(), None

    def _hit(self, kind: str) -> bool:
        if self.armed is None or self.armed[0] != kind:
            return False
        n = self.counts[kind]
        self.counts[kind] += 1
        if n == self.armed[1]:
            self.fired, self.armed = kind, None
            return True
        return False

    # allocation delegates --------------------------------------------------------------------------------
    def alloc_storage(self, rows, row_bytes):
        return self.inner.alloc_storage(rows, row_bytes)

    def alloc_staging(self, row_bytes):
        return self.inner.alloc_staging(row_bytes)

    # data movement ---------------------------------------------------------------------------------------
    def stage(self, staging, host_row):
        ptr = staging.data_ptr()
        if any(ev.staging.data_ptr() == ptr for ev in self.pending):
            self.staging_violations += 1  # rewriting a buffer a copy has not finished reading
        if self._hit("stage"):
            raise TransferError("injected failure: host -> staging copy")
        self.inner.stage(staging, host_row)
        self.stage_bytes += host_row.numel()

    def h2d(self, dst_row, staging):
        if self._hit("submit"):
            raise TransferError("injected failure: submitting the staging -> device copy")
        ev = _FakeEvent(len(self.events), dst_row, staging, staging.numel())
        ev.fail = self._hit("copy")
        if not self.deferred:
            ev.inner = self.inner.h2d(dst_row, staging)
        self.events.append(ev)
        self.pending.append(ev)
        self.h2d_bytes += staging.numel()
        return ev

    def _complete(self, ev: _FakeEvent) -> None:
        if ev.state != "pending":
            return
        if self.deferred:
            ev.inner = self.inner.h2d(ev.dst, ev.staging)
        self.inner.wait(ev.inner)
        if ev.fail:
            ev.dst.fill_(GARBAGE)  # a failed copy leaves undefined bytes behind
        ev.state = "failed" if ev.fail else "done"
        self.pending.remove(ev)

    def complete_some(self, n: int) -> int:
        """Complete up to n pending copies in random order (late completions). Returns how many."""
        picks = self.rng.sample(self.pending, min(n, len(self.pending)))
        for ev in picks:
            self._complete(ev)
        return len(picks)

    def query(self, ev):
        return ev.state != "pending"

    def wait(self, ev):
        if ev.state == "pending":
            others = [o for o in self.pending if o is not ev]
            for o in self.rng.sample(others, self.rng.randint(0, len(others))):
                self._complete(o)  # other copies finish first: completions out of order
                self.out_of_order += 1
            self._complete(ev)
        if ev.state == "failed":
            raise TransferError(f"injected failure: copy {ev.id} completed with an error")

    def note_release(self):
        self.inner.note_release()

    def upload_table(self, table):
        if self._hit("table"):
            raise TransferError("injected failure: uploading the row table")
        self.table_uploads += 1
        return self.inner.upload_table(table)

    def after_publish(self):
        if self._hit("after_publish"):
            raise TransferError("injected ambiguous failure after publication")
        self.inner.after_publish()

    def describe(self):
        return {"kind": "ControlledTransport", "deferred": self.deferred, "inner": self.inner.describe()}


# ---------------------------------------------------------------------------------------------------
# Deliberately broken caches: the model must catch every one (tests/test_contract_model.py)
# ---------------------------------------------------------------------------------------------------
class PublishBeforeTransfer(ExpertCache):
    """Publishes the group without waiting for its copies."""

    def _wait_all(self, submitted):
        return None


class RecycleWithLiveLease(ExpertCache):
    """Recycles victim rows at once, even while a live request can still read them."""

    def _visible(self, since, until):
        return False


class ReuseStagingEarly(ExpertCache):
    """Reuses a staging buffer without waiting for the copy that reads it."""

    def _take_staging(self):
        return self._use_staging(self._staging[-1])


class NoFenceOnAbort(ExpertCache):
    """Returns an aborted transaction's rows to the spares while their copies are still running."""

    def _abort(self, layer, rows, submitted):
        self.counters["transactions_aborted"] += 1
        self._free[layer].extend(rows)


class EvictLeased(ExpertCache):
    """Evicts experts that live leases read (only the group being published is protected)."""

    def _protected(self, layer, group):
        return set(group)


class IgnoreAmbiguousFailure(ExpertCache):
    """Reports the failure after publication but keeps admitting requests."""

    def _fault(self, exc):
        self.counters["faults"] += 1


MUTANTS = {
    "publish-before-transfer": PublishBeforeTransfer,
    "recycle-with-live-lease": RecycleWithLiveLease,
    "reuse-staging-early": ReuseStagingEarly,
    "no-fence-on-abort": NoFenceOnAbort,
    "evict-leased": EvictLeased,
    "ignore-ambiguous-failure": IgnoreAmbiguousFailure,
}


# ---------------------------------------------------------------------------------------------------
# Statistics collected for the report
# ---------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class ContractStats:
    examples: int = 0
    steps: int = 0
    rules: Counter = dataclasses.field(default_factory=Counter)
    invariants: Counter = dataclasses.field(default_factory=Counter)
    outcomes: Counter = dataclasses.field(default_factory=Counter)
    configs: Counter = dataclasses.field(default_factory=Counter)
    progress: object = None  # anything with .update(n) (a tqdm bar), advanced once per example


INVARIANTS = (
    "leased_rows_hold_expert_bytes", "published_within_capacity", "rows_conserved", "no_early_staging_reuse",
    "generations_strictly_increase", "abort_keeps_generation", "faulted_admits_nothing",
    "required_zero_observations", "lease_gets_exactly_its_group", "eviction_respects_leases",
    "spares_only_from_free_rows",
)


# ---------------------------------------------------------------------------------------------------
# The state machine
# ---------------------------------------------------------------------------------------------------
class _Req:
    def __init__(self, handle, gen):
        self.handle, self.gen, self.pins, self.leases = handle, gen, {gen}, []


class CacheContractMachine(RuleBasedStateMachine):
    cache_cls = ExpertCache
    device = "cpu"
    stats: ContractStats = ContractStats()

    def __init__(self):
        super().__init__()
        self.cache = None
        self.stats.examples += 1
        if self.stats.progress is not None:
            self.stats.progress.update(1)

    # --- setup --------------------------------------------------------------------------------------------
    @initialize(data=st.data())
    def setup(self, data):
        d = data.draw
        layers = d(st.integers(1, 2), label="layers")
        experts = d(st.integers(2, 8), label="experts")
        max_group = d(st.integers(1, min(4, experts)), label="max_group")
        if max_group == 1 and experts > 2:  # groups of one expert cannot leave copies in flight; keep them rare
            max_group = d(st.integers(1, min(4, experts)), label="max_group_again")
        full = d(st.integers(0, 3), label="full") == 0 if experts <= 4 else False  # mostly partial: misses
        resident = experts if full else d(st.integers(max_group, max(max_group, experts - 1)), label="resident")
        full = resident == experts
        spares = d(st.integers(0, 1), label="spares") if full else d(st.integers(max_group, max_group + 3),
                                                                    label="spares")
        staging = d(st.integers(1, 3), label="staging") if full else d(st.integers(max_group, max_group + 2),
                                                                      label="staging")
        self.policy = d(st.sampled_from(["lru", "lfu-decay"]), label="policy")
        prefill = d(st.booleans(), label="prefill")
        deferred = d(st.booleans(), label="deferred") if self.device != "cpu" else True
        rng = d(st.randoms(use_true_random=False), label="rng")
        self.layout = RowLayout.build(8, 4, 4)  # 6 sections x 128-byte alignment: 768-byte rows
        g = torch.Generator().manual_seed(d(st.integers(0, 2**16), label="bytes_seed"))
        rows = [torch.randint(0, 256, (experts, self.layout.row_bytes), dtype=torch.uint8, generator=g)
                for _ in range(layers)]
        self.pack = InMemoryPack(rows, self.layout)
        self.transport = ControlledTransport(default_transport(self.device), deferred=deferred, rng=rng)
        self.cache = self.cache_cls.from_pack(self.pack, resident=resident, spares=spares, staging=staging,
                                              max_group=max_group, device=self.device, policy=self.policy,
                                              transport=self.transport, prefill=prefill)
        self.expected = torch.stack(rows).to(self.cache.device)  # (L, E, row_bytes) reference bytes
        self.L, self.E, self.R = layers, experts, resident + spares
        self.resident, self.max_group = resident, max_group
        # reference model ------------------------------------------------------------------------------
        self.gen = self.cache.generation
        self.history = {self.gen: tuple(self.cache.mapping(lay) for lay in range(layers))}
        self.since = [{r: self.gen for r in self.history[self.gen][lay].values()} for lay in range(layers)]
        self.retiring = [[] for _ in range(layers)]  # (row, since, until)
        self.fenced = [[] for _ in range(layers)]  # (row, fake event)
        self.reqs: dict[int, _Req] = {}
        self.faulted = False
        self.last_use = {(lay, e): 0 for lay in range(layers) for e in self.history[self.gen][lay]}
        self.clock = 0
        self.stats.configs["full" if full else "partial"] += 1
        self.stats.configs[self.policy] += 1
        self.stats.configs["deferred" if deferred else "immediate"] += 1
        if full or prefill:
            check(self.gen == 1, f"startup published generation {self.gen}, expected 1")
        if full:
            check(all(len(self.history[1][lay]) == experts for lay in range(layers)),
                  "full residency: generation 1 does not map every expert")

    # --- model helpers ------------------------------------------------------------------------------------
    def _live_pins(self):
        return Counter(g for r in self.reqs.values() for g in r.pins)

    def _visible_retiring(self, layer):
        pins = self._live_pins()
        return [(row, a, b) for row, a, b in self.retiring[layer] if any(a <= g < b for g in pins)]

    def _pending_fenced(self, layer):
        return [(row, ev) for row, ev in self.fenced[layer] if ev.state == "pending"]

    def _model_free(self, layer):
        used = set(self.history[self.gen][layer].values())
        used |= {row for row, *_ in self._visible_retiring(layer)}
        used |= {row for row, _ in self._pending_fenced(layer)}
        return set(range(self.R)) - used

    def _leased(self, layer):
        return {e for r in self.reqs.values() for lay, grp, _g in r.leases if lay == layer for e in grp}

    def _note(self, name):
        self.stats.invariants[name] += 1

    def _step(self, name):
        self.stats.rules[name] += 1
        self.stats.steps += 1

    # --- rules --------------------------------------------------------------------------------------------
    @precondition(lambda self: self.cache is not None and len(self.reqs) < 3)
    @rule()
    def admit(self):
        self._step("admit")
        if self.faulted:
            try:
                self.cache.admit()
            except CacheFaultedError:
                self._note("faulted_admits_nothing")
                self.stats.outcomes["admit_refused_faulted"] += 1
                return
            raise ContractViolation("a FAULTED cache admitted a request")
        req = self.cache.admit()
        check(req.generation == self.gen, f"admission captured generation {req.generation}, current is {self.gen}")
        self.reqs[req.id] = _Req(req, self.gen)

    @precondition(lambda self: bool(self.reqs))
    @rule(data=st.data())
    def acquire(self, data):
        self._step("acquire")
        d = data.draw
        rid = d(st.sampled_from(sorted(self.reqs)), label="request")
        r = self.reqs[rid]
        layer = d(st.integers(0, self.L - 1), label="layer")
        top_k = d(st.integers(1, self.max_group), label="top_k")
        batch = d(st.lists(st.lists(st.integers(0, self.E - 1), min_size=top_k, max_size=top_k, unique=True),
                           min_size=1, max_size=3), label="batch")
        order = list(dict.fromkeys(e for row in batch for e in row))
        group = tuple(sorted(order[: self.max_group]))  # the engine sizes max_group = top_k x batch
        ids = [e for row in batch for e in row if e in group]
        gen_before = self.cache.generation
        # predict --------------------------------------------------------------------------------------
        cur_map = self.history[self.gen][layer]
        req_map = self.history[r.gen][layer]
        if self.faulted:
            expect = "faulted"
        elif all(e in req_map for e in group):
            expect, lease_gen = "hit", r.gen
        elif all(e in cur_map for e in group):
            expect, lease_gen = "hit", self.gen
        else:
            missing = [e for e in group if e not in cur_map]
            n_evict = len(cur_map) + len(missing) - self.resident
            candidates = [e for e in cur_map if e not in group and e not in self._leased(layer)]
            free = self._model_free(layer)
            if n_evict > len(candidates) or len(missing) > len(free):
                expect = "busy"
            else:
                expect = "miss"
                # a failure is drawn only for a transaction, so every injection meets a transaction
                fail = d(st.one_of(st.none(), st.sampled_from(FAIL_KINDS)), label="fail")
                if fail is not None:  # k-th operation of that kind; table and after_publish happen once
                    fail = (fail, d(st.sampled_from([0, 1, 1, 2]), label="k") if fail in ("stage", "submit", "copy")
                            else 0)
                self.transport.arm(*(fail or (None,)))
                if fail:
                    self.stats.rules[f"inject_{fail[0]}"] += 1
                kind, k = fail if fail else (None, 0)
                if kind in ("stage", "submit", "copy") and k < len(missing):
                    expect = "abort"
                elif kind == "table" and k == 0:
                    expect = "abort"
                elif kind == "after_publish" and k == 0:
                    expect = "fault"
        n_events = len(self.transport.events)
        # act ------------------------------------------------------------------------------------------
        try:
            lease = r.handle.acquire(layer, torch.tensor(ids))
            got = "ok"
        except CacheFaultedError:
            got = "faulted" if expect == "faulted" else "fault"
        except TransactionAborted:
            got = "abort"
        except CacheBusyError:
            got = "busy"
        except ContractViolation:
            raise
        except Exception as exc:  # anything else is a contract violation, not a test error
            raise ContractViolation(f"acquire raised {type(exc).__name__}: {exc}") from exc
        self.transport.arm(None)
        self.stats.outcomes[got if got != "ok" else expect] += 1
        if expect in ("hit", "miss"):
            check(got == "ok", f"layer {layer} group {group}: expected a lease ({expect}), got {got} "
                               "(a request lost its experts)")
        else:
            check(got == expect, f"layer {layer} group {group}: expected {expect}, got {got}")
        if got in ("busy", "abort", "faulted"):
            check(self.cache.generation == gen_before, f"{got}: generation moved {gen_before} -> "
                                                       f"{self.cache.generation}")
            if got == "abort":
                self._note("abort_keeps_generation")
                left = [ev for ev in self.transport.events[n_events:] if ev.state == "pending"]
                for ev in left:
                    self.fenced[layer].append((self._row_of(layer, ev.dst), ev))
                if left:
                    self.stats.outcomes["abort_with_copies_in_flight"] += 1
            return
        # the transaction published (miss or fault): check the transition -------------------------------
        if expect in ("miss", "fault"):
            self._check_publication(layer, group, missing, n_evict, cur_map)
        if got == "fault":
            self.faulted = True
            return
        check(lease.experts == group, f"lease experts {lease.experts} != requested group {group}")
        lease_gen = lease_gen if expect == "hit" else self.gen
        check(lease.generation == lease_gen, f"lease on generation {lease.generation}, expected {lease_gen}")
        gmap = self.history[lease_gen][layer]
        check(dict(lease.rows) == {e: gmap[e] for e in group},
              f"lease rows {dict(lease.rows)} differ from generation {lease_gen}'s mapping of {group}")
        table = lease.row_table.to("cpu").tolist()
        check(table == [gmap.get(e, -1) for e in range(self.E)],
              f"row table {table} != generation {lease_gen} mapping {gmap}")
        self._note("lease_gets_exactly_its_group")
        if lease_gen > r.gen:
            r.gen = lease_gen
        r.pins.add(lease_gen)
        r.leases.append((layer, group, lease_gen))
        self.clock += 1
        for e in group:
            self.last_use[(layer, e)] = self.clock

    def _row_of(self, layer, dst):
        base = self.cache.storage(layer)
        return (dst.data_ptr() - base.data_ptr()) // base.stride(0)

    def _check_publication(self, layer, group, missing, n_evict, cur_map):
        new_gen = self.gen + 1
        check(self.cache.generation == new_gen, f"publication: generation {self.cache.generation}, "
                                                f"expected {new_gen}")
        self._note("generations_strictly_increase")
        new_map = self.cache.mapping(layer)
        victims = set(cur_map) - set(new_map)
        check(set(new_map) == (set(cur_map) - victims) | set(group),
              f"published mapping {sorted(new_map)} is not old {sorted(cur_map)} - victims + group {group}")
        check(len(victims) == max(n_evict, 0), f"evicted {sorted(victims)}, expected {max(n_evict, 0)} victims")
        check(not victims & set(group), f"evicted {victims & set(group)} from the group being published")
        check(not victims & self._leased(layer), f"evicted {victims & self._leased(layer)} read by live leases")
        self._note("eviction_respects_leases")
        if self.policy == "lru" and victims:
            cand = [e for e in cur_map if e not in group and e not in self._leased(layer)]
            want = set(sorted(cand, key=lambda e: (self.last_use.get((layer, e), -1), e))[:n_evict])
            check(victims == want, f"LRU evicted {sorted(victims)}, reference LRU picks {sorted(want)}")
        for e in set(cur_map) - victims:
            check(new_map[e] == cur_map[e], f"expert {e} moved rows {cur_map[e]} -> {new_map[e]} on publication")
        new_rows = {new_map[e] for e in missing}
        free = self._model_free(layer)
        check(new_rows <= free, f"new rows {sorted(new_rows)} were not free spares (free: {sorted(free)})")
        self._note("spares_only_from_free_rows")
        for v in victims:
            self.retiring[layer].append((cur_map[v], self.since[layer].pop(cur_map[v]), new_gen))
        for e in missing:
            self.since[layer][new_map[e]] = new_gen
        self.history[new_gen] = tuple(new_map if lay == layer else self.history[self.gen][lay]
                                      for lay in range(self.L))
        self.gen = new_gen

    @precondition(lambda self: self.cache is not None and self.cache.full_residency and bool(self.reqs))
    @rule(data=st.data())
    def acquire_all(self, data):
        self._step("acquire_all")
        rid = data.draw(st.sampled_from(sorted(self.reqs)), label="request")
        layer = data.draw(st.integers(0, self.L - 1), label="layer")
        r = self.reqs[rid]
        if self.faulted:
            try:
                r.handle.acquire_all(layer)
            except CacheFaultedError:
                return
            raise ContractViolation("a FAULTED cache served acquire_all")
        lease = r.handle.acquire_all(layer)
        check(lease.experts == tuple(range(self.E)) and lease.generation == r.gen == 1,
              f"full residency acquire_all: experts {lease.experts} generation {lease.generation}")
        check(torch.equal(self.cache.static_row_table(layer), lease.row_table), "static row table differs")
        self._note("lease_gets_exactly_its_group")
        r.leases.append((layer, lease.experts, lease.generation))

    @precondition(lambda self: bool(self.reqs))
    @rule(data=st.data())
    def release(self, data):
        self._step("release")
        rid = data.draw(st.sampled_from(sorted(self.reqs)), label="request")
        self.reqs.pop(rid).handle.release()

    @precondition(lambda self: self.cache is not None and bool(self.transport.pending))
    @rule(n=st.integers(1, 4), fail=st.booleans())
    def complete_late(self, n, fail):
        """Copies of aborted transactions finish later, in any order, possibly with an error."""
        self._step("complete_late")
        if fail:
            self.transport.rng.choice(self.transport.pending).fail = True
            self.stats.rules["complete_late_with_error"] += 1
        self.transport.complete_some(n)

    # --- invariants ---------------------------------------------------------------------------------------
    @invariant()
    def leased_rows_hold_expert_bytes(self):
        """Every row reachable from a pinned generation (or the current one) holds its expert's bytes."""
        if self.cache is None:
            return
        gens = set(self._live_pins()) | {self.gen}
        for g in gens:
            for layer in range(self.L):
                m = self.history[g][layer]
                if not m:
                    continue
                experts = torch.tensor(sorted(m), device=self.expected.device)
                rows = torch.tensor([m[e] for e in sorted(m)], device=self.expected.device)
                got = self.cache.storage(layer).index_select(0, rows)  # (n, row_bytes)
                want = self.expected[layer].index_select(0, experts)  # (n, row_bytes)
                if not torch.equal(got, want):
                    bad = [e for e, ok in zip(sorted(m), (got == want).all(dim=1).tolist()) if not ok]
                    raise ContractViolation(f"generation {g} layer {layer}: rows of experts {bad} do not hold "
                                            "their expert's bytes")
        self._note("leased_rows_hold_expert_bytes")

    @invariant()
    def capacity_and_conservation(self):
        if self.cache is None:
            return
        for layer in range(self.L):
            st_ = self.cache.row_states(layer)
            check(len(st_["published"]) <= self.resident,
                  f"layer {layer}: {len(st_['published'])} published rows > resident {self.resident}")
            all_rows = st_["published"] + st_["free"] + st_["fenced"] + st_["retiring"]
            check(sorted(all_rows) == list(range(self.R)),
                  f"layer {layer}: rows not conserved: {st_} (total {self.R})")
            check(sorted(self.history[self.gen][layer].values()) == st_["published"],
                  f"layer {layer}: published rows {st_['published']} differ from the model")
            vis = sorted(row for row, *_ in self._visible_retiring(layer))
            check(vis == st_["retiring"], f"layer {layer}: retiring rows {st_['retiring']}, model says {vis}")
            pend = {row for row, _ in self._pending_fenced(layer)}
            check(not pend & set(st_["free"]), f"layer {layer}: rows {sorted(pend & set(st_['free']))} are free "
                                               "while a copy into them is still running")
        self._note("published_within_capacity")
        self._note("rows_conserved")

    @invariant()
    def staging_and_observations(self):
        if self.cache is None:
            return
        check(self.transport.staging_violations == 0,
              f"{self.transport.staging_violations} staging buffers rewritten before their copy completed")
        self._note("no_early_staging_reuse")
        tel = self.cache.telemetry()
        for name in REQUIRED_ZERO:
            o = tel["observations"][name]
            check(o["status"] == "OBSERVED" and o["value"] == 0, f"observation {name} = {o}")
        check(self.pack.reads_after_close == 0, "the pack was read after startup")
        self._note("required_zero_observations")
        check(tel["state"] == ("FAULTED" if self.faulted else "READY"),
              f"cache state {tel['state']}, model faulted={self.faulted}")
        if self.faulted:
            self._note("faulted_admits_nothing")
        check(tel["counters"]["generations"] == self.gen, "generation counter differs from the model")


def make_machine(cache_cls=ExpertCache, device: str = "cpu", stats: ContractStats | None = None):
    """A CacheContractMachine subclass bound to a cache class, a device and a stats object."""
    return type(f"CacheContract_{cache_cls.__name__}", (CacheContractMachine,),
                {"cache_cls": cache_cls, "device": device, "stats": stats or ContractStats()})


def contract_settings(examples: int, steps: int, **kw) -> settings:
    return settings(max_examples=examples, stateful_step_count=steps, deadline=None, database=None,
                    suppress_health_check=list(HealthCheck), report_multiple_bugs=False, **kw)


def run_contract(examples: int = 100, steps: int = 30, seed: int = 0, device: str = "cpu",
                 cache_cls=ExpertCache, shrink: bool = True, progress=None) -> tuple[ContractStats, BaseException | None]:
    """Run the state machine; returns (stats, the failure or None)."""
    stats = ContractStats(progress=progress)
    machine = make_machine(cache_cls, device, stats)
    phases = [Phase.generate] + ([Phase.shrink] if shrink else [])
    cfg = contract_settings(examples, steps, phases=phases)
    if get_state_machine_test is not None:
        test = hyp_seed(seed)(get_state_machine_test(machine, settings=cfg))
    else:  # pragma: no cover
        from hypothesis.stateful import run_state_machine_as_test

        def test():
            run_state_machine_as_test(machine, settings=cfg)
    try:
        test()
    except BaseException as exc:  # the failure is reported, not swallowed
        if isinstance(exc, KeyboardInterrupt):
            raise
        return stats, exc
    return stats, None


__all__ = ["CacheContractMachine", "ControlledTransport", "ContractStats", "ContractViolation", "InMemoryPack",
           "INVARIANTS", "MUTANTS", "make_machine", "run_contract"]
