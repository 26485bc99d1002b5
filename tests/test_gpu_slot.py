"""`runmap gpu-slot` (issue 21 item 1): concurrent jobs on a host with N (faked) GPUs never share one."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from runmap.gpuslot import SlotError, acquire, configured_slots, default_lock_dir

# What each fake job does on its slot: note the device it was given and when it held it.
JOB = r"""
import json, os, sys, time
t0 = time.time(); time.sleep(float(sys.argv[2])); t1 = time.time()
with open(sys.argv[1], "w") as f:
    json.dump({"dev": os.environ["CUDA_VISIBLE_DEVICES"], "slot": os.environ["RUNMAP_GPU_SLOT"], "t0": t0, "t1": t1}, f)
"""


def _runmap():
    return [sys.executable, "-c", "import sys; from runmap.cli.main import main; sys.exit(main())"]


def _start(tmp_path, lock_dir, slots, i, hold_s, wait_s=60):
    env = dict(os.environ, RUNMAP_GPU_SLOTS=slots)
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return subprocess.Popen([*_runmap(), "gpu-slot", "--lock-dir", str(lock_dir), "--wait-s", str(wait_s), "--",
                             sys.executable, "-c", JOB, str(tmp_path / f"job{i}.json"), str(hold_s)],
                            env=env, stderr=subprocess.PIPE, text=True)


def test_concurrent_jobs_never_share_a_gpu(tmp_path):
    lock_dir = tmp_path / "locks"
    jobs = [_start(tmp_path, lock_dir, "0,1,2", i, 1.5) for i in range(7)]  # 7 jobs racing for 3 GPUs
    for p in jobs:
        assert p.wait(timeout=120) == 0, p.stderr.read()
    runs = [json.loads((tmp_path / f"job{i}.json").read_text()) for i in range(7)]
    assert all(r["dev"] == r["slot"] and r["dev"] in {"0", "1", "2"} for r in runs)
    for a in range(len(runs)):
        for b in range(a + 1, len(runs)):
            ra, rb = runs[a], runs[b]
            if ra["dev"] == rb["dev"]:  # the same GPU only one after the other
                assert ra["t1"] <= rb["t0"] or rb["t1"] <= ra["t0"], (ra, rb)
    # and the slots were used at once: three jobs overlapped in time (7 x 1.5 s did not run one by one)
    assert len({r["dev"] for r in runs}) == 3
    assert max(r["t1"] for r in runs) - min(r["t0"] for r in runs) < 7 * 1.5


def test_a_killed_job_frees_its_slot(tmp_path):
    lock_dir = tmp_path / "locks"
    holder = _start(tmp_path, lock_dir, "0", 0, 60)
    deadline = time.time() + 30
    while not (lock_dir / "slot-0.lock").exists() or not (lock_dir / "slot-0.lock").read_text().strip():
        assert time.time() < deadline
        time.sleep(0.1)
    with pytest.raises(SlotError, match="stayed busy"):
        acquire(lock_dir, ["0"], wait_s=0.5)
    holder.send_signal(signal.SIGKILL)  # no cleanup code runs: the kernel drops the flock
    holder.wait(timeout=30)
    slot, fd = acquire(lock_dir, ["0"], wait_s=10)
    assert slot == "0"
    os.close(fd)


def test_all_busy_and_no_slots_are_one_line(tmp_path):
    lock_dir = tmp_path / "locks"
    slot, fd = acquire(lock_dir, ["7"], wait_s=0)
    try:
        p = _start(tmp_path, lock_dir, "7", 0, 0, wait_s=0.3)
        assert p.wait(timeout=60) == 1
        err = p.stderr.read()
        assert "GPU slots" in err and "stayed busy" in err and len(err.strip().splitlines()) == 1
        assert not (tmp_path / "job0.json").exists()
    finally:
        os.close(fd)
    with pytest.raises(SlotError, match="no GPU slots"):
        acquire(lock_dir, [], wait_s=0)


def test_slot_sources_and_lock_dir():
    assert configured_slots({"RUNMAP_GPU_SLOTS": "2,3", "CUDA_VISIBLE_DEVICES": "0"}) == ["2", "3"]
    assert configured_slots({"CUDA_VISIBLE_DEVICES": "1, 4"}) == ["1", "4"]
    with pytest.raises(SlotError, match="twice"):
        configured_slots({"RUNMAP_GPU_SLOTS": "1,1"})
    # under SLURM each job numbers its own GPUs from 0: their locks must not collide across jobs
    a, b = default_lock_dir({"SLURM_JOB_ID": "11"}), default_lock_dir({"SLURM_JOB_ID": "12"})
    assert a != b and default_lock_dir({"RUNMAP_GPU_LOCK_DIR": "/x"}) == Path("/x")
