"""Instruments behind the required-zero observations (docs/cache-contract.md#observations).

``ExpertCopyMonitor`` sees every torch call issued while it is active and counts the ones that copy bytes
*out of* the cache's expert storage into host memory. It watches at one of two levels:

* ``level="function"`` (the default): a ``TorchFunctionMode``, which sees every torch function and Tensor
  method called from Python (``Tensor.cpu``, ``.to``, ``copy_``, ``clone``, ``.item()``, ``.tolist()``,
  indexing, ...), about 2 us per call;
* ``level="dispatch"``: a ``TorchDispatchMode``, which sees every aten operation, including those issued by
  C++ code on behalf of one Python call; it costs ~45 us per operation on the H200 host (measured:
  ``results/residency/probe-partial-h200.log``), which made it half of a partial-residency decode step.

Both count the same copies for every Python-level way of making one (tests/test_observations.py runs the same
cases at both levels); the dispatch level also sees a copy made inside a C++ extension's own code.

* ``d2h_bytes`` / ``d2h_copies``: a copy whose source aliases a registered expert storage tensor and whose
  destination is a CPU tensor outside every registered storage (``Tensor.cpu()``, ``.to("cpu")``,
  ``copy_`` into a host buffer, ``.item()`` / ``.tolist()`` of a row, ...). With the CPU transport the
  "device" rows are themselves CPU tensors; a copy of them into other host memory counts the same way.
* ``writebacks``: such a copy made inside a miss transaction (where an eviction would write a victim back)
  or whose destination lies inside the host source.

The cache activates the monitor around everything it does for a request (admission, acquisition with its
miss transaction, release); callers extend it to their own code that reads leased rows with
``ExpertCache.monitored()`` (the contract model runs its expert kernels inside it). The observations
state which scopes were covered.
"""
from __future__ import annotations

import bisect
import contextlib

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

_aten = torch.ops.aten
# operations that move bytes from their first tensor argument into a new tensor or into ``dst``
# .item() dispatches as _local_scalar_dense, but as aten.item under inference_mode (the engine's mode)
_SCALAR_OUT = {_aten._local_scalar_dense.default, _aten.item.default}
_COPY_OUT = {_aten._to_copy.default, _aten.clone.default, *_SCALAR_OUT}
_COPY_INTO = {_aten.copy_.default: (1, 0)}  # op -> (source arg, destination arg)
_COPY_FROM = {_aten._copy_from.default: (0, 1), _aten._copy_from_and_resize.default: (0, 1)}
# function level: calls that make a new tensor holding their input's bytes (same dtype: a copy, not arithmetic)
_F_COPY_OUT = {torch.Tensor.to, torch.Tensor.cpu, torch.Tensor.clone, torch.clone, torch.Tensor.contiguous,
               torch.Tensor.__deepcopy__, torch.Tensor.new_tensor}
_F_SCALARS = {torch.Tensor.item: False, torch.Tensor.tolist: True}  # -> whole tensor (True) or one element
LEVELS = ("function", "dispatch")


def _span(t: torch.Tensor) -> tuple[int, int]:
    """[first byte, last byte + 1) of the memory a tensor can address (its untyped storage)."""
    s = t.untyped_storage()
    return s.data_ptr(), s.data_ptr() + s.nbytes()


class _Spans:
    """A union of address ranges [lo, hi) kept sorted and merged, so that a lookup is one bisection, not a scan:
    the monitor asks "is this tensor in expert storage?" several times per torch call of a miss transaction, over
    one storage tensor per layer (tools/explore: the scan over 16 layers was most of the monitor's cost)."""

    def __init__(self):
        self.lo: list[int] = []
        self.hi: list[int] = []

    def add(self, lo: int, hi: int) -> None:
        if hi <= lo:
            return
        spans = sorted(zip(self.lo + [lo], self.hi + [hi]))
        merged = [list(spans[0])]
        for a, b in spans[1:]:
            if a <= merged[-1][1]:  # touching or overlapping: one range
                merged[-1][1] = max(merged[-1][1], b)
            else:
                merged.append([a, b])
        self.lo, self.hi = [m[0] for m in merged], [m[1] for m in merged]

    def contains(self, p: int) -> bool:
        i = bisect.bisect_right(self.lo, p) - 1
        return i >= 0 and p < self.hi[i]

    def __iter__(self):
        return iter(zip(self.lo, self.hi))


