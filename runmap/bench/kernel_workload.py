"""Synthetic kernel workloads at real MoE expert shapes, and CUDA-graph timing (GPU benchmarks only).

What the kernel benchmark (benchmarks/bench_kernels.py) and the kernel studies (tools/explore/) share:
random qpacked layers (random nibbles, small positive FP16 scales: timing needs no real packing), random
top-k routing, the same-run device-copy bandwidth every decode fraction is taken against, CUDA-graph replay
timing per layer, and torch's bf16 grouped MoE layer as the prefill baseline. Nothing here runs in tests
(every function but ``median`` needs a CUDA device).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from runmap.bench.cuda_timing import event_times_ms
from runmap.format.qpack import RowLayout

# Expert shapes of the two model families (OLMoE-1B-7B, Qwen1.5-MoE-A2.7B), as the kernels see them.
MODELS = {
    "olmoe": {"hidden": 2048, "intermediate": 1024, "experts": 64, "top_k": 8},
    "qwen1.5-moe": {"hidden": 2048, "intermediate": 1408, "experts": 60, "top_k": 4},
}
LAYERS = 16  # decode: layers of distinct weights per CUDA graph, so the weights come from HBM, not L2
PREFILL_TOKENS = 512  # prefill: tokens routed over all experts
PREFILL_LAYERS = 4  # prefill: layers per CUDA graph


def median(v):
    """Median of a non-empty sequence (the mean of the middle two for an even length)."""
    s = sorted(v)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


def copy_bandwidth(nbytes: int) -> dict:
    """Device copy ``dst.copy_(src)`` of ``nbytes`` (moved bytes = read + write), median of 30 CUDA-event timings."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    ms = event_times_ms(lambda: dst.copy_(src), reps=30)
    m = median(ms)
    return {"buffer_bytes": nbytes, "moved_bytes": 2 * nbytes, "median_ms": m, "gbps": 2 * nbytes / m / 1e6}


def probe_start(doc: str) -> tuple:
    """The start every kernel probe of tools/explore shares: its ``--out`` option (``doc``'s first line as the
    description), a CUDA generator seeded 0, the same-run device copy (printed). Returns (out path, generator, copy)."""
    import argparse
    from pathlib import Path

    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("--out", required=True, help="JSON written here")
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    copy = copy_bandwidth(1 << 30)
    print(f"copy {copy['gbps']:.0f} GB/s", flush=True)
    return Path(args.out), gen, copy


def random_layer(layout: RowLayout, n_experts: int, gen: torch.Generator) -> torch.Tensor:
    """uint8 (E, row_bytes) with random nibbles and small positive fp16 scales (timing needs no packing)."""
    storage = torch.randint(0, 256, (n_experts, layout.row_bytes), dtype=torch.uint8, device="cuda", generator=gen)
    for s in layout.sections:
        if s.dtype == "float16":
            view = storage[:, s.offset:s.offset + s.nbytes].view(torch.float16)  # (E, n * nb)
            view.copy_(torch.rand(view.shape, device="cuda", generator=gen) * 0.01 + 0.001)
    return storage


def routing(tokens: int, n_experts: int, k: int, gen: torch.Generator):
    """Each of ``tokens`` routed to ``k`` distinct random experts with softmax gate weights: ids (T, k), w (T, k)."""
    ids = torch.rand(tokens, n_experts, device="cuda", generator=gen).argsort(dim=1)[:, :k].contiguous()  # (T, k)
    w = torch.softmax(torch.randn(tokens, k, device="cuda", generator=gen), dim=1).contiguous()
    return ids, w


def model_layers(spec: dict, gen: torch.Generator, n: int = LAYERS) -> tuple:
    """(RowLayout, ``n`` random layers of every expert (``random_layer``), identity int32 row table (E,))."""
    layout = RowLayout.build(spec["hidden"], spec["intermediate"], 256)
    layers = [random_layer(layout, spec["experts"], gen) for _ in range(n)]
    return layout, layers, torch.arange(spec["experts"], dtype=torch.int32, device="cuda")


def random_batches(n: int, tokens: int, hidden: int, n_experts: int, k: int, gen: torch.Generator) -> list:
    """``n`` layer inputs (x fp16 (T, H), ids (T, k), weights (T, k)), each routed as ``routing``."""
    batches = []
    for _ in range(n):
        ids, w = routing(tokens, n_experts, k, gen)
        batches.append((torch.randn(tokens, hidden, device="cuda", generator=gen).half(), ids, w))
    return batches


def graph_of(fn):
    """Capture ``fn`` (already warmed up) in a CUDA graph; returns the replay callable."""
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
        torch.cuda.synchronize()
        with torch.cuda.graph(g):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    return g.replay


def graph_us(fn, layers: int, reps: int = 30, warmup: int = 3) -> float:
    """Median microseconds per layer of ``fn`` (``layers`` layer calls) replayed as one CUDA graph."""
    return median(event_times_ms(graph_of(fn), reps=reps, warmup=warmup)) / layers * 1e3


def bf16_grouped_layer(x, ids, w, wgu_t, wd_t, n_experts, use_grouped_mm: bool):
    """torch bf16 MoE layer on the same problem. wgu_t: (E, H, 2I) view of (E, 2I, H); wd_t: (E, I, H) view
    of (E, H, I). Returns (T, H) bf16."""
    t, k = ids.shape
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # (P,)
    tok = order // k
    xs = x[tok]  # (P, H)
    counts = torch.bincount(flat, minlength=n_experts) if not use_grouped_mm else \
        torch.zeros(n_experts, dtype=torch.int64, device=x.device).scatter_add_(0, flat, torch.ones_like(flat))
    if use_grouped_mm:
        offs = torch.cumsum(counts, 0).to(torch.int32)
        gu = torch._grouped_mm(xs, wgu_t, offs=offs)  # (P, 2I)
        inter = gu.shape[1] // 2
        hh = F.silu(gu[:, :inter]) * gu[:, inter:]
        d = torch._grouped_mm(hh, wd_t, offs=offs)  # (P, H)
    else:
        bounds = torch.cumsum(counts, 0).tolist()
        parts, lo = [], 0
        for e, hi in enumerate(bounds):
            if hi > lo:
                gu = xs[lo:hi] @ wgu_t[e]
                inter = gu.shape[1] // 2
                parts.append((F.silu(gu[:, :inter]) * gu[:, inter:]) @ wd_t[e])
            lo = hi
        d = torch.cat(parts)
    y = torch.zeros(t, x.shape[1], dtype=torch.float32, device=x.device)
    y.index_add_(0, tok, d.float() * w.reshape(-1)[order][:, None])
    return y.to(torch.bfloat16)
