"""Unit tests of the expert cache (runmap/residency/cache.py) and its host source, beyond the contract model."""
import random

import numpy as np
import pytest
import torch

from runmap.residency.cache import (CacheBusyError, CacheConfigError, CacheError, CacheFaultedError, ExpertCache,
                                    TransactionAborted)
from runmap.residency.contract_model import ControlledTransport, InMemoryPack
from runmap.residency.eviction import LFUDecayPolicy, LRUPolicy, make_policy
from runmap.residency.host_source import HostSource, HostSourceError, HostSourceRewriteError
from runmap.residency.observations import all_zero
from runmap.format.qpack import RowLayout
from runmap.residency.transport import CpuDirectTransport, CpuTransport, Event, TransferError, Transport

LAYOUT = RowLayout.build(8, 4, 4)


def _rows(layers=2, experts=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (experts, LAYOUT.row_bytes), dtype=torch.uint8, generator=g) for _ in range(layers)]


def _cache(rows=None, transport=None, **kw):
    rows = rows if rows is not None else _rows()
    pack = InMemoryPack(rows, LAYOUT)
    kw.setdefault("resident", 3)
    kw.setdefault("max_group", 2)
    return ExpertCache.from_pack(pack, transport=transport, **kw), pack, rows


def _assert_lease_bytes(lease, rows):
    for e, r in lease.rows.items():
        assert torch.equal(lease.storage[r], rows[lease.layer][e]), f"expert {e} row {r}"
        assert int(lease.row_table[e]) == r


# --- host source --------------------------------------------------------------------------------------
def test_host_source_is_a_private_read_only_copy():
    rows = _rows(1, 4)
    src = HostSource.from_rows(rows, LAYOUT)
    rows[0][1].fill_(0)  # the caller's tensor changes; the host source must not
    assert not np.array_equal(src.expected_row(0, 1), rows[0][1].numpy())
    with pytest.raises(ValueError):
        src.array[0, 0, 0] = 1  # numpy refuses: read-only
    with pytest.raises(HostSourceRewriteError):
        src.write_row(0, 0, b"x")
    assert src.rewrite_attempts == 1


def test_host_source_verifies_hashes_once_and_names_the_expert():
    rows = _rows(2, 3)
    pack = InMemoryPack(rows, LAYOUT)
    bad = [pack.expert_sha256(0), pack.expert_sha256(1)]
    bad[1][2] = "0" * 64
    with pytest.raises(HostSourceError, match="layer 1 expert 2 sha256"):
        HostSource.from_rows(rows, LAYOUT, sha256=bad)
    src = HostSource.from_pack(pack)
    assert src.hash_ops_startup == 6 and src.hash_ops_after_seal == 0
    assert pack.closed
    with pytest.raises(Exception):
        pack.read_expert_rows(0)
    assert pack.reads_after_close == 1


def test_host_source_rejects_wrong_row_shape():
    with pytest.raises(HostSourceError, match="layer 1 expert rows"):
        HostSource.from_rows([torch.zeros(3, LAYOUT.row_bytes, dtype=torch.uint8),
                              torch.zeros(3, LAYOUT.row_bytes + 1, dtype=torch.uint8)], LAYOUT)


# --- startup refusals ------------------------------------------------------------------------------------
@pytest.mark.parametrize("kw, msg", [
    (dict(resident=3, spares=1, max_group=2), "spares=1 per layer cannot receive the largest routed group of 2"),
    (dict(resident=3, staging=1, max_group=2), "staging=1 pinned buffers cannot stage the largest routed group of 2"),
    (dict(resident=2, max_group=3), "resident=2 rows per layer cannot publish the largest routed group of 3"),
    (dict(resident=3, max_group=2, budget_bytes=1000), r"device budget too small: .* = \d+ bytes needed"),
    (dict(resident=7, max_group=2), r"resident=7 must be in \[1, 6\]"),
])
def test_startup_refuses_insufficient_capacity(kw, msg):
    with pytest.raises(CacheConfigError, match=msg):
        _cache(**kw)


def test_largest_group_is_capped_by_experts_per_layer():
    cache, _, _ = _cache(resident=6, max_group=64)  # top_k x batch > experts: full residency suffices
    assert cache.max_group == 6 and cache.full_residency


# --- full residency ----------------------------------------------------------------------------------------
def test_full_residency_one_generation_no_misses():
    cache, _, rows = _cache(resident=6, max_group=4)
    assert cache.generation == 1
    moved = cache.counters["bytes_h2d"]
    assert moved == 2 * 6 * LAYOUT.row_bytes
    with cache.admit() as req:
        for layer in range(2):
            lease = req.acquire_all(layer)
            _assert_lease_bytes(lease, rows)
            assert torch.equal(cache.static_row_table(layer), lease.row_table)
            _assert_lease_bytes(req.acquire(layer, torch.tensor([[5, 0], [0, 3]])), rows)
    assert cache.generation == 1 and cache.counters["bytes_h2d"] == moved and cache.counters["misses"] == 0
    tel = cache.telemetry()
    assert tel["regime"] == "full" and all_zero(tel["observations"])


# --- the CPU transports ------------------------------------------------------------------------------------
@pytest.mark.parametrize("cls", [CpuTransport, CpuDirectTransport])
def test_cpu_transports_move_the_host_rows_and_count_what_they_move(cls):
    """v1 (CpuTransport) stages each row and copies it; v2 (CpuDirectTransport) copies the host-source row itself
    and its staging slots are one-byte tokens. Either counts the bytes it moves and the row tables it uploads
    (int32, -1 where unmapped); every CPU copy is complete when it returns."""
    tr = cls()
    cache, _, rows = _cache(transport=tr)  # 2 layers of 6 experts, 3 resident (prefilled), groups of 2
    startup = 2 * 3 * LAYOUT.row_bytes
    assert tr.h2d_bytes == startup and tr.stage_bytes == (0 if tr.direct else startup)
    assert tr.table_uploads == 2 + 2  # per layer: generation 0's empty table, generation 1's
    assert cache.staging_bytes == (cache.staging if tr.direct else cache.staging * LAYOUT.row_bytes)
    with cache.admit() as r:
        lease = r.acquire(1, [4, 5])
        _assert_lease_bytes(lease, rows)
        table = [-1] * 6
        for e, row in cache.mapping(1).items():
            table[e] = row
        assert lease.row_table.dtype == torch.int32 and lease.row_table.tolist() == table
    moved = startup + 2 * LAYOUT.row_bytes
    assert tr.h2d_bytes == moved == cache.telemetry()["counters"]["bytes_h2d_transport"]
    assert tr.stage_bytes == (0 if tr.direct else moved) and tr.table_uploads == 5
    assert cache.staging_free() == cache.staging and cache.row_states(1)["fenced"] == []
    if tr.direct:
        slot = tr.alloc_staging(LAYOUT.row_bytes)
        assert slot.dtype == torch.uint8 and slot.nbytes == 1  # a one-byte token, not a buffer
        with pytest.raises(TransferError, match="^contract v2 has no staging copy$"):
            tr.stage(tr.alloc_staging(LAYOUT.row_bytes), rows[0][0])


