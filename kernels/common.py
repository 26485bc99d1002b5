"""Host-side helpers shared by every kernel wrapper: input checks, section offsets, allocation, configs.

Wrappers raise ``ValueError`` (``KernelInputError``) naming the tensor and the field before any launch;
no check here reads tensor *values* (that would synchronize with the device), only metadata.
"""
from __future__ import annotations

import dataclasses
import functools
import os

import torch

from runmap.format.qpack import RowLayout


class KernelInputError(ValueError):
    """A kernel argument has the wrong dtype, shape, stride, device or layout. The message names it."""


def empty(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Every buffer a wrapper allocates goes through here, so tests can poison them (NaN) and prove
    that the kernels write every element instead of relying on zeroed memory."""
    return torch.empty(shape, dtype=dtype, device=device)


def interpreting(device: torch.device) -> bool:
    """True when kernels run in the Triton CPU interpreter (tile choices differ: fewer, larger programs)."""
    return device.type == "cpu" or os.environ.get("TRITON_INTERPRET") == "1"


# Programmatic dependent launch (PDL) of the decode chain's kernels. Each chained kernel starts with
# ``runmap.kernels.core.chain_wait``: it waits until the launch before it has completed and its writes are visible,
# then lets the launch after it start. So the next kernel's programs are already resident, blocked at their wait,
# when this one ends, instead of being launched then: ~0.5 us less per launch boundary on the H200
# (tools/explore/probe_decode_pdl.py, results/kernels/pdl/). Before its wait a chained kernel writes nothing and
# reads only what the launch before it does not write (docs/kernels.md), so the values are those of plain launches;
# RUNMAP_PDL=0 in the environment of the process switches it off (for A/B measurements).
PDL_ENV = "RUNMAP_PDL"


_UNCHAINED = {"CHAINED": False}
_chain_setting: dict = {}  # CUDA device index -> launch keywords, decided at the first launch (reset_chained)


def _chained_cuda(index: int | None) -> dict:
    if torch.version.hip is not None or os.environ.get("TRITON_INTERPRET") == "1" \
            or os.environ.get(PDL_ENV, "1") == "0":
        return _UNCHAINED  # (ROCm reports capabilities like 9.4 too: griddepcontrol is NVIDIA PTX)
    capable = torch.cuda.get_device_capability(index if index is not None else torch.cuda.current_device()) >= (9, 0)
    return {"CHAINED": True, "launch_pdl": True} if capable else _UNCHAINED


def chained(device: torch.device) -> dict:
    """Launch keywords of a kernel that takes a ``CHAINED`` constexpr: ``{"CHAINED": True, "launch_pdl": True}`` on a
    CUDA device of compute capability 9.0 or later (Hopper) unless RUNMAP_PDL=0, else ``{"CHAINED": False}`` (the
    interpreter, older GPUs, ROCm, or switched off). Decided at the first launch on each device (a dictionary lookup
    afterwards: eager passes launch hundreds of kernels); ``reset_chained`` reads RUNMAP_PDL again. Callers unpack
    the result and never change it."""
    if device.type != "cuda":
        return _UNCHAINED
    kw = _chain_setting.get(device.index)
    if kw is None:
        kw = _chain_setting[device.index] = _chained_cuda(device.index)
    return kw


def reset_chained() -> None:
    """Forget the decided setting: the next launch reads RUNMAP_PDL (and the device) again. For probes and tests that
    switch it within one process; a CUDA graph keeps what it was captured with."""
    _chain_setting.clear()


@dataclasses.dataclass(frozen=True)
class ProjSections:
    """Where one projection lives inside an expert row.

    w_off: byte offset of the packed uint8 (N, K/2) weight; s_off: offset of the fp16 (N, nb) scales in
    fp16 *elements* (the storage is also viewed as fp16, row r starting at r * row_bytes / 2).
    """

    n: int
    k: int
    nb: int
    w_off: int
    s_off: int


def proj_sections(layout: RowLayout, proj: str) -> ProjSections:
    n, k = layout.proj_dims(proj)
    w = layout.section(f"{proj}.weight")
    s = layout.section(f"{proj}.scale")
    if s.offset % 2 or layout.row_bytes % 2:
        raise KernelInputError(f"layout: {proj}.scale offset {s.offset} / row_bytes {layout.row_bytes} must be even")
    return ProjSections(n=n, k=k, nb=s.shape[1], w_off=w.offset, s_off=s.offset // 2)


def tile_scale(block_k: int, qblock: int) -> bool:
    """Whether every K tile of ``block_k`` values lies inside one scale block (scale applied once per tile
    to the partial dot product); otherwise the kernel gathers one scale per element."""
    return qblock % block_k == 0


def pick_block_k(want: int, qblock: int, minimum: int = 32) -> int:
    """Largest power of two <= ``want`` (and >= ``minimum``) dividing the quantization block, so that the
    scale is constant per tile; ``want`` itself when none divides (per-element scales)."""
    bk = want
    while bk >= minimum:
        if qblock % bk == 0:
            return bk
        bk //= 2
    return want


def gemv_block_k(want: int, qblock: int) -> tuple[int, int, bool]:
    """GEMV tile along K -> (BLOCK_K, GROUPS, TILE_SCALE). A tile may span several whole scale blocks
    (GROUPS = BLOCK_K / qblock) when qblock is a power of two; otherwise as ``pick_block_k``."""
    if want >= qblock and want % qblock == 0 and qblock & (qblock - 1) == 0 and (want // qblock) & (want // qblock - 1) == 0:
        return want, want // qblock, True
    bk = pick_block_k(want, qblock, minimum=16)
    return bk, 1, tile_scale(bk, qblock)


def metadata_only(check):
    """Run a check that reads only tensor metadata with torch-function handling off (see ``launch``: under the copy
    monitor every ``.dim()``, ``.shape``, ``.is_contiguous()`` went through its mode, ~1,600 calls per prefill)."""
    @functools.wraps(check)
    def run(*args, **kwargs):
        with torch._C.DisableTorchFunction():
            return check(*args, **kwargs)
    return run


@metadata_only
def check_tensor(name: str, t, dtype=None, ndim: int | None = None, shape=None, device=None,
                 contiguous: bool = True) -> None:
    """Raise KernelInputError unless ``t`` is a torch.Tensor matching every given property."""
    if not isinstance(t, torch.Tensor):
        raise KernelInputError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if dtype is not None:
        allowed = dtype if isinstance(dtype, tuple) else (dtype,)
        if t.dtype not in allowed:
            want = " or ".join(str(d).replace("torch.", "") for d in allowed)
            raise KernelInputError(f"{name}: dtype {str(t.dtype).replace('torch.', '')}, expected {want}")
    if ndim is not None and t.dim() != ndim:
        raise KernelInputError(f"{name}: {t.dim()}-D tensor of shape {tuple(t.shape)}, expected {ndim}-D")
    if shape is not None:
        if t.dim() != len(shape):  # a shape names every dimension: a tensor of another rank never matches it
            raise KernelInputError(f"{name}: {t.dim()}-D tensor of shape {tuple(t.shape)}, expected {len(shape)}-D "
                                   f"{tuple('any' if w is None else w for w in shape)}")
        for i, (got, want) in enumerate(zip(t.shape, shape)):
            if want is not None and got != want:
                raise KernelInputError(f"{name}: shape {tuple(t.shape)}, dimension {i} should be {want}")
    if device is not None and t.device != device:
        raise KernelInputError(f"{name}: on {t.device}, expected {device} (all kernel inputs share one device)")
    if contiguous and not t.is_contiguous():
        raise KernelInputError(f"{name}: not contiguous (strides {t.stride()} for shape {tuple(t.shape)})")


@metadata_only
def check_storage(storage, layout: RowLayout, device=None) -> None:
    """storage: uint8 (R, row_bytes) contiguous, row_bytes == layout.row_bytes."""
    if not isinstance(layout, RowLayout):
        raise KernelInputError(f"layout: expected runmap.format.qpack.RowLayout, got {type(layout).__name__}")
    check_tensor("storage", storage, torch.uint8, 2, device=device)
    if storage.shape[1] != layout.row_bytes:
        raise KernelInputError(
            f"storage: row_bytes {storage.shape[1]} != layout.row_bytes {layout.row_bytes} "
            f"(hidden={layout.hidden_size}, intermediate={layout.intermediate_size}, block={layout.block_size})"
        )
    if storage.shape[0] < 1:
        raise KernelInputError("storage: has no rows")
    if storage.storage_offset() % 2:
        raise KernelInputError("storage: odd storage offset; the fp16 scale view needs 2-byte alignment")


def launch_opts(cfg: dict) -> dict:
    """num_warps / num_stages of a config (ignored by the interpreter)."""
    return {k: cfg[k] for k in ("num_warps", "num_stages") if k in cfg}


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def launch(kernel, *args, **kwargs):
    """``kernel(*args, **kwargs)`` for a gridded Triton kernel (``jit_fn[grid]``), with torch-function handling off.

    Why: Triton's launcher reads each tensor argument's metadata (``data_ptr()``, ``dtype``, strides) through
    Python attribute calls, and while a ``TorchFunctionMode`` is active (the expert copy monitor,
    runmap.residency.instruments) every one of them went through the mode: ~3,300 calls and ~25 ms of host time
    per prefill on the H200 host (results/serve/probe/README.md), ten times the kernels' own time. A launch makes
    no torch call that moves bytes (the kernel reads device memory on the device), so nothing the monitor counts
    happens inside it; every torch call of a wrapper outside this call is still seen."""
    with torch._C.DisableTorchFunction():
        return kernel(*args, **kwargs)


class CompileLog:
    """Every Triton kernel variant this process compiles (or loads from Triton's disk cache) for a new
    specialization, seen through Triton's ``jit_post_compile_hook``: a compilation inside a request is a stall of
    seconds, so a server counts the variants made after it reported ready (none is the goal of its warm-up).

    One log per process (``compile_log()``); an earlier hook is kept and still called. Under the interpreter
    nothing is compiled and the log stays empty. ``mark()`` starts a second, bounded list of the variants compiled
    from then on (a server marks when it is ready), so those are kept however many the warm-up compiled."""

    KEEP = 64  # variants kept with their names in each list (the counts go on)

    def __init__(self):
        self.count = 0
        self.variants: list[str] = []  # the first KEEP variants: "kernel(arg: type, ..., NAME=constexpr value)"
        self.marked_at: int | None = None  # count at mark()
        self.since_mark: list[str] = []  # the first KEEP variants compiled after mark()
        self._previous = None

    def install(self) -> "CompileLog":
        try:
            from triton import knobs
        except ImportError:  # an older Triton without knobs: nothing to observe (count stays 0, said in stats)
            return self
        self._previous = knobs.runtime.jit_post_compile_hook
        knobs.runtime.jit_post_compile_hook = self._hook
        return self

    def mark(self) -> None:
        self.marked_at, self.since_mark = self.count, []

    @staticmethod
    def describe(fn, compile: dict, repr: str) -> str:
        """The kernel's name, argument types and constexpr values (Triton's ``repr`` is built from a key that is a
        string in Triton 3.6, so its argument part is not usable; the compile arguments are)."""
        name = (getattr(fn, "name", None) or repr.split("[", 1)[0]).rsplit(".", 1)[-1]
        sig = compile.get("signature") or {}
        consts = compile.get("constants") or {}
        names = list(sig) if isinstance(sig, dict) else []
        args = [f"{k}: {v}" for k, v in sig.items() if v != "constexpr"] if isinstance(sig, dict) else []
        for path, v in (consts.items() if isinstance(consts, dict) else ()):
            # a constexpr's key is its path among the arguments ((index,) for a plain one)
            i = path[0] if isinstance(path, tuple) and path and isinstance(path[0], int) else None
            args.append(f"{names[i] if i is not None and i < len(names) else path}={v}")
        return f"{name}({', '.join(args)})"

    def _hook(self, *, key, repr, fn, compile, is_manual_warmup, already_compiled):
        self.count += 1
        text = self.describe(fn, compile if isinstance(compile, dict) else {}, repr)
        if len(self.variants) < self.KEEP:
            self.variants.append(text)
        if self.marked_at is not None and len(self.since_mark) < self.KEEP:
            self.since_mark.append(text)
        if self._previous is not None:
            return self._previous(key=key, repr=repr, fn=fn, compile=compile, is_manual_warmup=is_manual_warmup,
                                  already_compiled=already_compiled)
        return None


_COMPILE_LOG: CompileLog | None = None


def compile_log() -> CompileLog:
    """This process's CompileLog, installed on first use."""
    global _COMPILE_LOG
    if _COMPILE_LOG is None:
        _COMPILE_LOG = CompileLog().install()
    return _COMPILE_LOG
