"""Why the cpu-native kernel is slower inside the engine's decode than in bench_cpu_experts.py (issue 25).

The bench calls the kernel back to back from the main thread with every core in its OpenMP team; the engine's decode
(runmap.engine.engine.SegmentDecoder) calls it once per layer from the CPU site's job thread with one thread fewer,
~0.5-1 ms apart, while the main thread drives the device (results/campaigns/h200-placement-split*/phases.log: ~0.6 ms
per call of ~2 experts). This times the same batch-1 layer calls (the engine's array path, OLMoE shape, 2 and 8
experts from rows larger than the last-level cache) under each of those conditions in turn: the caller (main thread
or a job thread), the team size, the gap between calls (the caller idle in a sleep, or the main thread busy in
Python meanwhile) and torch's own OpenMP team kept busy on the main thread. With --env-variants the whole probe is
repeated in child processes under other OpenMP wait settings (OMP_WAIT_POLICY, GOMP_SPINCOUNT), which must be set
before the runtime loads.

    PYTHONPATH=. python3 tools/explore/probe_cpu_native_cadence.py [--calls 200] [--env-variants]
"""
from __future__ import annotations

import argparse
import concurrent.futures
import os
import subprocess
import sys
import time

import numpy as np
import torch

from runmap.format.qpack import RowLayout
from runmap.kernels import cpu_native

ENV_VARIANTS = {"OMP_WAIT_POLICY=active": {"OMP_WAIT_POLICY": "active"},
                "OMP_WAIT_POLICY=passive": {"OMP_WAIT_POLICY": "passive"},
                "GOMP_SPINCOUNT=10000000": {"GOMP_SPINCOUNT": "10000000"}}


def busy_python(seconds: float) -> None:
    t_end = time.perf_counter() + seconds
    n = 0
    while time.perf_counter() < t_end:
        n += 1


def busy_torch(seconds: float, a: torch.Tensor) -> None:
    t_end = time.perf_counter() + seconds
    while time.perf_counter() < t_end:
        a.mul_(1.0)  # large enough for torch to use its intra-op team


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=200, help="timed layer calls per condition")
    ap.add_argument("--gib", type=float, default=1.25)
    ap.add_argument("--env-variants", action="store_true", help="repeat in child processes under ENV_VARIANTS")
    a = ap.parse_args()
    every = torch.get_num_threads()
    env = {k: os.environ.get(k) for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS")}
    print(f"process env {env}, torch threads {every}", flush=True)
    layout = RowLayout.build(2048, 1024, 256)
    n = int(a.gib * (1 << 30)) // layout.row_bytes
    rows = torch.randint(0, 256, (n, layout.row_bytes), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    for sec in ("gate.scale", "up.scale", "down.scale"):
        s = layout.section(sec)
        rows[:, s.offset:s.offset + s.nbytes] = torch.full((s.nbytes // 2,), 0.01, dtype=torch.float16).view(torch.uint8)
    nl = cpu_native.NativeLayer(layout, "i16")
    x = np.random.default_rng(1).standard_normal((1, 2048)).astype(np.float16)
    out = np.empty((1, 2048), dtype=np.float32)
    jobs = concurrent.futures.ThreadPoolExecutor(1)
    big = torch.ones(1 << 22)
    step = [0]

    def call(k: int, threads: int) -> float:
        experts = [(step[0] * k + j) % n for j in range(k)]
        step[0] += 1
        c = nl.prepare_arrays([rows[e].data_ptr() for e in experts], list(range(k + 1)), [0] * k, [1.0 / k] * k, x,
                              out, threads)
        t0 = time.perf_counter()
        c()
        return time.perf_counter() - t0

    conditions = [  # label, caller, threads, gap seconds, what the main thread does in the gap
        ("main thread, back to back", "main", every, 0.0, "idle"),
        ("job thread, back to back", "job", every - 1, 0.0, "idle"),
        ("job thread, 0.2 ms apart, main sleeps", "job", every - 1, 0.0002, "sleep"),
        ("job thread, 0.7 ms apart, main sleeps", "job", every - 1, 0.0007, "sleep"),
        ("job thread, 2 ms apart, main sleeps", "job", every - 1, 0.002, "sleep"),
        ("job thread, 0.7 ms apart, main busy in Python", "job", every - 1, 0.0007, "python"),
        ("job thread, 0.7 ms apart, main busy in torch ops", "job", every - 1, 0.0007, "torch"),
    ]
    # last: the main thread's OpenMP team shrunk to 2 threads (torch's intra-op count 1, then one 2-thread kernel call
    # on the main thread, which makes libgomp release the rest of that team), so that the job thread's team alone
    # nearly fills the cores: libgomp throttles its threads' spinning while it manages more threads than there are
    shrunk = [("job thread, back to back, main team shrunk", "job", every - 1, 0.0, "idle"),
              ("job thread, 0.7 ms apart, main sleeps, main team shrunk", "job", every - 1, 0.0007, "sleep"),
              ("job thread, 0.7 ms apart, main busy in Python, main team shrunk", "job", every - 1, 0.0007, "python")]
    for k in (2, 8):
        mb = k * layout.row_bytes / 1e6
        for label, caller, threads, gap, meanwhile in conditions + (shrunk if k == 8 else []):
            if "shrunk" in label and torch.get_num_threads() != 1:
                torch.set_num_threads(1)
                call(k, 2)
                # and the 2-expert rows again under this setting
                for label2, caller2, threads2, gap2, meanwhile2 in shrunk:
                    times2 = []
                    for _ in range(a.calls):
                        if gap2:
                            time.sleep(gap2) if meanwhile2 == "sleep" else busy_python(gap2)
                        times2.append(jobs.submit(call, 2, threads2).result())
                    times2.sort()
                    med2 = times2[len(times2) // 2]
                    mb2 = 2 * layout.row_bytes / 1e6
                    print(f"  2 experts ({mb2:.1f} MB), {label2:48s} threads {threads2:2d}: median {1e6 * med2:7.1f} us "
                          f"({mb2 / 1e3 / med2:6.1f} GB/s), p90 {1e6 * times2[int(0.9 * len(times2))]:7.1f} us",
                          flush=True)
            times = []
            for _ in range(5):  # warm-up
                call(k, threads)
            for _ in range(a.calls):
                if gap:
                    if meanwhile == "sleep":
                        time.sleep(gap)
                    elif meanwhile == "python":
                        busy_python(gap)
                    else:
                        busy_torch(gap, big)
                if caller == "main":
                    times.append(call(k, threads))
                else:
                    times.append(jobs.submit(call, k, threads).result())
            times.sort()
            med = times[len(times) // 2]
            print(f"  {k} experts ({mb:.1f} MB), {label:48s} threads {threads:2d}: median {1e6 * med:7.1f} us "
                  f"({mb / 1e3 / med:6.1f} GB/s), p90 {1e6 * times[int(0.9 * len(times))]:7.1f} us", flush=True)
    jobs.shutdown()
    if a.env_variants:
        for label, extra in ENV_VARIANTS.items():
            print(f"--- {label}", flush=True)
            subprocess.run([sys.executable, __file__, "--calls", str(a.calls), "--gib", str(a.gib)],
                           env={**os.environ, **extra}, check=False)


if __name__ == "__main__":
    main()
