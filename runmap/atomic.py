"""Atomic outputs: every file or directory the project writes appears whole or not at all.

A file is written to a hidden temporary name in its destination directory (same filesystem, so the
final ``os.replace`` is a rename), flushed and fsync'd, then renamed over the target. On any failure the
temporary is removed and the target is left as it was. Hidden names (leading dot) are skipped by
``runmap validate``, so a half-written file is never mistaken for an artifact.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator


@contextlib.contextmanager
def atomic_path(path: str | Path, suffix: str = ".tmp") -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on normal exit it is renamed to ``path``.

    For writers that want a file name (safetensors ``save_file``, matplotlib ``savefig``). The writer
    must have closed the file before the block ends."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=suffix, dir=path.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        os.replace(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)


def write_text(path: str | Path, text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` atomically, fsync'd. Returns the path."""
    path = Path(path)
    with atomic_path(path) as tmp:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
    return path


def write_json(path: str | Path, obj: Any, *, indent: int = 2, default=None, ensure_ascii: bool = True) -> Path:
    """Write ``obj`` as JSON (with a trailing newline) to ``path`` atomically. Returns the path."""
    return write_text(path, json.dumps(obj, indent=indent, default=default, ensure_ascii=ensure_ascii) + "\n")


def replace_dir(tmp: Path, out: Path) -> None:
    """Rename the finished directory ``tmp`` to ``out``. An existing ``out`` is first renamed aside into a
    hidden directory and removed only after the new one is in place, so ``out`` is never half-present."""
    if out.exists():
        trash = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
        os.replace(out, trash / out.name)
        os.replace(tmp, out)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.replace(tmp, out)
