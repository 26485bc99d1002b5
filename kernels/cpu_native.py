"""The ``cpu-native`` execution site: routed experts computed on the host CPU by a C kernel (kernels/cpu_native.c)
that reads the qpacked rows of the immutable host source directly, in FP32, all experts of a layer call in one
OpenMP parallel region.

Why (issue 25 item 1): torch's CPU int4 matmul (the ``cpu-int4`` site, kernels/cpu_int4.py) reached only
0.20-0.26 of the host read bandwidth on the 16-core H200 host: it splits each expert's M = 1 product across all
threads, one expert after another, with a bf16 unpack. The C kernel makes every output row of every expert one
work item of a single loop, so all threads stream expert bytes at once, and it needs no repacked copy: no
startup repack, no second copy of the experts in RAM, and every byte it computes from is the verified host row.

Numerics, executor ``cpu-native`` (precision "fp32"): FP32 activations, FP32 accumulation, exact FP16 scales (w =
q * s exactly as qpack's dequantization), FP32 SiLU * up intermediate. Only the summation order differs from the
FP32 reference executor (``TOLERANCE["fp32"]``). Executor ``cpu-native-i16`` (precision "i16"): both activation
vectors rounded to int16 per scale block, exact integer dot products, one FP32 scaling per block
(``TOLERANCE["i16"]``; blocks of at most ``I16_MAX_BLOCK`` values; a non-finite activation makes its block's scale
NaN, so the outputs that read it are NaN as on the FP32 path).

Build: on first use the source is compiled with the C compiler named by ``$CC`` (default ``cc``), flags
``COMPILE_FLAGS`` (``-march=native``: the binary is built for the machine that runs it), into a cache folder
(``$RUNMAP_CACHE_DIR``, else ``$XDG_CACHE_HOME/runmap``, else ``~/.cache/runmap``) under a key of the source,
compiler, flags and CPU, written atomically. No compiler: ``NativeBuildError`` names what to install; nothing
falls back to another kernel (that would change what the model computes).

Threads: ``threads`` per call (default: torch's intra-op count, i.e. every usable core). The kernel links
OpenMP; where torch's own libgomp is already loaded under the same name the two share one runtime.
"""
from __future__ import annotations

import ctypes
import dataclasses
import functools
import hashlib
import operator
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import numpy as np
import torch

from runmap.format.qpack import RowLayout, num_blocks
from runmap.kernels import common
from runmap.kernels.cpu_int4 import CpuSiteError

SOURCE = Path(__file__).with_name("cpu_native.c")
COMPILE_FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=c11")
LINK_FLAGS = ("-lm",)
# Relative Frobenius error ||y - ref|| / ||ref|| against the FP32 reference executor: FP32 arithmetic in another
# summation order (measured ~1e-6 before the output's rounding); the float16 output adds up to 2^-11 relative.
# i16 (executor cpu-native-i16): activations rounded to int16 per block, measured 3e-5 to 8.6e-5 on random experts.
TOLERANCE = {"fp32": 1e-5, "fp16-output": 1e-3, "i16": 5e-4}
EXECUTOR_PRECISION = {"cpu-native": "fp32", "cpu-native-i16": "i16"}
SECTIONS = ("gate.weight", "gate.scale", "up.weight", "up.scale", "down.weight", "down.scale")
BUILD_TIMEOUT_S = 120
# the kernel's compile-time options (kernels/cpu_native.c): how work is split and scheduled, never what is computed
BUILD_OPTIONS = ("ROW_CHUNK", "DOWN_CHUNK", "ROW_SCHEDULE", "STAGE_OVERLAP")
I16_MAX_BLOCK = 4096  # the i16 path's largest block (its int32 block sums; qpack's default block is 256)


class NativeBuildError(CpuSiteError):
    """The C kernel could not be compiled or loaded here (no compiler, a compiler error, a broken cache)."""


def cache_dir() -> Path:
    root = os.environ.get("RUNMAP_CACHE_DIR")
    if root:
        return Path(root)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "runmap"


