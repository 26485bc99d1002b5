"""GPU probe (not a test): does backing the host source (and the pinned staging) with transparent huge pages
speed up the miss path's CPU staging copy, which bounds issue 4's targets?

    python3 tools/explore/probe_hugepages.py        (CUDA only; prints a table and a JSON line, ~30 s)

Host source: 4 sets x 32 OLMoE rows (3,194,880 B) in one anonymous mapping, rotated so rows are not
cache-hot, with 4 KiB pages or madvise(MADV_HUGEPAGE) before the first touch. Staging: torch pinned buffers
(cudaHostAlloc) or one huge-page mapping registered with cudaHostRegister. Measured: the staging copy alone
(32 rows, torch copy_ with 16 / 1 CPU threads), the copy pipelined with the DMA (row i staged, then its DMA on
a transfer stream, all in one stream context, as CudaTransport.copy_rows), and one row alone.
"""
import json
import mmap
import statistics
import subprocess
import time

import numpy as np
import torch

R = 3194880
N = 32
SETS = 4


def anon(nbytes: int, huge: bool) -> np.ndarray:
    mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if huge:
        mm.madvise(mmap.MADV_HUGEPAGE)
    a = np.frombuffer(mm, dtype=np.uint8, count=nbytes)
    a[:] = np.arange(nbytes, dtype=np.uint64).astype(np.uint8)  # touch every page (first touch allocates)
    return a, mm


def anon_huge_kib() -> int:
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1])
    return -1


def main():
    out = {"thp": open("/sys/kernel/mm/transparent_hugepage/enabled").read().strip()}
    try:
        out["numa"] = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    except OSError:
        out["numa"] = "lscpu missing"
    dst = torch.empty(N, R, dtype=torch.uint8, device="cuda")
    s = torch.cuda.Stream()
    keep = []
    rows = []
    cart = torch.cuda.cudart()
    for huge_src in (False, True):
        before = anon_huge_kib()
        a, mm = anon(SETS * N * R, huge_src)
        keep.append((a, mm))
        huge_kib = anon_huge_kib() - before
        src = torch.from_numpy(a).view(SETS * N, R)
        for stg_kind in ("cudaHostAlloc", "registered-huge"):
            if stg_kind == "cudaHostAlloc":
                stg = [torch.empty(R, dtype=torch.uint8, pin_memory=True) for _ in range(N)]
            else:
                b, bmm = anon(N * R, True)
                keep.append((b, bmm))
                err = cart.cudaHostRegister(b.ctypes.data, N * R, 0)
                if int(err) != 0:
                    rows.append({"src_huge": huge_src, "staging": stg_kind, "error": f"cudaHostRegister {err}"})
                    continue
                st = torch.from_numpy(b).view(N, R)
                stg = [st[i] for i in range(N)]
            for th in (16, 1):
                torch.set_num_threads(th)
                res = {"src_huge": huge_src, "src_anon_huge_kib": huge_kib, "staging": stg_kind, "threads": th,
                       "staging_is_pinned": bool(stg[0].is_pinned())}
                for kind in ("stage_only", "pipelined", "one_row"):
                    ts = []
                    for it in range(12):
                        base = (it % SETS) * N
                        torch.cuda.synchronize()
                        t = time.perf_counter()
                        if kind == "stage_only":
                            for i in range(N):
                                stg[i].copy_(src[base + i])
                        elif kind == "pipelined":
                            with torch.cuda.stream(s):
                                for i in range(N):
                                    stg[i].copy_(src[base + i])
                                    dst[i].copy_(stg[i], non_blocking=True)
                                    ev = torch.cuda.Event()
                                    ev.record(s)
                            s.synchronize()
                        else:
                            stg[0].copy_(src[base + it % N])
                            with torch.cuda.stream(s):
                                dst[0].copy_(stg[0], non_blocking=True)
                            s.synchronize()
                        ts.append(time.perf_counter() - t)
                    m = statistics.median(ts[2:])
                    n = 1 if kind == "one_row" else N
                    res[kind + "_us"] = m * 1e6
                    res[kind + "_gbps"] = n * R / m / 1e9
                rows.append(res)
                print(f"src huge {huge_src!s:5} ({huge_kib // 1024:5d} MiB THP) staging {stg_kind:15s} threads {th:2d}: "
                      f"stage {res['stage_only_gbps']:5.1f} GB/s  pipelined {res['pipelined_gbps']:5.1f} GB/s  "
                      f"one row {res['one_row_us']:6.1f} us", flush=True)
    # the DMA alone from each staging kind, for the ceiling of this run
    for stg_kind in ("cudaHostAlloc",):
        stg = [torch.empty(R, dtype=torch.uint8, pin_memory=True) for _ in range(N)]
        ts = []
        for _ in range(10):
            torch.cuda.synchronize()
            t = time.perf_counter()
            with torch.cuda.stream(s):
                for i in range(N):
                    dst[i].copy_(stg[i], non_blocking=True)
            s.synchronize()
            ts.append(time.perf_counter() - t)
        out["dma_only_gbps"] = N * R / statistics.median(ts[2:]) / 1e9
        print(f"dma only (32 rows, {stg_kind}): {out['dma_only_gbps']:.1f} GB/s")
    out["rows"] = rows
    print(json.dumps(out))


if __name__ == "__main__":
    main()
