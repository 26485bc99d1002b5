"""Streaming safetensors I/O without holding a whole file in memory.

``safetensors.torch.save_file`` needs every tensor of a file in memory at once; for a 7B checkpoint or
a pack that is the whole model. ``StreamingWriter`` instead takes the list of (name, dtype, shape) up
front, writes the header, then accepts the tensors one at a time in that order, so peak memory is one
tensor. ``read_header`` / ``read_tensor_bytes`` read a file with plain positioned reads (no mmap), so
a caller gets a fresh, process-owned copy and can count every byte it read.

File format (safetensors): u64 little-endian header length N, N bytes of JSON header (may be padded
with spaces), then the concatenated tensor data; each header entry gives dtype, shape and
``data_offsets`` [begin, end) relative to the start of the data.
"""
from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import torch

DTYPES = {  # torch dtype <-> safetensors dtype string
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float32: "F32",
    torch.uint8: "U8",
    torch.int8: "I8",
    torch.int32: "I32",
    torch.int64: "I64",
}
DTYPE_FROM_STR = {v: k for k, v in DTYPES.items()}
ITEMSIZE = {"BF16": 2, "F16": 2, "F32": 4, "U8": 1, "I8": 1, "I32": 4, "I64": 8}


class SafetensorsFormatError(ValueError):
    """A safetensors file is truncated, has a malformed header or is written out of order."""


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


class StreamingWriter:
    """Write one safetensors file tensor by tensor.

    Args:
        path: output file (written in place; callers write inside a temp directory for atomicity).
        specs: [(name, torch dtype, shape)] in the order the tensors will be written.
        metadata: optional str -> str ``__metadata__``.
        align: the data section starts at a multiple of ``align`` bytes from the file start
            (header padded with spaces), e.g. 4096 so expert rows start page-aligned.
    """

    def __init__(self, path, specs, metadata: dict | None = None, align: int = 8):
        self.path = Path(path)
        header: dict = {}
        if metadata:
            header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
        off = 0
        self._order = []
        for name, dtype, shape in specs:
            nbytes = _numel(shape) * ITEMSIZE[DTYPES[dtype]]
            header[name] = {"dtype": DTYPES[dtype], "shape": [int(d) for d in shape], "data_offsets": [off, off + nbytes]}
            self._order.append((name, dtype, tuple(int(d) for d in shape), nbytes))
            off += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        total = 8 + len(raw)
        pad = (-total) % align
        raw += b" " * pad
        self.data_start = 8 + len(raw)  # absolute file offset of the first data byte
        self.offsets = {name: self.data_start + header[name]["data_offsets"][0] for name, *_ in self._order}
        self.total_bytes = self.data_start + off
        self._f = open(self.path, "wb")
        self._f.write(struct.pack("<Q", len(raw)))
        self._f.write(raw)
        self._next = 0

    def write(self, name: str, t: torch.Tensor) -> None:
        """Append tensor ``name`` (must be the next one in ``specs`` order, same dtype and shape)."""
        if self._next >= len(self._order):
            raise SafetensorsFormatError(f"{self.path}: unexpected extra tensor {name!r}")
        want_name, dtype, shape, nbytes = self._order[self._next]
        if name != want_name or t.dtype != dtype or tuple(t.shape) != shape:
            raise SafetensorsFormatError(
                f"{self.path}: expected tensor {want_name!r} {dtype} {shape}, got {name!r} {t.dtype} {tuple(t.shape)}"
            )
        data = t.detach().to("cpu").contiguous().view(-1).view(torch.uint8).numpy()  # raw little-endian bytes
        assert data.nbytes == nbytes
        self._f.write(memoryview(data))
        self._next += 1

    def close(self, fsync: bool = True) -> None:
        """Finish the file (fsync'd unless ``fsync=False``: a writer whose files are checked by digest later may
        leave write-back to the kernel). Raises if not every declared tensor was written."""
        if self._f is None:
            return
        try:
            if self._next != len(self._order):
                missing = [n for n, *_ in self._order[self._next:]]
                raise SafetensorsFormatError(f"{self.path}: closed before writing {missing[:3]}...")
            self._f.flush()
            if fsync:
                os.fsync(self._f.fileno())
        finally:
            self._f.close()
            self._f = None

    def abort(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


def write_file(path, tensors: dict[str, torch.Tensor], metadata: dict | None = None, align: int = 8) -> StreamingWriter:
    """Convenience: write a dict of (small) tensors. Returns the closed writer (for ``offsets``)."""
    w = StreamingWriter(path, [(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()], metadata, align)
    try:
        for n, t in tensors.items():
            w.write(n, t)
        w.close()
    except BaseException:
        w.abort()
        raise
    return w


def read_header(path) -> tuple[dict, int]:
    """Parse a safetensors header. Returns ({name: entry}, data_start). Checks the file covers every tensor."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise SafetensorsFormatError(f"{path}: truncated (shorter than the 8-byte header length)")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8 or n > 100_000_000:
            raise SafetensorsFormatError(f"{path}: header length {n} exceeds the file size {size}")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise SafetensorsFormatError(f"{path}: malformed header JSON ({e})") from e
    header.pop("__metadata__", None)
    data_start = 8 + n
    for name, e in header.items():
        b, end = e["data_offsets"]
        if e["dtype"] not in ITEMSIZE or end - b != _numel(e["shape"]) * ITEMSIZE[e["dtype"]]:
            raise SafetensorsFormatError(f"{path}: tensor {name!r} has an inconsistent dtype/shape/offsets entry")
        if data_start + end > size:
            raise SafetensorsFormatError(
                f"{path}: truncated: tensor {name!r} ends at byte {data_start + end} but the file has {size} bytes"
            )
    return header, data_start


def read_into(path, offset: int, out: torch.Tensor) -> int:
    """Read ``out.numel()*itemsize`` bytes at absolute ``offset`` of ``path`` into CPU tensor ``out``."""
    buf = out.view(-1).view(torch.uint8).numpy()
    with open(path, "rb", buffering=0) as f:
        f.seek(offset)
        view = memoryview(buf)
        got = 0
        while got < buf.nbytes:
            n = f.readinto(view[got:])
            if not n:
                raise SafetensorsFormatError(f"{path}: unexpected end of file at byte {offset + got}")
            got += n
    return got
