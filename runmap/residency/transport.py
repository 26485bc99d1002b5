"""Transport seam of the expert cache: host (pageable) -> staging -> device spare row.

The cache only ever moves expert bytes through a ``Transport``. Two real implementations:

* ``CpuTransport``: device rows are CPU tensors, copies are synchronous, events are born complete.
* ``CudaTransport``: staging buffers are pinned, the staging -> device copy is issued on a dedicated
  transfer stream and an event is recorded after each copy.

Contract v2 (``resident-qpacked-cache-v2``, opt-in) skips the staging copy: the host source is registered
(pinned) once and rows are copied straight into spare rows (``PinnedSourceTransport``; ``CpuDirectTransport``
is its CPU analogue for the contract tests). Publication, leases, failures and observations are v1's: the cache
still takes a staging slot per in-flight row (a one-byte token that bounds the copies in flight).

Tests and the contract model substitute ``runmap.residency.contract_model.ControlledTransport``, which defers
completions and injects failures at every step. Every transport counts the bytes it moves by
direction; no method copies device -> host, so ``d2h_bytes`` is an instrumented zero.
"""
from __future__ import annotations

import time

import weakref
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch


class TransferError(RuntimeError):
    """A host -> device expert copy (or its staging) failed."""


class Event:
    """Completion marker of one staging -> device copy."""

    __slots__ = ("raw", "nbytes")

    def __init__(self, raw, nbytes: int):
        self.raw = raw  # torch.cuda.Event, or None when the copy completed synchronously
        self.nbytes = nbytes


from runmap.residency.contracts import CACHE_CONTRACTS, CONTRACT_V1, CONTRACT_V2  # noqa: F401 (re-exported)


class Transport:
    """Base class: the operations the cache needs. Subclasses override the marked methods."""

    device: torch.device
    contract = CONTRACT_V1  # the cache contract this transport implements
    direct = False  # True: rows go host source -> device row with no staging copy (v2)

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.h2d_bytes = 0  # staging -> device, expert rows
        self.stage_bytes = 0  # host source -> staging
        self.d2h_bytes = 0  # never incremented: there is no device -> host path
        self.table_uploads = 0

    # allocation -----------------------------------------------------------------------------------
    def alloc_storage(self, rows: int, row_bytes: int) -> torch.Tensor:
        """uint8 (rows, row_bytes) on the device, zero-filled."""
        return torch.zeros(rows, row_bytes, dtype=torch.uint8, device=self.device)

    def alloc_staging(self, row_bytes: int) -> torch.Tensor:
        """uint8 (row_bytes,) host buffer (pinned on CUDA)."""
        return torch.empty(row_bytes, dtype=torch.uint8)

    # data movement ----------------------------------------------------------------------------------
    def stage(self, staging: torch.Tensor, host_row: torch.Tensor) -> None:
        """Copy one host-source row (uint8 (row_bytes,), CPU) into a staging buffer (CPU memcpy)."""
        staging.copy_(host_row)
        self.stage_bytes += host_row.numel()

    def h2d(self, dst_row: torch.Tensor, staging: torch.Tensor) -> Event:
        """Start the staging -> device row copy; returns its completion event."""
        raise NotImplementedError

    def stage_and_copy(self, dst_row: torch.Tensor, staging: torch.Tensor, host_row: torch.Tensor) -> Event:
        """host row -> staging -> device row; returns the event of the device copy. Transports may
        pipeline the two steps in chunks (CudaTransport(chunk_bytes=...))."""
        self.stage(staging, host_row)
        return self.h2d(dst_row, staging)

    def copy_rows(self, jobs: list, on_submit) -> None:
        """Move several rows: jobs = [(dst_row, staging, host_row)]; ``on_submit(j, event)`` is called as
        soon as job j's device copy is issued, so that a failure part-way leaves every issued copy known."""
        for j, (dst, stg, src) in enumerate(jobs):
            on_submit(j, self.stage_and_copy(dst, stg, src))

    def query(self, ev: Event) -> bool:
        """True once the copy behind ``ev`` has completed (successfully or not)."""
        raise NotImplementedError

    def wait(self, ev: Event) -> None:
        """Block until ``ev`` completed; raise TransferError if the copy failed."""
        raise NotImplementedError

    def upload_table(self, table: list[int]) -> torch.Tensor:
        """int32 (E,) row table on the device (the generation's mapping of one layer)."""
        self.table_uploads += 1
        return torch.tensor(table, dtype=torch.int32, device=self.device)

    def note_release(self) -> None:
        """A request was released: rows it could read may be recycled after work issued so far."""

    def upload_table_async(self, table: list[int]) -> tuple[torch.Tensor, Event | None]:
        """Like ``upload_table`` but may return before the copy completed, with its event (or None
        when the table is already complete). The caller waits for the event before publishing."""
        return self.upload_table(table), None

    def after_publish(self) -> None:
        """Order later compute after the published copies; a failure here is ambiguous (FAULTED)."""

    def attach_host(self, host) -> None:
        """Called once by the cache with its HostSource before any copy (v2 registers it here)."""

    def describe(self) -> dict:
        return {"kind": type(self).__name__, "device": str(self.device)}