# --- partial residency ---------------------------------------------------------------------------------------
def test_miss_then_all_hit_moves_bytes_once():
    cache, _, rows = _cache()
    assert cache.mapping(0) == {0: 0, 1: 1, 2: 2}  # prefilled generation 1
    with cache.admit() as req:
        lease = req.acquire(1, torch.tensor([[4, 5], [5, 4]]))
        _assert_lease_bytes(lease, rows)
        assert lease.generation == 2 and lease.experts == (4, 5)
        moved = cache.counters["bytes_h2d"]
        lease2 = req.acquire(1, [5])
        assert lease2.generation == 2 and cache.counters["bytes_h2d"] == moved  # all-hit: no transfer
    assert cache.counters["misses"] == 2 and cache.counters["hits"] == 1


def test_lru_evicts_least_recent_and_never_a_leased_expert():
    cache, _, rows = _cache(resident=3, max_group=2)
    a = cache.admit()
    a.acquire(0, [0])  # expert 0 leased by a live request, and most recent use
    with cache.admit() as b:
        b.acquire(0, [3])  # evicts 1 (least recent of the unleased 1, 2)
    assert set(cache.mapping(0)) == {0, 2, 3}
    with cache.admit() as c:
        c.acquire(0, [4])  # 0 is leased, 2 is older than 3
    assert set(cache.mapping(0)) == {0, 3, 4}
    a.release()


def test_lfu_decay_keeps_the_frequent_expert():
    cache, _, _ = _cache(resident=3, max_group=1, policy="lfu-decay")
    for _ in range(5):
        with cache.admit() as r:
            r.acquire(0, [0])
    with cache.admit() as r:
        r.acquire(0, [1])
    with cache.admit() as r:
        r.acquire(0, [2])
    with cache.admit() as r:
        r.acquire(0, [3])  # LRU would evict 0 (never touched since); LFU evicts 1
    assert 0 in cache.mapping(0) and 1 not in cache.mapping(0)


def test_lru_evicts_the_least_recent_expert_not_the_lowest_id():
    cache, _, _ = _cache(resident=3, max_group=1)  # experts 0, 1, 2 prefilled (all used at tick 0)
    with cache.admit() as r:
        r.acquire(0, [0])  # 0 is now the most recent; 1 and 2 tie, the lower id goes first
    with cache.admit() as r:
        r.acquire(0, [3])
    assert set(cache.mapping(0)) == {0, 2, 3}
    with cache.admit() as r:
        r.acquire(0, [2])  # use order now 0, 3, 2
    with cache.admit() as r:
        r.acquire(0, [0])  # use order 3, 2, 0
    with cache.admit() as r:
        r.acquire(0, [4])  # evicts 3, the least recent; every acquisition is a later tick
    assert set(cache.mapping(0)) == {0, 2, 4}


def test_lru_policy_ranks_a_never_used_expert_first():
    p = LRUPolicy()
    p.touch(0, [1], 0)
    p.touch(0, [2], 3)
    p.touch(1, [3], 9)  # another layer's history does not count
    assert p.choose(0, [2, 1, 3], 2, 4) == [3, 1]


@pytest.mark.parametrize("tick, victim", [(100, 1), (102, 0)])
def test_lfu_decay_halves_a_score_every_64_ticks(tick, victim):
    """Expert 0 used 3 times at tick 0, expert 1 once at ``tick``: 3 * 2**(-tick/64) drops below 1 once tick
    passes 64 * log2(3) = 101.4, so the frequent expert is kept at tick 100 and evicted at tick 102."""
    p = LFUDecayPolicy()
    for _ in range(3):
        p.touch(0, [0], 0)
    p.touch(0, [1], tick)
    assert p.choose(0, [0, 1], 1, tick) == [victim]


def test_lfu_decay_breaks_ties_by_least_recent_use():
    p = LFUDecayPolicy(half_life=float("inf"))  # no decay: plain use counts
    p.touch(0, [0], 5)
    p.touch(0, [1], 1)
    assert p.choose(0, [0, 1], 1, 6) == [1]  # equal counts: expert 1 was used longer ago
    assert p.choose(0, [0, 1, 7], 1, 6) == [7]  # never used: the lowest score
    fast = LFUDecayPolicy(half_life=1e-3)  # a used expert's score underflows to 0.0: a tie with a never-used one
    fast.touch(0, [0], 0)
    assert fast.choose(0, [0, 7], 1, 10) == [7]  # the never-used expert counts as the least recent


def test_policy_arguments_are_checked():
    for bad in (0, -1.0):
        with pytest.raises(ValueError, match="half_life must be positive"):
            LFUDecayPolicy(bad)
    assert LFUDecayPolicy(0.5).choose(0, [4, 2], 1, 0) == [2]
    with pytest.raises(ValueError, match=r"unknown eviction policy 'mru'; choose one of \['lfu-decay', 'lru'\]"):
        make_policy("mru")
    mine = LRUPolicy()
    assert make_policy(mine) is mine


def test_lfu_decay_counts_time_in_acquisitions():
    """The cache's clock advances by one per acquisition: with a half-life of 2 acquisitions, at the miss (tick 5)
    expert 1 (used at ticks 0, 3) scores 0.68, expert 0 (ticks 0, 1, 2) 0.78 and expert 2 (ticks 0, 4) 0.88, so 1
    is evicted. A clock running twice as fast would evict 0."""
    cache, _, _ = _cache(resident=3, max_group=1, policy=LFUDecayPolicy(half_life=2.0))
    for e in (0, 0, 1, 2):
        with cache.admit() as r:
            r.acquire(0, [e])
    with cache.admit() as r:
        r.acquire(0, [3])
    assert set(cache.mapping(0)) == {0, 2, 3}


def test_a_row_stays_retiring_while_any_request_pins_its_generation():
    """Two requests admitted on generation 1 both lease from generation 2; a row mapped only from generation 2
    on is evicted; after one of them is released the other still pins generation 2, so the row is not recycled
    and a later lease of that expert on generation 2 reads its bytes."""
    cache, _, rows = _cache(resident=3, spares=5, max_group=2)
    a, b = cache.admit(), cache.admit()  # generation 1: experts 0, 1, 2
    with cache.admit() as w:
        row4 = w.acquire(0, [3, 4]).rows[4]  # generation 2: 2, 3, 4
    a.acquire(0, [3])
    b.acquire(0, [3])  # both now pin generation 2
    with cache.admit() as v:
        v.acquire(0, [0, 1])  # generation 3: evicts 2 and 4; 4's row was mapped only from generation 2
    assert row4 in cache.row_states(0)["retiring"]
    a.release()
    assert row4 in cache.row_states(0)["retiring"]  # b still pins generation 2
    with cache.admit() as c:
        c.acquire(0, [5])  # a miss takes a free spare, never the retiring row
    _assert_lease_bytes(b.acquire(0, [4]), rows)  # expert 4 on generation 2: its row was not overwritten
    b.release()
    assert row4 not in cache.row_states(0)["retiring"]


