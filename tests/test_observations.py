"""The required-zero observations are instruments (docs/cache-contract.md#observations): each one is OBSERVED only
where something would have seen the event, and a deliberate event shows up in it."""
import mmap

import pytest
import torch
from hypothesis import given, settings, strategies as st

from runmap.format.qpack import RowLayout
from runmap.residency import contract_model as cm
from runmap.residency import host_source as hs
from runmap.residency.cache import CacheFaultedError, ExpertCache, TransactionAborted
from runmap.residency.host_source import HostSource
from runmap.residency.instruments import ExpertCopyMonitor, _Spans
from runmap.residency.observations import all_zero, cache_observations
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


# --- the observation block itself: each status and value under the conditions that decide it -----------------
# cache_observations reads its instruments' counters and flags; these stand-ins give each a distinct value, so a
# value taken from the wrong counter, a branch taken under the wrong condition or a changed text shows.
class _StubTransport:
    h2d_bytes = 12288


class _StubMonitor:
    def __init__(self, level, events=()):
        self.level, self.events = level, list(events)
        self.d2h_bytes, self.d2h_copies, self.writebacks = 4096, 3, 2
        self.cache_scopes, self.caller_scopes = 5, 7


class _StubHost:
    def __init__(self, frozen=True, holds=True, verified=True, reader=None, at_seal=0, watched=()):
        self.frozen, self.holds, self.protection_verified = frozen, holds, verified
        self.reader, self.pack_bytes_at_seal, self.watched_readers = reader, at_seal, list(watched)
        self.rewrite_attempts, self.hash_bytes_after_seal, self.protection_detail = 3, 96, "maps and probes agree"

    def check_frozen(self):
        return self.frozen

    def protection_holds(self):
        return self.holds


class _CountingReader:
    def __init__(self, bytes_read, reads_after_close):
        self.bytes_read, self.reads_after_close = bytes_read, reads_after_close


class _BareReader:  # a pack reader without counters
    pass


def _observe(monitor=None, **host):
    return cache_observations(_StubTransport(), _StubHost(**host), monitor)


def test_without_a_monitor_the_copy_observations_are_unknown_and_the_rest_observed():
    why = "cache built with copy_monitor=False: no instrument watched copies out of expert storage"
    assert _observe() == {
        "expert_d2h_bytes": {"status": "UNKNOWN", "unit": "bytes", "reason": why},
        "writebacks": {"status": "UNKNOWN", "unit": "count", "reason": why},
        "host_source_rewrites": {
            "status": "OBSERVED", "value": 3, "unit": "count",
            "source": "HostSource.write_row refusals; the whole host source is read-only, verified: maps and probes "
                      "agree, so a write through any alias would have faulted"},
        "request_hash_work": {"status": "OBSERVED", "value": 96, "unit": "bytes",
                              "source": "HostSource hash counter after startup"},
        "request_pack_reads": {"status": "UNKNOWN", "unit": "bytes",
                               "reason": "host source built from in-memory rows; no pack reader to instrument"},
    }


@pytest.mark.parametrize("level,events,mode,seen", [
    ("dispatch", [("copy_.default", 4096)], "TorchDispatchMode (aten operations)",
     "; first copies: [('copy_.default', 4096)]"),
    ("function", [], "TorchFunctionMode (torch calls from Python)", ""),
])
def test_the_copy_observations_report_the_monitor_counters_and_what_it_watched(level, events, mode, seen):
    obs = _observe(_StubMonitor(level, events))
    scope = (f"{mode} over 5 cache entry points (admit, acquire with its miss transaction, release) and 7 caller "
             "blocks (ExpertCache.monitored())")
    assert obs["expert_d2h_bytes"] == {
        "status": "OBSERVED", "value": 4096, "unit": "bytes",
        "source": f"{scope}: bytes of expert storage copied into host memory (3 copies{seen}; _StubTransport moved "
                  "12288 bytes host -> device)"}
    assert obs["writebacks"] == {
        "status": "OBSERVED", "value": 2, "unit": "count",
        "source": f"{scope}: copies out of expert storage inside a miss transaction (the eviction path) or into the "
                  "host source"}