class CpuTransport(Transport):
    """Device rows are ordinary CPU tensors; every copy completes before ``h2d`` returns."""

    def __init__(self):
        super().__init__(torch.device("cpu"))

    def h2d(self, dst_row, staging):
        dst_row.copy_(staging)  # (row_bytes,)
        self.h2d_bytes += staging.numel()
        return Event(None, staging.numel())

    def query(self, ev):
        return True

    def wait(self, ev):
        return None


class CudaTransport(Transport):
    """Pinned staging, a dedicated transfer stream, one event per staging -> device copy."""

    def __init__(self, device="cuda", chunk_bytes: int | None = None, stage_workers: int = 0):
        dev = torch.device(device)
        if chunk_bytes is not None and chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
        if stage_workers < 0:
            raise ValueError(f"stage_workers must be >= 0, got {stage_workers}")
        self.chunk_bytes = chunk_bytes
        self.stage_workers = stage_workers
        # numpy copies release the GIL, so worker threads copy host rows into staging in parallel
        self._pool = ThreadPoolExecutor(stage_workers, thread_name_prefix="runmap-stage") if stage_workers else None
        self._table_host = None  # one pinned int32 buffer; transactions are serialized and wait for it
        self._table_host_np = None
        if dev.type != "cuda":
            raise ValueError(f"CudaTransport needs a cuda device, got {dev}")
        if not torch.cuda.is_available():
            raise RuntimeError("CudaTransport: CUDA is not available in this process")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        super().__init__(dev)
        self.stream = torch.cuda.Stream(device=dev)
        self._release_event = None  # compute-stream event recorded at the latest request release

    def alloc_storage(self, rows, row_bytes):
        t = super().alloc_storage(rows, row_bytes)  # zero-filled on the current stream
        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # copies land after the fill
        return t

    def note_release(self):
        # Kernels of the released request may still be queued on the compute stream; a recycled row
        # must not be overwritten before they ran (write-after-read across streams).
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        self._release_event = ev

    def _order_after_releases(self):
        if self._release_event is not None:
            self.stream.wait_event(self._release_event)

    def alloc_staging(self, row_bytes):
        return torch.empty(row_bytes, dtype=torch.uint8, pin_memory=True)

    def stage_and_copy(self, dst_row, staging, host_row):
        if not self.chunk_bytes or self.chunk_bytes >= host_row.numel():
            return super().stage_and_copy(dst_row, staging, host_row)
        # Pipeline within the row: the CPU copies chunk i+1 into staging while the DMA engine moves
        # chunk i. Each chunk of staging is written once per row, so no chunk is rewritten in flight.
        n = host_row.numel()
        self._order_after_releases()
        with torch.cuda.stream(self.stream):
            for lo in range(0, n, self.chunk_bytes):
                hi = min(n, lo + self.chunk_bytes)
                staging[lo:hi].copy_(host_row[lo:hi])  # (chunk,) pageable -> pinned, CPU
                dst_row[lo:hi].copy_(staging[lo:hi], non_blocking=True)  # (chunk,) pinned -> device
            ev = torch.cuda.Event()
            ev.record(self.stream)
        self.stage_bytes += n
        self.h2d_bytes += n
        return Event(ev, n)

    def copy_rows(self, jobs, on_submit):
        if self._pool is None and not self.chunk_bytes:
            # One stream context for the whole batch: entering torch.cuda.stream() and recording an event
            # per row measured ~50 us per row on the H200 (tools/explore/probe_staging.py), which serialised the
            # CPU staging of row i+1 behind the bookkeeping of row i instead of overlapping it with row i's DMA.
            self._order_after_releases()
            n = jobs[0][2].numel() if jobs else 0  # one size per layer: one call (each goes through the copy monitor)
            with torch.cuda.stream(self.stream):
                for j, (dst, stg, src) in enumerate(jobs):
                    stg.copy_(src)  # (row_bytes,) pageable -> pinned, CPU
                    self.stage_bytes += n
                    dst.copy_(stg, non_blocking=True)  # (row_bytes,) pinned -> device, transfer stream
                    ev = torch.cuda.Event()
                    ev.record(self.stream)
                    self.h2d_bytes += n
                    on_submit(j, Event(ev, n))
            return None
        if self._pool is None:
            return super().copy_rows(jobs, on_submit)
        self._order_after_releases()
        if len(jobs) == 1:
            dst, stg, src = jobs[0]
            n = src.numel()
            step = -(-n // self.stage_workers)
            step = -(-step // 4096) * 4096  # page-aligned pieces
            spans = [(lo, min(n, lo + step)) for lo in range(0, n, step)]
            futs = [self._pool.submit(_np_copy, stg[lo:hi], src[lo:hi]) for lo, hi in spans]
            try:
                with torch.cuda.stream(self.stream):
                    for (lo, hi), f in zip(spans, futs):
                        f.result()
                        dst[lo:hi].copy_(stg[lo:hi], non_blocking=True)  # (piece,) as soon as it is staged
                    ev = torch.cuda.Event()
                    ev.record(self.stream)
            except BaseException:
                for f in futs:
                    f.cancel() or f.exception()
                self.stream.synchronize()  # no piece of this row stays in flight behind an error
                raise
            self.stage_bytes += n
            self.h2d_bytes += n
            on_submit(0, Event(ev, n))
            return None
        # Several rows: workers stage rows in parallel; each row's DMA starts once its staging is done.
        futs = [self._pool.submit(_np_copy, stg, src) for _dst, stg, src in jobs]
        try:
            for j, ((dst, stg, src), f) in enumerate(zip(jobs, futs)):
                f.result()
                self.stage_bytes += src.numel()
                with torch.cuda.stream(self.stream):
                    dst.copy_(stg, non_blocking=True)  # (row_bytes,) pinned -> device
                    ev = torch.cuda.Event()
                    ev.record(self.stream)
                self.h2d_bytes += src.numel()
                on_submit(j, Event(ev, src.numel()))
        except BaseException:
            for f in futs:  # never return while a worker may still write a staging buffer
                f.cancel() or f.exception()
            raise
        return None

    def h2d(self, dst_row, staging):
        # Spare rows are read by nothing published; a recycled victim row may still be read by kernels
        # queued before the release that freed it, hence the wait on the latest release event.
        self._order_after_releases()
        with torch.cuda.stream(self.stream):
            dst_row.copy_(staging, non_blocking=True)  # (row_bytes,) pinned -> device
            ev = torch.cuda.Event()
            ev.record(self.stream)
        self.h2d_bytes += staging.numel()
        return Event(ev, staging.numel())

    def query(self, ev):
        return ev.raw is None or ev.raw.query()

    def wait(self, ev):
        if ev.raw is not None:
            try:
                ev.raw.synchronize()
            except RuntimeError as e:  # a CUDA error surfaced by the copy
                raise TransferError(f"host -> device expert copy failed: {e}") from e

    def _stream_owned_table(self, n: int, reader: torch.cuda.Stream) -> torch.Tensor:
        """A device int32 (n,) allocated while the transfer stream is current, so the caching allocator
        never hands it a block that kernels still queued on the compute stream may read; recorded on the
        compute stream, which reads it, so it is not recycled before those reads either."""
        out = torch.empty(n, dtype=torch.int32, device=self.device)
        out.record_stream(reader)
        return out

    def upload_table(self, table):
        self.table_uploads += 1
        t = torch.tensor(table, dtype=torch.int32).pin_memory()
        compute = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self.stream):
            out = self._stream_owned_table(len(table), compute)
            out.copy_(t, non_blocking=True)  # (E,)
        self.stream.synchronize()  # the table must be complete before the generation is published
        return out

    def upload_table_async(self, table):
        self.table_uploads += 1
        if self._table_host is None or len(self._table_host_np) != len(table):
            self._table_host = torch.empty(len(table), dtype=torch.int32, pin_memory=True)
            self._table_host_np = self._table_host.numpy()  # the same pinned memory, written without a torch call
        # safe to overwrite: the previous upload was waited for before its generation was published
        self._table_host_np[:] = table
        t = self._table_host
        compute = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self.stream):
            out = self._stream_owned_table(len(table), compute)
            out.copy_(t, non_blocking=True)  # (E,) behind the row copies on the same stream
            ev = torch.cuda.Event()
            ev.record(self.stream)
        return out, Event(ev, 4 * len(table))

    def after_publish(self):
        # Later kernels on the compute stream must observe the copies (already complete on the host
        # side; this also orders them for graph capture / multi-stream users).
        torch.cuda.current_stream(self.device).wait_stream(self.stream)

    def describe(self):
        return {"kind": "CudaTransport", "device": str(self.device), "chunk_bytes": self.chunk_bytes,
                "stage_workers": self.stage_workers, "device_name": torch.cuda.get_device_name(self.device)}