def _cpu_identity() -> str:
    """What -march=native depends on: the CPU model and its feature flags (first processor of /proc/cpuinfo)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    keep = [ln for ln in text.splitlines() if ln.split(":")[0].strip() in ("model name", "flags", "Features")]
    return "\n".join(dict.fromkeys(keep))  # one copy of each distinct line


def _compiler() -> str:
    cc = os.environ.get("CC", "cc")
    path = shutil.which(cc)
    if path is None:
        raise NativeBuildError(f"cpu-native: no C compiler {cc!r} on PATH (set $CC or install one, e.g. "
                               "`apt-get install gcc`); the cpu-int4 site needs none")
    return path


def _flags(march: str, defines: tuple[str, ...] = ()) -> tuple[str, ...]:
    return tuple(f"-march={march}" if f == "-march=native" else f for f in COMPILE_FLAGS) + _defines(defines)


def _defines(defines) -> tuple[str, ...]:
    """``-DNAME=VALUE`` flags of the kernel's compile-time options (ROW_CHUNK, DOWN_CHUNK, ROW_SCHEDULE,
    STAGE_OVERLAP in kernels/cpu_native.c; none changes a result), each checked to be one such option."""
    out = []
    for d in defines:
        name, _, value = d.partition("=")
        if name not in BUILD_OPTIONS:
            raise CpuSiteError(f"cpu-native: build option {d!r}: one of {', '.join(BUILD_OPTIONS)} expected (NAME=VALUE)")
        kind, _, chunk = value.partition(",")
        if not ((name in ("ROW_CHUNK", "DOWN_CHUNK") and value.isdigit() and int(value) > 0)
                or (name == "STAGE_OVERLAP" and value in ("0", "1"))
                or (name == "ROW_SCHEDULE" and kind in ("static", "dynamic", "guided")
                    and (not chunk or (chunk.isdigit() and int(chunk) > 0)))):
            raise CpuSiteError(f"cpu-native: build option {d!r}: ROW_CHUNK and DOWN_CHUNK take a positive integer, "
                               "STAGE_OVERLAP 0 or 1, ROW_SCHEDULE static, dynamic or guided (with ',N', N > 0)")
        out.append(f"-D{d}")
    return tuple(out)


def library_path(march: str = "native", defines: tuple[str, ...] = ()) -> Path:
    """Where the compiled kernel for this source, compiler, flags and CPU lives (built or not). ``march``: the
    instruction set (tests build the AVX2 and portable paths with it on a machine whose native one is AVX-512);
    ``defines``: compile-time options as NAME=VALUE (``BUILD_OPTIONS``; the default build takes none)."""
    cc = _compiler()
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise NativeBuildError(f"cpu-native: could not run the C compiler {cc}: {exc}") from None
    key = hashlib.sha256("\0".join([SOURCE.read_text(), cc, version, " ".join(_flags(march, defines) + LINK_FLAGS),
                                    platform.machine(), _cpu_identity()]).encode()).hexdigest()[:20]
    return cache_dir() / "cpu_native" / key / "libcpu_native.so"


def build(march: str = "native", defines: tuple[str, ...] = ()) -> Path:
    """Compile the kernel into the cache (once per key) and return the library's path."""
    lib = library_path(march, defines)
    if lib.exists():
        return lib
    cc = _compiler()
    try:
        lib.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".libcpu_native.", suffix=".so", dir=lib.parent)
        os.close(fd)
    except OSError as exc:
        raise NativeBuildError(f"cpu-native: cannot write the kernel cache {lib.parent}: {exc.strerror} "
                               "(set $RUNMAP_CACHE_DIR to a writable folder)") from None
    cmd = [cc, *_flags(march, defines), "-o", tmp, str(SOURCE), *LINK_FLAGS]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        if proc.returncode != 0:
            first = next((ln for ln in proc.stderr.splitlines() if "error" in ln), proc.stderr.strip()[:300])
            raise NativeBuildError(f"cpu-native: compiling {SOURCE.name} failed ({' '.join(cmd[:1] + list(_flags(march, defines)))}): "
                                   f"{first}")
        os.replace(tmp, lib)  # atomic: a concurrent build or reader sees the whole library or none
    except subprocess.TimeoutExpired:
        raise NativeBuildError(f"cpu-native: compiling {SOURCE.name} took over {BUILD_TIMEOUT_S} s") from None
    except OSError as exc:  # the compiler could not be started, or the library not moved into place
        raise NativeBuildError(f"cpu-native: building {lib}: {exc}") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return lib


_load_lock = threading.Lock()


@functools.lru_cache(maxsize=None)
def _library(march: str = "native", defines: tuple[str, ...] = ()):
    """The kernel's shared library, built if needed and loaded once per build."""
    with _load_lock:
        path = build(march, defines)
        try:
            return ctypes.CDLL(str(path))
        except OSError as exc:
            raise NativeBuildError(f"cpu-native: loading {path} failed: {exc} (delete the folder to rebuild)") from None


_P, _I32 = ctypes.c_void_p, ctypes.c_int
# runmap_moe_layer's arguments from x on (kernels/cpu_native.c), shared by the masked entry point
_LAYER_TAIL = [_P, _I32, _I32, _I32, _I32, _P, _P, _P, _P, _P, _I32, _I32, _P, _P, _P, _P, _P, _P, _I32, _I32]


@functools.lru_cache(maxsize=None)
def _function(march: str = "native", defines: tuple[str, ...] = ()):
    """The loaded ``runmap_moe_layer`` with its argument types (ctypes.CDLL releases the GIL during a call)."""
    fn = _library(march, defines).runmap_moe_layer
    fn.argtypes = [_P, _I32, _P, _P, _P] + _LAYER_TAIL
    fn.restype = _I32
    return fn


