"""The ``cpu-int4`` execution site: routed experts computed on the host CPU from the immutable host source,
through torch's CPU int4 matmul (``aten._weight_int4pack_mm_for_cpu``) after a one-time repack per expert.

Why: when a cold expert's bytes cost more to move over the link than to multiply where they lie (issue 25),
the CPU computes with the host copy. Nothing here reads or writes device rows.

Repack (``repack_expert``), one time per (layer, expert), from a qpacked row (runmap.format.qpack):

* torch's format stores unsigned nibbles u in 0..15 and dequantizes w = (u - 8) * scale + zero per group of
  ``g`` values along K. Our nibbles are already u = q + 8, so the nibbles are passed unchanged with zero = 0:
  (u - 8) * s = q * s, the qpack dequantization, exactly (``tests/test_cpu_experts.py`` proves it with the
  identity matrix as activations in the FP32 mode).
* torch accepts g in {32, 64, 128, 256} with K % g == 0; our scales are per ``block_size`` values with a
  partial last block. g is the largest accepted size dividing the block size and K, each group taking its
  block's scale (a 256-block with K = 1408 becomes 11 groups of 128); where none divides K, K is padded with
  zero-weight columns (nibble 8) and the activations with zeros. N is padded to a multiple of 16 (the
  kernel's requirement) with zero rows that are sliced off.
* gate and up share their input, so they are stacked into one (2I, H) matrix: one call instead of two.

Precision: torch's kernel is vectorised only for bfloat16 activations (FP16 and FP32 activations run a
path ~40-100x slower on this machine's AVX-512 build), and its scales take the activation dtype. So the
default ``precision="bf16"`` rounds the FP16 scales and activations to bfloat16 (8 significant bits: up to
2^-8 relative each; the kernel's weight is exactly bf16(q * bf16(s))) and returns bfloat16 per projection: a
stated approximation, checked at ``TOLERANCE`` against the FP32 reference. ``precision="fp32"`` keeps every scale exact (FP32 scales and
activations, FP32 output): the exactness proof and a slow fallback, not the runtime path.

Two entry points:

* ``CpuExpertSite(host_source)``: the runtime site. Repacks each expert once, on first use, from
  ``host_source.row_tensor(layer, expert)`` (CPU memory only; a non-CPU row is refused), keeps the repacked
  copy (``nbytes`` records its memory) and computes a layer's routed experts (``moe``) or one expert's output
  (``expert_output``, for a mixed placement that computes some experts here and others on the device).
* ``cpu_int4_moe``: the registry form with every executor's arguments (kernels/__init__.py), over a CPU
  ``storage``. Its rows may be rewritten between calls (partial residency), so it repacks the routed rows on
  every call: checks and one-off calls only. The engine on device="cpu" uses a ``CpuExpertSite``.

Concurrent experts (issue 25 item 1). torch's kernel splits one M = 1 matmul across all its intra-op threads,
and at 16 threads each thread's share of an expert is too small (results/cpu-experts/README.md: 0.20 of the
host read). A ``CpuExpertSite`` with ``workers`` > 1 computes the experts of a layer call on persistent
worker threads (``_ExpertPool``), each whole expert (gate+up matmul, activation, down matmul, gate weight) on
one worker whose torch intra-op count is ``threads_per_worker``; the caller adds the per-expert terms in the
serial path's order (slot order at batch 1, ascending expert id otherwise), so the output does not depend on
scheduling: it is bitwise the ``workers=1`` output (the kernel parallelises over output blocks, each reducing
its whole K on one thread, so its result does not depend on the thread count either; tests/test_cpu_experts.py
checks the equality). torch releases the GIL inside each op, so the workers' kernels overlap.

How torch's intra-op thread count behaves across Python threads (OpenMP builds, the torch wheels; read in
aten/src/ATen/ParallelOpenMP.cpp and measured here with torch 2.13 on 2 cores, /proc/self/task and CPU time
over wall time of a parallel op run on a worker):

* the count is per OS thread: ``torch.set_num_threads(n)`` calls ``omp_set_num_threads``, which sets the
  calling thread's OpenMP ICV only. A worker that set 1 ran a parallel op at CPU/wall 1.00, one that set 2 at
  1.97, while the main thread's ``torch.get_num_threads()`` stayed 2. A parallel region opened by a worker
  gets its own OpenMP team (libgomp keeps a thread pool per master thread), so W workers with T threads each
  run up to W x T OS threads.
* it is also "process-wide" in one respect: ``set_num_threads`` stores n in a global that every thread reads
  once, lazily, at its first parallel op (``at::init_num_threads``). A fresh thread started after a worker set
  1 got 1, not the main thread's 2; threads that already ran an op keep their own count (the main thread's
  later ``set_num_threads`` does not reach the workers either).
* so the pool sets each worker's count once, as its first task, and then restores the global default in a
  throwaway thread (to what a fresh thread read before; ``set_num_threads`` also resizes torch's process-wide
  pthreadpool, which this restores too), so that threads created later (the engine's, the caller's other
  work) are not left at ``threads_per_worker``. A thread that starts its first torch op in that
  short window could still pick up ``threads_per_worker``.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import os
import threading
import weakref

import numpy as np
import torch
import torch.nn.functional as F

from runmap.format.qpack import NIBBLE_OFFSET, RowLayout
from runmap.kernels import common
from runmap.kernels.registry import CPU_SITE_EXECUTORS

GROUP_SIZES = (256, 128, 64, 32)  # what aten._weight_int4pack_mm_for_cpu accepts, largest first
N_ALIGN = 16  # aten._convert_weight_to_int4pack_for_cpu requires N % 16 == 0
PRECISIONS = {"bf16": torch.bfloat16, "fp32": torch.float32}
# Relative Frobenius error ||y - ref|| / ||ref|| against the FP32 reference (kernels/reference.py). bf16:
# activations, scales, both projection outputs and the intermediate rounded to bfloat16, measured 4.4-6.0e-3
# on random experts (tests/test_cpu_experts.py sweeps the shapes); the Triton paths' bound is 2e-3 (FP16
# intermediates). fp32: only the final FP16 output is rounded (~2e-4 measured).
TOLERANCE = {"bf16": 1e-2, "fp32": 5e-4}


SITE_EXECUTORS = CPU_SITE_EXECUTORS  # the kernels this class runs: the registry's CPU-site executors


class CpuSiteError(ValueError):
    """The CPU site was given something it cannot compute from (a device row, an unsupported block size)."""


def _have_kernel() -> bool:
    ops = torch.ops.aten
    return hasattr(ops, "_weight_int4pack_mm_for_cpu") and hasattr(ops, "_convert_weight_to_int4pack_for_cpu")


def group_size(k: int, block_size: int) -> tuple[int, int]:
    """(g, K padded) for a projection with K inputs: the largest accepted g that divides the block size
    (so that no group straddles two scale blocks) and, where possible, K itself."""
    fits = [g for g in GROUP_SIZES if block_size % g == 0]
    if not fits:
        raise CpuSiteError(f"block_size {block_size}: torch's CPU int4 kernel takes groups of {GROUP_SIZES}, "
                           "none of which divides the block, so the block scales cannot be represented")
    for g in fits:
        if k % g == 0:
            return g, k
    g = fits[0]
    return g, -(-k // g) * g


@dataclasses.dataclass(frozen=True)
class PackedProjection:
    """One (stacked) projection in torch's CPU int4 format.

    weight: uint8 (n_pad, k_pad / 2), torch's packing. scale_zero: (k_pad / g, n_pad, 2) in the activation
    dtype, [..., 0] the scale of (row, group), [..., 1] = 0. n / k: the real output / input sizes.
    """

    weight: torch.Tensor
    scale_zero: torch.Tensor
    n: int
    k: int
    k_pad: int
    group: int

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes + self.scale_zero.nbytes

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x (M, k) in the activation dtype -> (M, n) in the activation dtype."""
        if self.k_pad != self.k:
            x = F.pad(x, (0, self.k_pad - self.k))  # zero activations meet the zero-weight padding columns
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.contiguous(), self.weight, self.group, self.scale_zero)
        return y[:, : self.n]


