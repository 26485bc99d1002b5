"""Unit tests of the expert cache (runmap/residency/cache.py) and its host source, beyond the contract model."""
import numpy as np
import pytest
import torch

from runmap.residency.cache import (CacheBusyError, CacheConfigError, CacheFaultedError, ExpertCache, TransactionAborted)
from runmap.residency.contract_model import ControlledTransport, InMemoryPack
from runmap.residency.host_source import HostSource, HostSourceError, HostSourceRewriteError
from runmap.residency.observations import all_zero
from runmap.format.qpack import RowLayout
from runmap.residency.transport import CpuTransport

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
        with pytest.raises(TransactionAborted, match="generation 1 remains authoritative"):
            r.acquire(0, [4, 5])
        assert tr.fired == kind
        assert cache.generation == before and cache.mapping(0) == mapping and cache.state == "READY"
        tr.complete_some(10)  # late completions of the aborted copies
        tr.arm(None)
        _assert_lease_bytes(r.acquire(0, [4, 5]), rows)  # the retry succeeds on recycled spares
    assert cache.counters["transactions_aborted"] == 1


def test_ambiguous_failure_after_publication_faults_the_cache():
    tr = ControlledTransport(CpuTransport())
    cache, _, _ = _cache(transport=tr)
    r = cache.admit()
    tr.arm("after_publish", 0)
    with pytest.raises(CacheFaultedError):
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


def test_a_released_request_holds_nothing():
    cache, _, _ = _cache()
    r = cache.admit()
    r.acquire(0, [5])
    r.release()
    assert r.released and r.leases == [] and cache.outstanding_leases() == 0 and cache.live_requests() == 0
    r.release()  # a second release is a no-op
    assert cache.telemetry()["counters"]["requests_released"] == 1