@functools.lru_cache(maxsize=None)
def _masked_function(march: str = "native", defines: tuple[str, ...] = ()):
    """The loaded ``runmap_moe_layer_masked`` (the layer's pairs a keep mask leaves to the CPU) with its argument
    types."""
    fn = _library(march, defines).runmap_moe_layer_masked
    fn.argtypes = [_P, _I32, _P, _P, _P, _I32, _P, _P, _P] + _LAYER_TAIL
    fn.restype = _I32
    return fn


def available() -> bool:
    """True when the kernel builds and loads here."""
    try:
        _function()
        return True
    except NativeBuildError:
        return False


PREFETCH_BYTES = 1024  # software prefetch distance in a weight stream (kernels/cpu_native.c, argument prefetch)


def prefetch_bytes() -> int:
    """The prefetch distance: ``$RUNMAP_CPU_NATIVE_PREFETCH`` (bytes, 0 = none; a tuning knob for measurements, the
    value is recorded by bench_cpu_experts) or ``PREFETCH_BYTES``."""
    raw = os.environ.get("RUNMAP_CPU_NATIVE_PREFETCH")
    if raw is None:
        return PREFETCH_BYTES
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if not 0 <= value <= 1 << 20:
        raise CpuSiteError(f"RUNMAP_CPU_NATIVE_PREFETCH={raw!r}: a byte count in [0, 1048576] expected")
    return value


def section_offsets(layout: RowLayout) -> torch.Tensor:
    return torch.tensor([layout.section(s).offset for s in SECTIONS], dtype=torch.int64)


