"""Provenance fields shared by every record: file hashes, creation timestamps, library versions, device names."""
from __future__ import annotations

import datetime as _dt
import hashlib
import importlib.metadata
import platform
from pathlib import Path

CHUNK_BYTES = 1 << 22  # 4 MiB reads: large enough for throughput, small enough to stream any file


def sha256_file(path: str | Path) -> str:
    """Hex sha256 of a file's bytes, read in chunks (never the whole file in memory)."""
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(CHUNK_BYTES):
            h.update(chunk)
    return h.hexdigest()


def utc_timestamp() -> str:
    """Now, UTC, to the second: the ``created_utc`` form every schema expects (2026-11-29T23:59:41Z)."""
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def package_version(name: str) -> str | None:
    """Installed version of a distribution, or None (e.g. this project run from a source tree on the GPU machine)."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def library_versions(*modules: str) -> dict:
    """{"python", "torch", each named module's ``__version__``, "cuda" (only where CUDA is available)}: the versions
    block of the kernel-check and contract records (each schema pins its own module list)."""
    import importlib

    import torch

    v = {"python": platform.python_version(), "torch": torch.__version__}
    v.update({name: importlib.import_module(name).__version__ for name in modules})
    if torch.cuda.is_available():
        v["cuda"] = torch.version.cuda
    return v


def device_name(device) -> str:
    """The GPU's name for a CUDA device, else the host CPU's (platform) name."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine() or "cpu"