@pytest.mark.parametrize("frozen,holds,verified,reason", [
    (False, True, True, "the host source array was found writable again: a write through it would not be seen"),
    (False, False, False, "the host source array was found writable again: a write through it would not be seen"),
    (True, False, False, "host source protection not verified (maps and probes agree): a write through the torch "
                         "alias would not be seen"),
    (True, False, True, "part of the host source became writable after startup (/proc/self/maps)"),
])
def test_rewrites_are_unknown_unless_the_array_is_frozen_and_its_protection_holds(frozen, holds, verified, reason):
    assert _observe(frozen=frozen, holds=holds, verified=verified)["host_source_rewrites"] == {
        "status": "UNKNOWN", "unit": "count", "reason": reason}


def test_rewrites_are_observed_whenever_the_array_is_frozen_and_its_protection_holds():
    # protection_holds re-checks the whole range now; the startup verification flag does not decide then
    assert _observe(verified=False)["host_source_rewrites"]["status"] == "OBSERVED"


def test_a_pack_reader_without_a_counter_is_unsupported():
    assert _observe(reader=_BareReader())["request_pack_reads"] == {
        "status": "UNSUPPORTED", "unit": "bytes", "reason": "_BareReader exposes no bytes_read counter"}


def test_pack_reads_after_startup_sum_every_reader_from_its_count_at_close():
    # the pack's reader read 400 bytes after it was sealed, a watched reader 300 after its close; a watched reader
    # without counters adds nothing; refused reads are summed over the readers that count them
    obs = _observe(reader=_CountingReader(1000, 2), at_seal=600,
                   watched=[(_CountingReader(500, 2), 200), (_BareReader(), 0)])
    assert obs["request_pack_reads"] == {
        "status": "OBSERVED", "value": 700, "unit": "bytes",
        "source": "pack reader bytes_read after startup (3 closed reader(s); 4 refused read attempts)"}
    assert _observe(reader=_CountingReader(600, 0), at_seal=600)["request_pack_reads"]["value"] == 0


# --- the copy monitor: what counts as a copy out of expert storage, and how it is counted ----------------------
_aten = torch.ops.aten


def _float_rows():
    return torch.arange(24, dtype=torch.float32).reshape(3, 8)  # 3 rows of 32 bytes: bytes != elements


def _watching(level, rows, host=None):
    m = ExpertCopyMonitor(level)
    m.watch_storage(rows)
    if host is not None:
        m.watch_host(host)
    return m


def test_a_new_monitor_has_counted_nothing_and_checks_its_level():
    m = ExpertCopyMonitor()
    assert m.level == "function" and ExpertCopyMonitor("dispatch").level == "dispatch"
    assert (m.d2h_bytes, m.d2h_copies, m.writebacks, m.cache_scopes, m.caller_scopes, m.events) == (0, 0, 0, 0, 0, [])
    with pytest.raises(ValueError) as e:
        ExpertCopyMonitor("aten")
    assert str(e.value) == "copy monitor level 'aten': choose one of ['function', 'dispatch']"


@pytest.mark.parametrize("level,suffix", [("function", ""), ("dispatch", ".default")])
def test_the_monitor_counts_bytes_copies_and_names_the_first_eight(level, suffix):
    rows = _float_rows()
    m = _watching(level, rows)
    buf = torch.empty(8)
    with m.scope(), m.scope(caller=True):  # nested: one mode, both scopes counted
        rows[0].clone()
        rows[1:3].clone()
        buf.copy_(rows[2])
    assert (m.d2h_bytes, m.d2h_copies, m.writebacks) == (128, 3, 0)
    assert m.events == [(f"clone{suffix}", 32), (f"clone{suffix}", 64), (f"copy_{suffix}", 32)]
    assert (m.cache_scopes, m.caller_scopes) == (1, 1)
    with m.scope(caller=True):
        for _ in range(7):
            rows[1].clone()
    assert m.d2h_copies == 10 and m.d2h_bytes == 128 + 7 * 32 and len(m.events) == 8
    assert m.events[3:] == [(f"clone{suffix}", 32)] * 5