class CpuDirectTransport(CpuTransport):
    """Contract v2 on the CPU: rows are copied from the host source straight into the device rows (no staging).
    Exists so that the contract tests run v2's cache paths without a GPU."""

    contract = CONTRACT_V2
    direct = True

    def alloc_staging(self, row_bytes):
        return torch.empty(1, dtype=torch.uint8)  # a slot token: v2 stages nothing

    def stage(self, staging, host_row):
        raise TransferError("contract v2 has no staging copy")

    def h2d(self, dst_row, src_row):
        """Copy ``src_row`` (the host-source row itself under v2) into ``dst_row``."""
        dst_row.copy_(src_row)  # (row_bytes,)
        self.h2d_bytes += src_row.numel()
        return Event(None, src_row.numel())

    def stage_and_copy(self, dst_row, staging, host_row):
        return self.h2d(dst_row, host_row)


# cudaHostRegister flags (CUDA runtime API): the pages stay read-only (the host source is mprotect-ed), the
# registration is usable from every CUDA context of the process, and the range is mapped into the device's address
# space (the host-read site's kernels read it there; with unified addressing its device pointer is its host pointer).
_HOST_REGISTER_PORTABLE, _HOST_REGISTER_MAPPED, _HOST_REGISTER_READ_ONLY = 0x01, 0x02, 0x08
HOST_REGISTER_FLAGS = _HOST_REGISTER_PORTABLE | _HOST_REGISTER_MAPPED | _HOST_REGISTER_READ_ONLY