def test_staging_waits_and_reuses_are_counted():
    """A transaction aborted with both copies in flight leaves both staging buffers busy: the next transaction
    waits for each of them (2 staging waits) and reuses both (2 staging reuses)."""
    class OneAtATime(random.Random):
        def randint(self, a, b):  # a wait completes only the copy waited for, none of the others
            return a

    tr = ControlledTransport(CpuTransport(), rng=OneAtATime(0))
    cache, _, rows = _cache(transport=tr, staging=2, max_group=2)
    with cache.admit() as r:
        tr.arm("wait", 0)
        with pytest.raises(TransactionAborted):
            r.acquire(0, [4, 5])
        tr.arm(None)
        waits, reuses = cache.counters["staging_waits"], cache.counters["staging_reuses"]
        assert cache.staging_free() == 0
        _assert_lease_bytes(r.acquire(1, [4, 5]), rows)
    assert cache.counters["staging_waits"] - waits == 2 and cache.counters["staging_reuses"] - reuses == 2


def test_victim_rows_wait_for_old_generation_readers():
    cache, _, rows = _cache(resident=2, spares=2, max_group=2)
    old = cache.admit()
    old_lease = old.acquire(0, [0, 1])
    with cache.admit() as r:
        with pytest.raises(CacheBusyError, match="evictable"):
            r.acquire(0, [2, 3])  # both residents are leased by `old`
    old.release()
    keep = cache.admit()  # pins generation 1, which maps experts 0 and 1
    with cache.admit() as r:
        r.acquire(0, [2, 3])  # evicts 0 and 1; their rows retire behind `keep`
    assert cache.row_states(0)["retiring"] == sorted(old_lease.rows.values())
    with cache.admit() as r:
        with pytest.raises(CacheBusyError, match="free spare rows"):
            r.acquire(0, [4, 5])  # no free spares: the retiring rows are still readable by `keep`
    keep.release()
    assert cache.row_states(0)["retiring"] == []
    with cache.admit() as r:
        _assert_lease_bytes(r.acquire(0, [4, 5]), rows)


@pytest.mark.parametrize("kind, k", [("stage", 1), ("submit", 0), ("copy", 0), ("table", 0)])
def test_failure_before_publication_aborts_and_keeps_generation(kind, k):
    tr = ControlledTransport(CpuTransport())
    cache, _, rows = _cache(transport=tr)
    before, mapping = cache.generation, cache.mapping(0)
    with cache.admit() as r:
        tr.arm(kind, k)
        with pytest.raises(TransactionAborted, match=r"\(TransferError: injected failure.*\); generation 1 remains "
                                                     "authoritative"):
            r.acquire(0, [4, 5])
        assert tr.fired == kind
        assert cache.generation == before and cache.mapping(0) == mapping and cache.state == "READY"
        tr.complete_some(10)  # late completions of the aborted copies
        tr.arm(None)
        _assert_lease_bytes(r.acquire(0, [4, 5]), rows)  # the retry succeeds on recycled spares
    assert cache.counters["transactions_aborted"] == 1


def test_publication_waits_for_the_row_table_upload():
    """A transport whose table upload completes later returns its event; the cache waits for it before it
    publishes the new generation."""
    class AsyncTable(CpuTransport):
        def __init__(self):
            super().__init__()
            self.table_events, self.waited, self.cache = [], [], None

        def upload_table_async(self, table):
            ev = Event(None, 4 * len(table))
            self.table_events.append(ev)
            return self.upload_table(table), ev

        def wait(self, ev):
            if self.cache is not None:
                self.waited.append((ev, self.cache.generation))

    tr = AsyncTable()
    cache, _, rows = _cache(transport=tr)
    tr.cache = cache
    with cache.admit() as r:
        _assert_lease_bytes(r.acquire(0, [4]), rows)
    assert len(tr.table_events) == 1 and (tr.table_events[0], 1) in tr.waited  # waited while generation 1 was current
    assert cache.generation == 2


def test_ambiguous_failure_after_publication_faults_the_cache():
    tr = ControlledTransport(CpuTransport())
    cache, _, _ = _cache(transport=tr)
    r = cache.admit()
    tr.arm("after_publish", 0)
    with pytest.raises(CacheFaultedError, match=r"layer 0: failure after publishing generation 2 \(TransferError: "
                                                r"injected failure: ambiguous failure after publication\); the cache "
                                                r"is FAULTED"):
        r.acquire(0, [4])
    assert cache.state == "FAULTED" and cache.generation == 2
    with pytest.raises(CacheFaultedError, match="FAULTED"):
        cache.admit()
    with pytest.raises(CacheFaultedError):
        r.acquire(1, [0])
    r.release()
    assert cache.telemetry()["counters"]["faults"] == 1


def test_telemetry_observations_statuses():
    cache, pack, _ = _cache()
    with cache.admit() as r:
        r.acquire(0, [5])
    obs = cache.telemetry()["observations"]
    assert all_zero(obs) and obs["request_pack_reads"]["status"] == "OBSERVED"
    cache.host.hash_row(0, 0)  # hash work after startup is observed, not hidden
    assert cache.telemetry()["observations"]["request_hash_work"]["value"] == LAYOUT.row_bytes
    bare = ExpertCache(HostSource.from_rows(_rows(), LAYOUT), resident=3, max_group=2)
    o = bare.telemetry()["observations"]["request_pack_reads"]
    assert o["status"] == "UNKNOWN" and "value" not in o


def test_group_validation():
    cache, _, _ = _cache()
    with cache.admit() as r:
        with pytest.raises(IndexError):
            r.acquire(0, [6])
        with pytest.raises(Exception, match="exceeds the configured max_group"):
            r.acquire(0, [0, 1, 2])


def test_real_pack_reader(tmp_path):
    from runmap.arch.config import load_preset
    from runmap.format.pack import pack_checkpoint
    from runmap.format.packfile import PackReader
    from runmap.synth.checkpoint import write_synthetic

    cfg = load_preset("tiny-olmoe")[0]
    ck = write_synthetic(cfg, tmp_path / "ck", seed=3)
    pack = pack_checkpoint(ck, tmp_path / "pack", device="cpu")
    reader = PackReader(pack)
    want = [reader.read_expert_rows(layer).clone() for layer in range(reader.num_layers)]
    reader = PackReader(pack)
    cache = ExpertCache.from_pack(reader, resident=cfg.num_experts // 2, max_group=min(cfg.top_k * 2, cfg.num_experts // 2),
                                  device="cpu")
    assert reader.closed  # the host source owns the bytes; the pack is never read again
    with cache.admit() as r:
        lease = r.acquire(cfg.num_layers - 1, list(range(cfg.num_experts - cache.max_group, cfg.num_experts)))
        _assert_lease_bytes(lease, want)
    obs = cache.telemetry()["observations"]
    assert all_zero(obs), obs