@pytest.mark.parametrize("level", sorted(MODE_NAMES))
def test_copies_in_a_transaction_or_into_the_host_source_are_writebacks(level):
    rows, host = _float_rows(), torch.zeros(2, 8)
    m = _watching(level, rows, host)
    with m.scope(transaction=True):
        rows[0].clone()
        rows[1].clone()
    assert (m.writebacks, m.d2h_copies) == (2, 2)
    with m.scope():
        host[1].copy_(rows[0])  # into the last row of the host source
        torch.empty(8).copy_(rows[0])  # into other host memory: a read-back, not a writeback
    assert (m.writebacks, m.d2h_copies) == (3, 4)


@pytest.mark.parametrize("level", sorted(MODE_NAMES))
def test_what_is_not_a_copy_out_of_expert_storage_is_not_counted(level):
    rows, other = _float_rows(), torch.ones(2, 8)
    m = _watching(level, rows)
    with m.scope(caller=True):
        rows[0].copy_(rows[1])  # within expert storage
        torch.empty(8, device="meta").copy_(rows[1])  # into memory that is not the host's
        torch.empty(8).copy_(other[0])  # from outside expert storage
        other[0].clone()
        rows[0].contiguous()  # already contiguous: the row itself, no copy
        rows[0] * 2  # arithmetic on host rows (same dtype) makes new values, not a copy of the row's bytes
        rows[0, 1].item()  # a host row's element is host memory already
        rows[0].tolist()
        rows[0].to(torch.float64)  # a conversion on the host is arithmetic
        torch.equal(rows[0], other[0])
    assert (m.d2h_bytes, m.d2h_copies, m.events) == (0, 0, [])
    with torch.inference_mode(), m.scope(caller=True):
        rows[0].to(torch.float32)  # aten.to.dtype returns the row itself
        rows[0].to("cpu", copy=True)  # aten.to.* that does copy
    assert m.events == [("to" if level == "function" else "to.dtype_layout", 32)]


@pytest.mark.parametrize("level", sorted(MODE_NAMES))
def test_a_row_passed_by_keyword_is_counted(level):
    rows = _float_rows()
    m = _watching(level, rows)
    buf = torch.empty(8)
    with m.scope(caller=True):
        buf.copy_(other=rows[2])
        buf.copy_(non_blocking=False, other=rows[1])
        torch.clone(input=rows[0])
    assert m.d2h_copies == 3 and m.d2h_bytes == 96


def test_a_storage_span_ends_where_the_next_allocation_begins():
    import numpy as np

    buf = np.zeros(64, np.float32)
    watched, neighbour = torch.from_numpy(buf[:32]), torch.from_numpy(buf[32:])  # adjacent: 128 bytes each
    assert watched.untyped_storage().data_ptr() + 128 == neighbour.untyped_storage().data_ptr()
    m = _watching("function", watched.view(4, 8))
    with m.scope(caller=True):
        neighbour.clone()
        torch.empty(8).copy_(neighbour[:8])
    assert m.d2h_copies == 0
    with m.scope(caller=True):
        watched[:8].clone()  # a view at the start of the watched span
    assert (m.d2h_copies, m.d2h_bytes) == (1, 32)
    spans = [(watched.untyped_storage().data_ptr(), neighbour.untyped_storage().data_ptr())]
    assert ExpertCopyMonitor._inside(watched[24:], spans) and not ExpertCopyMonitor._inside(neighbour, spans)


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
def test_only_tensors_with_storage_can_be_inside_expert_storage():
    everything = [(0, 2 ** 64)]
    inside = ExpertCopyMonitor._inside
    assert inside(torch.zeros(3), everything)
    assert not inside(None, everything) and not inside(3, everything) and not inside([torch.zeros(3)], everything)
    assert not inside(torch.eye(3).to_sparse(), everything)  # no storage to locate
    assert not inside(torch.eye(3).to_sparse_csr(), everything)  # its storage raises NotImplementedError


# A row on a device: on this CPU-only machine a meta tensor stands in (its storage spans [0, nbytes)), and the
# classifiers are called as the modes call them, with the result a device op would return to the host.
def _device_rows():
    rows = torch.empty(3, 8, dtype=torch.float32, device="meta")
    assert rows.untyped_storage().data_ptr() == 0
    return rows


