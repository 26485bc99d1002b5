"""GPU slots for concurrent jobs on one host: which GPU a job gets, never the same one as a running job.

Snakemake counts GPUs (``resources: gpu=1`` against ``--resources gpu=N``) but does not say *which* GPU a
job may use. ``runmap gpu-slot -- CMD`` does: it takes the first free slot among the host's GPUs, sets
``CUDA_VISIBLE_DEVICES`` to it and replaces itself with CMD (``exec``), which then sees one GPU, ``cuda:0``.

A slot is an exclusive ``flock`` on ``LOCK_DIR/slot-<id>.lock``. flock is atomic (two processes racing for
one slot: exactly one wins), and the kernel drops it when the last process holding the open file ends, by
any means (exit, crash, SIGKILL): no stale lock survives a job, so nothing needs cleaning up. The lock's
file descriptor is inherited by CMD (it is the same process after exec) and by CMD's children that keep
it, so the slot stays taken while anything of the job runs.

Slots, first that applies:
  RUNMAP_GPU_SLOTS   comma-separated device ids ("0,1,2,3"): an override, and how the tests fake N GPUs;
  CUDA_VISIBLE_DEVICES of the caller (a subset the host's admin or a scheduler gave);
  one per GPU that ``nvidia-smi -L`` lists.
Lock directory: --lock-dir, else RUNMAP_GPU_LOCK_DIR, else $TMPDIR/runmap-gpu-slots-<uid>. Every job that
must not share a GPU with another has to use the same directory (the default is per user and host). Under
SLURM (SLURM_JOB_ID set) the scheduler already gives each job its own GPUs and numbers them from 0 in
every job, so the default directory is made per job: jobs on one node must not wait for each other's
"slot 0".
"""
from __future__ import annotations

import errno
import fcntl
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path


class SlotError(RuntimeError):
    """No slot could be taken (none configured, or all busy until the wait ran out)."""


def configured_slots(env: dict | None = None) -> list[str]:
    env = os.environ if env is None else env
    for var in ("RUNMAP_GPU_SLOTS", "CUDA_VISIBLE_DEVICES"):
        text = env.get(var)
        if text is not None and text.strip():
            slots = [s.strip() for s in text.split(",") if s.strip()]
            if len(set(slots)) != len(slots):
                raise SlotError(f"{var}={text!r} names a device twice")
            return slots
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
        except (OSError, subprocess.SubprocessError):
            out = ""
        return [str(i) for i, line in enumerate(l for l in out.splitlines() if l.startswith("GPU "))]
    return []


def default_lock_dir(env: dict | None = None) -> Path:
    env = os.environ if env is None else env
    if env.get("RUNMAP_GPU_LOCK_DIR"):
        return Path(env["RUNMAP_GPU_LOCK_DIR"])
    base = Path(tempfile.gettempdir()) / f"runmap-gpu-slots-{os.getuid()}"
    return base / f"slurm-{env['SLURM_JOB_ID']}" if env.get("SLURM_JOB_ID") else base


def try_acquire(lock_dir: Path, slots: list[str]) -> tuple[str, int] | None:
    """(slot, fd of its held lock) for the first free slot, or None when all are held."""
    lock_dir.mkdir(parents=True, exist_ok=True)
    for slot in slots:
        fd = os.open(lock_dir / f"slot-{slot}.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                continue
            raise
        # who holds it, for the "all busy" message (informational: the lock, not this text, is the truth)
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        return slot, fd
    return None


def holders(lock_dir: Path, slots: list[str]) -> str:
    out = []
    for s in slots:
        try:
            out.append(f"{s}: pid {(lock_dir / f'slot-{s}.lock').read_text().strip() or '?'}")
        except OSError:
            out.append(f"{s}: ?")
    return ", ".join(out)


def acquire(lock_dir: Path, slots: list[str], wait_s: float, poll_s: float = 0.2) -> tuple[str, int]:
    if not slots:
        raise SlotError("no GPU slots: no GPU listed by nvidia-smi and neither RUNMAP_GPU_SLOTS nor "
                        "CUDA_VISIBLE_DEVICES is set")
    deadline = time.monotonic() + wait_s
    while True:
        got = try_acquire(lock_dir, slots)
        if got is not None:
            return got
        if time.monotonic() >= deadline:
            raise SlotError(f"all {len(slots)} GPU slots in {lock_dir} stayed busy for {wait_s:.0f} s "
                            f"({holders(lock_dir, slots)}); was the job started with more GPU jobs than "
                            f"--resources gpu=N allows?")
        time.sleep(poll_s)


def exec_in_slot(cmd: list[str], lock_dir: Path, slots: list[str], wait_s: float) -> None:
    """Take a slot and exec ``cmd`` on it (does not return; raises SlotError / OSError before the exec)."""
    slot, fd = acquire(lock_dir, slots, wait_s)
    os.set_inheritable(fd, True)  # the lock lives as long as the job that exec replaces us with
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=slot, RUNMAP_GPU_SLOT=slot, RUNMAP_GPU_SLOT_FD=str(fd))
    # one line in the job's log: which GPU it ran on
    print(f"runmap gpu-slot: pid {os.getpid()} runs on GPU slot {slot} (slots {','.join(slots)}, locks in "
          f"{lock_dir})", file=sys.stderr, flush=True)
    try:
        os.execvpe(cmd[0], cmd, env)
    except OSError as e:
        os.close(fd)
        raise SlotError(f"cannot run {cmd[0]!r}: {e.strerror}") from None