def test_host_source_pages_are_read_only():
    """torch has no read-only tensors: a write through the internal alias must fault, not change an expert."""
    import subprocess
    import sys

    code = (
        "import torch\n"
        "from runmap.residency.host_source import HostSource\n"
        "from runmap.format.qpack import RowLayout\n"
        "L = RowLayout.build(64, 32, 32)\n"
        "h = HostSource.from_rows([torch.ones(4, L.row_bytes, dtype=torch.uint8)], L)\n"
        "assert h.pages_protected\n"
        "print('before', int(h.row_tensor(0, 0)[0]), flush=True)\n"
        "h.row_tensor(0, 0)[0] = 7\n"
        "print('wrote', flush=True)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "before 1" in r.stdout, r.stderr[-2000:]
    assert "wrote" not in r.stdout
    assert r.returncode != 0


def test_acquire_all_needs_full_residency():
    cache, _, _ = _cache()
    with cache.admit() as r, pytest.raises(CacheError, match=r"^acquire_all needs full residency \(resident == experts "
                                                              r"per layer\)$"):
        r.acquire_all(0)


def test_a_request_block_lets_what_its_body_raises_propagate():
    cache, _, _ = _cache()
    with pytest.raises(KeyError, match="from the body"):
        with cache.admit() as r:
            r.acquire(0, [4])
            raise KeyError("from the body")
    assert r.released and cache.live_requests() == 0 and cache.outstanding_leases() == 0


def test_miss_transactions_are_serialized():
    """A miss started while another transaction runs (here from inside the transport's copy) is refused and
    changes nothing; the running transaction completes."""
    class Reentrant(CpuTransport):
        inner = None
        refused: list = []

        def copy_rows(self, jobs, on_submit):
            call, Reentrant.inner = Reentrant.inner, None
            if call is not None:
                try:
                    call()
                except CacheError as exc:
                    Reentrant.refused.append(str(exc))
            super().copy_rows(jobs, on_submit)

    cache, _, rows = _cache(transport=Reentrant())
    a, b = cache.admit(), cache.admit()
    Reentrant.inner = lambda: b.acquire(1, [4])
    _assert_lease_bytes(a.acquire(0, [5]), rows)
    assert Reentrant.refused == ["miss transactions are serialized in v1; a transaction is already running"]
    assert cache.generation == 2 and 4 not in cache.mapping(1) and cache.counters["transactions"] == 1
    a.release()
    _assert_lease_bytes(b.acquire(1, [4]), rows)  # once it has ended, the next miss runs
    b.release()


def test_a_refusal_for_want_of_spares_needs_no_eviction():
    """Without prefill nothing has to be evicted; spares fenced behind two aborted transactions' copies still in
    flight leave too few free rows, and the refusal says that no eviction is needed."""
    tr = ControlledTransport(CpuTransport())
    cache, _, _ = _cache(transport=tr, prefill=False, resident=3, spares=2, staging=4, max_group=2)
    with cache.admit() as r:
        for group in ([0, 1], [2, 3]):
            tr.arm("wait", 0)  # the wait fails while both copies are in flight: their rows are fenced
            with pytest.raises(TransactionAborted):
                r.acquire(0, group)
        tr.arm(None)
        assert len(cache.row_states(0)["fenced"]) == 4
        with pytest.raises(CacheBusyError,
                           match=r"\(1 free, 0 retiring behind live requests, 4 fenced\) and 0 evictable experts"):
            r.acquire(0, [4, 5])


def test_a_released_request_holds_nothing():
    cache, _, _ = _cache()
    r = cache.admit()
    r.acquire(0, [5])
    r.release()
    assert r.released and r.leases == [] and cache.outstanding_leases() == 0 and cache.live_requests() == 0
    r.release()  # a second release is a no-op
    assert cache.telemetry()["counters"]["requests_released"] == 1
    with pytest.raises(CacheError, match=f"request {r.id} was released; admit a new one"):
        r.acquire(0, [5])


# --- construction and reporting (scope `construction` of benchmarks/mutation.sh) ------------------------------------
RB = LAYOUT.row_bytes  # 768


class _RecordingTransport(CpuTransport):
    """A CPU transport that records the host source it is attached to and every row table it uploads."""

    def __init__(self):
        super().__init__()
        self.attached, self.tables = [], []

    def attach_host(self, host):
        self.attached.append(host)

    def upload_table(self, table):
        self.tables.append(list(table))
        return super().upload_table(table)


class _CudaLabelledTransport(CpuTransport):
    """Reports a CUDA device (the budget then defaults to the device's free memory) but allocates on the CPU."""

    def __init__(self):
        super().__init__()
        self.device = torch.device("cuda", 0)

    def alloc_storage(self, rows, row_bytes):
        return torch.zeros(rows, row_bytes, dtype=torch.uint8)

    def upload_table(self, table):
        self.table_uploads += 1
        return torch.tensor(table, dtype=torch.int32)


def test_a_new_cache_reports_its_capacity_counters_and_rows():
    from runmap.residency.observations import cache_observations

    cache, pack, _ = _cache()  # 2 layers x 6 experts, resident 3, max_group 2: spares and staging default to 2
    tel = cache.telemetry()
    assert set(tel) == {"contract", "state", "regime", "device", "transport", "policy", "capacity", "counters",
                        "observations", "observations_all_zero", "fault"}
    assert (tel["contract"], tel["state"], tel["regime"], tel["device"], tel["policy"], tel["fault"]) == (
        "resident-qpacked-cache-v1", "READY", "partial", "cpu", "lru", None)
    assert tel["transport"] == {"kind": "CpuTransport", "device": "cpu"}
    assert tel["capacity"] == {"num_layers": 2, "num_experts": 6, "row_bytes": RB, "resident": 3, "spares": 2,
                               "staging": 2, "max_group": 2, "device_bytes": 2 * (5 * RB + 2 * 4 * 6),
                               "staging_bytes": 2 * RB, "host_source_bytes": 2 * 6 * RB}
    assert type(tel["capacity"]["device_bytes"]) is int
    assert cache.budget_bytes is None and cache.device_bytes == 7776
    assert cache.layout is cache.host.layout is LAYOUT  # the layout a lease's rows are in
    assert (cache.num_layers, cache.num_experts, cache.row_bytes) == (2, 6, RB)
    # startup published experts 0-2 of both layers through the two staging buffers (4 reuses after first use)
    assert tel["counters"] == {
        "requests_admitted": 0, "requests_released": 0, "leases": 0, "hits": 0, "misses": 0, "all_hit_leases": 0,
        "transactions": 0, "transactions_aborted": 0, "busy_refusals": 0, "bytes_h2d": 2 * 3 * RB,
        "staging_reuses": 4, "staging_waits": 0, "evictions": 0, "rows_recycled": 0, "rows_fenced": 0, "faults": 0,
        "cpu_site_experts": 0, "prefetches": 0, "prefetched_experts": 0, "prefetches_skipped": 0,
        "prefetches_aborted": 0, "prefetch_used": 0, "host_reads": 0, "host_read_bytes": 0, "promotions": 0,
        "promotions_skipped": 0, "generations": 1, "bytes_h2d_transport": 2 * 3 * RB, "leases_outstanding": 0, "staging_free": 2,
        "writebacks": 0, "bytes_d2h": 0}
    assert tel["observations"] == cache_observations(cache.transport, cache.host, cache.copy_monitor)
    assert tel["observations"]["request_pack_reads"]["status"] == "OBSERVED" and tel["observations_all_zero"] is True
    assert cache.generation == 1 and cache.mapping(0) == cache.mapping(1) == {0: 0, 1: 1, 2: 2}
    for layer in range(2):  # rows 0-2 published, the 2 spares free
        assert cache.row_states(layer) == {"published": [0, 1, 2], "free": [3, 4], "fenced": [], "retiring": []}
    with cache.admit() as r:  # a lease's row table maps the experts that are not resident to no row (-1)
        assert r.acquire(0, [0]).row_table.tolist() == [0, 1, 2, -1, -1, -1]
        assert r.acquire(1, []).experts == ()  # an empty group leases nothing
        assert cache.telemetry()["counters"]["leases_outstanding"] == 2


def test_telemetry_counts_the_copy_monitor_and_reports_the_regime_and_fault():
    full, _, _ = _cache(resident=6, max_group=4, copy_monitor=False)
    tel = full.telemetry()
    assert tel["regime"] == "full" and full.copy_monitor is None
    assert "writebacks" not in tel["counters"] and "bytes_d2h" not in tel["counters"]  # no instrument: not counted
    tr = ControlledTransport(CpuTransport())
    cache, _, _ = _cache(transport=tr, policy="lfu-decay")
    r = cache.admit()
    tr.arm("after_publish", 0)
    with pytest.raises(CacheFaultedError):
        r.acquire(0, [4])
    tel = cache.telemetry()
    assert (tel["state"], tel["policy"]) == ("FAULTED", "lfu-decay")
    assert tel["fault"] == "TransferError: injected failure: ambiguous failure after publication"


@pytest.mark.parametrize("arg, level", [(True, "function"), ("function", "function"), ("dispatch", "dispatch")])
def test_the_copy_monitor_runs_at_the_level_asked_for(arg, level):
    cache, _, _ = _cache(copy_monitor=arg)
    assert cache.copy_monitor.level == level


def test_requests_are_numbered_in_admission_order_and_counted():
    cache, _, _ = _cache()
    reqs = [cache.admit() for _ in range(3)]
    assert [r.id for r in reqs] == [0, 1, 2] and cache.live_requests() == 3
    assert all(r.generation == 1 for r in reqs) and cache.counters["requests_admitted"] == 3
    for r in reqs:
        r.release()
    assert cache.live_requests() == 0 and cache.telemetry()["counters"]["requests_released"] == 3


def test_the_transport_gets_the_host_source_and_empty_row_tables_before_startup():
    tr = _RecordingTransport()
    host = HostSource.from_rows(_rows(), LAYOUT)
    cache = ExpertCache(host, resident=3, max_group=2, transport=tr, prefill=False)
    assert tr.attached == [host]
    assert tr.tables == [[-1] * 6, [-1] * 6]  # generation 0: no expert has a row
    assert cache.generation == 0 and cache.mapping(0) == {} and cache.telemetry()["counters"]["generations"] == 0
    assert cache.row_states(0) == {"published": [], "free": [0, 1, 2, 3, 4], "fenced": [], "retiring": []}
    with cache.admit() as r:
        assert r.generation == 0
        r.acquire(0, [1])  # the first miss publishes generation 1
    assert cache.generation == 1 and list(cache.mapping(0)) == [1]


def test_full_residency_publishes_every_expert_even_without_prefill():
    cache, _, rows = _cache(resident=6, max_group=4, prefill=False)
    assert cache.generation == 1 and cache.mapping(0) == {e: e for e in range(6)}
    assert cache.row_states(1) == {"published": list(range(6)), "free": [], "fenced": [], "retiring": []}


def test_default_spares_and_staging_follow_the_regime():
    rows = _rows(1, 12)
    full, _, _ = _cache(rows, resident=12, max_group=12)  # full residency: no spares, at most 8 staging buffers
    assert (full.spares, full.staging, full.max_group, full.rows_per_layer) == (0, 8, 12, 12)
    assert full.telemetry()["capacity"]["staging_bytes"] == 8 * RB
    part, _, _ = _cache(rows, resident=9, max_group=9)  # partial: a routed group's worth of each
    assert (part.spares, part.staging, part.rows_per_layer) == (9, 9, 18)
    given, _, _ = _cache(rows, resident=4, spares=5, staging=3, max_group=2)
    assert (given.spares, given.staging, given.rows_per_layer) == (5, 3, 9)
    assert given.row_states(0)["free"] == list(range(4, 9))
    one, _, _ = _cache(rows, resident=1, max_group=1)  # the smallest configuration is accepted
    assert (one.resident, one.spares, one.staging, one.max_group) == (1, 1, 1, 1)
    tight, _, _ = _cache(resident=2, max_group=2)  # resident == the largest group is enough
    assert tight.resident == tight.max_group == 2
    assert _cache(resident=6, max_group=2, staging=1)[0].staging == 1  # full residency needs one buffer only


@pytest.mark.parametrize("kw, msg", [
    (dict(resident=3, max_group=0), "max_group must be a positive int (top_k x max batch), got 0"),
    (dict(resident=3, max_group=2.0), "max_group must be a positive int (top_k x max batch), got 2.0"),
    (dict(resident=6, max_group=2, staging=0), "staging=0 must be >= 1 and spares=0 >= 0"),
    (dict(resident=6, max_group=2, spares=-1), "staging=2 must be >= 1 and spares=-1 >= 0"),
    (dict(resident=0, max_group=1), "resident=0 must be in [1, 6] (experts per layer)"),
    (dict(resident=3, spares=1, max_group=2), "spares=1 per layer cannot receive the largest routed group of 2 "
                                              "missing experts; need spares >= 2"),
    (dict(resident=3, staging=1, max_group=2), "staging=1 pinned buffers cannot stage the largest routed group of 2 "
                                               "missing experts; need staging >= 2"),
    (dict(resident=2, max_group=9), "resident=2 rows per layer cannot publish the largest routed group of 6 experts "
                                    "(top_k x batch = 9, capped at 6); need resident >= 6"),
    # 2 layers x (3 + 1,000,000) rows x 768 bytes + 2 row tables of 6 int32 each per layer
    (dict(resident=3, spares=1_000_000, max_group=2, budget_bytes=1_000_000_000),
     "device budget too small: 2 layers x (resident 3 + spares 1000000) rows x 768 bytes (+ row tables) = "
     "1536004704 bytes needed (1.431 GiB), 1000000000 bytes available (0.931 GiB)"),
])
def test_startup_refusals_name_the_value_and_the_limit(kw, msg):
    with pytest.raises(CacheConfigError) as e:
        _cache(**kw)
    assert str(e.value) == msg


def test_a_budget_of_exactly_the_device_bytes_suffices():
    cache, _, _ = _cache(budget_bytes=7776)
    assert cache.budget_bytes == 7776 and cache.device_bytes == 7776
    with pytest.raises(CacheConfigError, match="= 7776 bytes needed"):
        _cache(budget_bytes=7775)


def test_on_cuda_the_budget_defaults_to_the_free_device_memory(monkeypatch):
    asked = []
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda dev: asked.append(dev) or (7000, 10**9))
    host = HostSource.from_rows(_rows(), LAYOUT)
    with pytest.raises(CacheConfigError) as e:
        ExpertCache(host, resident=3, max_group=2, transport=_CudaLabelledTransport())
    assert str(e.value).endswith("= 7776 bytes needed (0.000 GiB), 7000 bytes available (0.000 GiB)")
    assert asked == [torch.device("cuda", 0)]
    cache = ExpertCache(host, resident=3, max_group=2, transport=_CudaLabelledTransport(), budget_bytes=8000)
    assert cache.budget_bytes == 8000 and len(asked) == 1  # a budget given is not replaced
    assert cache.telemetry()["device"] == "cuda:0"