def test_function_level_values_of_a_device_row_that_reach_the_host_are_counted():
    rows = _device_rows()
    m = _watching("function", rows)
    m.see_call(torch.Tensor.item, (rows[0, 0],), {}, 1.0)  # one element
    m.see_call(torch.Tensor.tolist, (rows[1],), {}, [0.0] * 8)  # the whole row
    m.see_call(torch.Tensor.to, (rows[2],), {"dtype": torch.float64}, torch.zeros(8, dtype=torch.float64))
    m.see_call(torch.add, (rows[2], 1), {}, torch.zeros(8, dtype=torch.float16))  # any host tensor made from it
    m.see_call(torch.Tensor.to, (rows[2],), {}, torch.empty(8, device="meta"))  # stays on the device
    assert m.events == [("item", 4), ("tolist", 32), ("to", 64), ("add", 16)]
    assert (m.d2h_bytes, m.d2h_copies) == (116, 4)


def test_function_level_names_a_call_without_a_name_by_its_text():
    class Op:
        def __str__(self):
            return "custom-op"

    rows = _device_rows()
    m = _watching("function", rows)
    m.see_call(Op(), (rows[0],), {}, torch.zeros(8))
    assert m.events == [("custom-op", 32)]


def test_function_level_metadata_of_a_device_row_is_not_a_copy():
    # dim / size / numel / shape of a device row return host values that hold none of its bytes: the classifier
    # passes over a result that is not a host tensor (counting it would raise inside the caller's own call)
    rows = _device_rows()
    m = _watching("function", rows)
    with m.scope(caller=True):
        assert rows[1].dim() == 1 and rows.size(1) == 8 and rows[0].numel() == 8 and rows.shape == (3, 8)
    m.see_call(torch.Tensor.__setitem__, (rows[0], 0, 1.0), {}, None)  # an in-place write returns None
    assert (m.d2h_bytes, m.d2h_copies, m.events) == (0, 0, [])


def test_dispatch_level_values_of_a_device_row_that_reach_the_host_are_counted():
    rows = _device_rows()
    m = _watching("dispatch", rows)
    m.see(_aten._local_scalar_dense.default, (rows[0, 0],), {}, 1.0)
    m.see(_aten._to_copy.default, (rows[1],), {"dtype": torch.float64}, torch.zeros(8, dtype=torch.float64))
    m.see(_aten.add.Tensor, (rows[2], rows[1]), {}, torch.zeros(8))  # counted once, though two rows are read
    m.see(_aten.add.Tensor, (rows[2], 1), {}, torch.empty(8, device="meta"))  # stays on the device
    m.see(_aten._local_scalar_dense.default, (torch.zeros(()),), {}, 0.0)  # not a row
    assert m.events == [("_local_scalar_dense.default", 4), ("_to_copy.default", 64), ("add.Tensor", 32)]
    assert (m.d2h_bytes, m.d2h_copies) == (100, 3)


