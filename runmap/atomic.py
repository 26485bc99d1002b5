"""Atomic outputs: every file or directory the project writes appears whole or not at all.

A file is written to a hidden temporary name in its destination directory (same filesystem, so the
final ``os.replace`` is a rename), flushed and fsync'd, then renamed over the target. On any failure the
temporary is removed and the target is left as it was. Hidden names (leading dot) are skipped by
``runmap validate``, so a half-written file is never mistaken for an artifact.

A process killed outright (SIGKILL, power loss) cannot remove its temporary, so temporaries carry the
writer's PID (``.NAME.PID-XXXX.tmp``): the next atomic write of the same target removes those whose process
is gone (``remove_stale_temporaries``), and a rerun after a crash leaves nothing behind.
"""
from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any, Iterator


def pid_gone(pid: int) -> bool:
    """True when no process has this PID (a PID we cannot signal, another user's, counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False
    return False


def remove_stale_temporaries(path: str | Path, marker: str = ".") -> list[Path]:
    """Remove the siblings ``.NAME{marker}PID-*`` of ``path`` (temporaries of an atomic write of it) whose writer
    process is gone; this process's own and live processes' are kept. Returns what was removed."""
    path = Path(path)
    prefix = f".{path.name}{marker}"
    removed = []
    try:
        names = os.listdir(path.parent)
    except OSError:
        return removed
    for name in names:
        if not name.startswith(prefix):
            continue
        pid, sep, _ = name[len(prefix):].partition("-")
        if not sep or not pid.isdigit() or int(pid) == os.getpid() or not pid_gone(int(pid)):
            continue
        stale = path.parent / name
        if stale.is_dir() and not stale.is_symlink():
            shutil.rmtree(stale, ignore_errors=True)
        else:
            stale.unlink(missing_ok=True)
        removed.append(stale)
    return removed


@contextlib.contextmanager
def atomic_path(path: str | Path, suffix: str = ".tmp") -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on normal exit it is renamed to ``path``.

    For writers that want a file name (safetensors ``save_file``, matplotlib ``savefig``). The writer
    must have closed the file before the block ends."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.{os.getpid()}-", suffix=suffix, dir=path.parent)
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


def exchange_paths(a: Path, b: Path) -> bool:
    """Swap two existing paths in one atomic step (Linux ``renameat2(RENAME_EXCHANGE)``). Returns False where
    the platform, C library or filesystem does not offer it; any other failure raises OSError."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):  # C library without renameat2 (glibc < 2.28, some musl builds)
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):  # flag or call not supported here
        return False
    raise OSError(err, os.strerror(err), str(a), None, str(b))


def replace_dir(tmp: Path, out: Path) -> None:
    """Rename the finished directory ``tmp`` to ``out``. An existing ``out`` is swapped with ``tmp`` in one
    atomic exchange where the platform has it (readers see the old or the new directory, never neither);
    otherwise it is first renamed aside into a hidden directory, so ``out`` is never half-present (but absent
    between the two renames). The old contents are removed afterwards."""
    if not out.exists():
        os.replace(tmp, out)
        return
    if exchange_paths(tmp, out):
        shutil.rmtree(tmp, ignore_errors=True)  # tmp now holds the old directory
        return
    trash = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
    os.replace(out, trash / out.name)
    os.replace(tmp, out)
    shutil.rmtree(trash, ignore_errors=True)