class NativeLayer:
    """The C kernel bound to one row layout and precision ("fp32", or "i16": activations as int16 per block,
    integer dot products; kernels/cpu_native.c). Call ``run`` once per layer call. ``march`` and ``defines`` (the
    compile-time options of ``BUILD_OPTIONS``, NAME=VALUE) pick another build of the same kernel, for tests and
    measurements; every build computes the same values bit for bit."""

    def __init__(self, layout: RowLayout, precision: str = "fp32", march: str = "native",
                 defines: tuple[str, ...] = ()):
        if layout.block_size % 2:
            raise CpuSiteError(f"block_size {layout.block_size}: cpu-native needs an even block size")
        if precision == "i16" and layout.block_size > I16_MAX_BLOCK:
            # the block's integer sums are int32: 15 * 32767 per value overflows past ~4,369 values
            raise CpuSiteError(f"block_size {layout.block_size}: cpu-native-i16 sums a block in int32 and takes "
                               f"blocks of at most {I16_MAX_BLOCK} values; use cpu-native")
        if precision not in EXECUTOR_PRECISION.values():
            raise CpuSiteError(f"precision {precision!r}: cpu-native computes in 'fp32' or 'i16'")
        self.layout, self.precision = layout, precision
        self.prefetch_bytes = prefetch_bytes()
        self.offsets = section_offsets(layout)
        self.fn = _function(march, tuple(defines))
        self._build = (march, tuple(defines))  # (the masked entry point of the same library: bind_masked)
        self._offsets_ptr = self.offsets.data_ptr()  # read once: run_arrays makes no torch call
        self._scratch = threading.local()  # run_arrays' buffers, per calling thread, grown as needed

    def run(self, row_ptrs: list[int], assign_start: list[int] | torch.Tensor, assign_token, assign_weight,
            x: torch.Tensor, threads: int | None = None) -> torch.Tensor:
        """The routed-expert sum of one layer call.

        Args:
            row_ptrs: (n_experts,) addresses of qpacked rows of this layout, alive for the call (read only).
            assign_start: int32 (n_experts + 1,), expert i's assignments are [start[i], start[i + 1]).
            assign_token: int32 (n_assign,) token of each assignment, in [0, T).
            assign_weight: float32 (n_assign,) its gate weight.
            x: float32 (T, H) contiguous CPU activations.
            threads: OpenMP threads (default torch.get_num_threads()).
        Returns:
            float32 (T, H): out[t] = sum over t's assignments, in order, of weight * down(silu(gate x) * up x).
        """
        h, i = self.layout.hidden_size, self.layout.intermediate_size
        n_exp = len(row_ptrs)
        common.check_tensor("x", x, torch.float32, 2, shape=(None, h), device=torch.device("cpu"))
        if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
            raise common.KernelInputError(f"threads {threads!r}: a positive integer or None expected")
        t = x.shape[0]
        # the C kernel indexes with the table unchecked: a bad one is one line here, never a stray read there
        table = _assignment_table(assign_start, assign_token, assign_weight, n_exp, t)
        cpu = torch.device("cpu")
        out = common.empty((t, h), torch.float32, cpu)  # every element written by the kernel (tests poison these)
        if table is None:
            return out.zero_()
        start, tok, wts, n_assign = table
        x_split = common.empty((t, h), torch.float32, cpu)
        h_split = common.empty((n_assign, i), torch.float32, cpu)
        y = common.empty((n_assign, h), torch.float32, cpu)
        q16 = []  # the i16 path's scratch: int16 activations, per-block scales and sums, for x and for the intermediate
        if self.precision == "i16":
            nb_h, nb_i = num_blocks(h, self.layout.block_size), num_blocks(i, self.layout.block_size)
            q16 = [common.empty((t, h), torch.int16, cpu), common.empty((t, nb_h), torch.float32, cpu),
                  common.empty((t, nb_h), torch.int32, cpu), common.empty((n_assign, i), torch.int16, cpu),
                  common.empty((n_assign, nb_i), torch.float32, cpu), common.empty((n_assign, nb_i), torch.int32, cpu)]
        ptrs = (ctypes.c_void_p * n_exp)(*row_ptrs)
        rc = self.fn(ptrs, n_exp, start, tok, wts, x.data_ptr(), t, h, i,
                     self.layout.block_size, self.offsets.data_ptr(), x_split.data_ptr(), h_split.data_ptr(),
                     y.data_ptr(), out.data_ptr(), threads or torch.get_num_threads(), int(bool(q16)),
                     *([b.data_ptr() for b in q16] or [None] * 6), self.prefetch_bytes, 0)
        if rc != 0:
            raise CpuSiteError(f"cpu-native: the kernel returned {rc}")
        return out


    def _scratch_arrays(self, t: int, n_assign: int, fresh: bool = False) -> tuple[list[np.ndarray], tuple[int, ...]]:
        """This thread's scratch for a call of ``t`` tokens and ``n_assign`` assignments, and the buffers' addresses:
        x_split (t, H), h_split (n_assign, I), y (n_assign, H), then the i16 path's six buffers (``run``'s q16), as numpy views of tensors from common.empty (tests poison
        them); reallocated only when a call needs more room (each buffer may have more rows than the call uses).
        ``fresh``: new buffers of exactly that size, not kept (a prepared call of this thread still owns the kept
        ones)."""
        if fresh:
            tensors = self._allocate_scratch(t, n_assign)
            return [b.numpy() for b in tensors], tuple(b.data_ptr() for b in tensors)
        have = getattr(self._scratch, "size", (0, 0))
        if have[0] < t or have[1] < n_assign:
            t, n_assign = max(t, have[0]), max(n_assign, have[1])
            self._scratch.tensors = self._allocate_scratch(t, n_assign)  # keeps the memory
            self._scratch.arrays = [b.numpy() for b in self._scratch.tensors]
            self._scratch.ptrs = tuple(b.data_ptr() for b in self._scratch.tensors)
            self._scratch.size = (t, n_assign)
        return self._scratch.arrays, self._scratch.ptrs

    def _allocate_scratch(self, t: int, n_assign: int) -> list[torch.Tensor]:
        h, i, cpu = self.layout.hidden_size, self.layout.intermediate_size, torch.device("cpu")
        shapes = [((t, h), torch.float32), ((n_assign, i), torch.float32), ((n_assign, h), torch.float32)]
        if self.precision == "i16":
            nb_h, nb_i = num_blocks(h, self.layout.block_size), num_blocks(i, self.layout.block_size)
            shapes += [((t, h), torch.int16), ((t, nb_h), torch.float32), ((t, nb_h), torch.int32),
                       ((n_assign, i), torch.int16), ((n_assign, nb_i), torch.float32), ((n_assign, nb_i), torch.int32)]
        return [common.empty(shape, dt, cpu) for shape, dt in shapes]

    def run_arrays(self, row_ptrs: list[int], assign_start: list[int], assign_token: list[int],
                   assign_weight: list[float], x: np.ndarray, out: np.ndarray, threads: int | None = None) -> None:
        """``run`` on host arrays, writing into ``out``, with no torch call: ``prepare_arrays(...)()``."""
        self.prepare_arrays(row_ptrs, assign_start, assign_token, assign_weight, x, out, threads)()

    def prepare_arrays(self, row_ptrs: list[int], assign_start: list[int], assign_token: list[int],
                       assign_weight: list[float], x: np.ndarray, out: np.ndarray,
                       threads: int | None = None) -> "NativeCall":
        """Check and bind one call of ``run`` on host arrays, writing into ``out``, with no torch call: the decode
        chain's CPU part (runmap.engine.engine.SegmentDecoder) prepares it on the main thread and runs the returned
        call on the site's job thread, which then holds the GIL only to enter and leave the C kernel (the checks and
        the activations' widening done there kept the main thread waiting for the GIL). The preparing thread's
        scratch buffers are bound: one prepared call in flight per thread.

        Args:
            row_ptrs: (n_experts,) addresses of qpacked rows of this layout, alive for the call (read only).
            assign_start, assign_token, assign_weight: the assignment table as ``run`` takes it (Python sequences).
            x: float16 or float32 (T, H) C-contiguous numpy activations, read when the call runs (not copied
                here): unchanged until then.
            out: float32 (T, H) C-contiguous numpy array, every element written.
            threads: OpenMP threads (default torch.get_num_threads()).
        """
        h, i = self.layout.hidden_size, self.layout.intermediate_size
        n_exp = len(row_ptrs)
        for name, a, dtypes in (("x", x, (np.float16, np.float32)), ("out", out, (np.float32,))):
            if (not isinstance(a, np.ndarray) or a.dtype not in dtypes or a.ndim != 2 or a.shape[1] != h
                    or not a.flags.c_contiguous):
                got = f"{a.dtype} {a.shape}" if isinstance(a, np.ndarray) else type(a).__name__
                raise common.KernelInputError(f"cpu-native: {name} must be a C-contiguous "
                                              f"{'/'.join(np.dtype(d).name for d in dtypes)} (T, {h}) array, got {got}")
        t = x.shape[0]
        if out.shape[0] != t:
            raise common.KernelInputError(f"cpu-native: out has {out.shape[0]} rows for {t} tokens")
        # both are C-contiguous (checked above), so overlapping bounds are overlapping memory: the cheap test is exact
        if not out.flags.writeable or np.may_share_memory(out, x):
            raise common.KernelInputError("cpu-native: out must be a writable array that does not overlap x")
        if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
            raise common.KernelInputError(f"threads {threads!r}: a positive integer or None expected")
        table = _assignment_table(assign_start, assign_token, assign_weight, n_exp, t)
        if table is None:
            return NativeCall(None, (), out)
        start, tok, wts, n_assign = table
        # this thread's scratch, unless a call it prepared has not run yet (that call owns it): then fresh buffers
        state = getattr(self._scratch, "state", None)
        if state is None:
            state = self._scratch.state = _PendingCalls()
        scratch, scratch_ptrs = self._scratch_arrays(t, n_assign, fresh=state.count > 0)
        # the scratch buffers' addresses were read once at allocation (a view of their first rows starts there); FP16
        # activations are widened by the kernel itself (numpy's widening cost ~6 us per 2,048 values on the host)
        x_split_ptr, h_split_ptr, y_ptr = scratch_ptrs[:3]
        q16_ptrs = scratch_ptrs[3:] if self.precision == "i16" else (None,) * 6
        ptrs = (ctypes.c_void_p * n_exp)(*row_ptrs)
        args = (ptrs, n_exp, start, tok, wts, x.ctypes.data, t, h, i, self.layout.block_size, self._offsets_ptr,
                x_split_ptr, h_split_ptr, y_ptr, out.ctypes.data, threads or torch.get_num_threads(),
                int(self.precision == "i16"), *q16_ptrs, self.prefetch_bytes, int(x.dtype == np.float16))
        return NativeCall(self.fn, args, out, keep=(x, scratch), owner=state)

    def masked_scratch(self, t: int, k: int, n_experts: int) -> "MaskedScratch":
        """Scratch for masked calls of ``t`` tokens, top ``k`` and ``n_experts`` experts per layer, which calls that
        never run at the same time may share (``bind_masked``'s ``scratch``: one per decoder, whose layers are joined
        one after another)."""
        return MaskedScratch(self._allocate_scratch(t, t * k), np.empty(2 * (n_experts + 1) + t * k, dtype=np.int32),
                             (ctypes.c_void_p * n_experts)(), np.empty(t * k, dtype=np.float32), (t, k, n_experts))

    def bind_masked(self, layer_rows: list[int], ids: np.ndarray, keep: np.ndarray, weights: np.ndarray,
                    x: np.ndarray, out: np.ndarray, threads: int,
                    scratch: "MaskedScratch | None" = None) -> "MaskedCall":
        """Bind, once, the call that computes the pairs a device split left to the CPU (``keep`` 0) from arrays that
        stay at these addresses and are rewritten between calls (the one-graph two-site step's pinned copies of a
        layer's ids, keep mask, gate weights and input, runmap.engine.engine.SegmentDecoder): each call then reads
        them as they are, builds its assignment table in C and writes ``out``, with nothing checked or converted per
        call in Python. Shapes, dtypes and overlaps are checked here; expert ids are checked by the C code on every
        call (a pair to compute naming an expert outside the layer: KernelInputError, nothing read).

        Args:
            layer_rows: (E,) addresses of the layer's qpacked row of every expert, alive while the call is bound.
            ids: int64 (T, k) C-contiguous. keep: int32 (T k,) C-contiguous, 0 = computed here.
            weights: float32 (T, k) C-contiguous gate weights.
            x: float16 (T, H) C-contiguous activations. out: float32 (T, H) C-contiguous, every element written.
            threads: OpenMP threads, >= 1.
            scratch: from ``masked_scratch`` for these T, k and E, shared with calls that never run at the same time;
                None: the call's own.
        """
        h, i = self.layout.hidden_size, self.layout.intermediate_size
        n_e = len(layer_rows)

        def want(name, a, dtype, shape):
            if (not isinstance(a, np.ndarray) or a.dtype != dtype or a.shape != shape or not a.flags.c_contiguous):
                got = f"{a.dtype} {a.shape}" if isinstance(a, np.ndarray) else type(a).__name__
                raise common.KernelInputError(f"cpu-native masked call: {name} must be a C-contiguous "
                                              f"{np.dtype(dtype).name} {shape} array, got {got}")
        if not isinstance(ids, np.ndarray) or ids.ndim != 2:
            raise common.KernelInputError(f"cpu-native masked call: ids must be an int64 (T, k) array, got "
                                          f"{getattr(ids, 'shape', type(ids).__name__)}")
        t, k = ids.shape
        want("ids", ids, np.int64, (t, k))
        want("keep", keep, np.int32, (t * k,))
        want("weights", weights, np.float32, (t, k))
        want("x", x, np.float16, (t, h))
        want("out", out, np.float32, (t, h))
        if not out.flags.writeable or any(np.may_share_memory(out, a) for a in (ids, keep, weights, x)):
            raise common.KernelInputError("cpu-native masked call: out must be writable and overlap no input")
        if n_e < 1 or t < 1 or k < 1:
            raise common.KernelInputError(f"cpu-native masked call: {n_e} experts, {t} tokens, top_k {k}: each "
                                          "must be at least 1")
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise common.KernelInputError(f"threads {threads!r}: a positive integer expected")
        if scratch is None:
            scratch = self.masked_scratch(t, k, n_e)
        elif not isinstance(scratch, MaskedScratch) or scratch.size != (t, k, n_e):
            raise common.KernelInputError(f"cpu-native masked call: scratch for (T, k, E) = "
                                          f"{getattr(scratch, 'size', None)}, the call has {(t, k, n_e)}")
        tensors, work, rows_sel, weights_sel = scratch.tensors, scratch.work, scratch.rows_sel, scratch.weights_sel
        rows = (ctypes.c_void_p * n_e)(*layer_rows)
        ptrs = [b.data_ptr() for b in tensors]
        q16_ptrs = ptrs[3:] if self.precision == "i16" else [None] * 6
        args = (rows, n_e, ids.ctypes.data, keep.ctypes.data, weights.ctypes.data, k, work.ctypes.data, rows_sel,
                weights_sel.ctypes.data, x.ctypes.data, t, h, i, self.layout.block_size, self._offsets_ptr, *ptrs[:3],
                out.ctypes.data, threads, int(self.precision == "i16"), *q16_ptrs, self.prefetch_bytes, 1)
        return MaskedCall(_masked_function(*self._build), args, keep=(ids, keep, weights, x, out, tensors, work,
                                                                        rows_sel, weights_sel, rows))