class MappedArray:
    """``__cuda_array_interface__`` of registered, mapped host memory: torch.as_tensor(..., device=cuda) of it is a CUDA
    uint8 (rows, row_bytes) tensor whose kernels read the host bytes over the link. Declared writable only because
    torch refuses read-only device buffers; the pages are write-protected and registered read-only, so a write
    through it faults instead of changing the host source."""

    def __init__(self, ptr: int, rows: int, row_bytes: int, typestr: str = "|u1"):
        self.__cuda_array_interface__ = {"shape": (rows, row_bytes), "typestr": typestr, "data": (ptr, False),
                                         "version": 2, "strides": None}


_TYPESTR = {torch.int32: "<i4", torch.float32: "<f4", torch.int64: "<i8", torch.float16: "<f2"}


def mapped_tensor(pinned: torch.Tensor, device) -> torch.Tensor:
    """A pinned host tensor (2-D, contiguous, int32, int64, float16 or float32) as a tensor on ``device`` over the same
    memory: on a GPU a device view of the page-locked buffer (pinned memory is mapped into the device's address space
    under unified addressing; a kernel's loads and stores cross the link), on the CPU the tensor itself. The one-graph
    two-site step reads the CPU site's sums and the host's publication flags through it, and under handoff "mapped"
    writes each layer's ids, input, gate weights, keep mask and count through it (kernels/site_split.py)."""
    dev = torch.device(device)
    if dev.type == "cpu":
        return pinned
    if pinned.device.type != "cpu" or not pinned.is_pinned() or pinned.dim() != 2 or not pinned.is_contiguous() \
            or pinned.dtype not in _TYPESTR:
        raise TransferError("mapped_tensor: needs a contiguous 2-D pinned host tensor of int32, int64, float16 or "
                            "float32, got "
                            f"{pinned.dtype} {tuple(pinned.shape)} on {pinned.device}")
    with torch.cuda.device(dev):
        return torch.as_tensor(MappedArray(pinned.data_ptr(), *pinned.shape, typestr=_TYPESTR[pinned.dtype]),
                               device=dev)


