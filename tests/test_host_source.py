"""The host source's own instruments (runmap/residency/host_source.py): the protection check behind the
``host_source_rewrites`` observation (write probes in child processes and /proc/self/maps, each able to find an
unprotected page alone), the rewrite and hash counters, and ``all_zero`` over an incomplete observation block."""
import ctypes
import hashlib
import mmap

import pytest
import torch

from runmap.format.qpack import RowLayout
from runmap.residency import host_source as hs
from runmap.residency.cache import ExpertCache
from runmap.residency.host_source import HostSource, HostSourceRewriteError
from runmap.residency.observations import OBSERVATION_NAMES, all_zero, observed

LAYOUT = RowLayout.build(64, 32, 32)  # 3,456-byte rows: 2 layers x 6 experts span 11 pages
PAGE = mmap.PAGESIZE
PROT_READ, PROT_RW = 1, 3


def _rows(layers=2, experts=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (experts, LAYOUT.row_bytes), dtype=torch.uint8, generator=g) for _ in range(layers)]


def _mprotect(addr: int, length: int, prot: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    assert libc.mprotect(ctypes.c_void_p(addr), length, prot) == 0, ctypes.get_errno()


def _protect_all_but(page_index):
    """A _protect_read_only that leaves one page of the host source writable (``None``: protects all of it)."""
    def protect(mm, arr):
        _mprotect(arr.ctypes.data, len(mm), PROT_READ)
        if page_index is not None:
            _mprotect(arr.ctypes.data + page_index * PAGE, PAGE, PROT_RW)
        return True
    return protect


# --- the protection check -------------------------------------------------------------------------------------------
def test_a_verified_host_source_names_both_checks():
    src = HostSource.from_rows(_rows(), LAYOUT)
    n = len(hs._probe_pages(src.nbytes, PAGE))
    assert src.protection_verified and src.protection_holds()
    assert src.protection_detail == (f"write probes in child processes faulted at {n} pages spread over {src.nbytes} "
                                     "bytes; /proc/self/maps: the whole range read-only")
    assert src.verify_protection(probes=3) == (True, f"write probes in child processes faulted at 3 pages spread over "
                                                     f"{src.nbytes} bytes; /proc/self/maps: the whole range read-only")


def test_without_proc_self_maps_the_write_probes_decide(monkeypatch):
    """Where /proc/self/maps does not exist the child-process write probes alone verify the protection, and they
    alone find a page left writable."""
    monkeypatch.setattr(hs, "_maps_read_only", lambda lo, hi: None)
    src = HostSource.from_rows(_rows(), LAYOUT)
    n = len(hs._probe_pages(src.nbytes, PAGE))
    assert src.protection_verified and src.protection_holds()
    assert src.protection_detail == f"write probes in child processes faulted at {n} pages spread over {src.nbytes} " \
                                    "bytes"
    last = hs._probe_pages(src.nbytes, PAGE)[-1] // PAGE
    monkeypatch.setattr(hs, "_protect_read_only", _protect_all_but(last))
    src = HostSource.from_rows(_rows(), LAYOUT)
    assert not src.protection_verified and not src.protection_holds()
    assert src.protection_detail == (f"a child process wrote byte {last * PAGE} of the host source without a fault: "
                                     "that page is writable")


def test_a_writable_page_between_the_probes_is_found_in_proc_self_maps(monkeypatch):
    src = HostSource.from_rows(_rows(), LAYOUT)
    probed = {off // PAGE for off in hs._probe_pages(src.nbytes, PAGE)}
    pages = -(-src.nbytes // PAGE)
    unprobed = min(set(range(pages)) - probed)  # the write probes cannot see this page
    monkeypatch.setattr(hs, "_protect_read_only", _protect_all_but(unprobed))
    src = HostSource.from_rows(_rows(), LAYOUT)
    assert not src.protection_verified and not src.protection_holds()
    assert src.protection_detail == "/proc/self/maps shows a writable part of the host source range"


def test_without_a_child_process_protection_is_not_verified(monkeypatch):
    monkeypatch.setattr(hs, "_child_write_faults", lambda addr: None)
    src = HostSource.from_rows(_rows(), LAYOUT)
    assert src.pages_protected and not src.protection_verified and not src.protection_holds()
    assert src.protection_detail == "no child process could be forked to probe the protection"
    o = ExpertCache(src, resident=3, max_group=2).telemetry()["observations"]["host_source_rewrites"]
    assert o["status"] == "UNKNOWN" and "no child process" in o["reason"]


def test_an_empty_host_source_is_never_verified():
    src = HostSource.from_rows([torch.zeros(0, LAYOUT.row_bytes, dtype=torch.uint8)], LAYOUT)
    assert src.nbytes == 0 and not src.protection_verified and not src.protection_holds()
    assert src.protection_detail == "empty host source: nothing to protect"


def test_probe_pages_of_a_host_source_within_one_page():
    assert hs._probe_pages(100, PAGE) == [0] and hs._probe_pages(PAGE, PAGE) == [0]
    assert hs._probe_pages(8 * PAGE, PAGE) == [i * PAGE for i in range(8)]  # exactly PROBE_PAGES pages: all of them


def test_maps_read_only_reads_the_mappings_of_the_process():
    """Five pages of our own: read-only pages 1-3 between two writable ones, then page 2 unmapped (a gap). Mapped
    and unmapped with libc directly, so that nothing later unmaps the gap (whatever the process maps there)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
    libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
    base = libc.mmap(None, 5 * PAGE, PROT_RW, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
    assert base not in (None, ctypes.c_void_p(-1).value), ctypes.get_errno()
    p = [base + i * PAGE for i in range(6)]
    try:
        _mprotect(p[1], 3 * PAGE, PROT_READ)  # mappings: [p0, p1) rw, [p1, p4) r, [p4, p5) rw
        assert hs._maps_read_only(p[1], p[4]) is True  # exactly the read-only mapping
        assert hs._maps_read_only(p[2], p[3]) is True  # inside it
        assert hs._maps_read_only(p[1] + 100, p[4] - 100) is True
        assert hs._maps_read_only(p[0], p[4]) is False  # a writable page before
        assert hs._maps_read_only(p[1], p[5]) is False  # a writable page after
        assert hs._maps_read_only(p[3], p[4] + 1) is False  # one byte of the writable page
        assert libc.munmap(ctypes.c_void_p(p[2]), PAGE) == 0  # [p1, p2) r, gap, [p3, p4) r
        assert hs._maps_read_only(p[1], p[2]) is True and hs._maps_read_only(p[3], p[4]) is True
        assert hs._maps_read_only(p[1], p[4]) is False  # the gap is not read-only memory of the range
    finally:
        libc.munmap(ctypes.c_void_p(p[0]), 2 * PAGE)
        libc.munmap(ctypes.c_void_p(p[3]), 2 * PAGE)


# --- the counters behind host_source_rewrites and request_hash_work -------------------------------------------------
def test_every_refused_rewrite_counts():
    src = HostSource.from_rows(_rows(), LAYOUT)
    for n in (1, 2):
        with pytest.raises(HostSourceRewriteError, match=f"refused a rewrite of layer 1 expert {n}"):
            src.write_row(1, n, b"x")
        assert src.rewrite_attempts == n


def test_an_array_made_writable_again_counts_as_a_rewrite_attempt_each_time_it_is_seen():
    src = HostSource.from_rows(_rows(), LAYOUT)
    cache = ExpertCache(src, resident=3, max_group=2)
    assert src.check_frozen() and src.rewrite_attempts == 0
    src.array.flags.writeable = True  # nothing is written (the pages are still read-only)
    assert not src.check_frozen() and src.rewrite_attempts == 1
    assert not src.check_frozen() and src.rewrite_attempts == 2
    assert not src.protection_holds()
    o = cache.telemetry()["observations"]["host_source_rewrites"]
    assert o["status"] == "UNKNOWN" and "writable again" in o["reason"] and src.rewrite_attempts == 3


def test_every_hash_after_startup_counts():
    src = HostSource.from_rows(_rows(), LAYOUT)
    assert src.hash_ops_after_seal == 0 and src.hash_bytes_after_seal == 0
    for n, (layer, e) in enumerate([(0, 1), (1, 5)], start=1):
        assert src.hash_row(layer, e) == hashlib.sha256(src.expected_row(layer, e).tobytes()).hexdigest()
        assert src.hash_ops_after_seal == n and src.hash_bytes_after_seal == n * LAYOUT.row_bytes


# --- all_zero ----------------------------------------------------------------------------------------------------
def test_all_zero_needs_every_observation():
    full = {n: observed(n, 0, "test") for n in OBSERVATION_NAMES}
    assert all_zero(full)
    for missing in OBSERVATION_NAMES:
        assert not all_zero({n: o for n, o in full.items() if n != missing}), missing
    assert not all_zero({})


# --- construction (scope `construction` of benchmarks/mutation.sh) ---------------------------------------------------
RB = LAYOUT.row_bytes  # 3,456


def _refusal(*args, **kw) -> str:
    with pytest.raises(hs.HostSourceError) as e:
        HostSource(*args, **kw)
    return str(e.value)


def test_rows_of_the_wrong_kind_are_refused_naming_the_layer():
    assert _refusal([], LAYOUT, None) == "host source: no layers given"
    u8 = lambda *shape: torch.zeros(*shape, dtype=torch.uint8)  # noqa: E731
    expect = "(row_bytes from the row layout)"
    assert _refusal([u8(6, RB).to(torch.int16)], LAYOUT, None) == (
        f"host source: layer 0 expert rows are torch.int16 (6, {RB}), expected uint8 (6, {RB}) {expect}")
    # the expert count comes from layer 0; a layer 0 that is not 2-D has none
    assert _refusal([u8(6 * RB), u8(6, RB)], LAYOUT, None) == (
        f"host source: layer 0 expert rows are torch.uint8 ({6 * RB},), expected uint8 (-1, {RB}) {expect}")
    assert _refusal([u8(1, 6, RB)], LAYOUT, None) == (
        f"host source: layer 0 expert rows are torch.uint8 (1, 6, {RB}), expected uint8 (-1, {RB}) {expect}")
    assert _refusal([u8(3, RB), u8(4, RB)], LAYOUT, None) == (
        f"host source: layer 1 expert rows are torch.uint8 (4, {RB}), expected uint8 (3, {RB}) {expect}")


def test_a_new_host_source_is_an_anonymous_private_mapping_with_its_counters_at_zero():
    rows = _rows()
    src = HostSource(rows, LAYOUT, None, identity="pack-123")
    assert (src.layout, src.identity, src.num_layers, src.num_experts, src.row_bytes) == (LAYOUT, "pack-123", 2, 6, RB)
    assert (src.rewrite_attempts, src.hash_ops_startup, src.hash_ops_after_seal, src.hash_bytes_after_seal,
            src.pack_bytes_at_seal) == (0, 0, 0, 0, 0)
    assert src.watched_readers == [] and src.reader is None and src.nbytes == 2 * 6 * RB
    assert all(torch.equal(src.row_tensor(layer, e), rows[layer][e]) for layer in range(2) for e in range(6))
    lo = src.array.ctypes.data
    with open("/proc/self/maps") as f:  # "start-end perms ...": the mapping that holds the rows
        perms = [p for rng, p, *_ in (line.split() for line in f)
                 if int(rng.split("-")[0], 16) <= lo < int(rng.split("-")[1], 16)]
    assert perms == ["r--p"]  # read-only, and private: never shared with a forked child or a file


def test_without_page_protection_the_host_source_says_so(monkeypatch):
    monkeypatch.setattr(hs, "_protect_read_only", lambda mm, arr: False)
    src = HostSource.from_rows(_rows(), LAYOUT)
    assert not src.pages_protected and not src.protection_verified
    assert src.protection_detail == "mprotect(PROT_READ) of the host source failed or is not available"


def test_hash_lists_of_the_wrong_size_or_value_are_refused_naming_the_expert():
    rows = _rows(2, 3)
    good = [[hashlib.sha256(r[e].numpy().tobytes()).hexdigest() for e in range(3)] for r in rows]
    src = HostSource(rows, LAYOUT, good)
    assert src.hash_ops_startup == 6 and src.hash_ops_after_seal == 0
    assert _refusal(rows, LAYOUT, good[:1]) == "host source: 1 layers of hashes for 2 layers"
    assert _refusal(rows, LAYOUT, [good[0], good[1][:2]]) == "host source: layer 1 has 2 hashes for 3 experts"
    for layer, e in ((0, 0), (1, 2), (0, 2), (1, 0)):
        bad = [list(h) for h in good]
        bad[layer][e] = "0" * 64
        assert _refusal(rows, LAYOUT, bad) == (f"host source: layer {layer} expert {e} sha256 {good[layer][e]} does "
                                               f"not match the manifest's {'0' * 64}")


class _Reader:
    """A pack reader (PackReader API) with only what from_pack needs: no identity, no bytes_read."""

    def __init__(self, rows, layout=LAYOUT, short_layer=None):
        self.layout, self._rows, self.closed, self.short_layer = layout, rows, False, short_layer
        self.num_layers, self.num_experts = len(rows), rows[0].shape[0]

    def read_expert_rows(self, layer):
        return self._rows[layer][:-1] if layer == self.short_layer else self._rows[layer]

    def expert_sha256(self, layer):
        return [hashlib.sha256(self._rows[layer][e].numpy().tobytes()).hexdigest() for e in range(self.num_experts)]

    def close(self):
        self.closed = True


def test_from_pack_keeps_the_reader_and_what_it_read():
    from runmap.residency.contract_model import InMemoryPack

    rows = _rows()
    pack = InMemoryPack(rows, LAYOUT)
    src = HostSource.from_pack(pack)
    assert src.reader is pack and pack.closed and src.identity == pack.identity
    assert src.pack_bytes_at_seal == pack.bytes_read == 2 * 6 * RB and src.hash_ops_startup == 12
    assert all(torch.equal(src.row_tensor(layer, e), rows[layer][e]) for layer in range(2) for e in range(6))
    bare = _Reader(rows)  # a reader without identity and bytes_read
    src = HostSource.from_pack(bare)
    assert src.reader is bare and bare.closed and src.identity is None and src.pack_bytes_at_seal == 0
    assert src.hash_ops_startup == 12


def test_from_pack_refuses_a_reader_it_cannot_trust():
    rows = _rows()
    with pytest.raises(hs.HostSourceError) as e:
        HostSource.from_pack(_Reader(rows, layout={"row_bytes": RB}))
    assert str(e.value) == "pack reader layout is dict, expected RowLayout"
    with pytest.raises(hs.HostSourceError) as e:
        HostSource.from_pack(_Reader(rows, short_layer=1))
    assert str(e.value) == "pack layer 1: 5 expert rows, manifest says 6"


# --- accessors (scope `construction-rest` of benchmarks/mutation.sh) -------------------------------------------------
def test_from_rows_verifies_the_hashes_and_keeps_the_identity_it_is_given():
    rows = _rows()
    good = [[hashlib.sha256(r[e].numpy().tobytes()).hexdigest() for e in range(6)] for r in rows]
    src = HostSource.from_rows(rows, LAYOUT, good, identity="pack-123")
    assert (src.identity, src.hash_ops_startup) == ("pack-123", 12)
    assert HostSource.from_rows(rows, LAYOUT).identity is None


def test_row_tensor_reads_a_host_row_and_refuses_every_other_index():
    rows = _rows()  # 2 layers x 6 experts
    src = HostSource.from_rows(rows, LAYOUT)
    assert torch.equal(src.row_tensor(0, 0), rows[0][0]) and torch.equal(src.row_tensor(1, 5), rows[1][5])
    for layer, expert in ((2, 0), (0, 6), (-1, 0), (0, -1), (1, 7)):
        with pytest.raises(IndexError) as e:
            src.row_tensor(layer, expert)
        assert str(e.value) == f"host source has no layer {layer} expert {expert} (2 layers x 6 experts)"


class _WatchedReader:
    """Another reader of the same pack: counts what it reads (and its refused reads), also after it was closed."""

    def __init__(self, bytes_read=0):
        self.bytes_read, self.reads_after_close, self.closed = bytes_read, 0, False

    def close(self):
        self.closed = True


class _UncountedReader:  # a reader without counters
    closed = False

    def close(self):
        self.closed = True


def test_a_watched_reader_is_closed_and_what_it_reads_later_counts_in_every_cache_over_the_host_source():
    from runmap.residency.contract_model import InMemoryPack

    src = HostSource.from_pack(InMemoryPack(_rows(), LAYOUT))
    later, bare = _WatchedReader(bytes_read=5 * RB), _UncountedReader()  # what `later` read before is not counted
    src.watch_reader(later)
    src.watch_reader(bare)
    assert later.closed and bare.closed
    caches = [ExpertCache.from_host(src, resident=6, max_group=2) for _ in range(2)]
    for cache in caches:
        assert cache.telemetry()["observations"]["request_pack_reads"] == {
            "status": "OBSERVED", "value": 0, "unit": "bytes",
            "source": "pack reader bytes_read after startup (3 closed reader(s); 0 refused read attempts)"}
    later.bytes_read += RB
    later.reads_after_close += 2
    for cache in caches:
        assert cache.telemetry()["observations"]["request_pack_reads"] == {
            "status": "OBSERVED", "value": RB, "unit": "bytes",
            "source": "pack reader bytes_read after startup (3 closed reader(s); 2 refused read attempts)"}


class _RowsOnAnotherDevice(torch.Tensor):
    """uint8 rows that say they live on a CUDA device (a wrapper subclass: nothing is allocated there, so this runs
    on a machine without a GPU); the only way to their bytes is a copy to the CPU, as for real device rows."""

    @staticmethod
    def __new__(cls, data: torch.Tensor):
        t = torch.Tensor._make_wrapper_subclass(cls, data.shape, dtype=data.dtype, device="cuda",
                                                strides=data.stride())
        t.data_on_device = data
        return t

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten.detach.default:
            return cls(args[0].data_on_device)
        if func is torch.ops.aten._to_copy.default and kwargs.get("device") == torch.device("cpu"):
            return args[0].data_on_device.clone()
        raise NotImplementedError(f"{func} is not available on these rows")


def test_rows_held_on_a_device_are_copied_into_host_memory():
    # A pack read onto the GPU (or rows a test builds there) must still end up as bytes in the process's own
    # read-only mapping: the host source copies each layer to the CPU rather than hand numpy a device tensor.
    rows = _rows()
    src = HostSource.from_rows([_RowsOnAnotherDevice(r) for r in rows], LAYOUT)
    assert src.num_layers == 2 and src.num_experts == 6
    for layer, r in enumerate(rows):
        for e in range(6):
            assert torch.equal(src.row_tensor(layer, e), r[e])