@dataclasses.dataclass(eq=False)
class MaskedScratch:
    """The buffers of masked calls (``NativeLayer.masked_scratch``): the kernel's scratch tensors, the C code's int32
    work array, its selected row addresses and weights, and the (T, k, E) they are sized for."""

    tensors: list
    work: np.ndarray
    rows_sel: object  # ctypes array of E row addresses
    weights_sel: np.ndarray
    size: tuple


class MaskedCall:
    """A bound ``runmap_moe_layer_masked`` call (``NativeLayer.bind_masked``): each call computes the pairs the keep
    mask leaves to the CPU, as the bound arrays hold them then. Not re-entrant, nor concurrent with another call bound
    to the same scratch."""

    def __init__(self, fn, args: tuple, keep: tuple):
        self.fn, self.args, self._keep = fn, args, keep

    def __call__(self) -> None:
        rc = self.fn(*self.args)
        if rc == 2:
            raise common.KernelInputError("cpu-native masked call: a pair to compute names an expert outside the "
                                          "layer's experts")
        if rc != 0:
            raise CpuSiteError(f"cpu-native: the kernel returned {rc}")


SMALL_TABLE = 256  # assignments up to which the table is checked and converted in plain Python (decode calls)


def _assignment_table(assign_start, assign_token, assign_weight, n_exp: int, t: int):
    """The assignment table of ``NativeLayer.prepare_arrays`` checked (one line naming the shapes when it does not fit
    ``n_exp`` experts and ``t`` tokens: the C kernel indexes with it unchecked) and converted to what the kernel
    reads, in memory of its own (a caller that changes its table afterwards changes nothing): (start int32, token
    int32, weight float32, n_assign) as ctypes arrays, built from Python lists for small tables (no numpy object per
    call) and over numpy copies otherwise; None when there is nothing to compute."""
    try:
        if isinstance(assign_start, list) and isinstance(assign_token, list) and len(assign_token) <= SMALL_TABLE:
            start, tok, wts = assign_start, assign_token, list(assign_weight)
            n_assign = start[-1] if n_exp and len(start) == n_exp + 1 else 0
            if (len(start) != n_exp + 1 or (n_exp and (start[0] != 0 or not all(map(operator.le, start, start[1:]))))
                    or len(tok) != n_assign or len(wts) != n_assign or (n_assign and (min(tok) < 0 or max(tok) >= t))):
                raise common.KernelInputError(f"cpu-native: assignment table does not fit {n_exp} experts and {t} "
                                              f"tokens (start ({len(start)},), token ({len(tok)},), weight "
                                              f"({len(wts)},))")
            if n_exp == 0 or n_assign == 0:
                return None
            # ctypes refuses a float or a string where an int32 belongs (TypeError); the checks above keep every value
            # in range (tokens below t, starts at most n_assign <= SMALL_TABLE)
            return ((ctypes.c_int32 * len(start))(*start), (ctypes.c_int32 * n_assign)(*tok),
                    (ctypes.c_float * n_assign)(*wts), n_assign)
        # torch tensors (run's table from ``assignments``) as numpy views first; np.array then copies
        start, tok, wts = (v.numpy() if isinstance(v, torch.Tensor) else v
                           for v in (assign_start, assign_token, assign_weight))
        start, tok = np.array(start), np.array(tok)
        if start.dtype.kind not in "iu" or (tok.size and tok.dtype.kind not in "iu"):
            raise TypeError("indices")
        wts = np.array(wts, dtype=np.float32)
    except common.KernelInputError:
        raise
    except (TypeError, ValueError):  # a float or a string where an index belongs, a ragged list, ...
        raise common.KernelInputError("cpu-native: assignment table: integer starts and tokens and real weights "
                                      "expected") from None
    n_assign = int(start[-1]) if n_exp and start.shape == (n_exp + 1,) else 0
    # checked before the int32 conversion, so that an out-of-range value is refused, never wrapped
    if (start.shape != (n_exp + 1,) or (n_exp and (int(start[0]) != 0 or bool((start[1:] < start[:-1]).any())))
            or tok.shape != (n_assign,) or wts.shape != (n_assign,)
            or (n_assign and (int(tok.min()) < 0 or int(tok.max()) >= t))):
        raise common.KernelInputError(f"cpu-native: assignment table does not fit {n_exp} experts and {t} tokens "
                                      f"(start {start.shape}, token {tok.shape}, weight {wts.shape})")
    if n_exp == 0 or n_assign == 0:
        return None
    start, tok = start.astype(np.int32), tok.astype(np.int32)  # new C-contiguous arrays (n_assign < 2^31 here)
    # ctypes arrays over them: passed as pointers, and they keep the arrays alive
    return (np.ctypeslib.as_ctypes(start), np.ctypeslib.as_ctypes(tok), np.ctypeslib.as_ctypes(wts), n_assign)


