"""Provenance fields shared by every record: file hashes and creation timestamps."""
from __future__ import annotations

import datetime as _dt
import hashlib
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