class ExpertCopyMonitor:
    """Counts copies of expert storage into host memory while active (see the module docstring)."""

    def __init__(self, level: str = "function"):
        if level not in LEVELS:
            raise ValueError(f"copy monitor level {level!r}: choose one of {list(LEVELS)}")
        self.level = level
        self.d2h_bytes = 0
        self.d2h_copies = 0
        self.writebacks = 0
        self.cache_scopes = 0  # cache entry points run under the monitor
        self.caller_scopes = 0  # ExpertCache.monitored() blocks entered by callers
        self.events: list[tuple[str, int]] = []  # (op, bytes) of the first few copies seen, for error messages
        # watched memory by device type: a tensor on another device cannot be inside it (on CUDA, every host
        # tensor a transaction touches is answered without locating its storage)
        self._storage_by_device: dict[str, _Spans] = {}
        self._host_by_device: dict[str, _Spans] = {}
        self._depth = 0
        self._in_transaction = 0
        self._mode = None  # one mode object, entered by the outermost scope each time

    # registration -------------------------------------------------------------------------------------
    def watch_storage(self, t: torch.Tensor) -> None:
        self._storage_by_device.setdefault(t.device.type, _Spans()).add(*_span(t))

    def watch_host(self, t: torch.Tensor) -> None:
        self._host_by_device.setdefault(t.device.type, _Spans()).add(*_span(t))

    # scopes ---------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def scope(self, caller: bool = False, transaction: bool = False):
        """Run a block under the monitor (nested scopes share one dispatch mode)."""
        if caller:
            self.caller_scopes += 1
        else:
            self.cache_scopes += 1
        self._in_transaction += transaction
        try:
            if self._depth:
                self._depth += 1
                try:
                    yield self
                finally:
                    self._depth -= 1
            else:
                self._depth = 1
                if self._mode is None:
                    self._mode = _Mode(self) if self.level == "dispatch" else _FunctionMode(self)
                try:
                    with self._mode:
                        yield self
                finally:
                    self._depth = 0
        finally:
            self._in_transaction -= transaction

    # classification -------------------------------------------------------------------------------------
    @staticmethod
    def _inside(t, spans) -> bool:
        """True when tensor ``t``'s storage begins inside one of ``spans`` (a _Spans, or (lo, hi) pairs)."""
        if not isinstance(t, torch.Tensor) or t.is_sparse:
            return False
        try:
            p = t.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError):  # tensors without storage (meta, functional wrappers)
            return False
        if isinstance(spans, _Spans):
            return spans.contains(p)
        return any(lo <= p < hi for lo, hi in spans)

    def _in_storage(self, t) -> bool:
        """``t`` is (a view of) watched expert storage: only tensors on a device that holds some are located."""
        if not isinstance(t, torch.Tensor):
            return False
        spans = self._storage_by_device.get(t.device.type)
        return spans is not None and self._inside(t, spans)

    def _in_host(self, t) -> bool:
        """``t`` lies in the watched host source."""
        if not isinstance(t, torch.Tensor):
            return False
        spans = self._host_by_device.get(t.device.type)
        return spans is not None and self._inside(t, spans)

    def _count(self, name: str, dst: torch.Tensor | None, nbytes: int | None = None) -> None:
        """Count one copy into ``dst`` (None: a Python scalar of ``nbytes``) if it lands in host memory."""
        if dst is not None:
            if dst.device.type != "cpu" or self._in_storage(dst):
                return
            nbytes = dst.numel() * dst.element_size()
        n = int(nbytes)
        self.d2h_bytes += n
        self.d2h_copies += 1
        if self._in_transaction or (dst is not None and self._in_host(dst)):
            self.writebacks += 1
        if len(self.events) < 8:
            self.events.append((name, n))

    def see(self, func, args, kwargs, out) -> None:
        if not self._storage_by_device:
            return
        if func in _COPY_INTO:
            s, d = _COPY_INTO[func]
            if self._in_storage(args[s]):
                self._count(func.__name__, args[d])
        elif func in _COPY_FROM:
            s, d = _COPY_FROM[func]
            if self._in_storage(args[s]):
                self._count(func.__name__, out if isinstance(out, torch.Tensor) else args[d])
        elif func in _COPY_OUT or func.overloadpacket is _aten.to:
            # aten.to.* is what Tensor.to dispatches to under inference_mode (the engine's mode); elsewhere
            # it decomposes into _to_copy. Counted: a new tensor holding the row's bytes (same dtype), or any
            # host tensor made from a row on a GPU; a dtype conversion on the CPU is arithmetic on host memory.
            src = args[0] if args else None
            if self._in_storage(src):
                if func in _SCALAR_OUT:
                    if src.device.type != "cpu":  # .item() of a device row: the scalar crosses to the host
                        self._count(func.__name__, None, src.element_size())
                elif isinstance(out, torch.Tensor) and not self._in_storage(out) and (
                        src.device.type != "cpu" or out.dtype == src.dtype):
                    self._count(func.__name__, out)
        elif isinstance(out, torch.Tensor) and out.device.type == "cpu":
            # any other op that reads a device-resident expert row and produces a host tensor
            for a in args:
                if isinstance(a, torch.Tensor) and a.device.type != "cpu" and self._in_storage(a):
                    self._count(func.__name__, out)
                    break


    def see_call(self, func, args, kwargs, out) -> None:
        """Function level: classify one torch call (func, its arguments, its result)."""
        # a row passed by keyword is read like a positional one (buf.copy_(other=row), torch.clone(input=row)); the
        # dispatch level needs no such step: the aten op gets both as arguments of its schema
        if not self._storage_by_device or not (args or kwargs):
            return
        if func is torch.Tensor.copy_:
            if self._in_storage(args[1] if len(args) > 1 else kwargs.get("other")):
                self._count("copy_", args[0])
            return
        src = None
        for a in (*args, *kwargs.values()):
            if self._in_storage(a):
                src = a
                break
        if src is None:
            return
        if func in _F_SCALARS:
            if src.device.type != "cpu":  # .item() / .tolist() of a device row: the values cross to the host
                self._count(func.__name__, None, src.element_size() * (src.numel() if _F_SCALARS[func] else 1))
            return
        if isinstance(out, torch.Tensor) and out.device.type == "cpu" and not self._in_storage(out):
            # any host tensor made from a device row; on the CPU, a same-dtype copy of a row's bytes
            if src.device.type != "cpu" or (func in _F_COPY_OUT and out.dtype == src.dtype):
                self._count(getattr(func, "__name__", str(func)), out)


class _FunctionMode(TorchFunctionMode):
    def __init__(self, monitor: ExpertCopyMonitor):
        super().__init__()
        self.monitor = monitor

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # see_call counts only copy_, .item() / .tolist(), and calls that return a host tensor: every other call
        # (metadata reads such as .shape / .data_ptr() / .dim(), device results: nearly all of a GPU pass, ~3,300
        # calls per prefill, mostly from Triton's launcher) passes here without the classification's cost
        if func is torch.Tensor.copy_ or func in _F_SCALARS or (
                isinstance(out, torch.Tensor) and out.device.type == "cpu"):
            self.monitor.see_call(func, args, kwargs or {}, out)
        return out


class _Mode(TorchDispatchMode):
    def __init__(self, monitor: ExpertCopyMonitor):
        super().__init__()
        self.monitor = monitor

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.monitor.see(func, args, kwargs or {}, out)
        return out
