"""The required-zero observations are instruments (docs/cache-contract.md#observations): each one is OBSERVED only
where something would have seen the event, and a deliberate event shows up in it."""
import mmap

import pytest
import torch

from runmap.format.qpack import RowLayout
from runmap.residency import contract_model as cm
from runmap.residency import host_source as hs
from runmap.residency.cache import CacheFaultedError, ExpertCache, TransactionAborted
from runmap.residency.host_source import HostSource
from runmap.residency.observations import all_zero
from runmap.residency.transport import CpuTransport

LAYOUT = RowLayout.build(64, 32, 32)  # a few KB per row: the host source spans several pages


def _rows(layers=2, experts=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (experts, LAYOUT.row_bytes), dtype=torch.uint8, generator=g) for _ in range(layers)]


def _cache(cls=ExpertCache, **kw):
    kw.setdefault("resident", 3)
    kw.setdefault("max_group", 2)
    return cls.from_pack(cm.InMemoryPack(_rows(), LAYOUT), **kw)


def _obs(cache):
    return cache.telemetry()["observations"]


# --- expert_d2h_bytes and writebacks: a torch function / dispatch mode sees copies out of expert storage -------
MODE_NAMES = {"function": "TorchFunctionMode", "dispatch": "TorchDispatchMode"}


@pytest.mark.parametrize("level", sorted(MODE_NAMES))
def test_clean_requests_observe_zero(level):
    cache = _cache(copy_monitor=level)
    with cache.monitored(), cache.admit() as r:
        lease = r.acquire(0, [4, 5])
        assert torch.equal(lease.storage[lease.rows[4]], torch.as_tensor(cache.host.expected_row(0, 4)))
    obs = _obs(cache)
    assert all_zero(obs), obs
    assert MODE_NAMES[level] in obs["expert_d2h_bytes"]["source"]


@pytest.mark.parametrize("level", sorted(MODE_NAMES))
@pytest.mark.parametrize("read_back", [
    lambda row: row.to("cpu", copy=True), lambda row: row.clone(), lambda row: torch.empty_like(row).copy_(row),
    lambda row: row.contiguous().cpu().clone()])
def test_a_deliberate_read_back_during_a_request_is_counted(level, read_back):
    cache = _cache(copy_monitor=level)
    with cache.monitored(), cache.admit() as r:
        lease = r.acquire(1, [3])
        read_back(lease.storage[lease.rows[3]])  # the read-back
    obs = _obs(cache)
    assert obs["expert_d2h_bytes"]["status"] == "OBSERVED" and obs["expert_d2h_bytes"]["value"] >= LAYOUT.row_bytes
    assert obs["writebacks"]["value"] == 0 and not all_zero(obs)


def test_the_default_monitor_is_the_function_level():
    assert _cache().copy_monitor.level == "function"
    with pytest.raises(ValueError, match="level"):
        _cache(copy_monitor="aten")


@pytest.mark.parametrize("level", sorted(MODE_NAMES))
def test_a_read_back_in_the_miss_path_is_counted_at_each_level(level):
    cache = _cache(cm.ReadBackOnMiss, copy_monitor=level)
    with cache.admit() as r:
        r.acquire(0, [5])
    assert _obs(cache)["expert_d2h_bytes"]["value"] == LAYOUT.row_bytes


def test_a_read_back_in_the_miss_path_is_counted():
    cache = _cache(cm.ReadBackOnMiss)
    with cache.admit() as r:
        r.acquire(0, [5])
    assert _obs(cache)["expert_d2h_bytes"]["value"] == LAYOUT.row_bytes


def test_a_writeback_on_eviction_is_counted():
    cache = _cache(cm.WritebackOnEvict)
    with cache.admit() as r:
        r.acquire(0, [4, 5])  # evicts two of the three prefilled experts
    obs = _obs(cache)
    assert obs["writebacks"]["status"] == "OBSERVED" and obs["writebacks"]["value"] == 2
    assert cache.telemetry()["counters"]["writebacks"] == 2


def test_without_the_monitor_d2h_and_writebacks_are_unknown():
    cache = _cache(copy_monitor=False)
    with cache.admit() as r:
        r.acquire(0, [5])
    obs = _obs(cache)
    for name in ("expert_d2h_bytes", "writebacks"):
        assert obs[name]["status"] == "UNKNOWN" and "value" not in obs[name] and obs[name]["reason"]
    assert "writebacks" not in cache.telemetry()["counters"]