def mapped_rows(host, layer: int, device) -> torch.Tensor:
    """The host-read site's rows of ``layer``: uint8 (E, row_bytes), expert e at row e, on ``device``. On a GPU the
    registered host source mapped into the device's address space (contract v2's registration; a kernel reading it
    reads host memory over the link), never a copy; on the CPU the host source itself."""
    dev = torch.device(device)
    arr = host.array[layer]  # (E, row_bytes) uint8, read-only pages
    if dev.type == "cpu":
        return host._tensor[layer]  # the host source's internal alias (read-only pages; torch has no read-only tensor)
    reg = getattr(host, "pinned_registration", None)
    if not reg or not (reg[0] <= arr.ctypes.data and arr.ctypes.data + arr.nbytes <= reg[0] + reg[1]):
        raise TransferError("the host-read site needs the host source registered and mapped (contract v2: "
                            "--contract v2)")
    with torch.cuda.device(dev):
        return torch.as_tensor(MappedArray(arr.ctypes.data, *arr.shape), device=dev)


class PinnedSourceTransport(CudaTransport):
    """Contract v2 on CUDA: the whole host source is registered as pinned memory once (``attach_host``), and
    each miss copies its row by DMA straight into the spare row on the transfer stream, one event per row.
    No CPU staging copy, so the copy runs at the link's rate instead of the host's memcpy rate."""

    contract = CONTRACT_V2
    direct = True

    def __init__(self, device="cuda"):
        super().__init__(device)
        self.registered_bytes = 0

    def attach_host(self, host) -> None:
        arr = host.array
        if getattr(host, "pinned_registration", None):
            self.registered_bytes = arr.nbytes  # another engine of this process registered it already
            return
        err = torch.cuda.cudart().cudaHostRegister(arr.ctypes.data, arr.nbytes, HOST_REGISTER_FLAGS)
        code = int(getattr(err, "value", err))
        if code != 0:
            raise TransferError(f"resident-qpacked-cache-v2: pinning the {arr.nbytes / 2**30:.2f} GiB host source "
                                f"failed (cudaHostRegister error {code}); use contract v1 or free host memory")
        host.pinned_registration = (arr.ctypes.data, arr.nbytes)
        # Unregister before the host source's mapping goes away: a later mapping at the same address would
        # otherwise find the range still registered (cudaErrorHostMemoryAlreadyRegistered).
        weakref.finalize(host, _unregister_host, arr.ctypes.data)
        self.registered_bytes = arr.nbytes

    def alloc_staging(self, row_bytes):
        return torch.empty(1, dtype=torch.uint8)  # a slot token: v2 stages nothing

    def stage(self, staging, host_row):
        raise TransferError("contract v2 has no staging copy")

    def stage_and_copy(self, dst_row, staging, host_row):
        return self.h2d(dst_row, host_row)

    def copy_rows(self, jobs, on_submit):
        if not jobs:
            return
        self._order_after_releases()
        n = jobs[0][2].numel()  # every row of a layer has the same size; one call, not one per row (copy monitor)
        with torch.cuda.stream(self.stream):
            for j, (dst, _slot, src) in enumerate(jobs):
                dst.copy_(src, non_blocking=True)  # (row_bytes,) registered host source -> device row, DMA
                ev = torch.cuda.Event()
                ev.record(self.stream)
                self.h2d_bytes += n
                on_submit(j, Event(ev, n))

    def describe(self):
        return {**super().describe(), "kind": "PinnedSourceTransport", "registered_bytes": self.registered_bytes}