class _PendingCalls:
    """How many calls a thread prepared on its kept scratch that have not run yet (decremented by the thread that runs
    them, or when a call is dropped unrun, hence the lock; re-entrant because a drop may happen in a garbage
    collection that starts inside ``add`` on the same thread)."""

    def __init__(self):
        self.count = 0
        self.lock = threading.RLock()

    def add(self, n: int) -> None:
        with self.lock:
            self.count += n


class NativeCall:
    """One bound call of the C kernel (``NativeLayer.prepare_arrays``): calling it runs the kernel (ctypes releases
    the GIL for its duration) and raises CpuSiteError on a non-zero return; a call with no assignment zeroes ``out``.
    It holds the arrays the kernel reads, so their addresses stay valid until it has run."""

    def __init__(self, fn, args: tuple, out: np.ndarray, keep: tuple = (), owner=None):
        self.fn, self.args, self.out, self._keep = fn, args, out, keep
        # the preparing thread's scratch state: while this call has not run, that thread's next preparation takes
        # fresh buffers instead of the ones bound here
        self._owner = owner
        if owner is not None:
            owner.add(1)

    def __call__(self) -> None:
        try:
            if self.fn is None:
                self.out.fill(0.0)
                return
            rc = self.fn(*self.args)
            if rc != 0:
                raise CpuSiteError(f"cpu-native: the kernel returned {rc}")
        finally:
            self._release()

    def __del__(self):
        # dropped without running (a cancelled job): its scratch is free again, so the preparing thread goes back
        # to its kept buffers instead of allocating fresh ones for every later call
        self._release()

    def _release(self) -> None:
        owner, self._owner = getattr(self, "_owner", None), None
        if owner is not None:
            owner.add(-1)