def test_dispatch_level_counts_item_under_inference_mode():
    # under torch.inference_mode (the engine's mode) .item() reaches the dispatch level as aten.item, not as
    # aten._local_scalar_dense: a scalar read back from a device row that way must count all the same
    with torch.inference_mode():
        seen = []

        class Spy(torch.utils._python_dispatch.TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                seen.append(func)
                return func(*args, **(kwargs or {}))

        with Spy():
            torch.ones(2)[0].item()
    assert _aten.item.default in seen  # the op this test is about is the one torch sends
    rows = _device_rows()
    m = _watching("dispatch", rows)
    m.see(_aten.item.default, (rows[0, 0],), {}, 1.0)
    m.see(_aten.item.default, (torch.zeros(()),), {}, 0.0)  # not a row
    assert m.events == [("item.default", 4)] and (m.d2h_bytes, m.d2h_copies) == (4, 1)


def test_dispatch_level_copy_from_counts_its_destination():
    # aten._copy_from(self, dst) is how backends other than the CPU's copy across devices
    rows = _float_rows()
    m = _watching("dispatch", rows)
    dst = torch.empty(2, 8)
    m.see(_aten._copy_from.default, (rows[1:3], dst), {}, dst)
    m.see(_aten._copy_from_and_resize.default, (torch.ones(8), dst), {}, dst)  # not from expert storage
    assert m.events == [("_copy_from.default", 64)]


def test_dispatch_level_item_and_arithmetic_of_host_rows_are_not_counted():
    rows = _float_rows()
    m = _watching("dispatch", rows)
    with m.scope(caller=True):
        rows[0, 0].item()
        rows[0] + 1
        rows[0].add(rows[1])
    assert m.events == []


def test_the_modes_run_each_call_as_made():
    rows = _float_rows()
    for level in sorted(MODE_NAMES):
        m = _watching(level, rows)
        with m.scope(caller=True):
            assert rows[0].to(dtype=torch.float64).dtype == torch.float64
            assert torch.full((2,), 3.0, dtype=torch.float16).dtype == torch.float16
            assert torch.equal(rows[1].clone(), rows[1])
        assert m.d2h_copies == 1


def test_the_function_mode_hands_every_call_it_could_count_to_the_classifier(monkeypatch):
    """The mode skips the classifier only for calls it could never count: .item() / .tolist() (counted on a GPU
    even though they return no tensor), copy_ and host-tensor results must reach see_call; metadata reads not."""
    m = ExpertCopyMonitor()
    rows = torch.arange(64, dtype=torch.uint8).reshape(4, 16)
    m.watch_storage(rows)
    seen = []
    classify = m.see_call
    monkeypatch.setattr(m, "see_call", lambda func, args, kwargs, out: (seen.append(func),
                                                                        classify(func, args, kwargs, out)))
    buf = torch.empty(16, dtype=torch.uint8)
    with m.scope(caller=True):
        rows[0, 0].item()
        rows[1].tolist()
        buf.copy_(rows[2])
        rows[3].clone()
        rows.dim()
        rows.data_ptr()
    for func in (torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.copy_, torch.Tensor.clone):
        assert func in seen, func
    assert torch.Tensor.dim not in seen and torch.Tensor.data_ptr not in seen
    assert m.d2h_copies == 2  # copy_ and clone of host rows (.item() / .tolist() count only from a device)


@settings(max_examples=200, deadline=None)
@given(ranges=st.lists(st.tuples(st.integers(0, 60), st.integers(0, 12)), max_size=8),
       probes=st.lists(st.integers(-2, 80), min_size=1, max_size=20))
def test_merged_spans_answer_like_a_scan_of_every_range(ranges, probes):
    """The monitor's bisected spans (merged on insertion) hold exactly the addresses some watched range holds:
    overlapping, touching, nested, empty and repeated ranges, in any order."""
    spans = _Spans()
    for lo, n in ranges:
        spans.add(lo, lo + n)
    assert list(spans) == sorted(spans) and all(lo < hi for lo, hi in spans)
    assert all(a_hi < b_lo for (_, a_hi), (b_lo, _) in zip(spans, list(spans)[1:]))  # merged: gaps between
    for p in probes:
        assert spans.contains(p) == any(lo <= p < lo + n for lo, n in ranges), p


def test_a_host_tensor_is_never_located_against_another_devices_storage(monkeypatch):
    """Watched memory is kept per device type: a CPU tensor checked against device (here meta) storage returns
    without reading its storage address, and a meta row is still found."""
    rows = torch.empty(3, 8, dtype=torch.float32, device="meta")
    m = _watching("function", rows)
    host = torch.zeros(8)
    located = []
    real = ExpertCopyMonitor._inside
    monkeypatch.setattr(ExpertCopyMonitor, "_inside", staticmethod(lambda t, spans: located.append(t) or real(t, spans)))
    assert not m._in_storage(host) and located == []
    assert m._in_storage(rows[1]) and len(located) == 1


def test_only_tensors_are_located_in_watched_storage_or_the_host_source():
    """Arguments that are not tensors (None, numbers, lists holding rows) are never inside expert storage or the host
    source, even where every watched range would hold their address; tensors there still are."""
    rows, host = torch.zeros(4, 8), torch.zeros(2, 8)
    m = _watching("function", rows, host)
    for x in (None, 0, rows.untyped_storage().data_ptr(), host.untyped_storage().data_ptr(), [rows[0]], (host[1],)):
        assert not m._in_storage(x) and not m._in_host(x), x
    assert m._in_storage(rows[2]) and not m._in_host(rows[2])
    assert m._in_host(host[1]) and not m._in_storage(host[1])