def test_a_failed_startup_names_the_failure():
    class Failing(CpuTransport):
        def h2d(self, dst_row, staging):
            raise TransferError("copy of row 0 failed")

    with pytest.raises(CacheConfigError) as e:
        ExpertCache(HostSource.from_rows(_rows(), LAYOUT), resident=3, max_group=2, transport=Failing())
    assert str(e.value) == "startup: loading the first generation failed (TransferError: copy of row 0 failed)"
    assert isinstance(e.value.__cause__, TransferError)


def test_routed_ids_are_checked_and_named():
    cache, _, rows = _cache()
    with cache.admit() as r:
        for layer in (2, -1):
            with pytest.raises(IndexError) as e:
                r.acquire(layer, [0])
            assert str(e.value) == f"layer {layer} out of range [0, 2)"
        for ids, shown in (([6], "(6,)"), ([-1, 2], "(-1, 2)"), ([0, 6], "(0, 6)")):
            with pytest.raises(IndexError) as e:
                r.acquire(1, ids)
            assert str(e.value) == f"layer 1: expert ids {shown} outside [0, 6)"
        with pytest.raises(CacheError) as e:
            r.acquire(0, [0, 1, 2])
        assert str(e.value) == "layer 0: routed group of 3 experts exceeds the configured max_group 2"
        # a host array (the segment decoder's ids) and a tensor of any shape: the batch union
        _assert_lease_bytes(r.acquire(0, np.array([[5, 0], [0, 5]])), rows)
        assert r.acquire(1, torch.tensor([[1, 0], [0, 1]])).experts == (0, 1)
        assert r.acquire(0, np.array([[5, 0], [0, 5]])).experts == (0, 5)


