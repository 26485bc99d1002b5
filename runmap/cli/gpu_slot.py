"""``runmap gpu-slot -- CMD``: run CMD on one GPU of this host that no other such job is using."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

HELP = "run a command on a free GPU of this host (lock-file slot allocator for concurrent pipeline jobs)"
DESCRIPTION = """\
Take the first free GPU slot of this host, set CUDA_VISIBLE_DEVICES to it, and replace this process with
CMD (which then sees exactly one GPU, cuda:0). Two jobs started at the same moment never get the same
slot: a slot is an exclusive flock on LOCK_DIR/slot-<id>.lock, held by CMD (and whatever of its children
keeps the descriptor) until it ends, released by the kernel however it ends (no stale locks).

The pipeline's GPU jobs run under it, so `snakemake --cores all --resources gpu=N` puts N jobs on N
different GPUs: Snakemake limits how many run at once, this command says which GPU each one gets.

Slots: RUNMAP_GPU_SLOTS ("0,1,2,3": an override, and how tests fake GPUs on a CPU host), else the
caller's CUDA_VISIBLE_DEVICES, else one per GPU that `nvidia-smi -L` lists.
Lock directory: --lock-dir, else RUNMAP_GPU_LOCK_DIR, else $TMPDIR/runmap-gpu-slots-<uid> (per SLURM
job when SLURM_JOB_ID is set: SLURM already isolates its jobs' GPUs).
CMD gets RUNMAP_GPU_SLOT (the slot's device id) in its environment as well.

exit status: CMD's own; 1 when no slot is configured, all stayed busy for --wait-s, or CMD cannot be run;
2 usage (no CMD).

example:
  runmap gpu-slot -- runmap ifeval generate --packed results/packs/olmoe-b256 --out a.jsonl --shard 1/4
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lock-dir", type=Path, default=None, help="directory of the slot locks (see above)")
    p.add_argument("--wait-s", type=float, default=600.0,
                   help="wait this long for a slot to become free before giving up (default 600; the one before "
                        "may still be ending)")
    p.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- CMD ...", help="the command to run on the slot")
    # nothing here needs torch: skip runmap's Triton backend selection, which imports it
    p.set_defaults(_no_torch=True)


def run(args) -> int:
    from runmap.gpuslot import SlotError, configured_slots, default_lock_dir, exec_in_slot

    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        print("runmap gpu-slot: no command given (usage: runmap gpu-slot [--lock-dir DIR] -- CMD ...)",
              file=sys.stderr)
        return 2
    if args.wait_s < 0:
        print("runmap gpu-slot: --wait-s must be >= 0", file=sys.stderr)
        return 2
    try:
        exec_in_slot(cmd, args.lock_dir or default_lock_dir(), configured_slots(), args.wait_s)
    except (SlotError, OSError) as e:
        print(f"runmap gpu-slot: {e}", file=sys.stderr)
        return 1
    return 1  # not reached: exec_in_slot replaces the process or raises