def _unregister_host(ptr: int) -> None:
    """cudaHostUnregister of a host source range (weakref finalizer of the HostSource; runs before its mmap closes)."""
    try:
        torch.cuda.synchronize()  # no copy from the range may still be in flight
        torch.cuda.cudart().cudaHostUnregister(ptr)
    except Exception:  # interpreter shutdown: the process is ending, its mappings with it
        pass


def _np_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """uint8 (n,) CPU copy outside the GIL (numpy), for staging worker threads."""
    np.copyto(dst.numpy(), src.numpy())


def pace(transport: Transport, gb_s: float) -> Transport:
    """EMULATION, never a default: make ``transport``'s row copies take at least ``bytes / gb_s`` seconds each
    (one batch of a miss transaction), to stand in for a slower host link than this machine's (a consumer GPU's
    PCIe 4.0 x8 moves ~13 GB/s where the H200 host's moves ~55). The copies are submitted as before; the host then
    sleeps until ``bytes / gb_s`` after the submission, and the transaction waits for the copies' events as
    always, so a batch completes after max(its real copy time, its paced time). Nothing else changes: the same
    bytes move through the same path under the same contract rules. The rate is in ``describe()`` and
    ``transport.pace_gb_s``. Returns ``transport`` (its ``copy_rows`` wrapped)."""
    if not gb_s > 0:
        raise ValueError(f"pace: a link rate must be > 0 GB/s, got {gb_s!r}")
    inner, describe = transport.copy_rows, transport.describe

    def copy_rows(jobs, on_submit):
        nbytes = sum(int(src.numel()) for _dst, _stg, src in jobs)
        t0 = time.perf_counter()
        inner(jobs, on_submit)
        left = t0 + nbytes / (gb_s * 1e9) - time.perf_counter()
        if left > 0:
            time.sleep(left)

    transport.copy_rows = copy_rows
    transport.pace_gb_s = float(gb_s)
    transport.describe = lambda: {**describe(), "paced_gb_s": float(gb_s), "emulation": True}
    return transport


def default_transport(device, chunk_bytes: int | None = None, stage_workers: int = 0,
                      contract: str = "v1") -> Transport:
    """The transport of ``contract`` ("v1": pageable host source -> pinned staging -> device, the default;
    "v2": the registered host source straight into device rows) on ``device``."""
    dev = torch.device(device)
    if contract not in CACHE_CONTRACTS:
        raise ValueError(f"unknown cache contract {contract!r}; choose one of {list(CACHE_CONTRACTS)}")
    if dev.type == "cpu":
        return CpuDirectTransport() if contract == "v2" else CpuTransport()
    if dev.type == "cuda":
        if contract == "v2":
            return PinnedSourceTransport(dev)
        return CudaTransport(dev, chunk_bytes=chunk_bytes, stage_workers=stage_workers)
    raise ValueError(f"no transport for device {dev}")
