"""The immutable host source of resident-qpacked-cache-v1 (docs/cache-contract.md, rule 1 `host-source`).

At startup every routed expert row of every layer is copied into one process-owned host array,
every page is touched, the per-expert hashes are verified once, and the array is then frozen
(``numpy`` ``writeable = False``). The pack reader is closed afterwards; its own counters show any
later read (``reads_after_close``). The host source is the only origin of expert bytes for misses
and is kept even under full residency.

Instrumentation kept here (docs/cache-contract.md#observations):

* ``rewrite_attempts`` — every call of ``write_row`` (the one mutation entry point, which always
  refuses) and every time ``check_frozen`` finds the array made writable again. Beyond that the pages are
  ``mprotect``-ed read-only after sealing (``pages_protected``), so a write through any alias faults
  instead of silently changing an expert. That the protection holds is *verified*, not assumed
  (``verify_protection``): a forked child writes one byte at pages spread over the whole range (first and
  last page included) and must die of SIGSEGV/SIGBUS at each, and, where ``/proc/self/maps`` exists, every
  page of the range must lie in a mapping without write permission. Only a verified host source makes the
  ``host_source_rewrites`` observation OBSERVED.
* ``hash_ops_after_seal`` / ``hash_bytes_after_seal`` — any hash computed after startup
  (request-time hash work).
"""
from __future__ import annotations

import ctypes
import faulthandler
import hashlib
import mmap
import os
import signal
import warnings
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from runmap.format.qpack import RowLayout


class HostSourceError(ValueError):
    """The pack's rows, hashes or layout do not match what the host source expects."""


class HostSourceRewriteError(RuntimeError):
    """Something tried to modify the immutable host source."""


def _sha256(buf: np.ndarray) -> str:
    return hashlib.sha256(memoryview(buf)).hexdigest()


_PROT_READ = 1