def test_a_cache_of_one_layer_with_one_expert():
    rows = _rows(1, 1)
    cache, _, _ = _cache(rows, resident=1, max_group=1)
    assert cache.full_residency and cache.mapping(0) == {0: 0}
    with cache.admit() as r:
        _assert_lease_bytes(r.acquire_all(0), rows)
        assert r.acquire(0, [0]).rows == {0: 0}
    assert all_zero(cache.telemetry()["observations"])


def test_lfu_decay_counts_the_startup_publication_as_a_use_at_tick_0():
    """Startup publishes experts 0-2 at tick 0 and every acquisition is the next tick. At tick 19 the candidates
    are expert 1 (published at startup, hit at 17: decayed score e^-19r (1 + e^17r)) and expert 3 (missed at 3, hit at
    14: e^-19r (e^3r + e^14r), 0.5 % lower), r = ln 2 / 64: expert 3 goes. Without the startup use, or with the
    acquisitions counted from tick 2, expert 1 would be the lower."""
    cache, _, _ = _cache(resident=3, max_group=1, policy="lfu-decay")

    clock = [0]  # acquisitions so far

    def at(tick, layer, ids):
        while clock[0] < tick - 1:  # acquisitions of nothing in the other layer only advance the clock
            with cache.admit() as r:
                r.acquire(1, [])
            clock[0] += 1
        with cache.admit() as r:
            r.acquire(layer, ids)
        clock[0] += 1

    at(3, 0, [3])  # evicts 0 (experts 0-2 tie at tick 0: the lowest id goes)
    assert set(cache.mapping(0)) == {1, 2, 3}
    at(14, 0, [3])
    at(17, 0, [1])
    with cache.admit() as keep:
        keep.acquire(0, [2])  # tick 18: 2 is leased, so 1 and 3 are the only candidates
        with cache.admit() as r:
            r.acquire(0, [4])  # tick 19
    assert set(cache.mapping(0)) == {1, 2, 4}


# --- accessors, inspection helpers and the transports' allocation (scope `construction-rest`) -------------------------
class _ReleaseFailingTransport(CpuTransport):
    """A CPU transport whose release marker fails once ``fail`` is set (every later release faults the cache)."""

    fail = False

    def note_release(self):
        if self.fail:
            raise RuntimeError("release marker lost")


def test_every_fault_counts_and_the_refusals_name_the_last_failure():
    """A failed release marker faults the cache; a request released after that faults it again (its marker fails
    too), and each fault counts. Every later admission is refused with the generation and the failure named."""
    tr = _ReleaseFailingTransport()
    cache, _, _ = _cache(transport=tr, resident=6, max_group=2)  # full residency: one generation
    reqs = [cache.admit(), cache.admit()]
    tr.fail = True
    for r in reqs:
        with pytest.raises(RuntimeError, match="release marker lost"):
            r.release()
    assert cache.state == "FAULTED" and cache.counters["faults"] == 2
    assert cache.outstanding_leases() == 0 and cache.live_requests() == 0  # nothing leaks
    with pytest.raises(CacheFaultedError) as e:
        cache.admit()
    assert str(e.value) == ("expert cache is FAULTED after an ambiguous failure following publication of generation 1 "
                            "(RuntimeError: release marker lost); no request can be admitted or served; restart the "
                            "engine")
    with pytest.raises(CacheFaultedError) as e2:  # the static row table of a FAULTED cache is refused alike
        cache.static_row_table(0)
    assert str(e2.value) == str(e.value)


def test_the_static_row_table_is_refused_under_partial_residency():
    cache, _, _ = _cache()  # 3 of 6 experts resident
    with pytest.raises(CacheError) as e:
        cache.static_row_table(0)
    assert str(e.value) == "static_row_table is only valid under full residency (resident == experts per layer)"