# --- host_source_rewrites: OBSERVED only once the whole host source is verified read-only ---------------------
def test_verified_protection_is_observed():
    src = HostSource.from_rows(_rows(), LAYOUT)
    assert src.pages_protected and src.protection_verified, src.protection_detail
    assert "faulted at" in src.protection_detail
    cache = ExpertCache(src, resident=3, max_group=2)
    o = _obs(cache)["host_source_rewrites"]
    assert o["status"] == "OBSERVED" and o["value"] == 0


def test_mprotect_failing_makes_rewrites_unknown(monkeypatch):
    monkeypatch.setattr(hs, "_protect_read_only", lambda mm, arr: False)
    src = HostSource.from_rows(_rows(), LAYOUT)
    o = _obs(ExpertCache(src, resident=3, max_group=2))["host_source_rewrites"]
    assert o["status"] == "UNKNOWN" and "value" not in o and "mprotect" in o["reason"]


def test_protecting_only_the_first_page_is_detected(monkeypatch):
    def first_page_only(mm, arr):
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mprotect.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        return libc.mprotect(ctypes.c_void_p(arr.ctypes.data), mmap.PAGESIZE, 1) == 0

    monkeypatch.setattr(hs, "_protect_read_only", first_page_only)
    src = HostSource.from_rows(_rows(), LAYOUT)
    assert src.nbytes > 2 * mmap.PAGESIZE and src.pages_protected and not src.protection_verified
    assert "writable" in src.protection_detail
    o = _obs(ExpertCache(src, resident=3, max_group=2))["host_source_rewrites"]
    assert o["status"] == "UNKNOWN"


def test_protection_removed_later_is_detected():
    import ctypes
    src = HostSource.from_rows(_rows(), LAYOUT)
    cache = ExpertCache(src, resident=3, max_group=2)
    assert _obs(cache)["host_source_rewrites"]["status"] == "OBSERVED"
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    last = src.array.ctypes.data + (src.nbytes - 1) // mmap.PAGESIZE * mmap.PAGESIZE
    assert libc.mprotect(ctypes.c_void_p(last), mmap.PAGESIZE, 3) == 0  # PROT_READ | PROT_WRITE
    assert _obs(cache)["host_source_rewrites"]["status"] == "UNKNOWN"


def test_probe_pages_span_the_whole_range():
    page = 4096
    assert hs._probe_pages(3 * page, page) == [0, page, 2 * page]
    offs = hs._probe_pages(1000 * page, page, 8)
    assert len(offs) == 8 and offs[0] == 0 and offs[-1] == 999 * page and offs == sorted(set(offs))


# --- nothing leaks when an interrupt or a failure hits a request ---------------------------------------------
@pytest.mark.parametrize("kind,k", [("stage", 1), ("submit", 0), ("wait", 0), ("table", 0)])
def test_an_interrupt_in_a_miss_gives_back_spares_and_staging(kind, k):
    tr = cm.ControlledTransport(CpuTransport())
    cache = _cache(transport=tr, staging=2)
    gen, free = cache.generation, cache.row_states(0)["free"]
    r = cache.admit()
    tr.arm(kind, k, interrupt=True)
    with pytest.raises(cm.InjectedInterrupt):
        r.acquire(0, [4, 5])
    tr.arm(None)
    assert cache.generation == gen and cache.staging_reserved() == 0 and cache.state == "READY"
    st = cache.row_states(0)
    assert sorted(st["free"] + st["fenced"]) == free  # every reserved spare is back (or fenced behind its copy)
    r.release()
    tr.complete_some(10)
    assert cache.staging_free() == cache.staging and cache.outstanding_leases() == 0


def test_an_interrupt_after_publication_faults_the_cache():
    tr = cm.ControlledTransport(CpuTransport())
    cache = _cache(transport=tr)
    tr.arm("after_publish", 0, interrupt=True)
    with cache.admit() as r, pytest.raises(cm.InjectedInterrupt):
        r.acquire(0, [5])
    assert cache.state == "FAULTED" and cache.outstanding_leases() == 0 and cache.live_requests() == 0
    with pytest.raises(CacheFaultedError):
        cache.admit()


