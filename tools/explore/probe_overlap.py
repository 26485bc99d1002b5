"""GPU probe (not a test): why the pipelined miss path (stage row i on the CPU, then its DMA) reaches only
~35 GB/s when the staging copy alone runs at ~70 GB/s and the DMA alone at ~52 GB/s.

    python3 tools/explore/probe_overlap.py         (CUDA only; ~30 s; prints a table)

Measured on 32 cold OLMoE rows (3,194,880 B; 4 sets rotated):
  stage_alone / stage_under_dma   the 32-row staging copy alone, and while a 1 GiB DMA is in flight
  dma_alone / dma_under_stage     the 32-row DMA alone, and while the CPU stages another 32 rows
  pipelined                       CudaTransport.copy_rows' order (stage row i, start its DMA) per thread count
  pipelined_chunks                the same with rows staged and sent in 1 MiB pieces
  workers_memmove                 8 Python threads staging rows with ctypes.memmove (GIL released), the
                                  main thread starting each row's DMA as soon as it is staged
"""
import ctypes
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import torch

R = 3194880
N = 32
SETS = 4


def med_us(fn, reps=10):
    ts = []
    for it in range(reps + 2):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn(it)
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts[2:]) * 1e6


def main():
    src = torch.empty(SETS * N, R, dtype=torch.uint8)
    src.view(-1)[:] = 7
    stg = [torch.empty(R, dtype=torch.uint8, pin_memory=True) for _ in range(N)]
    stg2 = [torch.empty(R, dtype=torch.uint8, pin_memory=True) for _ in range(N)]
    for b in stg + stg2:
        b.fill_(1)
    dst = torch.empty(N, R, dtype=torch.uint8, device="cuda")
    big_src = torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True)
    big_src.fill_(3)
    big_dst = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    s = torch.cuda.Stream()
    s2 = torch.cuda.Stream()
    gb = N * R / 1e3  # bytes / us -> GB/s

    def stage(it, bufs=stg):
        base = (it % SETS) * N
        for i in range(N):
            bufs[i].copy_(src[base + i])

    def dma(it):
        with torch.cuda.stream(s):
            for i in range(N):
                dst[i].copy_(stg[i], non_blocking=True)
        s.synchronize()

    def stage_under_dma(it):
        with torch.cuda.stream(s2):
            big_dst.copy_(big_src, non_blocking=True)
        t = time.perf_counter()
        stage(it, stg2)
        stage_under_dma.last = time.perf_counter() - t
        s2.synchronize()

    def dma_under_stage(it):
        ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(s):
            ev0.record(s)
            for i in range(N):
                dst[i].copy_(stg[i], non_blocking=True)
            ev1.record(s)
        stage(it + 1, stg2)
        s.synchronize()
        dma_under_stage.last = ev0.elapsed_time(ev1) * 1e3

    def pipelined(it):
        base = (it % SETS) * N
        with torch.cuda.stream(s):
            for i in range(N):
                stg[i].copy_(src[base + i])
                dst[i].copy_(stg[i], non_blocking=True)
                torch.cuda.Event().record(s)
        s.synchronize()

    def pipelined_chunks(it, chunk=1 << 20):
        base = (it % SETS) * N
        with torch.cuda.stream(s):
            for i in range(N):
                for lo in range(0, R, chunk):
                    hi = min(R, lo + chunk)
                    stg[i][lo:hi].copy_(src[base + i][lo:hi])
                    dst[i][lo:hi].copy_(stg[i][lo:hi], non_blocking=True)
                torch.cuda.Event().record(s)
        s.synchronize()

    pool = ThreadPoolExecutor(8)

    def workers_memmove(it):
        base = (it % SETS) * N
        futs = [pool.submit(ctypes.memmove, stg[i].data_ptr(), src[base + i].data_ptr(), R) for i in range(N)]
        with torch.cuda.stream(s):
            for i in range(N):
                futs[i].result()
                dst[i].copy_(stg[i], non_blocking=True)
                torch.cuda.Event().record(s)
        s.synchronize()

    rows = []
    for th in (16, 8, 4):
        torch.set_num_threads(th)
        a = med_us(stage)
        d = med_us(dma)
        med_us(stage_under_dma)
        sud = []
        for it in range(6):
            stage_under_dma(it)
            sud.append(stage_under_dma.last * 1e6)
        dus = []
        for it in range(6):
            dma_under_stage(it)
            dus.append(dma_under_stage.last)
        p = med_us(pipelined)
        pc = med_us(pipelined_chunks)
        rows.append((th, a, statistics.median(sud), d, statistics.median(dus), p, pc))
        print(f"threads {th:2d}: stage alone {gb / a:5.1f} GB/s, under DMA {gb / statistics.median(sud):5.1f} | "
              f"dma alone {gb / d:5.1f}, under staging {gb / statistics.median(dus):5.1f} | pipelined {gb / p:5.1f} "
              f"| pipelined 1 MiB chunks {gb / pc:5.1f}", flush=True)
    w = med_us(workers_memmove)
    print(f"8 memmove workers + main-thread DMA: {gb / w:5.1f} GB/s", flush=True)


if __name__ == "__main__":
    main()