def test_a_caller_block_counts_as_the_callers_and_its_copies_are_read_backs():
    """Copies out of expert storage inside ``ExpertCache.monitored()`` count in expert_d2h_bytes (not writebacks),
    and the observation says how many caller blocks and cache entry points the monitor covered."""
    cache, _, rows = _cache()
    before = cache.copy_monitor.cache_scopes  # startup's
    with cache.monitored(), cache.admit() as r:
        lease = r.acquire(0, [1])
        lease.storage[lease.rows[1]].clone()  # a read-back by the caller's own code
    obs = cache.telemetry()["observations"]
    assert (obs["expert_d2h_bytes"]["value"], obs["writebacks"]["value"]) == (RB, 0)
    entry = before + 3  # admit, acquire (all hit), release
    assert obs["expert_d2h_bytes"]["source"].startswith(
        f"TorchFunctionMode (torch calls from Python) over {entry} cache entry points (admit, acquire with its miss "
        "transaction, release) and 1 caller blocks (ExpertCache.monitored()): bytes of expert storage copied into "
        "host memory (1 copies")


def test_a_read_back_at_a_cache_entry_point_outside_a_transaction_is_no_writeback():
    """Only copies inside a miss transaction (or into the host source) are writebacks: a row read back to the host
    by the transport while a request is released (not a transaction) counts in expert_d2h_bytes only."""
    class ReadingBack(CpuTransport):
        row = None

        def note_release(self):
            if self.row is not None:
                self.row.clone()

    tr = ReadingBack()
    cache, _, _ = _cache(transport=tr)
    r = cache.admit()
    lease = r.acquire(0, [2])
    tr.row = lease.storage[lease.rows[2]]
    r.release()
    obs = cache.telemetry()["observations"]
    assert (obs["expert_d2h_bytes"]["value"], obs["writebacks"]["value"]) == (RB, 0)


def test_staging_buffers_are_reserved_while_a_transaction_copies_and_free_afterwards():
    class Probing(CpuTransport):
        cache = None

        def __init__(self):
            super().__init__()
            self.seen = []

        def copy_rows(self, jobs, on_submit):
            if self.cache is not None:
                self.seen.append((len(jobs), self.cache.staging_reserved(), self.cache.staging_free()))
            super().copy_rows(jobs, on_submit)

    tr = Probing()
    cache, _, _ = _cache(transport=tr)  # staging 2, experts 0-2 resident
    tr.cache = cache
    assert (cache.staging_reserved(), cache.staging_free()) == (0, 2)
    with cache.admit() as r:
        r.acquire(0, [4, 5])  # two misses: both buffers taken
        r.acquire(1, [0, 3])  # one miss: one buffer taken
    assert tr.seen == [(2, 2, 0), (1, 1, 1)]
    assert (cache.staging_reserved(), cache.staging_free()) == (0, 2)


def test_a_transport_allocates_on_its_device_and_has_moved_nothing_yet():
    """Expert storage is zero-filled uint8 on the transport's device (here the meta device); a staging buffer is
    one row's bytes of host memory; a new transport has counted nothing, and d2h_bytes stays 0 (no method copies
    device -> host)."""
    tr = Transport("meta")
    assert (tr.h2d_bytes, tr.stage_bytes, tr.d2h_bytes, tr.table_uploads) == (0, 0, 0, 0)
    storage = tr.alloc_storage(3, RB)
    assert (storage.device, storage.dtype, tuple(storage.shape)) == (torch.device("meta"), torch.uint8, (3, RB))
    staging = tr.alloc_staging(RB)
    assert (staging.device.type, staging.dtype, staging.nbytes) == ("cpu", torch.uint8, RB)
    assert tr.describe() == {"kind": "Transport", "device": "meta"}
    cpu = CpuTransport()
    assert torch.equal(cpu.alloc_storage(2, RB), torch.zeros(2, RB, dtype=torch.uint8))
    cache, _, _ = _cache(transport=cpu)
    with cache.admit() as r:
        r.acquire(0, [4])
    assert cpu.h2d_bytes == 2 * 3 * RB + RB and cpu.d2h_bytes == 0


def test_an_event_carries_its_completion_marker_and_the_bytes_of_its_copy():
    marker = object()
    ev = Event(marker, RB)
    assert ev.raw is marker and ev.nbytes == RB
    tr = CpuTransport()
    dst = torch.zeros(RB, dtype=torch.uint8)
    ev = tr.h2d(dst, torch.full((RB,), 7, dtype=torch.uint8))  # a CPU copy is complete when it returns
    assert ev.raw is None and ev.nbytes == RB and tr.query(ev) and bool((dst == 7).all())


# --- expert placement and next-layer prefetch (scope `placement-prefetch`) ------------------------------------------
def test_the_placement_is_asked_only_about_experts_absent_from_both_generations():
    """An expert the request's generation maps (0, evicted since) or the current one maps (4, published since) is read
    from its row; only an expert neither maps (3) is offered to the placement, and it is a CPU-site expert, not a
    hit, a miss or part of an all-hit lease."""
    cache, _, rows = _cache()
    old = cache.admit()  # generation 1: experts 0, 1, 2
    with cache.admit() as r:
        r.acquire(0, [4, 5])  # generation 2: experts 2, 4, 5 (0 and 1 evicted, their rows pinned by `old`)
    before = dict(cache.counters)
    asked = []

    def place(absent):  # every absent expert it is asked about goes to the CPU site
        asked.append(absent)
        return absent

    lease = old.acquire(0, [0, 3], place=place)
    assert (lease.experts, lease.cpu_experts, lease.generation, asked) == ((0,), (3,), 1, [(3,)])
    _assert_lease_bytes(lease, rows)
    lease = old.acquire(0, torch.tensor([4, 3]), place=place)
    assert (lease.experts, lease.cpu_experts, lease.generation, asked) == ((4,), (3,), 2, [(3,), (3,)])
    _assert_lease_bytes(lease, rows)
    grew = {k: cache.counters[k] - v for k, v in before.items() if cache.counters[k] != v}
    assert grew == {"leases": 2, "hits": 2, "cpu_site_experts": 2}  # no miss, no transaction, no all-hit lease
    old.release()


def test_a_placement_that_puts_a_mapped_expert_at_the_cpu_site_is_refused_by_name():
    cache, _, _ = _cache()
    with cache.admit() as r:
        for chosen in ([2], [3, 2]):
            with pytest.raises(CacheError, match=r"^layer 1: placement put experts \[2\] at the CPU site; only absent "
                                                 r"experts \[3\] may go there$"):
                r.acquire(1, [2, 3], place=lambda absent: chosen)
        assert cache.counters["leases"] == 0 and cache.counters["cpu_site_experts"] == 0
        lease = r.acquire(1, [2, 3], place=lambda absent: absent)  # all of the absent experts may go
        assert (lease.experts, lease.cpu_experts) == ((2,), (3,))