def assignments(topk_ids: torch.Tensor, topk_weights: torch.Tensor, experts=None):
    """Group a layer call's (token, slot) pairs by expert.

    Args:
        topk_ids: int (T, k) CPU, topk_weights: float32 (T, k) CPU.
        experts: the expert ids to compute (None: every routed one); slots routed elsewhere are left out.
    Returns:
        (expert ids in ascending order, start int32 (n + 1,), token int32 (n_assign,), weight float32 (n_assign,));
        within an expert the assignments keep (token, slot) order.
    """
    t, k = topk_ids.shape
    if t == 1:  # decode: a few slots, plain Python is cheaper than the tensor ops
        return _one_token_assignments(topk_ids[0].tolist(), topk_weights[0].tolist(), experts)
    flat = topk_ids.reshape(-1).to(torch.int64)  # (T k,)
    tok = torch.arange(t, dtype=torch.int32).repeat_interleave(k)
    wts = topk_weights.reshape(-1).to(torch.float32)
    if experts is not None:
        sel = torch.isin(flat, torch.tensor(sorted({int(e) for e in experts}), dtype=torch.int64))
        flat, tok, wts = flat[sel], tok[sel], wts[sel]
    ids_sorted, perm = torch.sort(flat, stable=True)
    uniq, counts = torch.unique_consecutive(ids_sorted, return_counts=True)
    start = torch.zeros(len(uniq) + 1, dtype=torch.int32)
    torch.cumsum(counts, 0, out=start[1:])
    return uniq.tolist(), start, tok[perm].contiguous(), wts[perm].contiguous()


