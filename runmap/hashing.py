"""File hashing for provenance records (source checkpoints, IFEval inputs and responses, manifests)."""
from __future__ import annotations

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