def _protect_read_only(mm: mmap.mmap, arr: np.ndarray) -> bool:
    """mprotect(PROT_READ) the anonymous mapping behind ``arr``. True when the kernel accepted it (Linux and
    other POSIX systems); False where libc's mprotect is not reachable, which the observations report."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        mprotect = libc.mprotect
    except (OSError, AttributeError):
        return False
    mprotect.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    mprotect.restype = ctypes.c_int
    return mprotect(ctypes.c_void_p(arr.ctypes.data), len(mm), _PROT_READ) == 0  # mmap memory is page-aligned


PROBE_PAGES = 8  # pages written by the child-process probe (first, last and evenly spread between)


def _probe_pages(nbytes: int, page: int, n: int = PROBE_PAGES) -> list[int]:
    """Byte offsets of up to ``n`` page starts spread over [0, nbytes), first and last page included."""
    pages = max(1, -(-nbytes // page))
    if pages <= n:
        return [i * page for i in range(pages)]
    return sorted({round(i * (pages - 1) / (n - 1)) * page for i in range(n)})


def _child_write_faults(addr: int) -> bool | None:
    """Fork; the child writes one byte at ``addr`` and exits 0 if the write went through. True when the child
    died of SIGSEGV/SIGBUS (the page is read-only), False when it wrote, None when no child could be run.
    The parent's memory is never written (the mapping is private: a write lands in the child's copy)."""
    if not hasattr(os, "fork"):
        return None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork in a threaded process: the child only writes
        try:
            pid = os.fork()
        except OSError:
            return None
    if pid == 0:  # child: no Python-level work beyond the one store
        try:
            faulthandler.disable()
            try:
                import resource
                resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
            except (ImportError, ValueError, OSError):
                pass
            ctypes.memset(ctypes.c_void_p(addr), 0x5A, 1)
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        return os.WTERMSIG(status) in (signal.SIGSEGV, signal.SIGBUS)
    return False


def _maps_read_only(lo: int, hi: int) -> bool | None:
    """True when every byte of [lo, hi) lies in mappings of /proc/self/maps without write permission; None
    where the file does not exist."""
    try:
        with open("/proc/self/maps") as f:
            lines = f.readlines()
    except OSError:
        return None
    covered = lo
    for line in lines:
        span, perms = line.split()[:2]
        a, b = (int(x, 16) for x in span.split("-"))
        if b <= covered or a >= hi:
            continue
        if a > covered or "w" in perms:
            return False  # a gap in the range, or a writable piece of it
        covered = b
        if covered >= hi:
            return True
    return covered >= hi


class HostSource:
    """All routed expert rows, (L, E, row_bytes) uint8, in process-owned host memory, read-only.

    Use ``from_rows`` (tests) or ``from_pack`` (a ``runmap.format.packfile.PackReader``-like object).
    """

    def __init__(self, rows: list[torch.Tensor], layout: RowLayout, sha256: list[list[str]] | None,
                 identity: str | None = None):
        if not rows:
            raise HostSourceError("host source: no layers given")
        num_experts = rows[0].shape[0] if rows[0].dim() == 2 else -1
        for layer, r in enumerate(rows):
            if r.dtype != torch.uint8 or r.dim() != 2 or r.shape != (num_experts, layout.row_bytes):
                raise HostSourceError(
                    f"host source: layer {layer} expert rows are {r.dtype} {tuple(r.shape)}, expected "
                    f"uint8 ({num_experts}, {layout.row_bytes}) (row_bytes from the row layout)")
        self.layout = layout
        self.num_layers = len(rows)
        self.num_experts = num_experts
        self.row_bytes = layout.row_bytes
        self.identity = identity
        self.rewrite_attempts = 0
        self.hash_ops_startup = 0
        self.hash_ops_after_seal = 0
        self.hash_bytes_after_seal = 0
        self.pack_bytes_at_seal = 0
        self.watched_readers: list = []  # [(closed reader, bytes_read at close)]: see watch_reader
        self._sealed = False
        nbytes = self.num_layers * num_experts * self.row_bytes
        # Anonymous private mapping: memory owned by this process, not a view of the pack file.
        self._mm = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        arr = np.frombuffer(self._mm, dtype=np.uint8, count=nbytes).reshape(self.num_layers, num_experts,
                                                                            self.row_bytes)
        for layer, r in enumerate(rows):
            arr[layer] = r.detach().to("cpu").contiguous().numpy()  # (E, row_bytes) copy, writes every page
        self._touch_pages(arr)
        if sha256 is not None:
            self._verify(arr, sha256)
        arr.flags.writeable = False
        # torch has no read-only tensors, so the numpy flag alone cannot stop a write through the torch alias
        # below: the pages themselves are made read-only, and any write to the host source faults.
        self.pages_protected = _protect_read_only(self._mm, arr)
        self._array = arr
        self.protection_verified, self.protection_detail = self.verify_protection() if self.pages_protected else (
            False, "mprotect(PROT_READ) of the host source failed or is not available")
        # Internal torch alias used only as the *source* of host -> staging copies (torch has no
        # read-only tensors; the public view is the frozen numpy array).
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            self._tensor = torch.from_numpy(arr)  # (L, E, row_bytes) uint8, never written
        self._sealed = True

    # --- construction ---------------------------------------------------------------------------
    @classmethod
    def from_rows(cls, rows: list[torch.Tensor], layout: RowLayout, sha256: list[list[str]] | None = None,
                  identity: str | None = None) -> "HostSource":
        """rows: per layer uint8 (E, row_bytes); sha256: per layer list of E hex digests, or None."""
        return cls(rows, layout, sha256, identity)

    @classmethod
    def from_pack(cls, reader) -> "HostSource":
        """Read every layer through ``reader`` (PackReader API), verify hashes once, close the reader.

        The reader stays referenced as ``self.reader`` so its ``reads_after_close`` counter can be
        reported; it refuses every read once closed.
        """
        layout = reader.layout
        if not isinstance(layout, RowLayout):
            raise HostSourceError(f"pack reader layout is {type(layout).__name__}, expected RowLayout")
        rows, hashes = [], []
        for layer in range(reader.num_layers):
            r = reader.read_expert_rows(layer)  # (E, row_bytes) uint8
            if r.shape[0] != reader.num_experts:
                raise HostSourceError(f"pack layer {layer}: {r.shape[0]} expert rows, manifest says "
                                      f"{reader.num_experts}")
            rows.append(r)
            hashes.append(list(reader.expert_sha256(layer)))
        identity = getattr(reader, "identity", None)
        src = cls(rows, layout, hashes, identity)
        del rows
        reader.close()
        src.reader = reader
        src.pack_bytes_at_seal = int(getattr(reader, "bytes_read", 0))
        return src

    reader = None

    def watch_reader(self, reader) -> None:
        """Close ``reader`` (another reader of the same pack, e.g. a later engine's when a benchmark reuses this
        host source) and keep observing it: its bytes read after this point and its refused reads count in the
        ``request_pack_reads`` observation of every cache over this host source."""
        reader.close()
        self.watched_readers.append((reader, int(getattr(reader, "bytes_read", 0))))

    # --- startup steps ----------------------------------------------------------------------------
    @staticmethod
    def _touch_pages(arr: np.ndarray) -> None:
        flat = arr.reshape(-1)
        page = mmap.PAGESIZE
        # Reading one byte per page faults every page in (the copy above already wrote them).
        int(flat[::page].sum(dtype=np.uint64)) if flat.size else 0

    def _verify(self, arr: np.ndarray, sha256: list[list[str]]) -> None:
        if len(sha256) != self.num_layers:
            raise HostSourceError(f"host source: {len(sha256)} layers of hashes for {self.num_layers} layers")
        for layer in range(self.num_layers):
            if len(sha256[layer]) != self.num_experts:
                raise HostSourceError(f"host source: layer {layer} has {len(sha256[layer])} hashes for "
                                      f"{self.num_experts} experts")
        # hashlib releases the GIL on large buffers, so threads hash rows in parallel (startup of a real-size
        # pack is dominated by this); results are checked in (layer, expert) order, so the error is the same.
        cells = [(layer, e) for layer in range(self.num_layers) for e in range(self.num_experts)]
        workers = max(1, min(16, os.cpu_count() or 1))
        with ThreadPoolExecutor(max_workers=workers) as pool:
            digests = list(pool.map(lambda c: _sha256(arr[c[0], c[1]]), cells))
        for (layer, e), got in zip(cells, digests):
            self.hash_ops_startup += 1
            if got != sha256[layer][e]:
                raise HostSourceError(f"host source: layer {layer} expert {e} sha256 {got} does not match "
                                      f"the manifest's {sha256[layer][e]}")

    def verify_protection(self, probes: int = PROBE_PAGES) -> tuple[bool, str]:
        """Check from outside the interpreter that the whole host source is read-only (module docstring).
        Returns (verified, what was checked or why it failed)."""
        base, nbytes = self._array.ctypes.data, self._array.nbytes
        if nbytes == 0:
            return False, "empty host source: nothing to protect"
        offsets = _probe_pages(nbytes, mmap.PAGESIZE, probes)
        for off in offsets:
            r = _child_write_faults(base + off)
            if r is None:
                return False, "no child process could be forked to probe the protection"
            if not r:
                return False, (f"a child process wrote byte {off} of the host source without a fault: "
                               f"that page is writable")
        maps = _maps_read_only(base, base + nbytes)
        if maps is False:
            return False, "/proc/self/maps shows a writable part of the host source range"
        return True, (f"write probes in child processes faulted at {len(offsets)} pages spread over "
                      f"{nbytes} bytes" + ("" if maps is None else "; /proc/self/maps: the whole range read-only"))

    def protection_holds(self) -> bool:
        """Cheap re-check (telemetry time): verified at startup, array still read-only and, where
        /proc/self/maps exists, no page of the range writable now."""
        if not self.protection_verified or self._array.flags.writeable:
            return False
        base = self._array.ctypes.data
        return _maps_read_only(base, base + self._array.nbytes) is not False

    # --- read access --------------------------------------------------------------------------------
    @property
    def array(self) -> np.ndarray:
        """(L, E, row_bytes) uint8, read-only."""
        return self._array

    def row_tensor(self, layer: int, expert: int) -> torch.Tensor:
        """uint8 (row_bytes,) CPU tensor aliasing the host row. Callers only read it."""
        if not (0 <= layer < self.num_layers and 0 <= expert < self.num_experts):
            raise IndexError(f"host source has no layer {layer} expert {expert} "
                             f"({self.num_layers} layers x {self.num_experts} experts)")
        return self._tensor[layer, expert]

    def expected_row(self, layer: int, expert: int) -> np.ndarray:
        """(row_bytes,) uint8 read-only numpy view, for checks."""
        return self._array[layer, expert]

    def hash_row(self, layer: int, expert: int) -> str:
        """Hash one row. Counted: after startup this is request-time hash work."""
        if self._sealed:
            self.hash_ops_after_seal += 1
            self.hash_bytes_after_seal += self.row_bytes
        return _sha256(self._array[layer, expert])

    # --- the only mutation entry point: refuses and counts ------------------------------------------
    def write_row(self, layer: int, expert: int, data) -> None:
        self.rewrite_attempts += 1
        raise HostSourceRewriteError(f"host source is immutable: refused a rewrite of layer {layer} expert {expert}")

    def check_frozen(self) -> bool:
        """True when the array is still read-only; a writable flag counts as a rewrite attempt."""
        if self._array.flags.writeable:
            self.rewrite_attempts += 1
            return False
        return True

    @property
    def nbytes(self) -> int:
        return self._array.nbytes