def _one_token_assignments(ids: list, weights: list, experts=None):
    """``assignments`` of one token from its k ids and gate weights as Python lists."""
    keep = None if experts is None else {int(e) for e in experts}
    by_expert: dict[int, list[float]] = {}
    for e, w in zip(ids, weights):
        if keep is None or e in keep:
            by_expert.setdefault(int(e), []).append(w)
    order = sorted(by_expert)
    start, weight = [0], []
    for e in order:
        weight += by_expert[e]
        start.append(len(weight))
    return order, start, [0] * len(weight), weight


def assignments_arrays(topk_ids: np.ndarray, topk_weights: np.ndarray, experts=None):
    """``assignments`` on numpy arrays (int (T, k) ids, float32 (T, k) weights), with no torch call; the same
    order: experts ascending, within an expert (token, slot) order. Returns Python lists."""
    t, k = topk_ids.shape
    if t == 1:
        return _one_token_assignments(topk_ids[0].tolist(), topk_weights[0].tolist(), experts)
    flat = topk_ids.reshape(-1).astype(np.int64)  # (T k,)
    tok = np.repeat(np.arange(t, dtype=np.int32), k)
    wts = topk_weights.reshape(-1).astype(np.float32)
    if experts is not None:
        sel = np.isin(flat, np.fromiter((int(e) for e in experts), dtype=np.int64))
        flat, tok, wts = flat[sel], tok[sel], wts[sel]
    perm = np.argsort(flat, kind="stable")
    uniq, counts = np.unique(flat[perm], return_counts=True)
    start = [0] + np.cumsum(counts).tolist()
    return uniq.tolist(), start, tok[perm].tolist(), wts[perm].tolist()


def cpu_native_i16_moe(x, topk_ids, topk_weights, storage, row_table, layout: RowLayout, config=None):
    """``cpu_native_moe`` on the i16 path (executor cpu-native-i16). Returns float16 (T, H)."""
    return cpu_native_moe(x, topk_ids, topk_weights, storage, row_table, layout, config, precision="i16")


def cpu_native_moe(x, topk_ids, topk_weights, storage, row_table, layout: RowLayout, config=None,
                   precision: str = "fp32") -> torch.Tensor:
    """The registry form (arguments and result as runmap.kernels.executors.moe_experts), every tensor on the CPU.

    Reads the routed rows of ``storage`` where they lie (no copy). config: optional {"threads": n}.
    Returns float16 (T, H).
    """
    if storage.device.type != "cpu":
        raise common.KernelInputError(f"storage on {storage.device}: cpu-native computes on the CPU from host rows "
                                      "only (it never reads device rows); use a GPU executor for device storage")
    common.check_storage(storage, layout)
    cpu = torch.device("cpu")
    common.check_tensor("x", x, torch.float16, 2, shape=(None, layout.hidden_size), device=cpu)
    common.check_tensor("topk_ids", topk_ids, (torch.int32, torch.int64), 2, shape=(x.shape[0], None), device=cpu)
    common.check_tensor("topk_weights", topk_weights, torch.float32, 2, shape=tuple(topk_ids.shape), device=cpu)
    threads = (config or {}).get("threads")
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise common.KernelInputError(f"config threads {threads!r}: a positive integer expected")
    table = row_table.tolist()
    order, start, tok, wts = assignments(topk_ids, topk_weights)
    ptrs = []
    for e in order:
        row = table[e] if 0 <= e < len(table) else -1
        if row < 0 or row >= storage.shape[0]:  # never substitute another expert
            raise common.KernelInputError(f"expert {e} is not resident: row_table[{e}] = {row}")
        ptrs.append(storage[row].data_ptr())
    y = NativeLayer(layout, precision).run(ptrs, start, tok, wts, x.to(torch.float32).contiguous(), threads)
    return y.to(torch.float16)