def test_a_failing_release_drops_the_leases_and_faults():
    class FailRelease(CpuTransport):
        def note_release(self):
            raise RuntimeError("event record failed")

    cache = _cache(transport=FailRelease())
    r = cache.admit()
    r.acquire(0, [0, 1])
    with pytest.raises(RuntimeError, match="event record"):
        r.release()
    assert cache.outstanding_leases() == 0 and cache.live_requests() == 0 and cache.leased_experts(0) == set()
    assert cache.state == "FAULTED"


def test_a_failing_staging_take_returns_the_buffers_already_taken():
    class Boom(ExpertCache):
        calls = None  # counting starts once armed (startup takes buffers too)

        def _take_staging(self):
            if Boom.calls is not None:
                Boom.calls += 1
                if Boom.calls == 2:
                    raise cm.InjectedInterrupt("interrupted while taking staging")
            return super()._take_staging()

    cache = _cache(Boom)
    Boom.calls = 0
    with cache.admit() as r, pytest.raises(cm.InjectedInterrupt):
        r.acquire(0, [4, 5])
    assert cache.staging_reserved() == 0 and cache.staging_free() == cache.staging


def test_the_model_sees_a_kernel_read_back():
    stats, exc = cm.run_contract(examples=60, steps=20, seed=0, kernel_readback=True, shrink=False)
    assert isinstance(exc, cm.ContractViolation) and "expert_d2h_bytes" in str(exc), exc


def test_transaction_abort_counts_only_submitted_bytes():
    tr = cm.ControlledTransport(CpuTransport())
    cache = _cache(transport=tr)
    before = cache.counters["bytes_h2d"]
    tr.arm("submit", 1)
    with cache.admit() as r, pytest.raises(TransactionAborted):
        r.acquire(0, [4, 5])
    assert cache.counters["bytes_h2d"] - before == LAYOUT.row_bytes  # one copy was issued, not two


@pytest.mark.parametrize("level", sorted(MODE_NAMES))
@pytest.mark.parametrize("grad_mode", ["enable_grad", "no_grad", "inference_mode"])
def test_copy_monitor_counts_byte_copies_alike_in_every_autograd_mode(grad_mode, level):
    """Tensor.to dispatches as aten.to.* under inference_mode (the engine's mode) and as _to_copy
    elsewhere: a copy of a row's bytes counts in both; a dtype conversion on the CPU is arithmetic, not a
    copy out of expert storage, and the reference executor's dequantization never counts."""
    import torch

    from runmap.format.qpack import RowLayout
    from runmap.kernels.executors import moe_experts
    from runmap.residency.instruments import ExpertCopyMonitor

    mode = getattr(torch, grad_mode)
    rows = torch.randint(0, 256, (3, 64), dtype=torch.uint8)
    for copy, expected in [(lambda: rows[1].to("cpu", copy=True), 64), (lambda: rows[2].clone(), 64),
                           (lambda: rows[1].to(torch.int16), 0), (lambda: rows[0].float(), 0)]:
        monitor = ExpertCopyMonitor(level)
        monitor.watch_storage(rows)
        with mode(), monitor.scope(caller=True):
            copy()
        assert monitor.d2h_bytes == expected

    layout = RowLayout.build(64, 96, 64)
    experts = 3
    storage = torch.stack([_qpacked_row(layout, seed) for seed in range(experts)])  # (E, row_bytes) uint8
    monitor = ExpertCopyMonitor(level)
    monitor.watch_storage(storage)
    x = torch.randn(2, 64).half()
    ids = torch.tensor([[0, 2], [1, 2]])
    w = torch.full((2, 2), 0.5)
    with mode(), monitor.scope(caller=True):
        moe_experts("reference", x, ids, w, storage, torch.arange(experts, dtype=torch.int32), layout)
    assert monitor.d2h_bytes == 0


def _qpacked_row(layout, seed):
    """One expert's qpacked row of random weights (uint8 (row_bytes,))."""
    import torch

    g = torch.Generator().manual_seed(seed)
    h, i = layout.hidden_size, layout.intermediate_size
    return layout.pack_expert({"gate": torch.randn(i, h, generator=g), "up": torch.randn(i, h, generator=g),
                               "down": torch.randn(h, i, generator=g)})