def _pack_projection(packed: list[torch.Tensor], scales: list[torch.Tensor], k: int, block_size: int,
                     dtype: torch.dtype) -> PackedProjection:
    """packed: uint8 (N_i, K/2) qpack sections, scales: fp16 (N_i, nb), stacked along N in the given order."""
    g, k_pad = group_size(k, block_size)
    p = torch.cat(packed).to(torch.int32)  # (N, K/2)
    n = p.shape[0]
    n_pad = -(-n // N_ALIGN) * N_ALIGN
    u = torch.full((n_pad, k_pad), NIBBLE_OFFSET, dtype=torch.int32)  # nibble 8 = q 0 in the padding
    u[:n, 0:k:2] = p & 0xF  # low nibble holds the even k (qpack's low-first order)
    u[:n, 1:k:2] = p >> 4
    weight = torch.ops.aten._convert_weight_to_int4pack_for_cpu(u, 1)
    block_of_group = torch.arange(k_pad // g) * g // block_size  # (G,) the scale block of each group
    s = torch.zeros(n_pad, k_pad // g, dtype=torch.float32)
    s[:n] = torch.cat(scales).to(torch.float32)[:, block_of_group]  # fp16 -> fp32 is exact
    sz = torch.stack((s.T, torch.zeros_like(s.T)), dim=2).to(dtype).contiguous()  # (G, n_pad, 2)
    return PackedProjection(weight, sz, n, k, k_pad, g)


@dataclasses.dataclass(frozen=True)
class RepackedExpert:
    """gate and up stacked into one (2I, H) projection, down (H, I)."""

    gate_up: PackedProjection
    down: PackedProjection
    intermediate: int

    @property
    def nbytes(self) -> int:
        return self.gate_up.nbytes + self.down.nbytes


def check_host_row(row, layout: RowLayout, what: str = "expert row", contiguous: bool = False) -> None:
    """Raise CpuSiteError unless ``row`` is a host (CPU) uint8 (row_bytes,) tensor (and contiguous, if asked): the
    CPU sites read host rows only, never device rows."""
    if not isinstance(row, torch.Tensor) or row.device.type != "cpu":
        where = row.device if isinstance(row, torch.Tensor) else type(row).__name__
        raise CpuSiteError(f"expert row on {where}: the CPU site reads host rows only, never device rows")
    if (row.dtype != torch.uint8 or row.dim() != 1 or row.numel() != layout.row_bytes
            or (contiguous and not row.is_contiguous())):
        raise CpuSiteError(f"{what}: {'contiguous ' if contiguous else ''}uint8 ({layout.row_bytes},) expected, "
                           f"got {row.dtype} {tuple(row.shape)}")


def repack_expert(row: torch.Tensor, layout: RowLayout, precision: str = "bf16") -> RepackedExpert:
    """One qpacked expert row -> torch's CPU int4 format.

    Args:
        row: uint8 (row_bytes,) CPU tensor (read only, never written).
        layout: its runmap.format.qpack.RowLayout.
        precision: "bf16" (fast kernel path) or "fp32" (exact scales).
    """
    if precision not in PRECISIONS:
        raise CpuSiteError(f"precision {precision!r}, expected one of {tuple(PRECISIONS)}")
    check_host_row(row, layout)
    dtype = PRECISIONS[precision]
    h, i, b = layout.hidden_size, layout.intermediate_size, layout.block_size
    view = layout.view
    gate_up = _pack_projection([view(row, "gate.weight"), view(row, "up.weight")],
                               [view(row, "gate.scale"), view(row, "up.scale")], h, b, dtype)
    down = _pack_projection([view(row, "down.weight")], [view(row, "down.scale")], i, b, dtype)
    return RepackedExpert(gate_up, down, i)


def expert_ffn(rep: RepackedExpert, x: torch.Tensor) -> torch.Tensor:
    """down(silu(gate(x)) * up(x)) of one expert. x: (M, H) in the activation dtype -> float32 (M, H)."""
    gu = rep.gate_up.matmul(x).to(torch.float32)  # (M, 2I)
    i = rep.intermediate
    h = (F.silu(gu[:, :i]) * gu[:, i:]).to(x.dtype)  # (M, I), rounded once to the activation dtype
    return rep.down.matmul(h).to(torch.float32)


def _layer_moe(expert_of, x, topk_ids, topk_weights, dtype, out_dtype=torch.float16, pool=None) -> torch.Tensor:
    """sum_j w[t, j] * ffn_e(x_t) over the batch union, one kernel pass per distinct expert (its tokens batched).
    expert_of(e) -> RepackedExpert (called on the worker that computes e when ``pool`` is given: it must be
    thread-safe then). pool: an ``_ExpertPool`` computing the terms concurrently, or None (the calling thread)."""
    out = common.empty((x.shape[0], x.shape[1]), torch.float32, x.device)
    out.zero_()
    ids = topk_ids.to(torch.int64)
    xa = x.to(dtype)
    if x.shape[0] == 1:  # decode at batch 1: k distinct experts of one token, no grouping work per step
        gw = topk_weights.to(torch.float32)

        def slot_term(je):
            j, e = je
            return expert_ffn(expert_of(e), xa) * gw[0, j]

        with _terms(pool, slot_term, list(enumerate(ids[0].tolist()))) as terms:
            for y in terms:  # slot order, whichever worker finished first
                out.add_(y)
        return out.to(out_dtype)
    _add_experts(out, expert_of, xa, ids, topk_weights, torch.unique(ids).tolist(), pool)
    return out.to(out_dtype)


# Below this many elements a term (n_e, H) is added row by row in the caller of a concurrent call: torch's
# elementwise ops on that few elements run inline, while index_add_ (and advanced-index gather / scatter) opens an
# OpenMP region at any size, after which the caller's idle team threads spin (libgomp's default wait policy;
# measured with 2 threads: a core kept busy through a 2 ms sleep after each call), taking cores from the
# workers. at::internal::GRAIN_SIZE: larger terms are parallel work anyway.
ROW_ADD_MAX_ELEMENTS = 32768


def _add_experts(out, expert_of, xa, ids, topk_weights, experts, pool=None) -> None:
    """out (T, H) fp32 += w[t, j] * ffn_e(x_t) for each expert e of ``experts`` over the (t, j) slots routed to it,
    its tokens batched in one pass (an expert no slot routes to is skipped). xa: (T, H) in the activation dtype,
    ids int64 (T, k), topk_weights (T, k). The terms are added in the order of ``experts`` (pool: see _layer_moe)."""

    def expert_term(e):
        tok, slot = (ids == e).nonzero(as_tuple=True)  # (n_e,) each
        if tok.numel() == 0:
            return None
        y = expert_ffn(expert_of(e), xa[tok])  # (n_e, H) fp32
        return tok, y * topk_weights[tok, slot].to(torch.float32)[:, None]

    with _terms(pool, expert_term, list(experts)) as terms:
        for term in terms:
            if term is None:
                continue
            tok, yw = term
            if pool is None or yw.numel() >= ROW_ADD_MAX_ELEMENTS:
                out.index_add_(0, tok, yw)
            else:
                # index_add_'s arithmetic exactly: one fp32 addition per element, rows in index order (a token
                # routed twice to e gets both, in slot order), so the sum is bitwise the serial one
                for i, t in enumerate(tok.tolist()):
                    out[t].add_(yw[i])


@contextlib.contextmanager
def _terms(pool, fn, items):
    """An iterator over fn(item) for the items, in the items' order. Without a pool (or with one item) each term
    is computed in the calling thread when the iterator reaches it, exactly the serial loop; with a pool all are
    submitted at once and each is waited for in order, so the caller adds a term while later ones compute."""
    if pool is None or len(items) <= 1:
        yield (fn(item) for item in items)
    else:
        with pool.ordered(fn, items) as results:
            yield results


def default_workers(cpus: int | None = None) -> int:
    """The worker count a ``CpuExpertSite`` takes when none is given, for ``cpus`` usable CPUs (default: this
    process's affinity mask, else os.cpu_count()). See ``CpuExpertSite`` for why."""
    del cpus  # kept in the signature: a sweep on another machine may give a count per CPU budget again
    return 1  # measured: concurrent workers were slower at every count tried (CpuExpertSite's docstring)


def usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1


class WorkerStartError(RuntimeError):
    """The expert pool's worker threads did not all start (and configure their torch thread count) in time."""


def _set_threads_and_wait(threads: int, barrier: threading.Barrier) -> int:
    torch.set_num_threads(threads)  # this worker's OpenMP count (and, as a side effect, the global default)
    barrier.wait()  # every worker holds one configure task: each runs on its own thread
    return torch.get_num_threads()


def _fresh_thread(fn, *args):
    """fn(*args) on a new thread (its result): reads or sets what a thread that has not run a torch op sees."""
    box = []
    t = threading.Thread(target=lambda: box.append(fn(*args)), name="cpu-int4-threads-probe")
    t.start()
    t.join()
    return box[0] if box else None


class _ExpertPool:
    """``workers`` persistent threads (a concurrent.futures.ThreadPoolExecutor), each running torch ops with
    ``threads`` intra-op threads. Started whole at construction: one configure task per worker, held at a barrier
    so that each lands on its own thread, then the global default thread count restored (module docstring)."""

    START_TIMEOUT_S = 60.0

    def __init__(self, workers: int, threads: int):
        self.workers, self.threads, self.pid = workers, threads, os.getpid()
        default = _fresh_thread(torch.get_num_threads)  # what a new thread's first torch op sets up
        self._ex = concurrent.futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="cpu-int4-expert")
        barrier = threading.Barrier(workers + 1, timeout=self.START_TIMEOUT_S)
        try:
            started = [self._ex.submit(_set_threads_and_wait, threads, barrier) for _ in range(workers)]
            barrier.wait()
            self.worker_threads = [f.result() for f in started]  # each worker's torch.get_num_threads()
        except BaseException as exc:
            barrier.abort()  # workers already waiting wake up instead of waiting out the timeout
            self._ex.shutdown(wait=False, cancel_futures=True)
            if isinstance(exc, threading.BrokenBarrierError):
                raise WorkerStartError(f"cpu-int4 expert pool: {workers} worker threads did not start within "
                                       f"{self.START_TIMEOUT_S:.0f} s") from None
            raise
        finally:
            _fresh_thread(torch.set_num_threads, default)
        self._finalizer = weakref.finalize(self, self._ex.shutdown, wait=False, cancel_futures=True)

    @contextlib.contextmanager
    def ordered(self, fn, items):
        """fn(item) for every item on the workers; yields an iterator over the results in the items' order.
        The first failing item (in order) raises its own exception, unchanged, in the caller; before anything
        leaves this block (a result of each, an exception, an early exit) the items not started are cancelled
        and the running ones waited for, so no worker still computes for this call afterwards."""
        futures = []
        try:
            for item in items:
                futures.append(self._ex.submit(fn, item))
            yield (f.result() for f in futures)
        finally:
            for f in futures:
                f.cancel()
            concurrent.futures.wait(futures)

    def submit(self, fn, *args):
        return self._ex.submit(fn, *args)

    def close(self) -> None:
        self._finalizer()  # shutdown(wait=False): idle workers exit; a running task finishes first


def _check_ids(topk_ids, num_experts: int) -> None:
    """topk_ids: an integer (T, k) CPU tensor or numpy array; the first id outside [0, E) raises, naming its place."""
    empty = (topk_ids.numel() if isinstance(topk_ids, torch.Tensor) else topk_ids.size) == 0
    if empty or (int(topk_ids.min()) >= 0 and int(topk_ids.max()) < num_experts):  # the common case: two reductions
        return
    bad = (topk_ids < 0) | (topk_ids >= num_experts)
    if bad.any():
        t, j = (int(v) for v in np.argwhere(np.asarray(bad))[0])
        raise common.KernelInputError(
            f"topk_ids[{t}, {j}] = {int(topk_ids[t, j])} is not an expert id in [0, {num_experts})")


class CpuExpertSite:
    """Routed experts computed on the CPU from a host source (runmap.residency.host_source.HostSource, or any
    object with ``layout``, ``num_layers``, ``num_experts`` and ``row_tensor(layer, expert)`` returning a CPU
    uint8 (row_bytes,) tensor). Thread-safe repack cache: a placement may call it from a worker thread.

    Args:
        source: the host source.
        precision: "bf16" (the runtime path) or "fp32" (exact scales, slow).
        workers: threads computing the experts of one layer call concurrently, each expert whole on one worker
            (``moe`` and ``moe_subset``; ``expert_output`` runs in the caller). 1: the calling thread computes
            them one after another with its own torch thread count, exactly the serial path (no pool is made).
            None: ``default_workers()``, which is 1 on every machine measured: on the 16-core H200 host the serial
            site (1 x 16 threads) reached 20.5 GB/s of OLMoE expert bytes at batch 1, 8 workers x 2 threads 6.65 and
            16 x 1 6.05 (b4: 13.4 vs 5.4 / 6.0; results/cpu-experts/h200-host-workers.json), and on the 2-core VM two
            single-thread workers reached 1.15-1.6x one thread where the serial site with both reached 1.4-1.8x. The
            workers stay available for machines where a sweep says otherwise.
        threads_per_worker: torch intra-op threads of each worker; None: max(1, usable CPUs // workers).
        executor: the kernel, one of the registry's CPU-site executors. "cpu-int4" (torch's int4 matmul over
            repacked copies, the arguments above) or "cpu-native" (kernels/cpu_native.py: a C kernel reading the
            host rows as they lie, FP32, every expert of a layer call in one parallel region of the calling
            thread's torch.get_num_threads() threads; precision "fp32", no workers, nothing to repack).

    The worker threads (``_ExpertPool``) start on the first concurrent layer call, persist, and stop at ``close()``
    (or when the site is garbage-collected); a later call starts them again.
    """

    def __init__(self, source, precision: str | None = None, workers: int | None = None,
                 threads_per_worker: int | None = None, executor: str = "cpu-int4"):
        if executor not in SITE_EXECUTORS:
            raise CpuSiteError(f"CPU site executor {executor!r}, expected one of {SITE_EXECUTORS}")
        from runmap.kernels.cpu_native import EXECUTOR_PRECISION

        if executor in EXECUTOR_PRECISION:
            native_precision = EXECUTOR_PRECISION[executor]
            if precision not in (None, native_precision):
                raise CpuSiteError(f"precision {precision!r}: the {executor} kernel computes in {native_precision} only")
            precision = native_precision
            from runmap.kernels.cpu_native import NativeLayer

            self._native = NativeLayer(source.layout, precision)  # builds the C kernel now: no compiler fails here
        else:
            precision = "bf16" if precision is None else precision
            self._native = None
            if precision not in PRECISIONS:
                raise CpuSiteError(f"precision {precision!r}, expected one of {tuple(PRECISIONS)}")
            if not _have_kernel():
                raise CpuSiteError(f"this torch ({torch.__version__}) has no aten._weight_int4pack_mm_for_cpu")
        self.executor = executor
        self.source, self.layout, self.precision = source, source.layout, precision
        self.dtype = PRECISIONS.get(precision, torch.float32)  # the torch kernel's activation dtype
        self._row_ptrs: dict[int, list[int]] = {}  # cpu-native: layer -> the host rows' addresses
        self._row_refs: list[torch.Tensor] = []  # the tensors behind those addresses
        # cpu-native: OpenMP threads per layer call; None = the calling thread's torch.get_num_threads()
        self.native_threads: int | None = None
        self.num_layers, self.num_experts = source.num_layers, source.num_experts
        self._cache: dict[tuple[int, int], RepackedExpert] = {}
        self._lock = threading.Lock()  # the cache, the counters and _repacking
        self._repacking: dict[tuple[int, int], threading.Lock] = {}
        self._pool_lock = threading.Lock()
        self._pool_obj: _ExpertPool | None = None
        self._jobs: concurrent.futures.ThreadPoolExecutor | None = None  # submit's job thread
        self._jobs_pid = None
        self.repacks = 0  # experts repacked (each once)
        self.nbytes = 0  # memory held by the repacked copies
        self.source_bytes_read = 0  # host-source bytes read by repacks (row_bytes per repack)
        self.layer_calls = 0  # moe / moe_subset / expert_output calls computed here
        self.set_workers(workers, threads_per_worker)

    def set_workers(self, workers: int | None = None, threads_per_worker: int | None = None) -> None:
        """(Re)configure the concurrency (constructor arguments); stops the current workers. Call it between
        layer calls, not while one is in flight. The repacked experts are kept."""
        for name, v in (("workers", workers), ("threads_per_worker", threads_per_worker)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise CpuSiteError(f"{name} {v!r}: a positive integer or None expected")
        if self._native is not None and (workers not in (None, 1) or threads_per_worker is not None):
            raise CpuSiteError("workers / threads_per_worker configure the cpu-int4 site; cpu-native runs a layer "
                               "call in one parallel region of torch.get_num_threads() threads")
        cpus = usable_cpus()
        w = default_workers(cpus) if workers is None else workers
        t = max(1, cpus // w) if threads_per_worker is None else threads_per_worker
        with self._pool_lock:
            old, self._pool_obj = self._pool_obj, None
            self.workers, self.threads_per_worker = w, t
        if old is not None:
            old.close()

    def _pool(self) -> _ExpertPool | None:
        """The worker pool (None with one worker), started on first use (again after close() or a fork)."""
        if self.workers == 1:
            return None
        with self._pool_lock:
            pool = self._pool_obj
            if pool is None or pool.pid != os.getpid():  # a forked child has the object but not its threads
                pool = self._pool_obj = _ExpertPool(self.workers, self.threads_per_worker)
            return pool

    def close(self) -> None:
        """Stop the worker threads and the job thread (idempotent; a running job finishes first); the site stays
        usable and restarts them when needed."""
        with self._pool_lock:
            pool, self._pool_obj = self._pool_obj, None
            jobs, self._jobs = self._jobs, None
        if pool is not None:
            pool.close()
        if jobs is not None:
            jobs.shutdown(wait=True)

    def _rows(self, layer: int) -> list[int]:
        """cpu-native: the addresses of one layer's host rows, each checked once (a CPU uint8 (row_bytes,)
        contiguous tensor; the source holds the memory for the site's lifetime)."""
        ptrs = self._row_ptrs.get(layer)
        if ptrs is None:
            ptrs = []
            for e in range(self.num_experts):
                row = self.source.row_tensor(layer, e)
                check_host_row(row, self.layout, f"expert row (layer {layer}, expert {e})", contiguous=True)
                ptrs.append(row.data_ptr())
                self._row_refs.append(row)  # the addresses stay valid while the site holds the tensors
            self._row_ptrs[layer] = ptrs
        return ptrs

    def _native_call(self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                     experts=None) -> torch.Tensor:
        from runmap.kernels.cpu_native import assignments

        order, start, tok, wts = assignments(topk_ids, topk_weights, experts)
        rows = self._rows(layer)
        return self._native.run([rows[e] for e in order], start, tok, wts, x.to(torch.float32).contiguous(),
                                self.native_threads)

    def expert(self, layer: int, expert: int) -> RepackedExpert | torch.Tensor:
        """The repacked expert, built from the host source on first use (cpu-native: the host row itself, which it
        reads as it lies). The repack holds only that expert's lock (torch releases the GIL), so threads repacking
        different experts run in parallel and no expert is repacked twice."""
        if self._native is not None:
            self._rows(layer)
            return self.source.row_tensor(layer, expert)
        key = (layer, expert)
        rep = self._cache.get(key)
        if rep is None:
            # one lock per expert being repacked: workers repack distinct experts at once, never one expert twice
            with self._lock:
                key_lock = self._repacking.setdefault(key, threading.Lock())
            with key_lock:
                rep = self._cache.get(key)
                if rep is None:
                    rep = repack_expert(self.source.row_tensor(layer, expert), self.layout, self.precision)
                    with self._lock:
                        self._cache[key] = rep
                        self._repacking.pop(key, None)
                        self.repacks += 1
                        self.nbytes += rep.nbytes
                        self.source_bytes_read += self.layout.row_bytes
        return rep

    def prepare(self, layers=None, experts=None, workers: int = 1) -> None:
        """Repack ahead of time (an engine whose placement may compute at the CPU site does it at build, so that no
        decode step pays a first use's repack), on ``workers`` threads. cpu-native: nothing to repack; the rows'
        addresses are checked."""
        if self._native is not None:
            for layer in (range(self.num_layers) if layers is None else layers):
                self._rows(layer)
            return
        keys = [(layer, e) for layer in (range(self.num_layers) if layers is None else layers)
                for e in (range(self.num_experts) if experts is None else experts)]
        if workers <= 1 or len(keys) <= 1:
            for key in keys:
                self.expert(*key)
            return
        with concurrent.futures.ThreadPoolExecutor(min(workers, len(keys)), thread_name_prefix="runmap-repack") as pool:
            for fut in [pool.submit(self.expert, *key) for key in keys]:
                fut.result()  # the first failure surfaces here; the pool's exit waits for the rest

    def expert_output(self, layer: int, expert: int, x: torch.Tensor) -> torch.Tensor:
        """One expert's FFN output. x: float16/bfloat16/float32 (M, H) CPU -> float32 (M, H) (unweighted)."""
        common.check_tensor("x", x, (torch.float16, torch.bfloat16, torch.float32), 2,
                            shape=(None, self.layout.hidden_size), device=torch.device("cpu"))
        if not 0 <= expert < self.num_experts:
            raise common.KernelInputError(f"expert {expert} is not an expert id in [0, {self.num_experts})")
        self.layer_calls += 1
        if self._native is not None:
            m = x.shape[0]
            return self._native.run([self._rows(layer)[expert]], [0, m], list(range(m)), [1.0] * m,
                                    x.to(torch.float32).contiguous(), self.native_threads)
        return expert_ffn(self.expert(layer, expert), x.to(self.dtype))

    def _check_layer_call(self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor):
        """The checks of a layer call (``moe``, ``moe_subset``): CPU tensors of the documented dtypes and shapes, a
        layer of the source, expert ids in range. Raises KernelInputError naming what is wrong."""
        cpu = torch.device("cpu")
        common.check_tensor("x", x, torch.float16, 2, shape=(None, self.layout.hidden_size), device=cpu)
        common.check_tensor("topk_ids", topk_ids, (torch.int32, torch.int64), 2, shape=(x.shape[0], None), device=cpu)
        common.check_tensor("topk_weights", topk_weights, torch.float32, 2, shape=tuple(topk_ids.shape), device=cpu)
        if not 0 <= layer < self.num_layers:
            raise common.KernelInputError(f"layer {layer} is not in [0, {self.num_layers})")
        _check_ids(topk_ids, self.num_experts)

    def moe(self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """Routed-expert output of one layer, every routed expert computed here.

        Args:
            layer: MoE layer index in [0, num_layers).
            x: float16 (T, H) CPU. topk_ids: int32/int64 (T, k) CPU, ids in [0, E).
            topk_weights: float32 (T, k) CPU, final gate weights.
        Returns:
            float16 (T, H) = sum_j w[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t)), e = topk_ids[t, j].
        """
        self._check_layer_call(layer, x, topk_ids, topk_weights)
        self.layer_calls += 1
        if self._native is not None:
            return self._native_call(layer, x, topk_ids, topk_weights).to(torch.float16)
        return _layer_moe(lambda e: self.expert(layer, e), x, topk_ids, topk_weights, self.dtype, pool=self._pool())

    def moe_subset(self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                   experts) -> torch.Tensor:
        """The part of a layer's routed-expert output that comes from ``experts`` (a mixed placement: the others
        are computed on the device).

        Args:
            layer: MoE layer index in [0, num_layers).
            x: float16 (T, H) CPU. topk_ids: int32/int64 (T, k) CPU. topk_weights: float32 (T, k) CPU.
            experts: iterable of expert ids computed here; slots routed to other experts contribute nothing.
        Returns:
            float32 (T, H) = sum over slots j with topk_ids[t, j] in experts of w[t, j] * ffn_e(x_t).
        """
        self._check_layer_call(layer, x, topk_ids, topk_weights)
        self.layer_calls += 1
        if self._native is not None:
            return self._native_call(layer, x, topk_ids, topk_weights, experts)
        out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32)  # (T, H)
        _add_experts(out, lambda e: self.expert(layer, e), x.to(self.dtype), topk_ids.to(torch.int64), topk_weights,
                     sorted({int(v) for v in experts}), self._pool())
        return out

    @property
    def native(self) -> bool:
        """True for the C kernel's executors (cpu-native, cpu-native-i16): ``moe_subset_arrays`` and ``submit``."""
        return self._native is not None

    def moe_subset_arrays(self, layer: int, x: np.ndarray, topk_ids: np.ndarray, topk_weights: np.ndarray,
                          experts, out: np.ndarray, threads: int | None = None) -> None:
        """``moe_subset`` on host arrays, written into ``out``, with no torch call (cpu-native executors only):
        ``prepare_subset_arrays(...)()``. The same kernel, assignment order and FP32 widening as ``moe_subset``, so
        the same values bit for bit."""
        self.prepare_subset_arrays(layer, x, topk_ids, topk_weights, experts, out, threads)()

    def prepare_subset_arrays(self, layer: int, x: np.ndarray, topk_ids: np.ndarray, topk_weights: np.ndarray,
                              experts, out: np.ndarray, threads: int | None = None):
        """Check and bind ``moe_subset_arrays``' call without running it: the decode chain prepares the CPU part on
        its main thread and runs the returned call (runmap.kernels.cpu_native.NativeCall) on the site's job thread
        (``submit``) while the main thread drives the device.

        Args:
            layer: MoE layer index in [0, num_layers).
            x: float16 (T, H) C-contiguous. topk_ids: integer (T, k). topk_weights: float32 (T, k).
            experts: iterable of expert ids computed here; slots routed to other experts contribute nothing.
            out: float32 (T, H) C-contiguous, every element written.
            threads: OpenMP threads (default ``native_threads``, else the caller's torch.get_num_threads()).
        """
        if self._native is None:
            raise CpuSiteError(f"moe_subset_arrays needs a cpu-native executor; this site runs {self.executor}")
        if not 0 <= layer < self.num_layers:
            raise common.KernelInputError(f"layer {layer} is not in [0, {self.num_layers})")
        if (not isinstance(topk_ids, np.ndarray) or topk_ids.ndim != 2 or topk_ids.dtype.kind not in "iu"
                or topk_ids.shape[0] != getattr(x, "shape", (None,))[0]):
            raise common.KernelInputError(f"topk_ids: an integer (T, k) array for x's T tokens expected, got "
                                          f"{getattr(topk_ids, 'dtype', type(topk_ids).__name__)} "
                                          f"{getattr(topk_ids, 'shape', '')}")
        if (not isinstance(topk_weights, np.ndarray) or topk_weights.dtype != np.float32
                or topk_weights.shape != topk_ids.shape):
            raise common.KernelInputError(f"topk_weights: a float32 {topk_ids.shape} array expected, got "
                                          f"{getattr(topk_weights, 'dtype', type(topk_weights).__name__)} "
                                          f"{getattr(topk_weights, 'shape', '')}")
        if not isinstance(x, np.ndarray) or x.dtype != np.float16:
            raise common.KernelInputError(f"x: a float16 (T, {self.layout.hidden_size}) array expected, got "
                                          f"{getattr(x, 'dtype', type(x).__name__)}")
        _check_ids(topk_ids, self.num_experts)
        from runmap.kernels.cpu_native import assignments_arrays

        order, start, tok, wts = assignments_arrays(topk_ids, topk_weights, experts)
        rows = self._rows(layer)
        call = self._native.prepare_arrays([rows[e] for e in order], start, tok, wts, x, out,
                                           threads or self.native_threads)
        with self._lock:
            self.layer_calls += 1  # a call that passed every check
        return call

    def masked_scratch(self, tokens: int, top_k: int):
        """Scratch that masked calls of ``tokens`` x ``top_k`` pairs which never run at the same time may share
        (``bind_masked_call``'s ``scratch``; cpu-native executors only)."""
        if self._native is None:
            raise CpuSiteError(f"masked_scratch needs a cpu-native executor; this site runs {self.executor}")
        return self._native.masked_scratch(tokens, top_k, self.num_experts)

    def bind_masked_call(self, layer: int, x: np.ndarray, topk_ids: np.ndarray, keep: np.ndarray,
                         topk_weights: np.ndarray, out: np.ndarray, threads: int | None = None, scratch=None):
        """A call bound once to fixed arrays (cpu-native executors only) that computes, each time it is called, the
        pairs of ``layer`` whose ``keep`` entry is 0 from the arrays as they are then: the one-graph two-site step's
        host join, whose device split decided the CPU site's experts (runmap.kernels.cpu_native.MaskedCall's
        contract; every call counts as a layer call).

        Args:
            layer: MoE layer index in [0, num_layers).
            x: float16 (T, H). topk_ids: int64 (T, k). keep: int32 (T k,). topk_weights: float32 (T, k). All
                C-contiguous and alive while the call is bound.
            out: float32 (T, H), written whole on each call.
            threads: OpenMP threads (default ``native_threads``, else torch.get_num_threads()).
            scratch: from ``masked_scratch`` for these T and k, shared with bound calls that never run at the same
                time (None: the call's own).
        """
        if self._native is None:
            raise CpuSiteError(f"bind_masked_call needs a cpu-native executor; this site runs {self.executor}")
        if not 0 <= layer < self.num_layers:
            raise common.KernelInputError(f"layer {layer} is not in [0, {self.num_layers})")
        call = self._native.bind_masked(self._rows(layer), topk_ids, keep, topk_weights, x, out,
                                        threads if threads is not None else self.native_threads or torch.get_num_threads(),
                                        scratch)

        def counted():
            call()
            with self._lock:
                self.layer_calls += 1
        return counted

    def submit(self, fn, *args) -> concurrent.futures.Future:
        """Run ``fn(*args)`` on the site's job thread (one, started on first use, stopped by ``close``): the decode
        chain's CPU part overlaps the device's work and the link's copies there. The C kernel releases the GIL."""
        with self._pool_lock:
            if self._jobs is None or self._jobs_pid != os.getpid():
                self._jobs = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="runmap-cpu-site")
                self._jobs_pid = os.getpid()
            return self._jobs.submit(fn, *args)

    def describe(self) -> dict:
        return {"executor": self.executor, "precision": self.precision, "repacked_experts": self.repacks,
                "repacked_bytes": self.nbytes, "source_bytes_read": self.source_bytes_read,
                "layer_calls": self.layer_calls, "threads": self.native_threads or torch.get_num_threads(),
                "workers": self.workers, "threads_per_worker": self.threads_per_worker}


def cpu_int4_moe(x, topk_ids, topk_weights, storage, row_table, layout: RowLayout, config=None) -> torch.Tensor:
    """The registry form (arguments and result as runmap.kernels.executors.moe_experts), every tensor on the CPU.

    Repacks the routed rows of ``storage`` on each call (they may be rewritten between calls); the cached,
    host-source path is ``CpuExpertSite``. config: optional {"precision": "bf16" | "fp32"}.
    Returns float16 (T, H).
    """
    if storage.device.type != "cpu":
        raise common.KernelInputError(f"storage on {storage.device}: cpu-int4 computes on the CPU from host rows "
                                      "only (it never reads device rows); use a GPU executor for device storage")
    precision = (config or {}).get("precision", "bf16")
    if precision not in PRECISIONS:
        raise common.KernelInputError(f"config precision {precision!r}, expected one of {tuple(PRECISIONS)}")
    table = row_table.tolist()
    reps: dict[int, RepackedExpert] = {}

    def expert_of(e):
        if e not in reps:
            row = table[e]
            if row < 0:  # reached only without the routing check; never substitute another expert
                raise common.KernelInputError(f"expert {e} is not resident: row_table[{e}] = {row}")
            reps[e] = repack_expert(storage[row], layout, precision)
        return reps[e]

    return _layer_moe(expert_of, x, topk_ids, topk_weights, PRECISIONS[precision])
