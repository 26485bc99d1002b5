"""GPU probe (not a test): where the miss path's time goes when rows are staged and copied.

    python3 tools/explore/probe_staging.py        (CUDA only; prints a table, ~10 s)

32 distinct pageable OLMoE-sized rows (3,194,880 B; 4 sets rotated so the source is not cache-hot) through
pinned staging to the device, with torch CPU thread counts 16 / 8 / 1:
  stage_only            pageable -> pinned copies alone
  dma_only              pinned -> device copies alone (one stream context)
  interleaved           stage row i, then start its DMA, inside ONE stream context
  interleaved_ctx_each  the same with a stream context and an event per row (the transport before this probe)
  one_row / one_row_np  a single row: torch copy / numpy copy into staging, then its DMA
"""
import time, statistics, torch
R = 3194880; N = 32
src = [torch.empty(R, dtype=torch.uint8).fill_(i % 251) for i in range(N * 4)]  # pageable, 4 sets to stay cold-ish
stg = [torch.empty(R, dtype=torch.uint8, pin_memory=True) for _ in range(N)]
dst = torch.empty(N, R, dtype=torch.uint8, device="cuda")
s = torch.cuda.Stream()
def run(kind, it):
    rows = src[(it % 4) * N:(it % 4 + 1) * N]
    torch.cuda.synchronize(); t = time.perf_counter()
    if kind == "stage_only":
        for i in range(N): stg[i].copy_(rows[i])
    elif kind == "dma_only":
        with torch.cuda.stream(s):
            for i in range(N): dst[i].copy_(stg[i], non_blocking=True)
        s.synchronize()
    elif kind == "interleaved":
        with torch.cuda.stream(s):
            for i in range(N):
                stg[i].copy_(rows[i]); dst[i].copy_(stg[i], non_blocking=True)
        s.synchronize()
    elif kind == "interleaved_ctx_each":
        for i in range(N):
            stg[i].copy_(rows[i])
            with torch.cuda.stream(s):
                dst[i].copy_(stg[i], non_blocking=True); e = torch.cuda.Event(); e.record(s)
        s.synchronize()
    elif kind == "one_row":
        stg[0].copy_(rows[0])
        with torch.cuda.stream(s):
            dst[0].copy_(stg[0], non_blocking=True)
        s.synchronize()
    elif kind == "one_row_np":
        import numpy as np
        np.copyto(stg[0].numpy(), rows[0].numpy())
        with torch.cuda.stream(s):
            dst[0].copy_(stg[0], non_blocking=True)
        s.synchronize()
    return time.perf_counter() - t
for kind in ("stage_only", "dma_only", "interleaved", "interleaved_ctx_each", "one_row", "one_row_np"):
    for th in (16, 8, 1):
        torch.set_num_threads(th)
        ts = [run(kind, i) for i in range(12)][2:]
        m = statistics.median(ts); n = 1 if kind.startswith("one_row") else N
        print(f"{kind:22s} threads {th:2d}: {m*1e6:9.1f} us  {n*R/m/1e9:6.1f} GB/s", flush=True)