def test_a_prefetch_is_one_tick_of_the_eviction_policys_clock():
    """LFU with a half-life of 2 ticks (x = 2^-1/2 per tick): expert 0 is published at tick 0 and hit at 1 (score
    1 + x at 1), the prefetch publishes 3 at tick 2 (score 1, evicting 1: 1 and 2 have x^2, the lower id goes) and
    the miss of 4 at tick 3 (2 protected in the group) chooses between 0 ((1 + x) x^2 = 0.85) and 3 (x = 0.71): 3
    goes. Had the prefetch counted as two ticks (3 published at 3, the miss at 4), 0 would have (1 + x) x^3 = 0.60 and
    go instead."""
    cache, _, _ = _cache(policy=LFUDecayPolicy(half_life=2))
    with cache.admit() as r:
        r.acquire(0, [0])  # tick 1
    assert cache.prefetch(0, [3]) == (3,) and sorted(cache.mapping(0)) == [0, 2, 3]  # tick 2
    with cache.admit() as r:
        r.acquire(0, [2, 4])  # tick 3
    assert sorted(cache.mapping(0)) == [0, 2, 4]


def test_a_writeback_on_eviction_by_a_prefetch_is_counted():
    """A prefetch's publication is a transaction for the copy monitor: a victim's row copied back to the host there
    is a writeback, as in an acquisition's miss transaction."""
    from runmap.residency.contract_model import WritebackOnEvict

    cache = WritebackOnEvict.from_pack(InMemoryPack(_rows(), LAYOUT), resident=3, max_group=2)
    assert cache.prefetch(0, [4, 5]) == (4, 5)  # evicts two of the three prefilled experts
    obs = cache.telemetry()["observations"]
    assert obs["writebacks"]["status"] == "OBSERVED" and obs["writebacks"]["value"] == 2


# --- transport.pace: the emulated slower link of the consumer-link experiment (an EMULATION, never a default) -------

class _Clock:
    """perf_counter / sleep for transport.pace: time moves only by what the copy costs and what pace sleeps."""

    def __init__(self, copy_s: float):
        self.now, self.copy_s, self.slept = 100.0, copy_s, []

    def perf_counter(self):
        return self.now

    def sleep(self, s):
        self.slept.append(s)
        self.now += s


def _paced_copy(monkeypatch, gb_s: float, copy_s: float, sizes=(300_000, 200_000)):
    from runmap.residency import transport as transport_module

    clock = _Clock(copy_s)
    monkeypatch.setattr(transport_module, "time", clock)
    inner = CpuTransport()
    real_copy = inner.copy_rows

    def copy_taking_time(jobs, on_submit):
        real_copy(jobs, on_submit)
        clock.now += copy_s

    inner.copy_rows = copy_taking_time
    t = transport_module.pace(inner, gb_s)
    g = torch.Generator().manual_seed(3)
    src = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g) for n in sizes]
    dst = [torch.zeros(n, dtype=torch.uint8) for n in sizes]
    seen = []
    t.copy_rows([(d, torch.empty_like(s), s) for d, s in zip(dst, src)], lambda j, ev: seen.append(j))
    assert seen == list(range(len(sizes))) and all(torch.equal(d, s) for d, s in zip(dst, src))  # same copies
    return t, clock


def test_a_paced_copy_lasts_its_bytes_over_the_rate(monkeypatch):
    # 0.5 MB at 0.05 GB/s = 10 ms; the copy itself took 2 ms, so pace sleeps the other 8 ms, once
    t, clock = _paced_copy(monkeypatch, 0.05, 0.002)
    assert clock.slept == [pytest.approx(0.008, abs=1e-12)]
    assert clock.now == pytest.approx(100.010, abs=1e-12)
    assert t.pace_gb_s == 0.05 and isinstance(t.pace_gb_s, float)
    d = t.describe()
    assert d["paced_gb_s"] == 0.05 and d["emulation"] is True
    assert {k: v for k, v in d.items() if k not in ("paced_gb_s", "emulation")} == CpuTransport().describe()


def test_a_copy_slower_than_the_paced_rate_is_not_slowed_further(monkeypatch):
    # 0.5 MB at 50 GB/s = 10 us, the copy took 2 ms: nothing to wait for
    _, clock = _paced_copy(monkeypatch, 50.0, 0.002)
    assert clock.slept == []
    # exactly on time: no zero-length sleep either
    _, clock = _paced_copy(monkeypatch, 0.25, 0.002)
    assert clock.slept == []


def test_pace_counts_every_row_of_a_batch(monkeypatch):
    # three rows of 0.1 MB at 0.1 GB/s: 3 ms, the copy took none of it
    _, clock = _paced_copy(monkeypatch, 0.1, 0.0, sizes=(100_000, 100_000, 100_000))
    assert clock.slept == [pytest.approx(0.003, abs=1e-12)]


@pytest.mark.parametrize("rate", [0, -1.0, float("nan")])
def test_pace_refuses_a_rate_that_is_not_positive(rate):
    from runmap.residency.transport import pace

    with pytest.raises(ValueError, match=r"pace: a link rate must be > 0 GB/s, got"):
        pace(CpuTransport(), rate)


# --- Request.pinned_row: a valid row for a reader that does not use its result (the segment chain's CPU-site slots)

def test_pinned_row_is_a_row_of_the_requests_generation_and_keeps_its_bytes_while_the_request_lives():
    cache, _, rows = _cache(resident=3, spares=5, max_group=2)
    a = cache.admit()  # generation 1: experts 0, 1, 2 in each layer
    for layer in (0, 1):
        m = cache.mapping(layer)
        assert a.pinned_row(layer) == min(m.values())
    row = a.pinned_row(0)
    expert = next(e for e, r in cache.mapping(0).items() if r == row)
    with cache.admit() as w:
        w.acquire(0, [3, 4])  # generation 2 evicts two of 0, 1, 2
    with cache.admit() as v:
        v.acquire(0, [5])  # and a third: none of generation 1's experts is current any more
    assert expert not in cache.mapping(0) and row in cache.row_states(0)["retiring"]
    assert torch.equal(cache.storage(0)[row], rows[0][expert])  # a still pins generation 1: the bytes stay
    assert a.pinned_row(0) == row
    a.release()
    assert row not in cache.row_states(0)["retiring"]
    with pytest.raises(CacheError, match=r"request \d+ is released; it pins no generation"):
        a.pinned_row(0)


def test_pinned_row_follows_the_latest_generation_the_request_captured():
    cache, _, _ = _cache(resident=3, spares=5, max_group=2)
    a = cache.admit()
    with cache.admit() as w:
        w.acquire(0, [3, 4])  # generation 2
    a.acquire(0, [3])  # a moves to generation 2
    assert a.generation == 2 and a.pinned_row(0) == min(cache.mapping(0).values())
    a.release()
